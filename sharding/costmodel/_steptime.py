"""One step-time model for a target, fed by compiled programs and by closed-form predictions.

A `StepWork` is what one step asks of each device: matmul FLOPs, bytes of memory-bound work,
collectives (kind, mesh axes, bytes, count), the pipeline bubble, the step's tokens and model
FLOPs. `work_from_report` (a compiled program) and `work_from_prediction` (a `Prediction`) build
it, in `sharding.costmodel._stepwork`. `step_time` prices it on a `sharding.targets.Target`:
compute, exposed communication and bubble seconds, throughput, MFU, memory against HBM, one row
per collective, and every assumption as a sentence.

Compute is matmul FLOPs at a fraction of the dense peak plus memory-bound bytes (the optimizer
update, and the non-matmul operations' traffic, `sharding.costmodel._elementwise`) at a fraction
of the HBM bandwidth. Collectives are rings: all-reduce sends 2(n-1)/n of its operand, all-gather
(n-1)/n of its gathered output, reduce-scatter and all-to-all (n-1)/n of their operand,
collective-permute its operand once (the `CollectiveOp.bytes` convention, which predictions
share), at what the group sustains (`Topology.group`: the intra-node link; across nodes, rings
over the rails, k NICs for its k devices on each node, and a device's permute and all-to-all
bytes through its own NIC), plus one link latency per ring step: 2(n-1) for
all-reduce, n-1 for the other rings, 1 for a permute. Data/fsdp gradient reductions and weight
gathers hide behind compute up to `OVERLAP` of it; tensor-parallel collectives too where the
program overlaps them (`StepWork.tensor_overlap`); the rest is exposed. Gradient accumulation's
all-reduces run once per step, exposed after the micro-step loop, where the target's XLA moves
them out of it (`sharding.targets.PLATFORMS`), else once per micro-step as the program shows; a
program that buckets them behind its last micro-batch (`StepWork.reduction_overlap`) hides them
behind one micro-batch's compute, as it does zero1's weight gathers, else exposed after the update.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sharding._mesh import AXES, mesh_text
from sharding._units import fmt_bytes, fmt_count
from sharding.costmodel._passes import compiler_sentences, run_kind
from sharding.costmodel._predict import CostModelError
from sharding.costmodel._traffic import SHIFT_GATHERS
from sharding.costmodel._zero import UPDATED_WEIGHTS
from sharding.inspection import overlap_options
from sharding.targets import PLATFORMS, Target, target

# Share of the compute window that hides overlappable collectives: the first layer's gather and
# the last layer's reduction have nothing to hide behind, and XLA's latency-hiding scheduler is
# not perfect (MaxText and torchtitan runs show FSDP/DP traffic mostly, not wholly, hidden).
OVERLAP = 0.8
# Share of HBM a step may fill: the rest is the runtime, library workspaces and fragmentation.
MEMORY_FRACTION = 0.9
OVERLAP_AXES = frozenset({"data", "fsdp"})  # their reductions and gathers overlap compute
RINGS = frozenset({"all-reduce", "all-gather", "reduce-scatter"})  # over rails across nodes
# What follows a loop (tick scan, accumulation) or the update (zero1): exposed unless bucketed.
AFTER_LOOPS = frozenset({"exposed: after the tick scan", "exposed: after the accumulation loop",
                         "exposed: after the optimizer update"})  # fmt: skip
BACKWARD_SHARE = {"none": 2 / 3, "dots": 2 / 3, "full": 3 / 4}  # of the matmul time, by remat
_HOPS = {"all-reduce": lambda n: 2 * (n - 1), "all-gather": lambda n: n - 1,
         "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: n - 1,
         "collective-permute": lambda n: 1}  # fmt: skip


def _sunk(c: CollectiveWork) -> bool:
    """A gradient all-reduce over data, summed into the accumulation buffer each micro-step: what
    XLA for GPU moves out of the micro-step loop (`sharding.targets.PLATFORMS`). One over fsdp
    ends in a slice of the sum (the CPU program's reduce-scatter), which XLA for GPU makes a
    reduce-scatter first (ReduceScatterCreator), and that stays in the loop."""
    return c.axes == ("data",) and c.kind == "all-reduce"


class StepTimeError(CostModelError):
    """Work the step-time model cannot price as given."""


def ring_factor(kind: str, n: int) -> float:
    """Bytes a device sends per byte of `CollectiveOp.bytes`, in a ring of ``n`` devices."""
    if kind not in _HOPS:
        raise StepTimeError(f"unknown collective kind {kind!r}; the kinds are {', '.join(_HOPS)}")
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)


def ring_hops(kind: str, n: int) -> int:
    """Link latencies one execution waits: one per ring step, one for a permute."""
    ring_factor(kind, n)
    return 0 if n <= 1 else _HOPS[kind](n)


@dataclass(frozen=True)
class CollectiveWork:
    """Collectives of one kind over one set of mesh axes (None: unknown): ``bytes`` per device
    per step, summed over ``count`` executions, in the `CollectiveOp.bytes` convention."""

    kind: str
    axes: tuple[str, ...] | None
    bytes: float
    count: int
    what: str = ""


@dataclass
class StepWork:
    """What one step asks of each device; the neutral input of `step_time`.

    ``matmul_flops`` is the critical path per device, bubble included, and ``bubble_flops`` the
    part of it spent in the bubble (ticks on zeros, or waiting for the slowest stage);
    ``tokens`` (or samples, ``unit``) and ``model_flops`` are per step over all devices;
    ``notes`` are the adapter's assumptions and ``pipeline`` the per-tick FLOPs it read.
    ``accum`` is the micro-steps per step (gradient accumulation) whose gradient reductions the
    collectives count once each, ``microbatches`` a pipeline's micro-batches per micro-step;
    ``tensor_overlap`` says the program overlaps its tensor-parallel collectives with the
    matmuls they feed (collective matmuls, Megatron's ``--tp-comm-overlap``), and
    ``reduction_overlap`` that it reduces the data-parallel gradients in buckets as the last
    micro-batch's backward produces them and gathers the updated weights as the next step's
    first forward needs them (Megatron's ``--overlap-grad-reduce --overlap-param-gather`` with
    its distributed optimizer): spmdkit's programs do neither. The adapters set ``microbatches``
    from the schedule; a hand-built pipelined work left at 1 hides them behind its whole step.
    """

    mesh: dict[str, int]
    matmul_flops: float
    collectives: list[CollectiveWork]
    tokens: int
    dtype: str = "float32"
    unit: str = "tokens"
    memory_bound_bytes: float = 0.0
    elementwise_bytes: float = 0.0  # of memory_bound_bytes, the non-matmul operations' (per row)
    bubble_flops: float = 0.0
    bubble_fraction: float = 0.0
    schedule: str | None = None
    remat: str = "none"
    model_flops: float | None = None
    memory_bytes: int | None = None
    source: str = "given"
    notes: list[str] = field(default_factory=list)
    pipeline: dict[str, Any] | None = None
    accum: int = 1
    microbatches: int = 1
    tensor_overlap: bool = False
    reduction_overlap: bool = False
    # Whose compiler produced ``collectives`` ("cpu", "gpu", "tpu"; None: a closed form). The
    # target's own has already run its collective passes (reassociation, reduce-scatters,
    # all-reduces moved out of the accumulation loop): they are priced as the program shows.
    compiled_by: str | None = None


@dataclass(frozen=True)
class CollectiveTime:
    """One priced collective: group size, ring factor, link, its time (``time_s`` = bandwidth +
    latency) and the part of it exposed after overlap."""

    kind: str
    axes: tuple[str, ...] | None
    bytes: float
    count: int
    group: int
    factor: float
    link: str
    inside_node: bool
    bandwidth_s: float
    latency_s: float
    time_s: float
    exposed_s: float
    overlap: str


@dataclass
class StepTime:
    """A step's predicted time on a target, split, with every assumption behind it."""

    target: str
    mesh: dict[str, int]
    devices: int
    compute_s: float
    matmul_s: float
    memory_bound_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    step_s: float
    unit: str
    throughput: float
    throughput_per_device: float
    mfu: float | None
    memory_bytes: int | None
    hbm_bytes: int
    fits: bool | None
    collectives: list[CollectiveTime]
    warnings: list[str]
    assumptions: list[str]

    def describe(self) -> str:
        """One line: the step time split, throughput per device, MFU, memory."""
        mfu = "" if self.mfu is None else f", MFU {self.mfu:.1%}"
        mem = "" if self.memory_bytes is None else (
            f", {fmt_bytes(self.memory_bytes)} of {fmt_bytes(self.hbm_bytes)} HBM"
            f" ({'fits' if self.fits else 'does not fit'})")  # fmt: skip
        ms = [f"{x * 1e3:.3g}" for x in (self.step_s, self.compute_s, self.exposed_comm_s,
                                         self.bubble_s)]  # fmt: skip
        return (
            f"{mesh_text(self.mesh)} on {self.target}: {ms[0]} ms/step = compute {ms[1]} + "
            f"exposed comm {ms[2]} + bubble {ms[3]}; {self.throughput_per_device:,.0f} "
            f"{self.unit}/s per device{mfu}{mem}"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for row in data["collectives"]:
            row["axes"] = None if row["axes"] is None else list(row["axes"])
        return data


def _overlap_rule(c: CollectiveWork, pipelined: bool, tensor_overlap: bool = False) -> str:
    """The overlap rule a collective falls under: "gather", "grad", "tensor" (a program that
    overlaps them), or "exposed: why"."""
    axes = set(c.axes or ())
    if c.axes is None:
        return "exposed: axes unknown"
    if c.kind == "collective-permute" or c.what == SHIFT_GATHERS:
        return "exposed: pipeline transfer between ticks"  # the shifts, and their gathers
    if "tensor" in axes:
        return "tensor" if tensor_overlap else "exposed: tensor-parallel, inside the layers"
    if c.kind == "all-gather" and UPDATED_WEIGHTS in c.what:  # zero1's
        return "exposed: after the optimizer update"
    if axes <= OVERLAP_AXES and c.kind == "all-gather":
        return "gather"
    if axes <= OVERLAP_AXES and c.kind in ("all-reduce", "reduce-scatter"):
        return "exposed: after the tick scan" if pipelined else "grad"
    return "exposed: no compute to overlap"


def step_time(
    work: StepWork,
    tgt: Target | str,
    *,
    overlap: float = OVERLAP,
    memory_fraction: float = MEMORY_FRACTION,
) -> StepTime:
    """Price ``work`` on a target (a `Target` or its text; its devices must be the mesh's).

    ``overlap`` is the share of the compute window that hides data/fsdp collectives,
    ``memory_fraction`` the share of HBM a step may fill and still fit. Every figure used is a
    sentence in ``assumptions``.

    Example:
        >>> work = StepWork({"data": 8}, 6e12, [CollectiveWork("all-reduce", ("data",), 2e9, 1)],
        ...                 tokens=8 * 4096, dtype="bfloat16")
        >>> round(step_time(work, "h100:1x8").step_s, 4)
        0.0145
    """
    if not (0 <= overlap <= 1 and 0 < memory_fraction <= 1):
        raise StepTimeError(
            f"overlap={overlap!r} and memory_fraction={memory_fraction!r}: overlap is a share in "
            f"[0, 1] (e.g. {OVERLAP}), memory_fraction one in (0, 1] (e.g. {MEMORY_FRACTION})"
        )
    if not 0 <= work.bubble_flops <= work.matmul_flops:
        raise StepTimeError(
            f"bubble_flops={work.bubble_flops:g} must lie within 0 and matmul_flops="
            f"{work.matmul_flops:g}: the bubble is part of the critical path's FLOPs"
        )
    tgt = target(tgt)
    topo, d, pipelined = tgt.topology(work.mesh), tgt.device, work.schedule is not None
    peak = d.peak(work.dtype)
    rate = peak * d.matmul_fraction
    matmul_s, bubble_s = (work.matmul_flops - work.bubble_flops) / rate, work.bubble_flops / rate
    memory_s = work.memory_bound_bytes / (d.hbm_bw * d.hbm_fraction)
    rows, by_rule = [], defaultdict(float)
    native = work.compiled_by == d.platform  # the target's compiler ran its passes already
    sinks = work.accum > 1 and not native and PLATFORMS[d.platform]["sinks_accumulated_all_reduces"]
    for c in work.collectives:
        kind = c.kind if native else run_kind(c.kind, c.what, d.platform)
        if kind is None:
            continue
        c = replace(c, kind=kind)
        g = topo.group(c.axes if c.axes is not None else [a for a in AXES if topo.sizes[a] > 1])
        factor, rule = ring_factor(c.kind, g.size), _overlap_rule(c, pipelined, work.tensor_overlap)
        link = g.ring_link if c.kind in RINGS else g.link
        if sinks and _sunk(c):  # once, after the loop: nothing left to hide behind
            c = CollectiveWork(c.kind, c.axes, c.bytes / work.accum,
                               max(1, c.count // work.accum), c.what)  # fmt: skip
            rule = "exposed: after the accumulation loop"
        if work.reduction_overlap and rule in AFTER_LOOPS:
            rule = "micro"  # bucketed, behind one micro-batch's backward and forward
        bw_s = factor * c.bytes / (link.bandwidth * d.link_fraction)
        lat_s = c.count * (d.op_latency + ring_hops(c.kind, g.size) * link.latency)
        by_rule[rule] += bw_s + lat_s
        rows.append((c, g, factor, bw_s, lat_s, rule))
    backward = BACKWARD_SHARE.get(work.remat, 2 / 3)
    hidden = {"grad": min(by_rule["grad"], overlap * backward * matmul_s)}
    hidden["gather"] = min(by_rule["gather"], overlap * matmul_s - hidden["grad"])
    # Collective matmuls split each matmul into chunks and send one while the next multiplies,
    # over the tensor group's own links: hidden up to the same share of the matmul time.
    hidden["tensor"] = min(by_rule["tensor"], overlap * matmul_s)
    left = overlap * matmul_s - hidden["grad"] - hidden["gather"]
    hidden["micro"] = min(
        by_rule["micro"], left, overlap * matmul_s / (work.accum * work.microbatches)
    )
    collectives = []
    for c, g, factor, bw_s, lat_s, rule in rows:
        seconds = bw_s + lat_s
        share_hidden = hidden.get(rule, 0.0) / by_rule[rule] if by_rule[rule] else 0.0
        collectives.append(CollectiveTime(c.kind, c.axes, c.bytes, c.count, g.size, factor,
                                          g.link.name, g.inside_node, bw_s, lat_s, seconds,
                                          seconds * (1 - share_hidden), rule))  # fmt: skip
    exposed_s = sum(c.exposed_s for c in collectives)
    step_s = matmul_s + memory_s + exposed_s + bubble_s
    throughput = work.tokens / step_s if step_s > 0 else math.inf
    budget = memory_fraction * d.hbm_bytes
    return StepTime(
        target=tgt.name, mesh=dict(topo.sizes), devices=tgt.devices,
        compute_s=matmul_s + memory_s, matmul_s=matmul_s, memory_bound_s=memory_s,
        comm_s=sum(c.time_s for c in collectives), exposed_comm_s=exposed_s, bubble_s=bubble_s,
        step_s=step_s, unit=work.unit, throughput=throughput,
        throughput_per_device=throughput / tgt.devices,
        mfu=work.model_flops / (step_s * tgt.devices * peak) if work.model_flops else None,
        memory_bytes=work.memory_bytes, hbm_bytes=d.hbm_bytes,
        fits=None if work.memory_bytes is None else work.memory_bytes <= budget,
        collectives=collectives, warnings=topo.warnings,
        assumptions=_assumptions(work, tgt, overlap, backward, budget, memory_fraction))  # fmt: skip


def _assumptions(work: StepWork, tgt: Target, overlap: float, backward: float, budget: float,
                 memory_fraction: float) -> list[str]:  # fmt: skip
    """Every figure `step_time` used, as sentences."""
    d, peak = tgt.device, tgt.device.peak(work.dtype)
    out = [
        f"Target {tgt.describe()} (figures: {d.source or d.name}).",
        f"Matmuls run at {d.matmul_fraction:.0%} of the dense {work.dtype} peak "
        f"({peak / 1e12:g} TFLOP/s): {peak * d.matmul_fraction / 1e12:.4g} TFLOP/s per device, "
        f"for {fmt_count(work.matmul_flops)} FLOPs per device per step ({work.source}); the "
        f"{d.matmul_fraction:.0%}: {d.source_of('matmul_fraction')}.",
        f"Memory-bound work moves {fmt_bytes(work.memory_bound_bytes)} per device at "
        f"{d.hbm_fraction:.0%} of {d.hbm_bw / 1e9:g} GB/s HBM (what it is: the adapter's note "
        f"below; the {d.hbm_fraction:.0%}: {d.source_of('hbm_fraction')}).",
        f"Collectives run as rings at {d.link_fraction:.0%} of the link bandwidth "
        f"({d.source_of('link_fraction')}): all-reduce "
        f"sends 2(n-1)/n of its bytes, all-gather (n-1)/n of its gathered output, reduce-scatter "
        f"and all-to-all (n-1)/n of their operand, collective-permute its operand once; each op "
        f"starts at {d.op_latency * 1e6:g} us and each ring step waits one hop ({d.intra_latency * 1e6:g} us over {d.intra_link}, "
        f"{d.inter_latency * 1e6:g} us over {d.inter_link}); across nodes a group with k "
        f"devices on each runs its rings (all-reduce, all-gather, reduce-scatter) over k rails, "
        f"min({d.intra_link} {d.intra_bw / 1e9:g}, k x {d.inter_bw / 1e9:g} GB/s) per device, "
        f"and a device's permute and all-to-all bytes through its own {d.inter_bw / 1e9:g} GB/s "
        f"{d.inter_link}.",
        f"Overlap ({overlap:.0%}: "
        + ("spmdkit's default: the first layer's gather and the last layer's reduction have "
           "nothing to hide behind, and XLA's latency-hiding scheduler is not perfect"
           if overlap == OVERLAP else "as given") + "): "
        f"gradient reductions over data/fsdp hide behind the backward ({backward:.0%} "
        f"of the matmul time, remat {work.remat}) up to {overlap:.0%} of it; fsdp weight "
        f"all-gathers are prefetched behind what the reductions leave of {overlap:.0%} of the "
        f"matmul time; " + ("tensor-parallel collectives overlap the matmuls they feed "
        f"(collective matmuls) up to {overlap:.0%} of the matmul time; pipeline permutes are "
        f"exposed" if work.tensor_overlap else "tensor-parallel collectives (inside each layer) "
        "and pipeline permutes are exposed") + ("; in a pipeline the gradient reductions follow the tick scan, so they are "
                      "exposed." if work.schedule and not work.reduction_overlap else ".")
        + " On a GPU this overlap needs XLA's latency-hiding scheduler and pipelined "
          "collectives: spmdkit gives every GPU compile "
          f"{', '.join(f'{k}=true' for k in overlap_options('gpu', ''))} "
          "(sharding.inspection.GPU_OVERLAP_OPTIONS; an option set in XLA_FLAGS keeps its value).",
        f"Fits if the per-device memory is at most {memory_fraction:.0%} of HBM "
        f"({fmt_bytes(budget)}); the rest is the runtime, workspaces and fragmentation.",
    ]  # fmt: skip
    if work.reduction_overlap:
        out.append(f"The program reduces the data-parallel gradients in buckets during the last "
                   f"micro-batch's backward and gathers the updated weights during the next "
                   f"step's first forward (given: StepWork.reduction_overlap): they hide behind "
                   f"one micro-batch's compute ({work.accum * work.microbatches} per step) up to "
                   f"{overlap:.0%} of it.")  # fmt: skip
    out += compiler_sentences(work, d.platform)
    if any(UPDATED_WEIGHTS in c.what for c in work.collectives):
        out.append("zero1's updated weights are gathered after the optimizer update: " + (
            "behind one micro-batch (above)." if work.reduction_overlap else "exposed."))  # fmt: skip
    if work.schedule:
        out.append(f"Pipeline {work.schedule}: {work.bubble_fraction:.1%} of stage-ticks idle; "
                   f"{fmt_count(work.bubble_flops)} FLOPs of the critical path are bubble, shown "
                   f"as bubble time.")  # fmt: skip
    out.append(f"MFU = model FLOPs per step ({fmt_count(work.model_flops)}) / (step time x "
               f"{tgt.devices} devices x {peak / 1e12:g} TFLOP/s {work.dtype} peak)."
               if work.model_flops else "MFU not computed: no model FLOPs per step were given.")  # fmt: skip
    return out + work.notes


__all__ = [
    "MEMORY_FRACTION",
    "OVERLAP",
    "CollectiveTime",
    "CollectiveWork",
    "StepTime",
    "StepTimeError",
    "StepWork",
    "ring_factor",
    "ring_hops",
    "step_time",
]
