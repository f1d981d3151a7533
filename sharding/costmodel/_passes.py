"""What XLA for a GPU makes of the collectives a CPU-compiled program shows, priced by platform
(`sharding.targets.PLATFORMS`).

The closed form counts the collectives XLA:CPU compiles (the tests hold it to them). Two passes of
XLA's GPU collective pipeline, which runs after SPMD partitioning with them in this order
(xla/service/gpu/gpu_compiler.cc), change what runs:

- ReduceScatterCreator makes an all-reduce whose result is only sliced by partition one
  reduce-scatter, (n-1)/n of its operand instead of 2(n-1)/n: Megatron SP's row-parallel
  outputs (`SCATTERED`), which XLA:CPU keeps as the pair;
- AllReduceReassociate rewrites add(all-reduce(a), all-reduce(b)) as all-reduce(add(a, b)): the
  partial input gradients of the column-parallel kernels that read one input (q, k and v; gate
  and up), which the partitioner all-reduces each before their sum, take one all-reduce per
  input (`REASSOCIATED`: the others, not run). Under SP that sum is sliced, but reduce-scatter
  creation ran before, so it stays an all-reduce.

A compiled program's collectives carry no purpose, so compare moves the closed form's share of them
out of a CPU-compiled program's (`apart_of`, `work_from_report(apart=)`): SP's row outputs, and
every reduce-scatter of the closed form (fsdp's gradients), which XLA:CPU compiles as an all-reduce
and a slice; compiled on a GPU, they ran already.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sharding._units import fmt_bytes
from sharding.targets import PLATFORMS

REASSOCIATED = "column-parallel input gradients summed before one all-reduce on GPU"
SCATTERED = "reduced onto the sequence split (all-reduce and slice; one reduce-scatter on GPU)"
APART = (REASSOCIATED, SCATTERED)  # purposes a platform runs otherwise than XLA:CPU shows


def apart_class(what: str) -> str:
    """The `APART` marker in a collective's purpose ``what`` ("" for none)."""
    return next((m for m in APART if m in what), "")


def run_kind(kind: str, what: str, platform: str) -> str | None:
    """The kind a collective of ``kind`` and purpose ``what`` runs as on ``platform``; None where
    that platform's compiler sums it into another."""
    passes, marker = PLATFORMS[platform], apart_class(what)
    if marker == REASSOCIATED and passes["reassociates_all_reduces"]:
        return None
    if marker == SCATTERED and kind == "all-reduce" and passes["creates_reduce_scatters"]:
        return "reduce-scatter"
    return kind


def apart_of(traffic: Iterable[Any]) -> dict[tuple[str, tuple[str, ...]], tuple[float, int]]:
    """What of a closed form's ``traffic`` (`Traffic` rows) a CPU-compiled program shows as
    all-reduces that XLA for GPU runs otherwise, summed by (`APART` marker, mesh axes): its marked
    all-reduces, and every reduce-scatter (XLA:CPU creates none: it compiles each as an
    all-reduce and a slice, which a GPU makes one reduce-scatter, `SCATTERED`). What
    `work_from_report(apart=)` keeps apart."""
    out: dict[tuple[str, tuple[str, ...]], tuple[float, int]] = {}
    for t in traffic:
        marker = SCATTERED if t.kind == "reduce-scatter" else apart_class(t.what)
        if marker and t.kind in ("all-reduce", "reduce-scatter"):
            nbytes, count = out.get((marker, tuple(t.axes)), (0.0, 0))
            out[marker, tuple(t.axes)] = (nbytes + t.bytes, count + t.count)
    return out


def pass_sentences(collectives: Iterable[Any], platform: str) -> list[str]:
    """What `run_kind` did to ``collectives`` (`CollectiveWork`) on ``platform``, as sentences."""
    collectives = list(collectives)
    merged = sum(c.bytes for c in collectives if apart_class(c.what) == REASSOCIATED)
    scattered = sum(c.bytes for c in collectives if apart_class(c.what) == SCATTERED)
    passes, out = PLATFORMS[platform], []
    if merged:
        out.append(f"{fmt_bytes(merged)} of column-parallel input-gradient all-reduces are " + (
            f"summed first by XLA for {platform} (AllReduceReassociate): one all-reduce per "
            f"input the kernels read (q, k, v: one), not one per kernel as the CPU program "
            f"shows; not priced." if passes["reassociates_all_reduces"] else
            f"priced one per kernel, as the program shows (XLA for {platform} is not known to "
            f"sum them first)."))  # fmt: skip
    if scattered:
        out.append(f"{fmt_bytes(scattered)} of sequence-parallel row-parallel outputs are " + (
            f"reduce-scatters: XLA for {platform} makes the program's all-reduce and slice one "
            f"(ReduceScatterCreator)." if passes["creates_reduce_scatters"] else
            "priced as the program's all-reduces (and slices)."))  # fmt: skip
    return out


def compiler_sentences(work: Any, platform: str) -> list[str]:
    """What the target's compiler did to a `StepWork`'s collectives, as sentences: nothing to
    correct where its own program was read (``work.compiled_by``), else what `step_time`
    applies for it: the accumulation loop's sunk all-reduces and `pass_sentences`."""
    if work.compiled_by == platform:
        return [
            f"Collectives as XLA for {platform} compiled them (its own program: its "
            f"reduce-scatters, combined and reassociated all-reduces, and reductions moved "
            f"out of loops are in the counts)."
        ]
    out = []
    if work.accum > 1:
        sinks = PLATFORMS[platform]["sinks_accumulated_all_reduces"]
        out.append(
            f"{work.accum} micro-steps per step: "
            + (
                f"XLA for {platform} moves the gradient all-reduces out of the accumulation loop "
                f"(WhileLoopAllReduceCodeMotion): they run once per step, after the loop, "
                + (
                    "behind the last micro-batch (above); "
                    if work.reduction_overlap
                    else "exposed; "
                )
                + "fsdp's reduce-scatters stay in it, once per micro-step."
                if sinks
                else "the gradient reductions run once per micro-step, as the program shows."
            )
        )
    return out + pass_sentences(work.collectives, platform)


__all__ = [
    "APART",
    "REASSOCIATED",
    "SCATTERED",
    "apart_class",
    "apart_of",
    "compiler_sentences",
    "pass_sentences",
    "run_kind",
]
