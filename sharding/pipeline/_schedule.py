"""Pipeline schedules as pure tables: what every stage does at every tick.

The pipeline is one SPMD program: a ``lax.scan`` over ticks in which all ``p`` stages run in
lock-step, then a ``ppermute`` moves activations from stage ``s`` to ``s + 1`` (cotangents from
``s`` to ``s - 1``). So an output made at tick ``t`` is usable by the neighbour at tick ``t + 1``,
and a tick lasts as long as its slowest stage. ``table[t][s]`` is the cell of stage ``s`` at tick
``t``: the `Action` s it runs, in order (empty: idle). ``F(i, s)`` is the tick of the forward of
micro-batch ``i`` on stage ``s``, ``B`` that of its backward (`sharding.pipeline._tables`):

    schedule     F(i, s)                    B(i, s)                      ticks
    gpipe        i + s                      autodiff, reversed scan      m + p - 1
    circular     j*m + i + s  (m >= p)      autodiff, reversed scan      r*m + p - 1
    1f1b         i + s                      i + 2p - 2 - s               m + 2p - 2
    interleaved  see _tables (m % p == 0)   fused with F, v = repeats    v*m + v*p + p - 2
    zb-h1        list-scheduled F, B (input gradient), W (weight gradient), one per tick

gpipe and circular tables hold the forward scan only: their backward is ``jax.grad`` through it,
a scan of the same length in reverse (`Schedule.backward_table`, drawn by `render`). The explicit
schedules (`EXPLICIT`) hold every backward action, so one scan runs the whole step and a stage
keeps a micro-batch's residuals only from its forward to its (last) backward action: 1f1b holds
``2(p - s) - 1`` on stage ``s`` against GPipe's ``m``, zb-h1 at most ``p``.

What a schedule costs on real devices is `Schedule.tick_costs`: the sum over ticks of the
slowest stage's work. With a forward, an input gradient and a weight gradient of equal cost,
gpipe and 1f1b take ``3(m + p - 1)`` units, interleaved ``3(m + (p - 1)/v)``, zb-h1
``3m + p - 1``: its bubble is a third of 1f1b's.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from rich.table import Table

from sharding.pipeline import _tables
from sharding.pipeline._errors import (  # noqa: F401  (the schedule's errors, re-exported)
    LayerCountError,
    PipelineError,
    RepeatsError,
    ScheduleError,
    ScheduleSizeError,
    TooFewMicrobatchesError,
    UnknownScheduleError,
    _check_sizes,
    check_layers,
)
from sharding.pipeline._kinds import Action, Cell, Kind
from sharding.pipeline._render import labels, render, rich_table

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zb-h1")
EXPLICIT = ("1f1b", "interleaved", "zb-h1")  # the table holds the backward too
CHUNKED = ("circular", "interleaved")  # repeats >= 2 chunks of layers per stage


# The kinds of action a tick's cost adds up (an idle cell costs nothing).
KINDS_PRICED = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
Grid = tuple[tuple[Action, ...], ...]  # [tick][stage], one action each
Table_ = tuple[tuple[Cell, ...], ...]  # [tick][stage], the cell's actions


@dataclass(frozen=True)
class TickCosts:
    """A schedule priced in lock-step (see `Schedule.tick_costs`).

    Attributes:
        critical: sum over ticks of the slowest stage's work (the step's pipeline time).
        busiest: the most work any one stage does (its own actions; in lock-step the lanes it
            runs for other stages count as bubble).
        ticks: the slowest stage's work in each tick (the backward scan's after the forward's
            for gpipe and circular).
    """

    critical: float
    busiest: float
    ticks: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """Time the busiest stage waits: ``critical - busiest``."""
        return self.critical - self.busiest

    @property
    def bubble_fraction(self) -> float:
        """``bubble / critical``."""
        return self.bubble / self.critical if self.critical else 0.0


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as tick-by-stage tables; build it with `make_schedule`.

    Attributes:
        name: one of `SCHEDULES`.
        stages, microbatches, repeats: ``p``, ``m``, ``r`` (chunks of layers per stage: circular
            and interleaved; 1 for the others).
        table: ``table[tick][stage]``, the cell of actions of the scan the pipeline runs.
        activation_in: ``[tick][stage]``, the forward whose input activation arrives from the
            previous stage at this tick (stage 0 of a chunked schedule: from the last stage, for
            the next chunk), else IDLE. Stage 0's first chunk reads the data.
        cotangent_in: ``[tick][stage]``, the backward whose cotangent arrives from the next
            stage. The last stage makes its own from the loss. All IDLE for gpipe and circular,
            whose cotangents move inside autodiff's reversed scan.
    """

    name: str
    stages: int
    microbatches: int
    repeats: int
    table: Table_
    activation_in: Grid
    cotangent_in: Grid

    @property
    def ticks(self) -> int:
        """Length of the scan (see the module's table)."""
        return len(self.table)

    @property
    def explicit(self) -> bool:
        """Whether the table holds the backward (one scan for the step, no autodiff)."""
        return self.name in EXPLICIT

    @cached_property
    def splits_backward(self) -> bool:
        """Whether backward actions compute input gradients only, ``W`` the weight gradients."""
        return any(a.kind is Kind.WEIGHT for row in self.table for cell in row for a in cell)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step on real devices, with a forward, an input gradient and a
        weight gradient of equal cost: gpipe (p-1)/(m+p-1), circular (p-1)/(r*m+p-1),
        1f1b (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), zb-h1 (p-1)/(3m+p-1)."""
        return self.tick_costs(1.0, 1.0, 1.0).bubble_fraction

    @property
    def backward_table(self) -> Table_:
        """The backward scan of gpipe/circular: tick k undoes forward tick T-1-k. Explicit: ()."""
        if self.explicit:
            return ()
        flip = {Kind.FORWARD: Kind.BACKWARD}
        return tuple(tuple(tuple(a._replace(kind=flip.get(a.kind, a.kind)) for a in cell)
                           for cell in row) for row in reversed(self.table))  # fmt: skip

    @property
    def peak_activations(self) -> tuple[int, ...]:
        """Per stage, the most micro-batch chunks whose forward residuals it holds at once: gpipe
        ``m``, circular ``r*m`` (autodiff keeps all for its reversed scan), 1f1b ``2(p - s) - 1``
        (at most m), zb-h1 at most ``p`` (residuals live until W)."""
        first, last = {}, {}  # (stage, micro-batch, chunk) -> its first / last tick
        for t, row in enumerate(self.table + self.backward_table):
            for s, cell in enumerate(row):
                for a in cell:
                    key = (s, a.microbatch, a.repeat)
                    first.setdefault(key, t)
                    last[key] = t
        spans: dict[int, list[tuple[int, int]]] = {s: [] for s in range(self.stages)}
        for key, start in first.items():
            spans[key[0]].append((start, last[key] + 1))
        return tuple(_max_overlap(spans[s]) for s in range(self.stages))

    @cached_property
    def slots(self) -> _tables.Slots:
        """Buffer slots of the scan: arrivals, residuals, zb-h1's weight cotangents."""
        return _tables.slots(self.table, self.activation_in, self.cotangent_in, self.stages,
                             self.repeats, self.explicit)  # fmt: skip

    @property
    def buffer_slots(self) -> int:
        """Arrived activations awaiting their forward, the most over stages: circular
        ``max(m - p, 0)`` (last-stage outputs for the next repeat), zb-h1 a few, else 0 or 1."""
        return self.slots.activations

    def tick_costs(
        self,
        forward: float | Sequence[float],
        backward: float | Sequence[float],
        weight: float | Sequence[float] = 0.0,
        *,
        lockstep: bool = False,
    ) -> TickCosts:
        """Price the table in lock-step: each tick lasts as long as its slowest stage (with
        ``lockstep``, lanes in lock-step, `sharding.pipeline._lockstep`: a stage's tick costs
        every kind of action any stage runs in it).

        Args:
            forward, backward, weight: one stage's forward, input-gradient and weight-gradient
                time for one micro-batch through all its layers (a float, or one per stage, e.g.
                measured from the compiled stage programs). A chunk of a circular or
                interleaved stage costs 1/repeats of it; an unsplit backward costs
                ``backward + weight``.

        Example:
            >>> make_schedule(4, 8, "1f1b").tick_costs(1.0, 1.0, 1.0).critical
            33.0
            >>> make_schedule(4, 8, "zb-h1").tick_costs(1.0, 1.0, 1.0).critical
            27.0
            >>> make_schedule(4, 8, "zb-h1").tick_costs(1.0, 1.0, 1.0, lockstep=True).critical
            62.0
            >>> make_schedule(4, 8, "zb-h1").tick_costs(1.0, 1.0, 1.0, lockstep=True).busiest
            24.0
        """
        p, r = self.stages, self.repeats
        f, b, w = (_per_stage(x, p, n) for x, n in
                   ((forward, "forward"), (backward, "backward"), (weight, "weight")))  # fmt: skip
        split = self.splits_backward
        cost = {Kind.FORWARD: f, Kind.BACKWARD: b if split else [x + y for x, y in zip(b, w, strict=True)],
                Kind.WEIGHT: w}  # fmt: skip
        # [ticks, stages, kinds] action counts (or, in lock-step, the tick's union of kinds)
        # against [kinds, stages] costs: each tick's work per stage.
        counts, union = self._kind_counts
        c = np.array([cost[k] for k in KINDS_PRICED], dtype=float)
        own = np.einsum("tsk,ks->ts", counts, c) / r  # each stage's own actions
        # in lock-step a tick costs every stage each kind any stage runs: the rest of it is
        # bubble, as a gpipe tick on zeros is
        work = np.einsum("tk,ks->ts", union, c) / r if lockstep else own
        per_tick = work.max(axis=1)
        return TickCosts(float(per_tick.sum()), float(own.sum(axis=0).max()),
                         tuple(float(x) for x in per_tick))  # fmt: skip

    @cached_property
    def _kind_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The table then the backward table as ``[ticks, stages, kinds]`` action counts, and
        ``[ticks, kinds]``: whether any stage runs the kind in the tick (`KINDS_PRICED`)."""
        rows = self.table + self.backward_table
        counts = np.zeros((len(rows), self.stages, len(KINDS_PRICED)))
        for t, row in enumerate(rows):
            for s, cell in enumerate(row):
                for a in cell:
                    counts[t, s, KINDS_PRICED.index(a.kind)] += 1
        return counts, (counts.sum(axis=1) > 0).astype(float)

    @cached_property
    def active_ticks(self) -> dict[Kind, int]:
        """Per kind of action, the ticks of the table in which some stage runs one."""
        union = self._kind_counts[1][: len(self.table)]
        return {k: int(union[:, i].sum()) for i, k in enumerate(KINDS_PRICED)}

    def layers_per_stage(self, n_layers: int) -> int:
        """Layers each stage applies per chunk; raises `LayerCountError` if they do not split.

        Example:
            >>> make_schedule(4, 8, "circular", repeats=2).layers_per_stage(32)
            4
        """
        return check_layers(n_layers, self.stages, self.repeats)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `json.dumps`; cells are labels like ``F3``, ``F3B0``, ``F3r1``, ``.``."""
        r = self.repeats > 1
        return {
            "schedule": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "repeats": self.repeats,
            "ticks": self.ticks,
            "bubble_fraction": self.bubble_fraction,
            "peak_activations": list(self.peak_activations),
            "buffer_slots": self.buffer_slots,
            "table": labels(self.table, r),
            "backward_table": labels(self.backward_table, r),
            "activation_in": labels(self.activation_in, r),
            "cotangent_in": labels(self.cotangent_in, r),
        }

    def __str__(self) -> str:
        return render(self)

    def __rich__(self) -> Table:
        return rich_table(self)


def make_schedule(stages: int, microbatches: int, schedule: str, repeats: int = 1) -> Schedule:
    """Build the tick-by-stage table of a pipeline schedule.

    Args:
        stages: ``p``, the size of the ``"stage"`` mesh axis.
        microbatches: ``m``, micro-batches per step (per data-parallel replica).
        schedule: one of `SCHEDULES`.
        repeats: ``r``, circular and interleaved only (>= 2): chunks of layers per stage, each
            micro-batch going round the stages r times.

    Raises:
        ScheduleSizeError, UnknownScheduleError, RepeatsError, TooFewMicrobatchesError.

    Example:
        >>> s = make_schedule(2, 4, "1f1b")
        >>> s.ticks, s.peak_activations
        (6, (3, 1))
        >>> print(s)
        1f1b: stages=2 microbatches=4 ticks=6 bubble=20.0%
        tick       0    1    2    3    4    5
        stage 0   F0   F1 F2B0 F3B1   B2   B3
        stage 1    . F0B0 F1B1 F2B2 F3B3    .
    """
    _check_sizes(stages=stages, microbatches=microbatches, repeats=repeats)
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        close = difflib.get_close_matches(str(schedule).lower(), SCHEDULES, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownScheduleError(
            f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}{hint}"
        )
    return _schedule(int(stages), int(microbatches), schedule, int(repeats))


@functools.lru_cache(maxsize=256)
def _schedule(p: int, m: int, schedule: str, r: int) -> Schedule:
    """`make_schedule` of checked sizes and name, each table built once (a search prices
    thousands)."""
    if schedule in CHUNKED and r < 2:
        plain = "gpipe" if schedule == "circular" else "1f1b"
        raise RepeatsError(
            f"schedule={schedule!r} needs repeats >= 2 (chunks of layers per stage), got "
            f"repeats={r}: one chunk is {plain}, so use schedule={plain!r} (or repeats >= 2: "
            f"the bubble shrinks about r times)"
        )
    if schedule not in CHUNKED and r != 1:
        raise RepeatsError(
            f"repeats={r} applies only to schedules 'circular' and 'interleaved'; {schedule} "
            f"runs each stage's layers once per micro-batch. Use schedule='circular' or "
            f"'interleaved' with repeats={r}, or repeats=1"
        )
    if schedule != "gpipe" and m < p:
        why = (
            f"micro-batch i leaves the last stage in repeat j at tick j*m+i+{p - 1}, but "
            f"stage 0 needs it for repeat j+1 at tick (j+1)*m+i, which is later only if m >= p"
            if schedule == "circular"
            else f"stage 0 runs {p} forwards before the first cotangent comes back, so it never "
            f"reaches the one-forward-one-backward steady state"
        )
        raise TooFewMicrobatchesError(
            f"schedule={schedule!r} needs microbatches >= stages, got microbatches={m} < "
            f"stages={p}: {why}. Use microbatches >= {p} (the smallest valid is {p}), or "
            f"schedule='gpipe'"
        )
    if schedule == "interleaved" and m % p:
        raise TooFewMicrobatchesError(
            f"schedule='interleaved' takes micro-batches in groups of the stages: microbatches="
            f"{m} is not a multiple of stages={p}. Use microbatches={m // p * p or p} or "
            f"{(m // p + 1) * p}, or schedule='1f1b'"
        )
    cells = {
        "1f1b": lambda: _tables.one_f_one_b(p, m),
        "interleaved": lambda: _tables.interleaved(p, m, r),
        "zb-h1": lambda: _tables.zero_bubble_h1(p, m),
    }.get(schedule, lambda: _tables.forward_only(p, m, r))()
    table = _tables.grid(cells, p)
    act_in, cot_in = _tables.arrivals(table, p, r)
    return Schedule(schedule, p, m, r, table, act_in, cot_in)


def _per_stage(x: float | Sequence[float], p: int, name: str) -> list[float]:
    if isinstance(x, int | float):
        return [float(x)] * p
    if len(x) != p:
        raise ScheduleError(f"{name} costs: one per stage, {p} values, got {len(x)}: {list(x)}")
    return [float(v) for v in x]


def _max_overlap(spans: list[tuple[int, int]]) -> int:
    """Most half-open tick intervals [start, end) covering one tick."""
    events = sorted([(a, 1) for a, b in spans if b > a] + [(b, -1) for a, b in spans if b > a])
    best = now = 0
    for _, step in events:  # ends sort before starts at the same tick: half-open
        now += step
        best = max(best, now)
    return best
