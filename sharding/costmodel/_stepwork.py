"""The two ways into the step-time model: a compiled program's report, or a prediction.

`work_from_report` reads a `StepWork` off a compiled step (`ProgramReport`, and for a pipeline
its HLO text), `work_from_prediction` off a closed-form `Prediction`; `step_time` prices either.

A pipelined step needs care. gpipe and circular run every tick on every stage (bubble ticks
compute on zeros), so the compiled count is what runs, and the bubble is the bubble fraction of
the tick loops' FLOPs. The explicit schedules (1f1b, interleaved, zb-h1) run each tick's actions
under `lax.cond` lanes (named scopes ``pipeline_F``, ``pipeline_B``, ``pipeline_W``; the head and
loss in ``pipeline_head`` inside F, taken by the last virtual stage), so an idle stage skips
them, but `count_flops` charges every branch of every tick. Their tick loop is re-priced from
the schedule table instead, by `Schedule.tick_costs` (each tick ends in a collective-permute, so
it lasts as long as its slowest stage), with each lane's FLOPs read off the HLO by `_Ticks`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from sharding._units import fmt_bytes, fmt_count
from sharding.costmodel._lanes import Lanes, lane_runs, price
from sharding.costmodel._passes import apart_class
from sharding.costmodel._predict import Prediction
from sharding.costmodel._steptime import CollectiveWork, StepTimeError, StepWork
from sharding.inspection import FlopCounter, ProgramReport
from sharding.pipeline import Kind, Schedule, make_schedule

# The named scope of each lane's conditional in an explicit schedule's tick (sharding.pipeline).
LANES = {Kind.FORWARD: "pipeline_F", Kind.BACKWARD: "pipeline_B", Kind.WEIGHT: "pipeline_W"}
HEAD_SCOPE = "pipeline_head"  # inside F: the head, loss and their VJP, last virtual stage only
HEAD_W_SCOPE = "pipeline_head_w"  # inside zb-h1's W: the head's weight gradient, the same stage
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation"
                    r"|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")  # fmt: skip
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NOISE = re.compile(r'/\*.*?\*/|metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_TRIP = re.compile(r'("known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?)(\d+)')
# XLA:GPU prints a two-way conditional on a predicate; its branches in index order are false, true
_PREDICATED = re.compile(r"true_computation=(%?[\w.\-]+), false_computation=(%?[\w.\-]+)")


class _Ticks:
    """Per-tick matmul FLOPs of a pipelined step, by `count_flops` on edited copies of its HLO.

    `count_flops` is linear in how often each computation runs, so one more iteration of a loop
    adds its body's FLOPs once, and a conditional branch listed twice adds that branch's. The
    call graph (which computation calls which) comes from the callee attributes.
    """

    def __init__(self, hlo_text: str):
        hlo_text = _PREDICATED.sub(r"branch_computations={\2, \1}", hlo_text)
        self.counter = FlopCounter(hlo_text)
        self.base = float(self.counter.count().total)
        self.lines: list[tuple[str, str, str]] = []  # (computation, line sans noise, raw line)
        self.callees: dict[str, set[str]] = defaultdict(set)
        comp = None
        for raw in hlo_text.splitlines():
            if raw[:1] not in ("", " ") and raw.rstrip().endswith("{"):
                comp = raw.removeprefix("ENTRY ").split()[0].lstrip("%")
            elif comp is not None and " = " in raw:
                line = _NOISE.sub("", raw)
                self.lines.append((comp, line, raw))
                for names in _CALLS.findall(line):
                    self.callees[comp].update(re.findall(r"[\w.\-]+", names))

    def reach(self, comp: str) -> set[str]:
        """``comp`` and every computation it calls, transitively."""
        seen, todo = set(), [comp]
        while todo:
            if (c := todo.pop()) not in seen:
                seen.add(c)
                todo += self.callees[c]
        return seen

    def added(self, raw: str, edited: str) -> float:
        """FLOPs the program gains when instruction line ``raw`` is replaced by ``edited``."""
        return self.counter.count(edit=(raw, edited)).total - self.base

    def loops(self, trips: int) -> list[tuple[str, float]]:
        """(body, FLOPs one more iteration adds) of the outermost loops of ``trips`` iterations."""
        found = [(c, raw, m.group(1)) for c, line, raw in self.lines
                 if (t := _TRIP.search(line)) and int(t.group(2)) == trips
                 and (m := re.search(r"\bbody=%?([\w.\-]+)", line))]  # fmt: skip
        inner = set().union(*(self.reach(body) for _, _, body in found))
        return [(body, self.added(raw, _TRIP.sub(lambda t: f"{t.group(1)}{trips + 1}", raw, 1)))
                for c, raw, body in found if c not in inner]  # fmt: skip

    def branches(self, comp: str, scope: str) -> tuple[list[str], list[float]]:
        """(names, FLOPs each adds per run) of the branches of the one conditional under
        ``comp`` made in jax scope ``scope`` (its op_name ends ``scope/cond``), their callees and
        loops included; ([], []) without one. A branch listed twice runs once more each time
        the conditional runs."""
        reach, found = self.reach(comp), []
        for c, line, raw in self.lines:
            if c in reach and " conditional(" in line and (m := _BRANCHES.search(raw)):
                name = _OP_NAME.search(raw)
                if name and (name.group(1) + "/").endswith(f"/{scope}/cond/"):
                    found.append((raw, m))
        if len(found) != 1:
            if found:
                raise StepTimeError(f"{len(found)} conditionals in scope {scope!r} in one tick; "
                                    f"expected one (sharding.pipeline's explicit schedules)")  # fmt: skip
            return [], []
        raw, m = found[0]
        listed = [x.strip() for x in m.group(1).split(",")]
        twice = ["branch_computations={" + ", ".join([*listed, x]) + "}" for x in listed]
        return ([x.lstrip("%") for x in listed],
                [self.added(raw, raw.replace(m.group(0), e, 1)) for e in twice])  # fmt: skip


def _lanes(
    t: _Ticks, body: str, per_tick: float, schedule: Schedule, lockstep: bool
) -> tuple[Lanes, dict]:
    """Per action FLOPs of an explicit schedule's tick loop ``body``: each lane's taken branch
    (the dearest: an idle stage's branch computes nothing), F's head cond taken apart; and per
    computation of a taken branch, the share of the ticks a stage runs it (`lane_runs`: m r, or
    in lock-step the ticks any stage runs its kind; the head's m), which a compiled count
    charges every tick."""
    ticks, taken, charged = schedule.ticks, {}, 0.0
    for kind, scope in LANES.items():
        names, flops = t.branches(body, scope)
        if not names and (kind is not Kind.WEIGHT or schedule.splits_backward):
            raise StepTimeError(
                f"no {scope} conditional in the {schedule.name} tick loop; expected the lanes of "
                f"sharding.pipeline's explicit schedules (pass the HLO of the program built "
                f"with this schedule)"
            )
        # Each conditional runs once per tick: FLOPs per run are the step's over the ticks.
        charged += sum(flops) / ticks
        taken[kind] = (names[flops.index(max(flops))], max(flops) / ticks) if names else ("", 0.0)
    # The head's conditional runs inside F's taken branch, once per tick too.
    names, head = t.branches(taken[Kind.FORWARD][0], HEAD_SCOPE)
    head = [x / ticks for x in head]
    m = schedule.microbatches
    share = {c: lane_runs(schedule, kind, lockstep) / ticks
             for kind, (name, _) in taken.items() if name for c in t.reach(name)}  # fmt: skip
    if names:
        share |= dict.fromkeys(t.reach(names[head.index(max(head))]), m / ticks)
    # zb-h1's W holds the head's weight gradient the same way.
    w_names, head_w = t.branches(taken[Kind.WEIGHT][0], HEAD_W_SCOPE) if taken[Kind.WEIGHT][0] \
        else ([], [])  # fmt: skip
    head_w = [x / ticks for x in head_w]
    if w_names:
        share |= dict.fromkeys(t.reach(w_names[head_w.index(max(head_w))]), m / ticks)
    lanes = Lanes(forward=taken[Kind.FORWARD][1] - sum(head), backward=taken[Kind.BACKWARD][1],
                  weight=taken[Kind.WEIGHT][1] - sum(head_w), head=max(head, default=0.0),
                  head_weight=max(head_w, default=0.0), per_tick=per_tick - charged)  # fmt: skip
    return lanes, share


def _pipeline_flops(
    hlo_text: str, schedule: Schedule, stage_layers: Sequence[int] | None = None
) -> tuple[dict[str, Any], dict]:
    """Per-tick FLOPs of a pipelined step's HLO (summed over its runs per step) and, for an
    explicit schedule, its lanes' FLOPs, the critical path and the busiest stage's own work;
    and the share of its charged runs each lane computation runs (`_lanes`)."""
    t, ticks = _Ticks(hlo_text), schedule.ticks
    loops = t.loops(ticks)
    if not loops:
        raise StepTimeError(
            f"no while loop of {ticks} iterations in the HLO, the {schedule.name} tick scan; pass "
            f"the HLO of the program built with this schedule (program.compiled.as_text() with "
            f"schedule=program.schedule)"
        )
    per_tick = [flops for _, flops in loops]
    out = {"schedule": schedule.name, "ticks": ticks, "charged_flops": t.base,
           "tick_flops": per_tick, "loop_flops": ticks * sum(per_tick),
           "outside_flops": t.base - ticks * sum(per_tick)}  # fmt: skip
    if not schedule.explicit:
        return out, {}
    if len(loops) != 1:
        raise StepTimeError(f"the {schedule.name} HLO has {len(loops)} loops of {ticks} "
                            f"iterations; expected one, the tick scan")  # fmt: skip
    # Lanes in lock-step (a stage body partitioned over an automatic axis) price the union.
    lockstep = "/pipeline_lockstep/" in hlo_text
    lanes, share = _lanes(t, loops[0][0], per_tick[0], schedule, lockstep)
    lanes = Lanes(**{**lanes.to_dict(), "outside": out["outside_flops"]})
    critical, busiest = price(schedule, lanes, stage_layers, lockstep=lockstep)
    out.update(lanes=lanes.to_dict(), lockstep=lockstep, forward_tick_flops=lanes.forward,
               backward_tick_flops=lanes.backward, weight_tick_flops=lanes.weight,
               head_tick_flops=lanes.head, critical_flops=critical,
               busiest_device_flops=busiest)  # fmt: skip
    return out, share


def _collectives_of(items: list, key: Callable) -> list[CollectiveWork]:
    """One `CollectiveWork` per (kind, axes), first seen first, and apart those the step time
    prices by platform (`APART`). Entries of one purpose (``what``) run combined, as XLA's
    combiners merge a layer's per-parameter reductions: their count is the largest of theirs."""
    groups: dict[tuple, list] = {}
    for x in items:
        kind, axes, nbytes, count, what = key(x)
        g = groups.setdefault((kind, axes, apart_class(what)), [0, {}])
        g[0] += nbytes
        g[1][what] = max(g[1].get(what, 0), count) if what else g[1].get(what, 0) + count
    return [CollectiveWork(k, a, b, sum(n.values()), "; ".join(filter(None, n)))
            for (k, a, _), (b, n) in groups.items()]  # fmt: skip


def work_from_report(
    report: ProgramReport,
    *,
    tokens: int,
    dtype: str = "float32",
    unit: str = "tokens",
    model_flops: float | None = None,
    schedule: Schedule | None = None,
    hlo_text: str | None = None,
    remat: str = "none",
    memory_bound_bytes: float | None = None,
    stage_layers: Sequence[int] | None = None,
    accum: int = 1,
    elementwise_bytes: float | None = None,
    apart: dict[tuple[str, tuple[str, ...]], tuple[float, int]] | None = None,
) -> StepWork:
    """The `StepWork` of a compiled step: FLOPs, collectives and memory read from the program.

    Args:
        report: ``program.report()`` (its mesh names the collectives' axes).
        tokens: tokens (or samples, ``unit="samples"``) per step, all devices together.
        dtype: the compute dtype, whose peak prices the matmuls.
        model_flops: useful FLOPs per step over all devices (forward and backward, no
            recompute, no bubble) for MFU; None leaves MFU out.
        schedule, hlo_text: ``program.schedule`` and ``program.compiled.as_text()`` of a
            pipelined step; the text is required for the explicit schedules (1f1b, interleaved,
            zb-h1, whose count charges every lane of every tick) and splits a gpipe/circular
            bubble exactly.
        remat: the remat policy (the backward's share of compute, for overlap).
        memory_bound_bytes: default: the optimizer update reading and writing the train state
            once (2 x the argument bytes), plus ``elementwise_bytes``.
        elementwise_bytes: what the non-matmul operations move per device, where a closed form
            counts it (`Prediction.elementwise_bytes`; the compiled HLO of a CPU compile fuses
            otherwise than a GPU's); None: charged at the matmul rate, and the notes say so.
        stage_layers: ``program.pipeline.stage_layers`` of balanced stages (an explicit
            schedule's stage runs its own count of its ``max(stage_layers)`` layer slots).
        accum: the step's micro-steps (``accum_steps``): its gradient all-reduces, which the
            program runs once per micro-step, run once per step where the target's compiler
            moves them out of the loop (`sharding.targets.PLATFORMS`).
        apart: {(`APART` marker, mesh axes): (bytes, count)} of a CPU-compiled program's
            all-reduces that XLA for GPU runs otherwise (`apart_of` the closed form's traffic):
            kept apart so that `step_time` prices them by platform; None: priced as compiled
            (a GPU-compiled program ran them already).

    Example:
        >>> program = build_program(llama, "dp", "data=8", batch=16, seq=32)  # doctest: +SKIP
        >>> step_time(work_from_report(program.report(), tokens=512), "h100")  # doctest: +SKIP
    """
    if report.mesh is None:
        raise StepTimeError("the report has no mesh; inspect the program with its mesh")
    if schedule is None and "pipeline" in report.extra:
        raise StepTimeError(
            f"the report is of a pipelined step ({report.extra['pipeline']}); pass "
            f"schedule=program.schedule (and hlo_text=program.compiled.as_text())"
        )
    mem = report.memory
    notes = [f"FLOPs and collectives read from the compiled program (loop-aware): "
             f"{fmt_count(report.matmul_flops)} matmul FLOPs and "
             f"{fmt_bytes(report.collective_bytes())} of collectives per device per step."]  # fmt: skip
    if memory_bound_bytes is None:
        memory_bound_bytes = (0.0 if mem is None else 2.0 * mem.argument) + (elementwise_bytes or 0)
        notes.append("Memory-bound bytes: the optimizer update reads and writes the train state "
                     "once (2 x the program's argument bytes)" + (
                         "; the non-matmul operations (norms, activations, softmax) are charged "
                         "at the matmul rate through the matmul fraction (no count of their "
                         "bytes given)." if elementwise_bytes is None else
                         f", and the non-matmul work moves {fmt_bytes(elementwise_bytes)} (the "
                         f"closed form's count, Prediction.elementwise_bytes)."))  # fmt: skip
    work = StepWork(
        mesh=dict(report.mesh), matmul_flops=float(report.matmul_flops),
        collectives=_collectives_of(report.collectives, lambda op: (
            op.kind, op.axes, op.bytes * op.multiplicity, op.multiplicity, "")),
        tokens=tokens, dtype=dtype, unit=unit, memory_bound_bytes=memory_bound_bytes,
        remat=remat, model_flops=model_flops, source="compiled program",
        memory_bytes=None if mem is None else mem.needed, notes=notes, accum=accum,
        compiled_by=report.platform,
        elementwise_bytes=min(elementwise_bytes or 0.0, memory_bound_bytes))  # fmt: skip
    if schedule is None:
        return _apart(work, apart)
    work.schedule, work.bubble_fraction = schedule.name, schedule.bubble_fraction
    work.microbatches = schedule.microbatches
    if hlo_text is None:
        if schedule.explicit:
            raise StepTimeError(
                f"{schedule.name} runs its F, B and W lanes under lax.cond but the report's FLOPs "
                f"charge every lane of every tick; pass hlo_text=program.compiled.as_text() to "
                f"price each tick"
            )
        work.bubble_flops = schedule.bubble_fraction * work.matmul_flops
        notes.append("Bubble: the bubble fraction of all matmul FLOPs (no HLO given: work "
                     "outside the tick scan counted as if it ticked).")  # fmt: skip
        return _apart(work, apart)
    p, share = _pipeline_flops(hlo_text, schedule, stage_layers)
    work.pipeline = p
    if not schedule.explicit:
        work.bubble_flops = schedule.bubble_fraction * p["loop_flops"]
        notes.append(f"{schedule.name}: every stage runs every tick (bubble ticks compute on "
                     f"zeros), so the compiled count is what runs; bubble = "
                     f"{schedule.bubble_fraction:.1%} of the {fmt_count(p['loop_flops'])} FLOPs "
                     f"of the tick loops.")  # fmt: skip
        return _apart(work, apart)
    work.matmul_flops = p["critical_flops"]
    work.bubble_flops = p["critical_flops"] - p["busiest_device_flops"]
    # Collectives inside a lane (tensor-parallel reductions) run when it does, not every tick.
    work.collectives = _collectives_of(report.collectives, lambda op: (
        op.kind, op.axes, op.bytes * op.multiplicity * share.get(op.computation, 1.0),
        round(op.multiplicity * share.get(op.computation, 1.0)), ""))  # fmt: skip
    weight = f", weight {fmt_count(p['weight_tick_flops'])}" if schedule.splits_backward else ""
    notes.append(
        f"{schedule.name}: the compiled count charges every lane of each of the {schedule.ticks} "
        f"ticks ({fmt_count(p['charged_flops'])} FLOPs); priced instead from the schedule table "
        f"in lock-step, each tick as long as its slowest stage, from the lanes' FLOPs per "
        f"micro-batch and chunk: forward {fmt_count(p['forward_tick_flops'])} (+ "
        f"{fmt_count(p['head_tick_flops'])} for the head on the last stage), backward "
        f"{fmt_count(p['backward_tick_flops'])}{weight}; bubble = the critical path less the "
        f"busiest stage's own work."
    )
    return _apart(work, apart)


def _apart(work: StepWork, apart: dict[tuple, tuple[float, int]] | None) -> StepWork:
    """``work`` with each of ``apart``'s bytes moved out of its all-reduces over those axes into a
    row of its own marker, with the program's executions in proportion to the bytes (XLA's
    combiners merge what the closed form counts apart): all of it, or what they hold (noted)."""
    for (marker, axes), (nbytes, _) in (apart or {}).items():
        plain = ("all-reduce", tuple(axes), "")
        whole = next((c for c in work.collectives if (c.kind, c.axes, c.what) == plain), None)
        if whole is None or not nbytes:
            continue
        if nbytes > whole.bytes:
            work.notes.append(f"The closed form marks more than the program's all-reduces over "
                              f"{', '.join(axes)} hold ({marker}): {whole.bytes / nbytes:.0%} "
                              f"of it kept apart.")  # fmt: skip
        moved = CollectiveWork("all-reduce", whole.axes, whole.bytes, whole.count, marker)
        rows = [moved]
        if nbytes < whole.bytes:  # at least one execution each, the rest by the bytes
            count = max(1, min(whole.count - 1, round(whole.count * nbytes / whole.bytes)))
            rows = [CollectiveWork("all-reduce", whole.axes, whole.bytes - nbytes,
                                   max(1, whole.count - count)),
                    replace(moved, bytes=nbytes, count=count)]  # fmt: skip
        at = work.collectives.index(whole)
        work.collectives[at : at + 1] = rows
    return work


def work_from_prediction(
    pred: Prediction, *, model_flops: float | None = None, memory_bound_bytes: float | None = None
) -> StepWork:
    """The `StepWork` of a closed-form `Prediction` (``sharding.costmodel.predict``).

    ``model_flops`` defaults, without pipeline or remat, to the predicted matmul FLOPs times the
    devices (each computes a distinct slice); else pass it, e.g. ``predict(family, cfg, "dp",
    {"data": 1}, batch, seq).matmul_flops``. ``memory_bound_bytes`` defaults to the optimizer
    update reading and writing the train state once (2 x the predicted argument bytes).
    """
    if model_flops is None and pred.pipeline is None and pred.remat == "none":
        model_flops = pred.matmul_flops * math.prod(pred.mesh.values())
    notes = ["FLOPs, collectives and memory from the closed-form prediction (no compile); "
             "collectives of one purpose count as one combined execution."]  # fmt: skip
    if memory_bound_bytes is None:
        memory_bound_bytes = 2.0 * pred.argument_bytes + pred.elementwise_bytes
        notes.append(f"Memory-bound bytes: the optimizer update reads and writes the train state "
                     f"once (2 x the predicted argument bytes), and the non-matmul work (norms, "
                     f"residuals, activations, softmax, loss) moves "
                     f"{fmt_bytes(pred.elementwise_bytes)} (sharding.costmodel._elementwise).")  # fmt: skip
    work = StepWork(
        mesh=dict(pred.mesh), matmul_flops=float(pred.critical_flops),
        collectives=_collectives_of(pred.traffic, lambda x: (
            x.kind, tuple(x.axes), x.bytes, x.count, x.what)),
        tokens=pred.batch * pred.seq, dtype=pred.dtype, memory_bound_bytes=memory_bound_bytes,
        elementwise_bytes=min(pred.elementwise_bytes, memory_bound_bytes),
        remat=pred.remat, model_flops=model_flops, memory_bytes=pred.memory_bytes,
        source="closed-form prediction", notes=notes, accum=pred.accum)  # fmt: skip
    if pred.pipeline is None:
        return work
    pipe = pred.pipeline
    sched = make_schedule(pred.mesh["stage"], pipe["microbatches"], pipe["name"], pipe["repeats"])
    work.schedule, work.bubble_fraction = sched.name, sched.bubble_fraction
    work.microbatches = sched.microbatches
    if not sched.explicit or "lanes" not in pipe:
        work.bubble_flops = sched.bubble_fraction * work.matmul_flops
        notes.append(f"{sched.name}: bubble = {sched.bubble_fraction:.1%} of the predicted FLOPs "
                     f"(the head outside the tick scan counted as if it ticked).")  # fmt: skip
        return work
    # predict's lanes (one micro-batch through one chunk), priced as a compiled program's are.
    critical, busiest = price(sched, Lanes.of(pipe["lanes"]), pipe.get("stage_layers"),
                              lockstep=pipe.get("lockstep", False))  # fmt: skip
    k = getattr(pred, "accum", 1)  # the table runs once per micro-step
    work.matmul_flops, work.bubble_flops = k * critical, k * (critical - busiest)
    notes.append(f"{sched.name}: priced from the schedule table in lock-step (each tick as long "
                 f"as its slowest stage; the head in the last stage's forward).")  # fmt: skip
    return work


__all__ = ["HEAD_SCOPE", "HEAD_W_SCOPE", "LANES", "work_from_prediction", "work_from_report"]
