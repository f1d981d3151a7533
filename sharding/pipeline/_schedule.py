"""Pipeline schedules as pure tables: what every stage does at every tick.

The pipeline is one SPMD program: a ``lax.scan`` over ticks in which all ``p`` stages run in
lock-step, then a ``ppermute`` moves activations from stage ``s`` to ``s + 1`` (cotangents from
``s`` to ``s - 1``). So an output made at tick ``t`` is usable by the neighbour at tick ``t + 1``.
``table[t][s]`` is the `Action` stage ``s`` runs at tick ``t``; ``F(i, s, j)`` below is the tick of
the forward of micro-batch ``i`` on stage ``s`` in repeat ``j``, ``B`` that of its backward.

    schedule  F(i, s, j)                          B(i, s)                    ticks
    gpipe     i + s                               autodiff, reversed scan    m + p - 1
    circular  j*m + i + s  (needs m >= p)         autodiff, reversed scan    r*m + p - 1
    1f1b      i + s if i < p - s, else 2*i + s    2*i + 2*p - 1 - s          2*(m + p - 1)

gpipe and circular tables hold the forward scan only: their backward is ``jax.grad`` through it,
a scan of the same length in reverse, where backward tick ``k`` undoes forward tick ``T - 1 - k``
(`Schedule.backward_table`, drawn by `render`). Circular is Praxis/MaxText's: stage ``s`` at tick
``t`` takes item ``t - s`` of its repeat-major stream ``j*m + i``. Micro-batch ``i`` leaves the
last stage in repeat ``j`` at tick ``j*m + i + p - 1`` and stage 0 needs it for repeat ``j + 1``
at ``(j + 1)*m + i``: in time only when ``m >= p``, after waiting ``m - p`` ticks.

1f1b holds forward and backward, one action per stage per tick. Stage ``s`` warms up with
``p - s`` forwards at ticks ``s .. p - 1``; the first cotangent starts at the last stage the tick
after its forward (the loss is computed there) and reaches stage ``s`` at ``2*p - 1 - s``. Then
forwards fall on ticks of parity ``s``, backwards on parity ``s + 1``: the stage alternates and
holds ``p - s`` micro-batches (GPipe: ``m``). It is busy ``2*m`` of ``2*(m + p - 1)`` ticks,
GPipe's bubble, a tick costing the slower of F and B. (One fused F+B per tick instead takes
``m + 2*p - 2`` ticks of ``t_f + t_b`` and holds ``2*p - 1``.)
"""

from __future__ import annotations

import difflib
import enum
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from rich.table import Table
from rich.text import Text

from sharding.pipeline._errors import PipelineError

SCHEDULES = ("gpipe", "circular", "1f1b")


class ScheduleError(PipelineError):
    """A pipeline schedule that cannot be built as asked."""


class ScheduleSizeError(ScheduleError):
    """Stages, micro-batches or repeats is not an integer >= 1."""


class UnknownScheduleError(ScheduleError):
    """The schedule name is not one of `SCHEDULES`."""


class RepeatsError(ScheduleError):
    """Circular with fewer than 2 repeats, or repeats given to a schedule without them."""


class TooFewMicrobatchesError(ScheduleError):
    """1f1b or circular with fewer micro-batches than stages."""


class LayerCountError(ScheduleError):
    """The layer count does not split evenly over stages x repeats."""


class Kind(enum.StrEnum):
    """What a stage does in one tick; the value is its one-letter diagram label."""

    FORWARD = "F"
    BACKWARD = "B"
    IDLE = "."


class Action(NamedTuple):
    """One stage's work in one tick.

    Example:
        >>> Action(Kind.FORWARD, 3).label(), Action(Kind.BACKWARD, 3, 1).label(repeats=True)
        ('F3', 'B3r1')
    """

    kind: Kind
    microbatch: int | None = None
    repeat: int = 0

    def label(self, repeats: bool = False) -> str:
        """``F3`` / ``B3`` / ``.``; with ``repeats``, ``F3r1`` is repeat 1."""
        if self.kind is Kind.IDLE:
            return "."
        return f"{self.kind}{self.microbatch}" + (f"r{self.repeat}" if repeats else "")


IDLE = Action(Kind.IDLE)
Grid = tuple[tuple[Action, ...], ...]  # [tick][stage]


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as tick-by-stage tables; build it with `make_schedule`.

    Attributes:
        name: ``"gpipe"``, ``"circular"`` or ``"1f1b"``.
        stages, microbatches, repeats: ``p``, ``m``, ``r`` (``r`` is 1 except for circular).
        table: ``table[tick][stage]``, the actions of the scan the pipeline runs.
        activation_in: ``[tick][stage]``, the forward whose input activation arrives from the
            previous stage at this tick (stage 0 of circular: from the last stage, for the next
            repeat), else IDLE. Stage 0's fresh micro-batches come from the data, not from here.
        cotangent_in: ``[tick][stage]``, the backward whose cotangent arrives from the next stage.
            The last stage makes its own from the loss at its forward tick. All IDLE for gpipe
            and circular, whose cotangents move inside autodiff's reversed scan.
    """

    name: str
    stages: int
    microbatches: int
    repeats: int
    table: Grid
    activation_in: Grid
    cotangent_in: Grid

    @property
    def ticks(self) -> int:
        """Length of the scan: gpipe m+p-1, circular r*m+p-1, 1f1b 2*(m+p-1)."""
        return len(self.table)

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-ticks over all stage-ticks: (p-1)/(r*m+p-1) (r = 1 but for circular)."""
        idle = sum(a.kind is Kind.IDLE for row in self.table for a in row)
        return idle / (self.ticks * self.stages)

    @property
    def backward_table(self) -> Grid:
        """The backward scan of gpipe/circular: tick k does B of forward tick T-1-k. 1f1b: ()."""
        if self.name == "1f1b":
            return ()
        return tuple(
            tuple(a._replace(kind=Kind.BACKWARD) if a.kind is Kind.FORWARD else a for a in row)
            for row in reversed(self.table)
        )

    @property
    def peak_activations(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose forward activations it holds at once.

        gpipe ``m``, circular ``r*m`` (autodiff keeps all for its reversed scan), 1f1b ``p - s``.
        """
        bwd = self._ticks(Kind.BACKWARD)
        spans = {s: [] for s in range(self.stages)}
        for key, f in self._ticks(Kind.FORWARD).items():
            spans[key[0]].append((f, bwd.get(key, self.ticks - 1) + 1))
        return tuple(_max_overlap(spans[s]) for s in range(self.stages))

    @property
    def buffer_slots(self) -> int:
        """Slots of the activation buffer the scan body itself carries, the most over stages.

        1f1b: stage inputs from arrival to backward, ``p`` in all, one more than
        `peak_activations` on stages >= 1 as micro-batch ``p - s`` arrives at tick ``p`` but runs
        at ``2*p - s``. A stage holds consecutive micro-batches, so ``microbatch % buffer_slots``
        never collides. gpipe 0, circular ``max(m - p, 0)``: the arrivals awaiting their forward
        (last-stage outputs for the next repeat); autodiff saves the rest.
        """
        fwd, bwd = self._ticks(Kind.FORWARD), self._ticks(Kind.BACKWARD)
        spans = {s: [] for s in range(self.stages)}
        for key, t in self._ticks(Kind.FORWARD, self.activation_in).items():
            spans[key[0]].append((t, bwd[key] + 1 if bwd else fwd[key]))
        if bwd:  # stage 0 of 1f1b reads the data, then keeps its input until the backward
            spans[0] += [(f, bwd[k] + 1) for k, f in fwd.items() if k[0] == 0]
        return max(_max_overlap(spans[s]) for s in range(self.stages))

    def layers_per_stage(self, n_layers: int) -> int:
        """Layers each stage applies per repeat; raises `LayerCountError` if they do not split.

        Example:
            >>> make_schedule(4, 8, "circular", repeats=2).layers_per_stage(32)
            4
        """
        return check_layers(n_layers, self.stages, self.repeats)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `json.dumps`; cells are labels like ``F3``, ``B3``, ``F3r1``, ``.``."""
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
            "table": _labels(self.table, r),
            "backward_table": _labels(self.backward_table, r),
            "activation_in": _labels(self.activation_in, r),
            "cotangent_in": _labels(self.cotangent_in, r),
        }

    def __str__(self) -> str:
        return render(self)

    def __rich__(self) -> Table:
        head, rows, split = _diagram(self)
        table = Table(title=head, title_justify="left", box=None, pad_edge=False)
        table.add_column("tick")
        for k in range(len(rows[0])):
            t = k if split is None or k < split else k - split
            table.add_column(("| " if k == split else "") + str(t), justify="right")
        colours = {Kind.FORWARD: "bold cyan", Kind.BACKWARD: "bold magenta", Kind.IDLE: "dim"}
        for s, row in enumerate(rows):
            cells = [Text(a.label(self.repeats > 1), style=colours[a.kind]) for a in row]
            table.add_row(f"stage {s}", *cells)
        return table

    def _ticks(self, kind: Kind, grid: Grid | None = None) -> dict[tuple[int, int, int], int]:
        """{(stage, microbatch, repeat): tick} of the ``kind`` cells of ``grid`` (`table`)."""
        return {
            (s, a.microbatch, a.repeat): t
            for t, row in enumerate(self.table if grid is None else grid)
            for s, a in enumerate(row)
            if a.kind is kind
        }


def make_schedule(stages: int, microbatches: int, schedule: str, repeats: int = 1) -> Schedule:
    """Build the tick-by-stage table of a pipeline schedule.

    Args:
        stages: ``p``, the size of the ``"stage"`` mesh axis.
        microbatches: ``m``, micro-batches per step (per data-parallel replica).
        schedule: ``"gpipe"``, ``"circular"`` or ``"1f1b"``.
        repeats: ``r``, circular only (>= 2): times each micro-batch goes round the stages,
            each stage holding ``r`` chunks of layers.

    Raises:
        ScheduleSizeError, UnknownScheduleError, RepeatsError, TooFewMicrobatchesError.

    Example:
        >>> s = make_schedule(2, 4, "1f1b")
        >>> s.ticks, s.bubble_fraction, s.peak_activations
        (10, 0.2, (2, 1))
        >>> print(s)
        1f1b: stages=2 microbatches=4 ticks=10 bubble=20.0%
        tick     0  1  2  3  4  5  6  7  8  9
        stage 0 F0 F1  . B0 F2 B1 F3 B2  . B3
        stage 1  . F0 B0 F1 B1 F2 B2 F3 B3  .
    """
    _check_sizes(stages=stages, microbatches=microbatches, repeats=repeats)
    p, m, r = stages, microbatches, repeats
    if schedule not in SCHEDULES:
        close = difflib.get_close_matches(str(schedule).lower(), SCHEDULES, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownScheduleError(
            f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}{hint}"
        )
    if schedule == "circular" and r < 2:
        raise RepeatsError(
            f"schedule='circular' needs repeats >= 2, got repeats={r}: one repeat is GPipe, so use "
            f"schedule='gpipe' (or repeats >= 2: bubble (p-1)/(r*m+p-1), not (p-1)/(m+p-1))"
        )
    if schedule != "circular" and r != 1:
        raise RepeatsError(
            f"repeats={r} applies only to schedule='circular'; {schedule} runs each stage's "
            f"layers once per micro-batch. Use schedule='circular' with repeats={r}, or repeats=1"
        )
    if schedule in ("1f1b", "circular") and m < p:
        why = (
            f"stage 0 runs {p} forwards before the first cotangent comes back, so it never "
            f"reaches the one-forward-one-backward steady state and 1F1B is GPipe with a "
            f"{(p - 1) / (m + p - 1):.0%} bubble"
            if schedule == "1f1b"
            else f"micro-batch i leaves the last stage in repeat j at tick j*m+i+{p - 1}, but "
            f"stage 0 needs it for repeat j+1 at tick (j+1)*m+i, which is later only if m >= p"
        )
        raise TooFewMicrobatchesError(
            f"schedule={schedule!r} needs microbatches >= stages, got microbatches={m} < "
            f"stages={p}: {why}. Use microbatches >= {p} (the smallest valid is {p}), or "
            f"schedule='gpipe'"
        )
    cells: dict[tuple[int, int], Action] = {}
    if schedule == "1f1b":  # warm-up back to back, then F on ticks of parity s, B on parity s+1
        ticks = 2 * (m + p - 1)
        for i in range(m):
            for s in range(p):
                cells[i + s if i < p - s else 2 * i + s, s] = Action(Kind.FORWARD, i)
                cells[2 * i + 2 * p - 1 - s, s] = Action(Kind.BACKWARD, i)
    else:  # gpipe is circular with one repeat: stage s takes stream item t - s = j*m + i
        ticks = r * m + p - 1
        for k in range(r * m):
            for s in range(p):
                cells[k + s, s] = Action(Kind.FORWARD, k % m, k // m)
    table = tuple(tuple(cells.get((t, s), IDLE) for s in range(p)) for t in range(ticks))
    act_in, cot_in = ([[IDLE] * p for _ in range(ticks)] for _ in range(2))
    for t in range(1, ticks):
        for s in range(p):
            prev = table[t - 1][s - 1]  # s - 1 == -1: the circular wrap from the last stage
            if prev.kind is Kind.FORWARD and s > 0:
                act_in[t][s] = prev
            elif prev.kind is Kind.FORWARD and schedule == "circular" and prev.repeat + 1 < r:
                act_in[t][s] = prev._replace(repeat=prev.repeat + 1)
            if s + 1 < p and table[t - 1][s + 1].kind is Kind.BACKWARD:
                cot_in[t][s] = table[t - 1][s + 1]
    return Schedule(schedule, p, m, r, table, tuple(map(tuple, act_in)), tuple(map(tuple, cot_in)))


def check_layers(n_layers: int, stages: int, repeats: int = 1) -> int:
    """Layers per stage per repeat, ``n_layers / (stages * repeats)``, or `LayerCountError`.

    Example:
        >>> check_layers(32, 4, 2)
        4

    ``check_layers(30, 4)`` raises, naming 28 and 32 as the nearest layer counts and the
    (stages, repeats) pairs that split 30 layers, such as (3, 1), (5, 1), (3, 2).
    """
    _check_sizes(n_layers=n_layers, stages=stages, repeats=repeats)
    parts = stages * repeats
    if n_layers % parts == 0:
        return n_layers // parts
    below = n_layers // parts * parts
    below_txt = f"{below} below" if below else f"none below ({parts} is the fewest)"
    # The 8 pairs nearest what was asked, shown in order; one stage is no pipeline at all.
    divisors = [d for d in range(1, math.isqrt(n_layers) + 1) if n_layers % d == 0]
    divisors = sorted({*divisors, *(n_layers // d for d in divisors)})
    pairs = [(a, b) for a in divisors for b in divisors if n_layers % (a * b) == 0 and a > 1]
    pairs.sort(key=lambda q: (abs(q[0] - stages) + abs(q[1] - repeats), abs(q[0] - stages)))
    pairs = sorted(pairs[:8])
    raise LayerCountError(
        f"n_layers={n_layers} does not split into stages={stages} x repeats={repeats} = "
        f"{parts} equal chunks of layers. Nearest valid layer counts: {below_txt}, "
        f"{below + parts} above. Valid (stages, repeats) for n_layers={n_layers}: "
        f"{', '.join(map(str, pairs)) or 'none, one layer is no pipeline'}"
    )


def render(schedule: Schedule) -> str:
    """The pipeline diagram: one row per stage, one column per tick, cells ``F3``/``B3``/``.``.

    gpipe and circular show the forward scan, ``|``, then autodiff's reversed backward scan.
    """
    head, rows, split = _diagram(schedule)
    ticks = [str(k if split is None or k < split else k - split) for k in range(len(rows[0]))]
    labels = _labels(rows, schedule.repeats > 1)
    width = max(len(c) for row in [ticks, *labels] for c in row)
    left = len(f"stage {schedule.stages - 1}")

    def line(name: str, cells: list[str]) -> str:
        cols = [c.rjust(width) for c in cells]
        if split is not None:
            cols.insert(split, "|")
        return f"{name.ljust(left)} {' '.join(cols)}".rstrip()

    body = [line(f"stage {s}", row) for s, row in enumerate(labels)]
    return "\n".join([head, line("tick", ticks), *body])


def _diagram(schedule: Schedule) -> tuple[str, list[list[Action]], int | None]:
    """Title, per-stage rows over the whole step, and the column where the backward scan starts."""
    s, split = schedule, (schedule.ticks if schedule.backward_table else None)
    head = f"{s.name}: stages={s.stages} microbatches={s.microbatches}"
    head += f" repeats={s.repeats}" if s.repeats > 1 else ""
    head += f" ticks={s.ticks} bubble={s.bubble_fraction:.1%}"
    head += " (forward scan | backward scan: autodiff, reversed)" if split else ""
    grid = s.table + s.backward_table
    return head, [[row[k] for row in grid] for k in range(s.stages)], split


def _labels(grid: Any, repeats: bool) -> list[list[str]]:
    return [[a.label(repeats) for a in row] for row in grid]


def _max_overlap(spans: list[tuple[int, int]]) -> int:
    """Most half-open tick intervals [start, end) covering one tick."""
    events = sorted([(a, 1) for a, b in spans if b > a] + [(b, -1) for a, b in spans if b > a])
    best = now = 0
    for _, step in events:  # ends sort before starts at the same tick: half-open
        now += step
        best = max(best, now)
    return best


_SIZE_HINTS = {
    "n_layers": "n_layers is the depth of the stacked layers",
    "stages": "stages is the size of the 'stage' mesh axis",
    "microbatches": "microbatches the micro-batches per step (1 for no micro-batching)",
    "repeats": "repeats the circular repeats (1 unless schedule='circular')",
}


def _check_sizes(**sizes: Any) -> None:
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        got = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        hints = ", ".join(_SIZE_HINTS[k] for k in bad)
        raise ScheduleSizeError(f"{', '.join(bad)} must be integers >= 1, got {got}; {hints}")
