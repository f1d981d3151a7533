"""Closed forms of the bytes each context-parallel method moves over ``context``, per device
per training step, from plain numbers (no model, no compile): what `spmdkit plan` needs at
32k-128k tokens, and what tests/test_context_parallel.py holds to the compiled programs (2%).

Conventions are `sharding.inspection`'s: an all-gather moves its output, every other
collective its operand; a collective in the layer scan counts once per layer. With
``b = batch / batch_shards`` rows per device, ``s = seq / context`` positions per device, heads
``N``, key/value heads ``K`` (each divided by ``tensor`` where both divide, as the kernels lay
them out), head width ``H`` and ``e`` bytes per activation element, one key (or value) block is
``kv = b * s * K * H * e`` and one query (or output) block ``qb = b * s * N * H * e``. Per layer:

- allgather: forward all-gathers K and V (``2 * c * kv``); backward reduce-scatters dK, dV, the
  all-gather's transpose (``2 * c * kv``);
- ring: forward c - 1 shifts of K and V (``2 (c-1) kv``); backward c - 1 shifts of K and V
  again, and c shifts of the float32 accumulators dK, dV (``2 (c-1) kv + 2 c kv * 4 / e``);
- ulysses: four all-to-alls forward (q, k, v to heads, the output back: ``2 qb + 2 kv``) and
  four backward (their transposes: the same bytes).

Under remat (any policy but "none") each layer's forward runs again in backward, and its
collectives with it, but for the ring's first shift of K and V, which is the same transfer as
the backward's first shift (XLA merges the two: ``2 (c-2) kv`` more). The zigzag methods also gather the per-position batch arrays (token ids,
int32) over context once per step to reorder them (``arrays * b * seq * 4``), where the batch
arrives split over context (the cp strategies).
"""

from __future__ import annotations

from typing import NamedTuple

from sharding.context._errors import ContextParallelError
from sharding.context._kernels import AXIS, BALANCED, METHODS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACCUMULATOR_BYTES = 4  # the ring's dK, dV travel in float32 whatever the compute dtype


class ContextTraffic(NamedTuple):
    """One modelled collective over ``context``: bytes per device per step over ``count`` runs."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    count: int
    what: str
    backward: bool = False  # run by the backward pass (its own, or the forward recomputed)


def context_traffic(
    method: str,
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    layers: int,
    context: int,
    tensor: int = 1,
    batch_shards: int = 1,
    dtype: str = "float32",
    remat: bool = False,
    seq_arrays: int = 2,
    batch_over_context: bool = True,
) -> list[ContextTraffic]:
    """Every collective over ``context`` that context-parallel attention adds to one step.

    Args:
        method: "ring", "allgather" or "ulysses".
        batch, seq: the global batch (sequences) and sequence length.
        heads, kv_heads, head_dim, layers: the model's attention sizes.
        context, tensor: the mesh's context and tensor sizes.
        batch_shards: how many ways the batch axes split the rows (data x fsdp x expert).
        dtype: the compute dtype ("float32", "bfloat16").
        remat: the layers are rematerialised (their forward collectives run twice).
        seq_arrays: per-position arrays in the batch (llama, gpt2: inputs and targets).
        batch_over_context: the batch arrives split over context (the cp strategies).

    Example:
        >>> [t.bytes for t in context_traffic("allgather", batch=8, seq=32, heads=8,
        ...     kv_heads=4, head_dim=8, layers=2, context=4, batch_shards=2)]
        [65536, 65536, 1024]
    """
    if method not in METHODS:
        raise ContextParallelError(
            f"context_traffic: method={method!r}; choose one of {list(METHODS)}"
        )
    if dtype not in DTYPE_BYTES:
        raise ContextParallelError(
            f"context_traffic: dtype={dtype!r}; choose one of {list(DTYPE_BYTES)}"
        )
    c, e = context, DTYPE_BYTES[dtype]
    if c < 2:
        return []
    split = tensor if tensor > 1 and heads % tensor == 0 and kv_heads % tensor == 0 else 1
    rows = batch / batch_shards
    kv = rows * (seq / c) * (kv_heads / split) * head_dim * e
    qb = rows * (seq / c) * (heads / split) * head_dim * e
    out: list[ContextTraffic] = []

    def add(kind: str, nbytes: float, count: int, what: str, backward: bool = False) -> None:
        out.append(ContextTraffic(kind, (AXIS,), round(nbytes * layers), count * layers, what,
                                  backward))  # fmt: skip

    if method == "allgather":
        add("all-gather", 2 * c * kv, 2, "K and V gathered over context")
        if remat:
            add("all-gather", 2 * c * kv, 2, "K and V gathered again (forward recomputed)", True)
        add("reduce-scatter", 2 * c * kv, 2, "dK and dV scattered back (backward)", True)
    elif method == "ring":
        add("collective-permute", 2 * (c - 1) * kv, 2 * (c - 1),
            "K and V blocks round the ring (forward)")  # fmt: skip
        if remat:  # its first shift is the backward's own first shift: XLA merges the two
            add("collective-permute", 2 * (c - 2) * kv, 2 * (c - 2),
                "K and V round the ring again (forward recomputed)", True)  # fmt: skip
        add("collective-permute", 2 * (c - 1) * kv + 2 * c * kv * ACCUMULATOR_BYTES / e,
            2 * (c - 1) + 2 * c, "K, V and the dK, dV accumulators round again (backward)",
            True)  # fmt: skip
    else:
        add("all-to-all", 2 * qb + 2 * kv, 4, "q, k, v to heads, output back")
        if remat:
            add("all-to-all", 2 * qb + 2 * kv, 4, "q, k, v to heads again (forward recomputed)",
                True)  # fmt: skip
        add("all-to-all", 2 * qb + 2 * kv, 4, "their transposes (backward)", True)
    if method in BALANCED and batch_over_context:
        nbytes = seq_arrays * rows * seq * 4
        out.append(ContextTraffic("all-gather", (AXIS,), round(nbytes), seq_arrays,
                                  "batch token ids gathered for the zigzag reorder"))  # fmt: skip
    return out
