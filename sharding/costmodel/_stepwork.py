"""The two ways into the step-time model: a compiled program's report, or a prediction.

`work_from_report` reads a `StepWork` off a compiled step (`ProgramReport`, and for a pipeline
its HLO text), `work_from_prediction` off a closed-form `Prediction`; `step_time` prices either.

A pipelined step needs care. gpipe and circular run every tick on every stage (bubble ticks
compute on zeros), so the compiled count is what runs, and the bubble is the bubble fraction of
the tick loops' FLOPs. 1F1B runs one `lax.switch` branch per tick (idle, forward, backward, the
last stage's backward adding the head), but `count_flops` charges every branch of every tick; the
tick loop is re-priced from the schedule table instead, in lock-step (each tick ends in a
collective-permute, so it lasts as long as its slowest stage), with each branch's FLOPs read off
the HLO by `_Ticks`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sharding._units import fmt_bytes, fmt_count
from sharding.costmodel._predict import Prediction
from sharding.costmodel._steptime import CollectiveWork, StepTimeError, StepWork
from sharding.inspection import ProgramReport, count_flops
from sharding.pipeline import Kind, Schedule, make_schedule

# The branches of sharding.pipeline's 1f1b tick, in its lax.switch order.
SWITCH = (Kind.IDLE, Kind.FORWARD, Kind.BACKWARD)
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation"
                    r"|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")  # fmt: skip
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_NOISE = re.compile(r'/\*.*?\*/|metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_TRIP = re.compile(r'("known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?)(\d+)')


def _lockstep(schedule: Schedule, cost: Callable[[Kind, int], float]) -> tuple[float, float]:
    """(sum over ticks of the slowest stage's tick, the busiest stage's own sum)."""
    critical, per_stage = 0.0, [0.0] * schedule.stages
    for row in schedule.table:
        costs = [cost(a.kind, s) for s, a in enumerate(row)]
        critical += max(costs)
        per_stage = [x + c for x, c in zip(per_stage, costs, strict=True)]
    return critical, max(per_stage)


class _Ticks:
    """Per-tick matmul FLOPs of a pipelined step, by `count_flops` on edited copies of its HLO.

    `count_flops` is linear in how often each computation runs, so one more iteration of a loop
    adds its body's FLOPs once, and a conditional branch listed twice adds that branch's. The
    call graph (which computation calls which) comes from the callee attributes.
    """

    def __init__(self, hlo_text: str):
        self.text, self.base = hlo_text, float(count_flops(hlo_text).total)
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
        return count_flops(self.text.replace(raw, edited, 1)).total - self.base

    def loops(self, trips: int) -> list[tuple[str, float]]:
        """(body, FLOPs one more iteration adds) of the outermost loops of ``trips`` iterations."""
        found = [(c, raw, m.group(1)) for c, line, raw in self.lines
                 if (t := _TRIP.search(line)) and int(t.group(2)) == trips
                 and (m := re.search(r"\bbody=%?([\w.\-]+)", line))]  # fmt: skip
        inner = set().union(*(self.reach(body) for _, _, body in found))
        return [(body, self.added(raw, _TRIP.sub(lambda t: f"{t.group(1)}{trips + 1}", raw, 1)))
                for c, raw, body in found if c not in inner]  # fmt: skip

    def branches(self, comp: str, n: int) -> tuple[list[str], list[float]]:
        """(names, FLOPs each adds) of the branches of the first ``n``-way conditional under
        ``comp``, their callees and loops included; ([], []) without one."""
        reach = self.reach(comp)
        for c, line, raw in self.lines:
            m = _BRANCHES.search(raw) if c in reach and " conditional(" in line else None
            listed = [x.strip() for x in m.group(1).split(",")] if m else []
            if len(listed) == n:
                twice = ["branch_computations={" + ", ".join([*listed, x]) + "}" for x in listed]
                flops = [self.added(raw, raw.replace(m.group(0), e, 1)) for e in twice]
                return [x.lstrip("%") for x in listed], flops
        return [], []


def _pipeline_flops(hlo_text: str, schedule: Schedule) -> dict[str, Any]:
    """Per-tick FLOPs of a pipelined step's HLO (summed over its runs per step) and, for 1f1b,
    the critical path and the busiest stage's own work in lock-step."""
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
    if schedule.name != "1f1b":
        return out
    names, switch = t.branches(loops[0][0], len(SWITCH))
    if len(loops) != 1 or not switch:
        raise StepTimeError(
            f"the 1f1b HLO has {len(loops)} tick loop(s) and {'a' if switch else 'no'} "
            f"{len(SWITCH)}-way switch; expected one of each (sharding.pipeline's 1f1b)"
        )
    # A branch listed twice runs once more every tick: per tick, divide by the ticks.
    switch = [x / ticks for x in switch]
    cost = dict(zip(SWITCH, switch, strict=True))
    # The backward's own two-way conditional: the head and loss, run by the last stage only.
    nested = [x / ticks for x in t.branches(names[SWITCH.index(Kind.BACKWARD)], 2)[1]]
    last = cost[Kind.BACKWARD] - (min(nested) if nested else 0.0)
    other = cost[Kind.BACKWARD] - (max(nested) if nested else 0.0)
    rest = per_tick[0] - sum(switch)  # per-tick work outside the switch

    def tick(kind: Kind, stage: int) -> float:
        if kind is Kind.BACKWARD:
            return rest + (last if stage == schedule.stages - 1 else other)
        return rest + cost[kind]

    critical, busiest = _lockstep(schedule, tick)
    out.update(forward_tick_flops=cost[Kind.FORWARD], backward_tick_flops=other,
               backward_tick_flops_last=last, critical_flops=out["outside_flops"] + critical,
               busiest_device_flops=out["outside_flops"] + busiest)  # fmt: skip
    return out


def _collectives_of(items: list, key: Callable) -> list[CollectiveWork]:
    """One `CollectiveWork` per (kind, axes), first seen first. Entries of one purpose
    (``what``) run combined, as XLA's combiners merge a layer's per-parameter reductions: their
    count is the largest of theirs."""
    groups: dict[tuple, list] = {}
    for x in items:
        kind, axes, nbytes, count, what = key(x)
        g = groups.setdefault((kind, axes), [0, {}])
        g[0] += nbytes
        g[1][what] = max(g[1].get(what, 0), count) if what else g[1].get(what, 0) + count
    return [CollectiveWork(k, a, b, sum(n.values()), "; ".join(filter(None, n)))
            for (k, a), (b, n) in groups.items()]  # fmt: skip


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
) -> StepWork:
    """The `StepWork` of a compiled step: FLOPs, collectives and memory read from the program.

    Args:
        report: ``program.report()`` (its mesh names the collectives' axes).
        tokens: tokens (or samples, ``unit="samples"``) per step, all devices together.
        dtype: the compute dtype, whose peak prices the matmuls.
        model_flops: useful FLOPs per step over all devices (forward and backward, no
            recompute, no bubble) for MFU; None leaves MFU out.
        schedule, hlo_text: ``program.schedule`` and ``program.compiled.as_text()`` of a
            pipelined step; the text is required for 1f1b (whose count charges every branch of
            a tick) and splits a gpipe/circular bubble exactly.
        remat: the remat policy (the backward's share of compute, for overlap).
        memory_bound_bytes: default: the optimizer update reading and writing the train state
            once (2 x the argument bytes).

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
        memory_bound_bytes = 0.0 if mem is None else 2.0 * mem.argument
        notes.append("Memory-bound bytes: the optimizer update reads and writes the train state "
                     "once (2 x the program's argument bytes).")  # fmt: skip
    work = StepWork(
        mesh=dict(report.mesh), matmul_flops=float(report.matmul_flops),
        collectives=_collectives_of(report.collectives, lambda op: (
            op.kind, op.axes, op.bytes * op.multiplicity, op.multiplicity, "")),
        tokens=tokens, dtype=dtype, unit=unit, memory_bound_bytes=memory_bound_bytes,
        remat=remat, model_flops=model_flops, source="compiled program",
        memory_bytes=None if mem is None else mem.allocated, notes=notes)  # fmt: skip
    if schedule is None:
        return work
    work.schedule, work.bubble_fraction = schedule.name, schedule.bubble_fraction
    if hlo_text is None:
        if schedule.name == "1f1b":
            raise StepTimeError(
                "1f1b runs one branch of a lax.switch per tick but the report's FLOPs charge "
                "every branch; pass hlo_text=program.compiled.as_text() to price each tick"
            )
        work.bubble_flops = schedule.bubble_fraction * work.matmul_flops
        notes.append("Bubble: the bubble fraction of all matmul FLOPs (no HLO given: work "
                     "outside the tick scan counted as if it ticked).")  # fmt: skip
        return work
    work.pipeline = p = _pipeline_flops(hlo_text, schedule)
    if schedule.name != "1f1b":
        work.bubble_flops = schedule.bubble_fraction * p["loop_flops"]
        notes.append(f"{schedule.name}: every stage runs every tick (bubble ticks compute on "
                     f"zeros), so the compiled count is what runs; bubble = "
                     f"{schedule.bubble_fraction:.1%} of the {fmt_count(p['loop_flops'])} FLOPs "
                     f"of the tick loops.")  # fmt: skip
        return work
    work.matmul_flops = p["critical_flops"]
    work.bubble_flops = p["critical_flops"] - p["busiest_device_flops"]
    notes.append(
        f"1f1b: the compiled count charges all {len(SWITCH)} branches of each of the "
        f"{schedule.ticks} ticks ({fmt_count(p['charged_flops'])} FLOPs); priced instead from the "
        f"schedule table in lock-step, each tick as long as its slowest stage: forward "
        f"{fmt_count(p['forward_tick_flops'])}, backward {fmt_count(p['backward_tick_flops'])} "
        f"({fmt_count(p['backward_tick_flops_last'])} on the last stage, with the head) FLOPs "
        f"per tick; bubble = the critical path less the busiest stage's own work."
    )
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
        memory_bound_bytes = 2.0 * pred.argument_bytes
        notes.append("Memory-bound bytes: the optimizer update reads and writes the train state "
                     "once (2 x the predicted argument bytes).")  # fmt: skip
    work = StepWork(
        mesh=dict(pred.mesh), matmul_flops=float(pred.critical_flops),
        collectives=_collectives_of(pred.traffic, lambda x: (
            x.kind, tuple(x.axes), x.bytes, x.count, x.what)),
        tokens=pred.batch * pred.seq, dtype=pred.dtype, memory_bound_bytes=memory_bound_bytes,
        remat=pred.remat, model_flops=model_flops, memory_bytes=pred.memory_bytes,
        source="closed-form prediction", notes=notes)  # fmt: skip
    if pred.pipeline is None:
        return work
    pipe = pred.pipeline
    sched = make_schedule(pred.mesh["stage"], pipe["microbatches"], pipe["name"], pipe["repeats"])
    work.schedule, work.bubble_fraction = sched.name, sched.bubble_fraction
    # predict's 1f1b: executed = stage (4+e) m + head, critical = stage (3+e) ticks + head, e = 1
    # under remat full; solved for the stage's forward and the head to price the table.
    e, m = int(pred.remat == "full"), sched.microbatches
    stage = -1.0
    if sched.name == "1f1b":  # (3+e) ticks > (4+e) m: ticks = 2(m + p - 1)
        stage = (pred.critical_flops - pred.matmul_flops) / ((3 + e) * sched.ticks - (4 + e) * m)
    if stage < 0:
        work.bubble_flops = sched.bubble_fraction * work.matmul_flops
        notes.append(f"{sched.name}: bubble = {sched.bubble_fraction:.1%} of the predicted FLOPs "
                     f"(the head outside the tick scan counted as if it ticked).")  # fmt: skip
        return work
    head = pred.matmul_flops - stage * (4 + e) * m

    def tick(kind: Kind, s: int) -> float:
        if kind is Kind.BACKWARD:
            return (3 + e) * stage + (head / m if s == sched.stages - 1 else 0.0)
        return stage if kind is Kind.FORWARD else 0.0

    critical, busiest = _lockstep(sched, tick)
    work.matmul_flops, work.bubble_flops = critical, critical - busiest
    notes.append("1f1b: priced from the schedule table in lock-step (each tick as long as its "
                 "slowest stage; the head in the last stage's backward).")  # fmt: skip
    return work


__all__ = ["SWITCH", "work_from_prediction", "work_from_report"]
