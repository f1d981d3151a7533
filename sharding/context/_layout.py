"""The zigzag (head-tail) layout of the sequence over ``context``, and the batch reorder it asks.

Causal attention gives the query at position p work on p + 1 keys, so a contiguous split of the
sequence over c devices leaves the last device c times the work of the first. Cutting the
sequence into 2c chunks and giving device i chunks i and 2c-1-i (a head chunk and its mirror
tail) balances it: every device owns the same number of (query, key) pairs under the mask.

The reorder is done once for the whole model, not per layer: every per-position batch array
(tokens, targets, masks: dim 1 of length ``seq``) is permuted before the loss, so each device's
contiguous S/c slice of every activation is its two chunks, and the ``positions`` kernel returns
the true position of each slot (`zigzag_positions`), so RoPE, learned position tables and the
causal mask see the sequence as written. The contract this needs of a loss: it must be invariant
to one permutation applied to all its per-position arrays at once, which a mean of per-position
terms is (llama's and gpt2's ``loss_from_logits``: the cross-entropy of each position's logits
against that position's target, inputs and targets permuted alike, averaged).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sharding._manual import manual_axes
from sharding._mesh import SEQUENCE_AXIS as AXIS
from sharding.context._errors import ContextParallelError


def check_balanced_seq(seq: int, context: int, *, who: str = "context parallelism") -> int:
    """The chunk length ``seq / (2 * context)``, or a `ContextParallelError` if it is not whole."""
    if seq % (2 * context):
        raise ContextParallelError(
            f"{who}: seq={seq} does not split into 2*context={2 * context} equal chunks (the "
            f"causal load balancing gives each of the context={context} devices a head and a "
            f"tail chunk); pick --seq a multiple of {2 * context}, or a smaller context axis"
        )
    return seq // (2 * context)


def zigzag_positions(seq: int, context: int) -> np.ndarray:
    """The true position of each slot of the zigzag layout (``[seq]`` int32).

    Device i's slots ``[i*seq/c, (i+1)*seq/c)`` hold chunks i and 2c-1-i of 2c.

    Example:
        >>> zigzag_positions(8, 2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    chunk = check_balanced_seq(seq, context)
    chunks = np.arange(seq, dtype=np.int32).reshape(2 * context, chunk)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]])
                           for i in range(context)])  # fmt: skip


def to_zigzag(x: jax.Array, context: int, axis: int = 1) -> jax.Array:
    """``x`` with its sequence ``axis`` laid out in zigzag order (slot j holds position order[j])."""
    return jnp.take(x, zigzag_positions(x.shape[axis], context), axis=axis)


def from_zigzag(x: jax.Array, context: int, axis: int = 1) -> jax.Array:
    """The inverse of `to_zigzag`: back to the written order."""
    return jnp.take(x, np.argsort(zigzag_positions(x.shape[axis], context)), axis=axis)


def positions_kernel(context: int, *, zigzag: bool = True) -> Callable[[int], jax.Array]:
    """The ``positions`` kernel (`models.kernels`) of the sequence split over ``context``: in
    the zigzag layout, or in written order (``zigzag=False``, Ulysses).

    Inside a region manual over context (a pipeline's stages), the model sees its own slice of
    the sequence and asks for ``seq_len`` = S/c positions: it gets this device's slice.
    """

    def order(n: int) -> jax.Array:
        return jnp.asarray(zigzag_positions(n, context) if zigzag else np.arange(n, dtype=np.int32))

    def positions(seq_len: int) -> jax.Array:
        if AXIS not in manual_axes():
            return order(seq_len)
        # This device's slice, from its index and an iota rather than a table sliced by the
        # index: the table, a constant cast to vary over context, becomes a residual of a
        # rematerialised layer, and jax 0.12 refuses to replay that cast on it once a pipeline's
        # lane has made it varying (invariant->variant pvary on a varying value).
        i, slot = lax.axis_index(AXIS), lax.iota(jnp.int32, seq_len)
        if not zigzag:
            return i * seq_len + slot
        half = check_balanced_seq(seq_len * context, context)  # chunks i and 2c-1-i, in halves
        return jnp.where(slot < half, i, 2 * context - 1 - i) * half + slot % half

    return positions


def batch_reorder(seq: int, context: int) -> Callable[[dict], dict]:
    """``batch -> batch`` putting every per-position array (dim 1 of length ``seq``) in zigzag
    order; other entries (per-row labels, scalars) pass unchanged."""
    check_balanced_seq(seq, context)

    def reorder(batch: dict) -> dict:
        return {k: to_zigzag(v, context) if v.ndim >= 2 and v.shape[1] == seq else v
                for k, v in batch.items()}  # fmt: skip

    return reorder
