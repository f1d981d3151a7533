"""The global batch as a search dimension: accumulation steps and micro-batches.

People train a global batch (Megatron's GBS) as micro-steps of a micro-batch each (its MBS, the
local batch of torchtitan and MaxText): ``batch = micro_batch x accum x batch shards``, with a
pipeline's micro-batches splitting each micro-step further. `micro_steps` lists the ways a
layout can run one global batch, smallest accumulation first; `sharding.costmodel.candidates`
prices each (`predict`'s ``accum``) and keeps, per layout and remat policy, the first that fits.

Example:
    >>> from sharding.costmodel import Layout
    >>> [(k, x.microbatches) for k, x in micro_steps(Layout("fsdp", "fsdp=8"), 64)]
    [(1, None), (2, None), (4, None), (8, None)]
    >>> [(k, x.microbatches) for k, x in micro_steps(Layout("pp", "stage=2,data=4", "1f1b", 8), 64)]
    [(1, 8), (2, 8), (4, 4), (8, 2)]
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from sharding._mesh import BATCH_AXES
from sharding.costmodel._zero import UPDATED_WEIGHTS

if TYPE_CHECKING:  # _layouts imports _predict, which prices accumulation here
    from sharding.costmodel._layouts import Layout


def rows_per_pass(
    batch: int, sizes: dict[str, int], accum: int = 1, microbatches: int | None = None
) -> int:
    """Rows each device runs per forward pass (Megatron's micro-batch size): the global batch
    over the accumulation steps, the batch shards (`sharding.BATCH_AXES`) and a pipeline's
    micro-batches."""
    split = math.prod(sizes.get(a, 1) for a in BATCH_AXES)
    return batch // (accum * split * (microbatches or 1))


def pipeline_microbatches(sizes: dict[str, int], batch: int) -> int | None:
    """A pipeline's micro-batch count for a (micro-)step of ``batch`` rows: one that splits it
    evenly over the batch shards, preferring 4p, 2p, then p (a smaller bubble), else the most
    up to 4p that is at least p (a 252-row batch on 4 shards over 18 stages: 63), else the
    fewest above 4p; None if no count of at least p splits it."""
    p, split = sizes.get("stage", 1), math.prod(sizes.get(a, 1) for a in BATCH_AXES)
    if batch % split:
        return None
    counts = [m for m in range(p, batch // split + 1) if (batch // split) % m == 0]
    preferred = [m for m in (4 * p, 2 * p, p) if m in counts]
    within = [m for m in counts if m <= 4 * p]
    return (preferred or within[-1:] or counts[:1] or [None])[0]


def micro_steps(
    layout: Layout, batch: int, *, accum: int | None = None, micro_batch: int | None = None
) -> list[tuple[int, Layout]]:
    """``(accum, layout)`` for every way ``layout`` runs a global ``batch``, smallest accum
    first: each micro-step keeps at least one row per batch shard, and a pipeline layout takes
    the micro-batch count of its micro-step (`pipeline_microbatches`). ``accum`` and
    ``micro_batch`` (rows per device per forward pass) pin them."""
    sizes = layout.sizes
    split = math.prod(sizes.get(a, 1) for a in BATCH_AXES)
    if batch % split:
        return []
    out = []
    for k in range(1, batch // split + 1):
        if (batch // split) % k or (accum is not None and k != accum):
            continue
        run = layout
        if layout.schedule is not None:
            m = pipeline_microbatches(sizes, batch // k)
            if m is None:
                continue
            run = dataclasses.replace(layout, microbatches=m)
        rows = rows_per_pass(batch, sizes, k, run.microbatches if run.schedule else None)
        if micro_batch is None or rows == micro_batch:
            out.append((k, run))
    return out


# Weight gathers outside the layer stack: loop-invariant, so XLA hoists them out of the
# accumulation loop (measured: fsdp's head and final-norm gathers, once at every k).
HOISTED = frozenset({"head weights", "final norm", "position table", "token table", "table gather"})


def accumulated(micro: Any, k: int) -> Any:
    """The step of ``k`` micro-steps, each ``micro`` (a `Prediction` of batch / k).

    The compiled step (`sharding.compile_train_step`) scans the micro-batches with the whole
    forward and backward inside the scan, and XLA keeps the collectives there: the layers'
    fsdp gathers *and* the gradients' reductions run once per micro-step (measured on llama
    tiny, accum 1, 2, 4: dp's gradient all-reduce k-fold to the byte, fsdp's layer gathers k
    times the closed form's), so collectives and FLOPs are k times one micro-step's; only the
    gathers of weights outside the layer stack (`HOISTED`), the same in every micro-step, are
    hoisted out of the loop and run once, as zero1's gathers of the updated weights, which follow
    the update once per step. Memory: one micro-step's activations and working set,
    the whole batch's token ids, and the float32 gradient sum beside one micro-step's
    gradients.
    """
    return dataclasses.replace(
        micro,
        batch=micro.batch * k,
        accum=k,
        traffic=[
            t
            if t.kind == "all-gather" and (t.what in HOISTED or t.what == UPDATED_WEIGHTS)
            else dataclasses.replace(t, bytes=t.bytes * k, count=t.count * k)
            for t in micro.traffic
        ],
        grad_bytes=2 * micro.grad_bytes,
        batch_bytes=micro.batch_bytes * k,
        matmul_flops=micro.matmul_flops * k,
        critical_flops=micro.critical_flops * k,
        elementwise_bytes=micro.elementwise_bytes * k,
    )


__all__ = ["HOISTED", "accumulated", "micro_steps", "pipeline_microbatches", "rows_per_pass"]
