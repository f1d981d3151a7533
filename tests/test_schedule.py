"""Pipeline schedule tables: tick counts, dependencies, memory, rendering and argument errors.

The checker below re-derives every rule from the table alone (it never calls the module's
formulas), so a wrong closed form shows up as a broken dependency, not as a matching typo.
"""

import itertools
import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from sharding.pipeline import (
    SCHEDULES,
    Action,
    Kind,
    LayerCountError,
    RepeatsError,
    ScheduleError,
    ScheduleSizeError,
    TooFewMicrobatchesError,
    UnknownScheduleError,
    check_layers,
    make_schedule,
    render,
)

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT


def positions(grid, kind, offset=0):
    """{(stage, microbatch, repeat): (tick, place in its cell)} of ``kind``; fails on any
    action seen twice or a cell holding two actions of one kind."""
    seen = {}
    for t, row in enumerate(grid):
        for s, cell in enumerate(row):
            assert len({a.kind for a in cell}) == len(cell), (t, s, cell)
            for k, a in enumerate(cell):
                if a.kind is kind:
                    key = (s, a.microbatch, a.repeat)
                    assert key not in seen, f"{kind} {key} at ticks {seen[key]} and {t + offset}"
                    seen[key] = (t + offset, k)
    return seen


def before(x, y):
    """Action at x = (tick, place) runs before the one at y: an earlier tick, or earlier in the
    same cell (a result is used by a later action of the same stage in the same tick)."""
    return x < y


def check(sched):
    """Every rule of a lock-step pipeline, from the tables alone; returns (F, B, W) positions."""
    p, m, r, T = sched.stages, sched.microbatches, sched.repeats, sched.ticks
    assert len(sched.table) == T and all(len(row) == p for row in sched.table)
    # Autodiff's backward scan follows the forward one, so its ticks count from T.
    fwd = positions(sched.table, F)
    explicit = sched.name in ("1f1b", "interleaved", "zb-h1")
    bwd = positions(sched.table, B) if explicit else positions(sched.backward_table, B, T)
    wgt = positions(sched.table, W)
    everything = {(s, i, j) for s in range(p) for i in range(m) for j in range(r)}
    assert set(fwd) == everything and set(bwd) == everything  # each exactly once (per chunk)
    assert set(wgt) == (everything if sched.name == "zb-h1" else set())
    for (s, i, j), (t, _) in fwd.items():
        if s > 0:  # the previous stage's output crosses one ppermute: a tick later at the earliest
            assert t > fwd[s - 1, i, j][0], (s, i, j)
        elif j > 0:  # a chunked schedule: the last stage's output wraps to stage 0
            assert t > fwd[p - 1, i, j - 1][0], (s, i, j)
    for (s, i, j), at in bwd.items():
        assert before(fwd[s, i, j], at), (s, i, j)
        if at[0] == fwd[s, i, j][0]:  # only where the loss is: the last virtual stage
            assert (s, j) == (p - 1, r - 1), (s, i, j)
        if s < p - 1:
            assert at[0] > bwd[s + 1, i, j][0], (s, i, j)
        elif j < r - 1:  # reversed wrap: chunk j's last stage waits for chunk j+1's stage 0
            assert at[0] > bwd[0, i, j + 1][0], (s, i, j)
    for key, at in wgt.items():
        assert before(bwd[key], at), key
    check_arrivals(sched, fwd, bwd)
    return fwd, bwd, wgt


def check_arrivals(sched, fwd, bwd):
    """activation_in/cotangent_in name exactly what the neighbour sent the tick before."""
    p, r, T = sched.stages, sched.repeats, sched.ticks
    idle = Action(Kind.IDLE)
    for t in range(T):
        for s in range(p):
            want_act = want_cot = idle
            for a in sched.table[t - 1][s - 1] if t > 0 else ():
                if a.kind is F and s > 0:
                    want_act = a
                elif a.kind is F and a.repeat < r - 1:
                    want_act = Action(F, a.microbatch, a.repeat + 1)
            for a in sched.table[t - 1][(s + 1) % p] if t > 0 else ():
                if a.kind is B and s < p - 1:
                    want_cot = a
                elif a.kind is B and a.repeat > 0:
                    want_cot = Action(B, a.microbatch, a.repeat - 1)
            act, cot = sched.activation_in[t][s], sched.cotangent_in[t][s]
            assert (act, cot) == (want_act, want_cot), (t, s)
            if act.kind is F:  # the input is there no later than the forward that needs it
                assert fwd[s, act.microbatch, act.repeat][0] >= t
            if cot.kind is B:
                assert bwd[s, cot.microbatch, cot.repeat][0] >= t


def held(sched):
    """{stage: max micro-batch chunks held from their forward to their last action}."""
    first, last = {}, {}
    for t, row in enumerate(sched.table + sched.backward_table):
        for s, cell in enumerate(row):
            for a in cell:
                first.setdefault((s, a.microbatch, a.repeat), t)
                last[s, a.microbatch, a.repeat] = t
    return {s: max(sum(first[k] <= t <= last[k] for k in first if k[0] == s)
                   for t in range(2 * sched.ticks)) for s in range(sched.stages)}  # fmt: skip


def check_slots(sched):
    """No two values share a slot of a buffer while both are live (from `Schedule.slots`):
    act from arrival to forward, cot from arrival (or the last stage's forward) to backward,
    res from forward to the last backward action, wct from B to W."""
    p, r = sched.stages, sched.repeats
    live = {}

    def mark(buf, s, a, t):
        span = live.setdefault((buf, s, a.microbatch, a.repeat), [t, t])
        span[1] = t

    for t, row in enumerate(sched.table):
        for s in range(p):
            for buf, a in (("act", sched.activation_in[t][s]), ("cot", sched.cotangent_in[t][s])):
                if a.kind is not Kind.IDLE:
                    mark(buf, s, a, t)
            for a in row[s]:
                key = (s, a.microbatch, a.repeat)
                if a.kind is F and ("act", *key) in live:
                    mark("act", s, a, t)
                if not sched.explicit:
                    continue
                if a.kind is F:
                    mark("res", s, a, t)
                    if s == p - 1 and a.repeat == r - 1:
                        mark("cot", s, a, t)
                elif a.kind is B:
                    mark("cot", s, a, t)
                    mark("res", s, a, t)
                    if sched.splits_backward:
                        mark("wct", s, a, t)
                else:
                    mark("res", s, a, t)
                    mark("wct", s, a, t)
    by_slot = {}
    for (buf, s, i, j), slot in sched.slots.of.items():
        by_slot.setdefault((buf, s, slot), []).append(live[buf, s, i, j])
    assert {k for k in live} == set(sched.slots.of)
    for key, ranges in by_slot.items():
        ranges.sort()
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end < start, (key, ranges)


CASES = [(p, m, r) for p in (2, 4) for m in sorted({p, 2 * p, 8}) for r in (1, 2)]


def schedules_for(p, m, r):
    if r > 1:
        return [
            make_schedule(p, m, n, r)
            for n in ("circular", "interleaved")
            if n != "interleaved" or m % p == 0
        ]
    return [make_schedule(p, m, n) for n in ("gpipe", "1f1b", "zb-h1")]


def bubble_of(name, p, m, r):
    """Closed forms with a forward, an input gradient and a weight gradient of equal cost."""
    return {"gpipe": Fraction(p - 1, m + p - 1), "1f1b": Fraction(p - 1, m + p - 1),
            "circular": Fraction(p - 1, r * m + p - 1),
            "interleaved": Fraction(p - 1, r * m + p - 1),
            "zb-h1": Fraction(p - 1, 3 * m + p - 1)}[name]  # fmt: skip


@pytest.mark.parametrize(("p", "m", "r"), CASES)
def test_ticks_and_bubble(p, m, r):
    for sched in schedules_for(p, m, r):
        expect = {"gpipe": m + p - 1, "circular": r * m + p - 1, "1f1b": m + 2 * p - 2,
                  "interleaved": r * m + r * p + p - 2, "zb-h1": 3 * m + p - 1}  # fmt: skip
        assert sched.ticks == expect[sched.name], sched.name
        assert sched.bubble_fraction == pytest.approx(float(bubble_of(sched.name, p, m, r)))


@pytest.mark.parametrize(("p", "m", "r"), CASES)
def test_dependencies_and_memory(p, m, r):
    for sched in schedules_for(p, m, r):
        fwd, bwd, _ = check(sched)
        check_slots(sched)
        peak = held(sched)
        assert sched.peak_activations == tuple(peak[s] for s in range(p))
        if sched.name == "gpipe":
            assert sched.peak_activations == (m,) * p
        elif sched.name == "circular":
            assert sched.peak_activations == (r * m,) * p
        elif sched.name == "1f1b":
            assert sched.peak_activations == tuple(min(2 * (p - s) - 1, m) for s in range(p))
            for (s, i, _), (t, _) in fwd.items():  # the closed forms of the module's table
                assert (t, bwd[s, i, 0][0]) == (i + s, i + 2 * p - 2 - s)
        elif sched.name == "zb-h1":  # never more than 1f1b's stage 0 holds
            assert max(sched.peak_activations) <= p


def test_lock_step_costs_rank_the_schedules():
    """Priced with forward, input-gradient and weight-gradient of equal cost at p=4, m=8: zb-h1's
    bubble is a third of 1f1b's, interleaved v=2 half of it; uneven costs follow the slowest stage."""
    one = make_schedule(4, 8, "1f1b").tick_costs(1.0, 1.0, 1.0)
    assert (one.critical, one.busiest, one.bubble) == (33.0, 24.0, 9.0)
    assert make_schedule(4, 8, "zb-h1").tick_costs(1.0, 1.0, 1.0).bubble == 3.0
    assert make_schedule(4, 8, "interleaved", 2).tick_costs(1.0, 1.0, 1.0).bubble == 4.5
    gp = make_schedule(4, 8, "gpipe").tick_costs(1.0, 1.0, 1.0)
    assert (gp.critical, gp.busiest) == (33.0, 24.0)
    # The last stage twice as slow: every tick it works in costs its time.
    slow = make_schedule(2, 4, "1f1b").tick_costs([1.0, 2.0], [1.0, 2.0])
    assert slow.ticks == (1.0, 4.0, 4.0, 4.0, 4.0, 1.0) and slow.busiest == 16.0
    with pytest.raises(ScheduleError, match=r"forward costs: one per stage, 2 values, got 3"):
        make_schedule(2, 4, "1f1b").tick_costs([1.0, 1.0, 1.0], 1.0)


def test_buffer_slots():
    assert make_schedule(4, 4, "circular", 2).buffer_slots == 1  # the ring feeds stage 0 at once
    assert make_schedule(4, 7, "circular", 3).buffer_slots == 4  # m - p + 1 wait for stage 0
    assert make_schedule(4, 8, "gpipe").buffer_slots == 1
    assert make_schedule(4, 8, "1f1b").slots.residuals == 7  # 2p - 1 in flight on stage 0
    zb = make_schedule(4, 8, "zb-h1").slots
    assert (zb.residuals, zb.weight_cotangents) == (4, 4)


@settings(max_examples=300, deadline=None)
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 12),
    r=st.integers(1, 3),
    name=st.sampled_from(SCHEDULES),
)
def test_every_schedule_is_valid_or_a_typed_error(p, m, r, name):
    chunked = name in ("circular", "interleaved")
    if (chunked and r < 2) or (not chunked and r != 1):
        with pytest.raises(RepeatsError, match=f"repeats={r}"):
            make_schedule(p, m, name, r)
        return
    if name != "gpipe" and m < p:
        with pytest.raises(TooFewMicrobatchesError, match=f"microbatches={m} < stages={p}"):
            make_schedule(p, m, name, r)
        return
    if name == "interleaved" and m % p:
        with pytest.raises(TooFewMicrobatchesError, match=f"microbatches={m} is not a multiple"):
            make_schedule(p, m, name, r)
        return
    sched = make_schedule(p, m, name, r)
    check(sched)
    check_slots(sched)
    peak = held(sched)
    assert sched.peak_activations == tuple(peak[s] for s in range(p))
    assert sched.bubble_fraction == pytest.approx(float(bubble_of(name, p, m, r)))
    assert json.loads(json.dumps(sched.to_dict()))["ticks"] == sched.ticks


GOLDEN_1F1B = """\
1f1b: stages=2 microbatches=4 ticks=6 bubble=20.0%
tick       0    1    2    3    4    5
stage 0   F0   F1 F2B0 F3B1   B2   B3
stage 1    . F0B0 F1B1 F2B2 F3B3    ."""

GOLDEN_ZB = """\
zb-h1: stages=2 microbatches=2 ticks=7 bubble=14.3%
tick     0  1  2  3  4  5  6
stage 0 F0 F1  . B0 W0 B1 W1
stage 1  . F0 B0 F1 B1 W0 W1"""

GOLDEN_GPIPE = """\
gpipe: stages=2 microbatches=2 ticks=3 bubble=33.3% (forward scan | backward scan: autodiff, reversed)
tick     0  1  2 |  0  1  2
stage 0 F0 F1  . |  . B1 B0
stage 1  . F0 F1 | B1 B0  ."""


def test_render_golden():
    assert render(make_schedule(2, 4, "1f1b")) == GOLDEN_1F1B
    assert render(make_schedule(2, 2, "zb-h1")) == GOLDEN_ZB
    assert str(make_schedule(2, 2, "gpipe")) == GOLDEN_GPIPE
    assert "stage 0 F0r0 F1r0 F0r1 F1r1    . |" in render(make_schedule(2, 2, "circular", 2))


def test_rich_and_dict():
    sched = make_schedule(3, 4, "1f1b")
    console = Console(record=True, width=200, color_system="truecolor")
    console.print(sched)
    text = console.export_text()
    assert "stage 2" in text and "B3" in text
    d = json.loads(json.dumps(sched.to_dict()))
    assert d["table"][2] == ["F2", "F1", "F0B0"] and d["peak_activations"] == [4, 3, 1]
    assert d["cotangent_in"][3] == [".", "B0", "."]  # B0 ran on stage 2 at tick 2
    circ = make_schedule(2, 3, "circular", 2).to_dict()
    assert circ["activation_in"][2][0] == "F0r1" and circ["backward_table"][0] == [".", "B2r1"]


def test_layers():
    assert make_schedule(4, 8, "circular", 2).layers_per_stage(32) == 4
    assert make_schedule(4, 8, "gpipe").layers_per_stage(32) == 8
    assert check_layers(6, 3) == 2
    with pytest.raises(LayerCountError) as e:
        check_layers(30, 4, 2)
    msg = str(e.value)
    assert "n_layers=30 does not split into stages=4 x repeats=2 = 8" in msg
    assert "24 below, 32 above" in msg
    assert "(3, 2)" in msg and "(5, 2)" in msg and "(2, 3)" in msg
    with pytest.raises(LayerCountError, match=r"none below \(8 is the fewest\), 8 above"):
        check_layers(5, 4, 2)
    with pytest.raises(
        LayerCountError, match=r"Valid \(stages, repeats\) for n_layers=7: \(7, 1\)$"
    ):
        check_layers(7, 2)
    with pytest.raises(
        LayerCountError, match=r"n_layers=1 does not .* none, one layer is no pipeline"
    ):
        check_layers(1, 2)
    with pytest.raises(ScheduleSizeError, match="n_layers must be integers >= 1, got n_layers=0"):
        check_layers(0, 2)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            (0, 4, "gpipe"),
            ScheduleSizeError,
            r"stages must be integers >= 1, got stages=0; stages is the size of the 'stage' mesh axis",
        ),
        (
            (2, 0, "gpipe"),
            ScheduleSizeError,
            r"microbatches must be integers >= 1, got microbatches=0",
        ),
        (
            (0, -1, "gpipe"),
            ScheduleSizeError,
            r"stages, microbatches must be .* got stages=0, microbatches=-1",
        ),
        ((2, 2.0, "gpipe"), ScheduleSizeError, r"got microbatches=2\.0"),
        ((2, True, "gpipe"), ScheduleSizeError, r"got microbatches=True"),
        (
            (4, 2, "1f1b"),
            TooFewMicrobatchesError,
            r"schedule='1f1b' needs microbatches >= stages, got microbatches=2 < stages=4: stage 0 runs 4 forwards .* Use microbatches >= 4 \(the smallest valid is 4\), or schedule='gpipe'",
        ),
        (
            (4, 3, "circular", 2),
            TooFewMicrobatchesError,
            r"microbatches=3 < stages=4: micro-batch i leaves the last stage .* smallest valid is 4",
        ),
        (
            (4, 8, "circular"),
            RepeatsError,
            r"schedule='circular' needs repeats >= 2 .* got repeats=1: one chunk is gpipe",
        ),
        (
            (4, 8, "1f1b", 2),
            RepeatsError,
            r"repeats=2 applies only to schedules 'circular' and 'interleaved'; 1f1b .* with repeats=2, or repeats=1",
        ),
        (
            (4, 8, "1F1B"),
            UnknownScheduleError,
            r"unknown pipeline schedule '1F1B'; choose one of gpipe, circular, 1f1b, interleaved, zb-h1; did you mean '1f1b'\?",
        ),
        ((4, 8, "zero bubble"), UnknownScheduleError, r"choose one of gpipe, .*, zb-h1$"),
        (
            (4, 6, "interleaved", 2),
            TooFewMicrobatchesError,
            r"microbatches=6 is not a multiple of stages=4. Use microbatches=4 or 8, or schedule='1f1b'",
        ),
    ],
)
def test_errors(args, error, match):
    with pytest.raises(error, match=match) as e:
        make_schedule(*args)
    assert isinstance(e.value, ScheduleError) and isinstance(e.value, ValueError)


def test_docstring_examples(doctests):
    import sharding.pipeline

    assert doctests(sharding.pipeline) > 0
