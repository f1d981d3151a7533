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

F, B = Kind.FORWARD, Kind.BACKWARD


def positions(grid, kind, offset=0):
    """{(stage, microbatch, repeat): tick} of ``kind``; fails on any action seen twice."""
    seen = {}
    for t, row in enumerate(grid):
        for s, a in enumerate(row):
            if a.kind is kind:
                key = (s, a.microbatch, a.repeat)
                assert key not in seen, f"{kind} {key} at ticks {seen[key]} and {t + offset}"
                seen[key] = t + offset
    return seen


def check(sched):
    """Every rule of a lock-step pipeline, from the tables alone; returns (F ticks, B ticks)."""
    p, m, r, T = sched.stages, sched.microbatches, sched.repeats, sched.ticks
    assert len(sched.table) == T and all(len(row) == p for row in sched.table)
    # Autodiff's backward scan follows the forward one, so its ticks count from T.
    fwd = positions(sched.table, F)
    bwd = (
        positions(sched.table, B) if sched.name == "1f1b" else positions(sched.backward_table, B, T)
    )
    everything = {(s, i, j) for s in range(p) for i in range(m) for j in range(r)}
    assert set(fwd) == everything and set(bwd) == everything  # each exactly once (per repeat)
    for (s, i, j), t in fwd.items():
        if s > 0:  # the previous stage's output crosses one ppermute: a tick later at the earliest
            assert t > fwd[s - 1, i, j], (s, i, j)
        elif j > 0:  # circular: the last stage's output of the previous repeat wraps to stage 0
            assert t > fwd[p - 1, i, j - 1], (s, i, j)
    for (s, i, j), t in bwd.items():
        assert t > fwd[s, i, j], (s, i, j)
        if s < p - 1:
            assert t > bwd[s + 1, i, j], (s, i, j)
        elif j < r - 1:  # reversed wrap: repeat j's last stage waits for repeat j+1's stage 0
            assert t > bwd[0, i, j + 1], (s, i, j)
    if sched.name == "1f1b":
        for i in range(m):  # the loss is at the last stage: its backward can follow at once
            assert bwd[p - 1, i, 0] == fwd[p - 1, i, 0] + 1
        for s in range(p):  # steady state: from the first B to the last F, strictly F/B/F/B
            first_b, last_f = bwd[s, 0, 0], fwd[s, m - 1, 0]
            kinds = [sched.table[t][s].kind for t in range(first_b, last_f + 1)]
            assert all(k is not Kind.IDLE for k in kinds), (s, kinds)
            assert all(a is not b for a, b in itertools.pairwise(kinds)), (s, kinds)
            for i in range(m - 1):  # a stage keeps micro-batch order
                assert fwd[s, i, 0] < fwd[s, i + 1, 0] and bwd[s, i, 0] < bwd[s, i + 1, 0]
    check_arrivals(sched, fwd)
    return fwd, bwd


def check_arrivals(sched, fwd):
    """activation_in/cotangent_in name exactly what the neighbour sent the tick before."""
    p, r, T = sched.stages, sched.repeats, sched.ticks
    for t in range(T):
        for s in range(p):
            act, cot = sched.activation_in[t][s], sched.cotangent_in[t][s]
            want_act = want_cot = Action(Kind.IDLE)
            if t > 0 and s > 0 and sched.table[t - 1][s - 1].kind is F:
                want_act = sched.table[t - 1][s - 1]
            wrap = sched.table[t - 1][p - 1] if t > 0 else Action(Kind.IDLE)
            if s == 0 and sched.name == "circular" and wrap.kind is F and wrap.repeat < r - 1:
                want_act = Action(F, wrap.microbatch, wrap.repeat + 1)
            if t > 0 and s < p - 1 and sched.table[t - 1][s + 1].kind is B:
                want_cot = sched.table[t - 1][s + 1]
            assert (act, cot) == (want_act, want_cot), (t, s)
            if act.kind is F:  # the input is there before the forward that needs it
                assert fwd[s, act.microbatch, act.repeat] >= t
            if cot.kind is B:  # 1f1b cotangents are used on arrival: no cotangent buffer
                assert sched.table[t][s] == cot


def held(sched, fwd, bwd):
    """{stage: max micro-batches held from forward to backward}, counted tick by tick."""
    return {
        s: max(
            sum(fwd[s, i, j] <= t <= bwd[s, i, j] for (s2, i, j) in fwd if s2 == s)
            for t in range(2 * sched.ticks)
        )
        for s in range(sched.stages)
    }


CASES = [(p, m, r) for p in (2, 4) for m in sorted({p, 2 * p, 8}) for r in (1, 2)]


def schedules_for(p, m, r):
    return (
        [make_schedule(p, m, "circular", r)]
        if r > 1
        else [make_schedule(p, m, n) for n in ("gpipe", "1f1b")]
    )


@pytest.mark.parametrize(("p", "m", "r"), CASES)
def test_ticks_and_bubble(p, m, r):
    for sched in schedules_for(p, m, r):
        expect = {"gpipe": m + p - 1, "circular": r * m + p - 1, "1f1b": 2 * (m + p - 1)}
        assert sched.ticks == expect[sched.name]
        bubble = Fraction(p - 1, r * m + p - 1)
        assert sched.bubble_fraction == float(bubble)
        idle = sum(a.kind is Kind.IDLE for row in sched.table for a in row)
        assert Fraction(idle, sched.ticks * p) == bubble


@pytest.mark.parametrize(("p", "m", "r"), CASES)
def test_dependencies_and_memory(p, m, r):
    for sched in schedules_for(p, m, r):
        fwd, bwd = check(sched)
        peak = held(sched, fwd, bwd)
        assert sched.peak_activations == tuple(peak[s] for s in range(p))
        if sched.name == "gpipe":
            assert sched.peak_activations == (m,) * p
        elif sched.name == "circular":
            assert sched.peak_activations == (r * m,) * p
        else:
            assert sched.peak_activations == tuple(min(p - s, m) for s in range(p))
            assert sched.peak_activations[0] <= p


def test_1f1b_buffer_slots_cover_arrivals_without_collisions():
    for p, m in [(1, 3), (2, 2), (2, 5), (3, 7), (4, 4), (4, 9), (6, 12)]:
        sched = make_schedule(p, m, "1f1b")
        fwd, bwd = check(sched)
        assert sched.buffer_slots == p
        arrive = {
            (s, a.microbatch): t
            for t, row in enumerate(sched.activation_in)
            for s, a in enumerate(row)
            if a.kind is F
        }
        for s in range(p):
            for t in range(sched.ticks):
                # stage 0 reads the data at its forward; the others keep what arrived
                live = [
                    i for i in range(m) if arrive.get((s, i), fwd[s, i, 0]) <= t <= bwd[s, i, 0]
                ]
                assert len(live) <= sched.buffer_slots
                assert len({i % sched.buffer_slots for i in live}) == len(live), (s, t, live)


def test_circular_storage_is_m_minus_p():
    assert make_schedule(4, 4, "circular", 2).buffer_slots == 0  # the ring feeds stage 0 directly
    assert make_schedule(4, 7, "circular", 3).buffer_slots == 3
    assert make_schedule(4, 8, "gpipe").buffer_slots == 0


@settings(max_examples=300, deadline=None)
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 12),
    r=st.integers(1, 3),
    name=st.sampled_from(SCHEDULES),
)
def test_every_schedule_is_valid_or_a_typed_error(p, m, r, name):
    if (name == "circular" and r < 2) or (name != "circular" and r != 1):
        with pytest.raises(RepeatsError, match=f"repeats={r}"):
            make_schedule(p, m, name, r)
        return
    if name in ("1f1b", "circular") and m < p:
        with pytest.raises(TooFewMicrobatchesError, match=f"microbatches={m} < stages={p}"):
            make_schedule(p, m, name, r)
        return
    sched = make_schedule(p, m, name, r)
    fwd, bwd = check(sched)
    peak = held(sched, fwd, bwd)
    assert sched.peak_activations == tuple(peak[s] for s in range(p))
    assert sched.bubble_fraction == float(Fraction(p - 1, r * m + p - 1))
    assert json.loads(json.dumps(sched.to_dict()))["ticks"] == sched.ticks


GOLDEN_1F1B = """\
1f1b: stages=2 microbatches=4 ticks=10 bubble=20.0%
tick     0  1  2  3  4  5  6  7  8  9
stage 0 F0 F1  . B0 F2 B1 F3 B2  . B3
stage 1  . F0 B0 F1 B1 F2 B2 F3 B3  ."""

GOLDEN_GPIPE = """\
gpipe: stages=2 microbatches=2 ticks=3 bubble=33.3% (forward scan | backward scan: autodiff, reversed)
tick     0  1  2 |  0  1  2
stage 0 F0 F1  . |  . B1 B0
stage 1  . F0 F1 | B1 B0  ."""


def test_render_golden():
    assert render(make_schedule(2, 4, "1f1b")) == GOLDEN_1F1B
    assert str(make_schedule(2, 2, "gpipe")) == GOLDEN_GPIPE
    assert "stage 0 F0r0 F1r0 F0r1 F1r1    . |" in render(make_schedule(2, 2, "circular", 2))


def test_rich_and_dict():
    sched = make_schedule(3, 4, "1f1b")
    console = Console(record=True, width=200, color_system="truecolor")
    console.print(sched)
    text = console.export_text()
    assert "stage 2" in text and "B3" in text
    d = json.loads(json.dumps(sched.to_dict()))
    assert d["table"][0] == ["F0", ".", "."] and d["peak_activations"] == [3, 2, 1]
    assert d["cotangent_in"][4] == [".", "B0", "."]  # B0 ran on stage 2 at tick 3
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
            r"schedule='circular' needs repeats >= 2, got repeats=1: .* use schedule='gpipe'",
        ),
        (
            (4, 8, "1f1b", 2),
            RepeatsError,
            r"repeats=2 applies only to schedule='circular'; 1f1b .* Use schedule='circular' with repeats=2, or repeats=1",
        ),
        (
            (4, 8, "1F1B"),
            UnknownScheduleError,
            r"unknown pipeline schedule '1F1B'; choose one of gpipe, circular, 1f1b; did you mean '1f1b'\?",
        ),
        ((4, 8, "zero-bubble"), UnknownScheduleError, r"choose one of gpipe, circular, 1f1b$"),
    ],
)
def test_errors(args, error, match):
    with pytest.raises(error, match=match) as e:
        make_schedule(*args)
    assert isinstance(e.value, ScheduleError) and isinstance(e.value, ValueError)


def test_docstring_examples(doctests):
    import sharding.pipeline

    assert doctests(sharding.pipeline) > 0
