"""What the explicit pipeline schedules execute, counted in the compiled HLO, and how the cost
model prices it (issue 15).

llama tiny (d_model 64, 4 layers, 8 heads of 8, 4 kv heads, d_ff 128, vocab 256) at batch 16 x
seq 32, 4 micro-batches, on 8 simulated devices. `work_from_report` reads each lane's taken
branch off the HLO: F (a chunk's forward, the head's conditional apart), B (its backward; zb-h1's
input gradient) and W (zb-h1's weight gradient), per micro-batch and chunk, and the head (its
forward and VJP, run in the last virtual stage's F). A compiled count charges every lane of
every tick; what a stage executes is m x (F + B + W) per chunk, plus m heads on the last stage.
"""

from __future__ import annotations

from functools import cache

import pytest

import models
import sharding
from sharding.costmodel import predict, work_from_report
from sharding.inspection import count_flops
from sharding.pipeline import make_schedule

BATCH, SEQ, M = 16, 32, 4
# Per token per layer: the weight matmuls (q 64x64, k and v 64x32, o 64x64, gate, up, down
# 64x128) and the attention's two products, 2 FLOPs per multiply-add; the head's matmul.
WEIGHT_MM = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
ATTENTION = 4 * SEQ * 8 * 8
LAYER_FWD = WEIGHT_MM + ATTENTION
DOWN = 2 * 128 * 64  # the layer's last matmul: remat full does not recompute it
HEAD_FWD = 2 * 64 * 256


@cache
def priced(schedule: str, mesh: str = "stage=2,data=4", remat: str = "none",
           strategy: str = "pp", stage_layers: tuple[int, ...] | None = None):  # fmt: skip
    """(program, report, work) of llama tiny under ``schedule``, compiled once per module."""
    repeats = 2 if schedule == "interleaved" else None
    program = sharding.build_program(models.llama, strategy, mesh, batch=BATCH, seq=SEQ,
                                     schedule=schedule, microbatches=M, repeats=repeats,
                                     remat=remat, stage_layers=stage_layers)  # fmt: skip
    report = program.report()
    work = work_from_report(report, tokens=BATCH * SEQ, schedule=program.schedule,
                            hlo_text=program.compiled.as_text(), remat=remat,
                            stage_layers=program.pipeline.stage_layers)  # fmt: skip
    return program, report, work


def lanes(schedule: str, **kw) -> tuple[float, float, float, float]:
    """(F, B, W, the head's work in all): zb-h1 runs the head's weight gradient in W."""
    p = priced(schedule, **kw)[2].pipeline
    return (
        p["forward_tick_flops"],
        p["backward_tick_flops"],
        p["weight_tick_flops"],
        p["head_tick_flops"] + p["lanes"]["head_weight"],
    )


# stage=2,data=4: micro-batches of 1 row x 32 tokens; 2 layers a stage (1 a chunk, interleaved).
@pytest.mark.parametrize(
    ("schedule", "remat", "layers"),
    [
        ("1f1b", "none", 2),
        ("1f1b", "full", 2),
        ("interleaved", "none", 1),
        ("zb-h1", "none", 2),
        ("zb-h1", "full", 2),
    ],
)
def test_no_forward_is_recomputed_without_remat(schedule, remat, layers):
    """B (+ W) executes twice the stack's forward FLOPs: every layer's residuals are kept from
    F, nothing recomputed; remat full recomputes each layer once (in B), all but its last matmul
    (whose output the backward does not need): 3 x F less the down projections."""
    f, b, w, h = lanes(schedule, remat=remat)
    assert f == 32 * layers * LAYER_FWD  # the stack's forward alone, the head apart
    assert h == 3 * 32 * HEAD_FWD  # the head's forward and VJP on one micro-batch
    recomputed = 32 * layers * (LAYER_FWD - DOWN) if remat == "full" else 0
    assert b + w == 2 * f + recomputed
    if schedule == "zb-h1":  # W: each weight's gradient once; B: the input-gradient chain
        assert w == 32 * layers * WEIGHT_MM
        head_w = priced(schedule, remat=remat)[2].pipeline["lanes"]["head_weight"]
        assert head_w == 32 * HEAD_FWD  # the head's weight gradient, in the last stage's W
        assert b == 32 * layers * (WEIGHT_MM + 2 * ATTENTION) + recomputed
    else:
        assert w == 0
    if remat == "full":
        return
    # What the stages execute per step: 3 x the stack's forward FLOPs (counted on the taken
    # branches; a compiled count charges every lane of every tick).
    sched = priced(schedule)[0].schedule
    chunks = M * sched.repeats
    assert chunks * (f + b + w) == 3 * chunks * f
    assert priced(schedule)[1].matmul_flops > chunks * (f + b + w) + M * h


@pytest.mark.parametrize("mesh", ["stage=2,data=4", "stage=4,data=2"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_explicit_schedules_execute_no_more_than_gpipe(schedule, mesh):
    """Matmul FLOPs per device per step, counted on what runs: m x the lanes (the last stage
    adding m heads) and whatever runs outside them, against gpipe's count at the same p and m
    (every gpipe tick runs, bubble ticks on zeros, so its count is what it executes)."""
    _, gpipe_report, _ = priced("gpipe", mesh)
    _, _, work = priced(schedule, mesh)
    p = work.pipeline
    f, b, w, h = lanes(schedule, mesh=mesh)
    outside = p["outside_flops"] + p["ticks"] * p["lanes"]["per_tick"]
    executed = M * (f + b + w) + M * h + outside  # the last stage, the busiest
    assert executed == p["busiest_device_flops"]
    assert count_flops(priced("gpipe", mesh)[0].compiled.as_text()).exact
    assert executed <= gpipe_report.matmul_flops


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1"])
def test_the_critical_path_is_tick_costs_of_the_measured_lanes(schedule):
    """The compiled program is priced by `Schedule.tick_costs` of its own lanes: per stage a
    chunk's F, B and W times the chunks (each chunk costs 1/repeats), the last stage's forward
    adding the head; plus what runs outside the lanes."""
    program, _, work = priced(schedule)
    sched, p = program.schedule, work.pipeline
    f, b, w, h = lanes(schedule)
    r, n = sched.repeats, sched.stages
    head_w = p["lanes"]["head_weight"]  # zb-h1: the head's weight gradient runs in W
    costs = sched.tick_costs([r * f] * (n - 1) + [r * f + h - head_w], r * b,
                             [r * w] * (n - 1) + [r * w + head_w])  # fmt: skip
    fixed = p["outside_flops"] + sched.ticks * p["lanes"]["per_tick"]
    assert work.matmul_flops == p["critical_flops"] == fixed + costs.critical
    assert p["busiest_device_flops"] == fixed + costs.busiest
    assert work.bubble_flops == costs.bubble
    # The closed form prices the same lanes the same way.
    pred = predict(models.llama, "tiny", "pp", {"stage": 2, "data": 4}, BATCH, SEQ,
                   pipeline=(schedule, M, r))  # fmt: skip
    assert pred.pipeline["lanes"] == {**p["lanes"], "outside": 0.0, "per_tick": 0.0}
    assert pred.critical_flops == work.matmul_flops


def test_zb_h1_bubble_is_smaller_than_1f1bs_on_the_compiled_lanes():
    """At p = 2, m = 4 the compiled lanes price zb-h1's bubble below 1f1b's."""
    one, zb = priced("1f1b")[2], priced("zb-h1")[2]
    assert zb.bubble_flops < one.bubble_flops
    assert zb.matmul_flops < one.matmul_flops
    assert make_schedule(2, 4, "zb-h1").ticks == 13


def test_collectives_inside_the_lanes_count_what_runs():
    """pp_tp 1f1b: the tensor all-reduces of the layers run inside the lanes, m times per
    stage per step, while a compiled count charges them every one of the m + 2p - 2 ticks."""
    _, report, work = priced("1f1b", "stage=2,data=2,tensor=2", strategy="pp_tp")
    charged = report.collective_bytes("all-reduce", ("tensor",))
    priced_bytes = sum(c.bytes for c in work.collectives
                       if c.axes == ("tensor",) and c.kind == "all-reduce")  # fmt: skip
    pred = predict(models.llama, "tiny", "pp_tp", {"stage": 2, "data": 2, "tensor": 2}, BATCH,
                   SEQ, pipeline=("1f1b", M, 1))  # fmt: skip
    assert priced_bytes < charged
    assert priced_bytes == pytest.approx(pred.collective_bytes("all-reduce", "tensor"), rel=0.1)


def test_balanced_stages_are_priced_by_the_layers_each_stage_runs():
    """stage_layers (1, 3): both stages hold 3 layer slots (the lanes measure 3 layers), the
    first runs 1 of them (its spare slots are skipped), the last 3 and the head."""
    program, _, work = priced("1f1b", stage_layers=(1, 3))
    p = work.pipeline
    f, b, w, h = lanes("1f1b", stage_layers=(1, 3))
    assert (f, b, w) == (32 * 3 * LAYER_FWD, 2 * f, 0)
    costs = program.schedule.tick_costs([f / 3, f + h], [b / 3, b])
    assert work.matmul_flops == p["critical_flops"] == costs.critical
    assert p["busiest_device_flops"] == M * (f + b + h)
