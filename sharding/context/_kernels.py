"""The context-parallel attention kernels: each a function of the mesh returning a kernel with
the seam's signature (`models.kernels`: ``(q_BSNH, k_BTKH, v_BTKH) -> out_BSNH``, causal,
grouped-query) whose inputs and output are split over ``context`` on the sequence.

Each runs its body in a `jax.shard_map` over the whole mesh, the rows split over the batch
axes, the sequence over ``context`` and the heads over ``tensor`` where they divide (`specs`):
as the step lays them out under dp, fsdp, tp and the cp strategies, so entering and leaving the
kernel moves nothing there, and the collectives it adds are exactly its own, over ``context``.

- `allgather_attention`: K and V all-gathered over context (their gradients reduce-scattered
  back), local queries against every key, the causal mask from the true positions of the zigzag
  layout. Simple and fast to compile; attention memory per device grows with the whole sequence.
- `ring_attention`: K/V blocks passed round the ring (`sharding.context._ring`); memory per
  device flat in the sequence when context grows with it; c - 1 sequential steps.
- `ulysses_attention`: all-to-all from sequence-split to head-split, plain causal attention on
  the whole sequence for heads / c heads, all-to-all back. Needs heads divisible by context;
  moves 4 activations per layer each way instead of K and V.

Causal all-gather and ring attention take their input in the zigzag layout (device i holds
chunks i and 2c-1-i of 2c): the caller reorders the batch once (`batch_reorder`) and hands the
model `positions_kernel` so positions are true. Ulysses sees the whole sequence per head and
needs no reorder.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax import sharding as jshard

from sharding._manual import manual_axes
from sharding._mesh import BATCH_AXES, SEQUENCE_AXIS
from sharding.context._errors import ContextParallelError
from sharding.context._layout import check_balanced_seq, zigzag_positions
from sharding.context._ring import ring_local

AXIS = SEQUENCE_AXIS  # "context"
METHODS = ("ring", "allgather", "ulysses")
# Methods whose causal work is balanced by the zigzag layout (the caller reorders the batch).
BALANCED = frozenset({"ring", "allgather"})

Kernel = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _context_size(mesh: jshard.Mesh, who: str) -> int:
    c = dict(mesh.shape).get(AXIS, 1)
    if c < 2:
        raise ContextParallelError(
            f"{who}: the mesh has {AXIS}={c}; context parallelism splits the sequence over a "
            f"'{AXIS}' axis of size >= 2, e.g. make_mesh('data=2,context=4')"
        )
    return c


def specs(mesh: jshard.Mesh, q_shape, kv_shape) -> tuple[jshard.PartitionSpec, ...]:
    """The kernel's ``(q, kv)`` specs: rows over the batch axes, the sequence over ``context``,
    heads over ``tensor`` where both head counts divide by it.

    Every mesh axis is manual in the kernel: XLA keeps an all-gather or all-to-all inside a
    region manual over ``context`` alone whole over the automatic axes (it gathered q, k, v over
    ``data`` first, measured on jax 0.10), so the rows and heads splits are written out here
    instead, as the step lays them out (its batch over `sharding.BATCH_AXES`, tp's heads over
    ``tensor``).
    """
    sizes = dict(mesh.shape)
    rows = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    if q_shape[0] % math.prod(sizes[a] for a in rows):
        rows = ()
    t = sizes.get("tensor", 1)
    heads = "tensor" if t > 1 and q_shape[2] % t == 0 and kv_shape[2] % t == 0 else None
    return tuple(jshard.PartitionSpec(rows or None, AXIS, heads, None) for _ in range(2))


def _sharded(mesh: jshard.Mesh, local: Callable, check: Callable) -> Kernel:
    def kernel(q_BSNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
        if AXIS in manual_axes():  # a pipeline's stages, manual over context: q, k, v are this
            return local(q_BSNH, k_BTKH, v_BTKH)  # device's slice (checked whole by the step)
        check(q_BSNH, k_BTKH)
        q_spec, kv_spec = specs(mesh, q_BSNH.shape, k_BTKH.shape)
        body = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                             out_specs=q_spec)  # fmt: skip
        return body(q_BSNH, k_BTKH, v_BTKH)

    return kernel


def _check_gqa(who: str, q, k) -> None:
    if q.shape[1] != k.shape[1] or q.shape[2] % k.shape[2]:
        raise ContextParallelError(
            f"{who}: self-attention with grouped query heads expected, got q {q.shape} and k "
            f"{k.shape} (same sequence length, query heads a multiple of key/value heads)"
        )


def allgather_attention(mesh: jshard.Mesh, core: Any) -> Kernel:
    """Causal attention with K/V all-gathered over ``context``, input in the zigzag layout;
    ``core`` is the model's online softmax (`Workload.attention_core`), whose whole-matrix
    ``masked_attention`` runs on the local queries.

    Example:
        >>> attend = allgather_attention(make_mesh("data=2,context=4"), ONLINE_SOFTMAX)  # doctest: +SKIP
        >>> out = jax.jit(attend)(to_zigzag(q, 4), to_zigzag(k, 4), to_zigzag(v, 4))  # doctest: +SKIP
    """
    who = "allgather_attention"
    c = _context_size(mesh, who)

    def local(q, k, v):
        s_local = q.shape[1]
        order = jnp.asarray(zigzag_positions(s_local * c, c))
        q_pos = lax.dynamic_slice_in_dim(order, lax.axis_index(AXIS) * s_local, s_local)
        k_all = lax.all_gather(k, AXIS, axis=1, tiled=True)
        v_all = lax.all_gather(v, AXIS, axis=1, tiled=True)
        return core.masked_attention(q, k_all, v_all, q_pos[:, None] >= order[None, :])

    def check(q, k):
        _check_gqa(who, q, k)
        check_balanced_seq(q.shape[1], c, who=who)

    return _sharded(mesh, local, check)


def ring_attention(mesh: jshard.Mesh, core: Any, *, causal: bool = True) -> Kernel:
    """Ring attention over ``context``, each block folded by ``core`` (the model's online
    softmax, `Workload.attention_core`); ``causal=True`` takes its input in the zigzag layout,
    ``causal=False`` (full attention, every key seen) in any layout.

    Example:
        >>> attend = ring_attention(make_mesh("context=8"), ONLINE_SOFTMAX, causal=False)  # doctest: +SKIP
    """
    who = "ring_attention"
    c = _context_size(mesh, who)

    def local(q, k, v):
        return ring_local(AXIS, c, causal, core, q, k, v)

    def check(q, k):
        _check_gqa(who, q, k)
        if causal:
            check_balanced_seq(q.shape[1], c, who=who)
        elif q.shape[1] % c:
            raise ContextParallelError(
                f"{who}: seq={q.shape[1]} does not split over {AXIS}={c}; pick --seq a "
                f"multiple of {c}"
            )

    return _sharded(mesh, local, check)


def check_ulysses_heads(n_heads: int, n_kv_heads: int, context: int, tensor: int = 1) -> None:
    """Refuse head counts Ulysses cannot split: each of context x tensor devices needs whole
    query and key/value heads."""
    split = context * tensor
    bad = [(name, n) for name, n in (("heads", n_heads), ("kv_heads", n_kv_heads)) if n % split]
    if bad:
        name, n = bad[0]
        raise ContextParallelError(
            f"context_method='ulysses' splits the attention heads over context={context}"
            f"{f' x tensor={tensor}' if tensor > 1 else ''} = {split} devices, and {name}={n} "
            f"does not divide by {split}; use context_method='ring' or 'allgather' (no head "
            f"split), or a context axis that divides {name}"
        )


def ulysses_attention(mesh: jshard.Mesh, core: Any) -> Kernel:
    """Causal attention by all-to-all over ``context``: sequence-split in, head-split inside
    (``heads / c`` heads over the whole sequence, ``core.masked_attention``), sequence-split
    out. Written order in and out.
    """
    who = "ulysses_attention"
    c = _context_size(mesh, who)
    t = dict(mesh.shape).get("tensor", 1)

    def local(q, k, v):
        to_heads = lambda x: lax.all_to_all(x, AXIS, 2, 1, tiled=True)  # noqa: E731
        q, k, v = to_heads(q), to_heads(k), to_heads(v)
        out = core.masked_attention(q, k, v, core.causal_mask(q.shape[1], k.shape[1]))
        return lax.all_to_all(out, AXIS, 1, 2, tiled=True)

    def check(q, k):
        _check_gqa(who, q, k)
        check_ulysses_heads(q.shape[2], k.shape[2], c, t)
        if q.shape[1] % c:
            raise ContextParallelError(
                f"{who}: seq={q.shape[1]} does not split over {AXIS}={c}; pick --seq a "
                f"multiple of {c}"
            )

    return _sharded(mesh, local, check)


FACTORIES: dict[str, Callable[[jshard.Mesh, Any], Kernel]] = {
    "ring": ring_attention,
    "allgather": allgather_attention,
    "ulysses": ulysses_attention,
}
