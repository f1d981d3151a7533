"""The step-time model: ring pricing, links, latency and overlap by hand, and its two adapters.

Hand figures use the H100 profile: 989.4 TFLOP/s bf16 at 60% = 593.64 TFLOP/s; NVLink 450 GB/s
and InfiniBand 50 GB/s at 80% = 360 and 40 GB/s; 2 us per NVLink hop, 5 us per InfiniBand hop;
3.35 TB/s HBM at 80% = 2.68 TB/s. The compiled programs are llama tiny (d_model 64, 4 layers, 8
heads of 8, 4 kv heads, d_ff 128, vocab 256) at batch 16 x seq 32 on 8 simulated devices.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache

import pytest

import models
import sharding
from sharding.costmodel import (
    REASSOCIATED,
    SCATTERED,
    CollectiveWork,
    StepTimeError,
    StepWork,
    apart_of,
    predict,
    ring_factor,
    ring_hops,
    step_time,
    work_from_prediction,
    work_from_report,
)
from sharding.pipeline import make_schedule
from sharding.targets import TargetError, TopologyError, UnknownTargetError

RATE = 989.4e12 * 0.6  # bf16 matmul FLOP/s per H100 at the default fraction
OP, HOP = 6.8e-6, 0.6e-6  # an NCCL op's start and one NVLink ring step (the h100 profile)
AR8, AG8 = OP + 14 * HOP, OP + 7 * HOP  # latency of one all-reduce / all-gather over 8 GPUs
NVLINK, IB = 450e9 * 0.8, 50e9 * 0.8
BATCH, SEQ = 16, 32
# llama tiny, forward matmul FLOPs per token: each layer 2 x (q 64x64 + k, v 64x32 + o 64x64 +
# gate, up, down 3 x 64x128) + attention 4 x seq x heads x head_dim; the head 2 x 64 x 256.
LAYER_FWD = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 4 * SEQ * 8 * 8
HEAD_FWD = 2 * 64 * 256


@pytest.mark.parametrize(
    ("kind", "factors", "hops"),
    [
        ("all-reduce", (1.0, 1.5, 1.75), (2, 6, 14)),
        ("all-gather", (0.5, 0.75, 0.875), (1, 3, 7)),
        ("reduce-scatter", (0.5, 0.75, 0.875), (1, 3, 7)),
        ("all-to-all", (0.5, 0.75, 0.875), (1, 3, 7)),
        ("collective-permute", (1.0, 1.0, 1.0), (1, 1, 1)),
    ],
)
def test_ring_factors_and_hops(kind, factors, hops):
    assert tuple(ring_factor(kind, n) for n in (2, 4, 8)) == factors
    assert tuple(ring_hops(kind, n) for n in (2, 4, 8)) == hops
    assert ring_factor(kind, 1) == 0 and ring_hops(kind, 1) == 0


def test_unknown_kind_is_refused():
    with pytest.raises(StepTimeError, match=r"unknown collective kind 'all-scatter'; the kinds"):
        ring_factor("all-scatter", 4)


def _price(mesh: dict, *collectives: CollectiveWork, tgt: str = "h100:2x8", **kw):
    work = StepWork(mesh, 0.0, list(collectives), tokens=1, dtype="bfloat16", **kw)
    return step_time(work, tgt)


def test_intra_and_inter_node_groups_on_two_nodes():
    # data=2,tensor=8: each tensor group fills a node, each data pair spans both.
    st = _price({"data": 2, "tensor": 8},
                CollectiveWork("all-reduce", ("tensor",), 8e8, 1),
                CollectiveWork("all-reduce", ("data",), 1e9, 1))  # fmt: skip
    tensor, data = st.collectives
    assert (tensor.group, tensor.link, tensor.inside_node, tensor.factor) == (
        8,
        "NVLink",
        True,
        1.75,
    )
    assert tensor.bandwidth_s == pytest.approx(1.75 * 8e8 / NVLINK)
    assert tensor.latency_s == pytest.approx(OP + 14 * HOP)
    assert (data.group, data.link, data.inside_node, data.factor) == (2, "InfiniBand", False, 1.0)
    assert data.time_s == pytest.approx(1e9 / IB + OP + 2 * 5e-6)
    assert st.warnings == []
    # tensor=2,data=8: the tensor pairs stay on NVLink, the data ring of 8 crosses InfiniBand
    # with 4 of its devices on each node: its rings leave a node over 4 NICs (rails).
    st = _price({"tensor": 2, "data": 8},
                CollectiveWork("all-reduce", ("tensor",), 8e8, 1),
                CollectiveWork("all-reduce", ("data",), 1e9, 1))  # fmt: skip
    tensor, data = st.collectives
    assert (tensor.link, tensor.factor) == ("NVLink", 1.0)  # 2(n-1)/n at n = 2
    assert tensor.time_s == pytest.approx(8e8 / NVLINK + OP + 2 * HOP)
    assert (data.link, data.factor, data.group) == ("InfiniBand", 1.75, 8)
    assert data.time_s == pytest.approx(1.75 * 1e9 / (4 * IB) + OP + 14 * 5e-6)
    # tensor across nodes: priced at InfiniBand (8 rails: 400 GB/s, under NVLink's 450) and
    # flagged.
    st = _price({"tensor": 16}, CollectiveWork("all-gather", ("tensor",), 1.6e9, 1))
    assert st.collectives[0].link == "InfiniBand"
    assert st.collectives[0].time_s == pytest.approx(15 / 16 * 1.6e9 / (8 * IB) + OP + 15 * 5e-6)
    assert st.warnings[0].startswith("tensor=16 spans 2 nodes")


def test_latency_dominates_small_collectives():
    # 10 all-gathers of 80 bytes over data=8 on one node: 10 x (a start + 7 hops).
    st = _price({"data": 8}, CollectiveWork("all-gather", ("data",), 80, 10), tgt="h100")
    (c,) = st.collectives
    assert c.latency_s == pytest.approx(10 * (OP + 7 * HOP))
    assert c.bandwidth_s == pytest.approx(7 / 8 * 80 / NVLINK)
    # a permute waits one hop per execution; unknown axes are priced over the whole mesh.
    st = _price({"stage": 2, "tensor": 8},
                CollectiveWork("collective-permute", ("stage",), 1e6, 4),
                CollectiveWork("all-reduce", None, 1e6, 1))  # fmt: skip
    permute, unknown = st.collectives
    assert permute.time_s == pytest.approx(1e6 / IB + 4 * (OP + 5e-6))
    assert (unknown.group, unknown.link, unknown.overlap) == (
        16,
        "InfiniBand",
        "exposed: axes unknown",
    )


def _work(**kw) -> StepWork:
    """10 ms of bf16 matmuls per device on 8 devices of one node."""
    base = dict(mesh={"data": 8}, matmul_flops=RATE * 0.01, collectives=[], tokens=8 * 4096,
                dtype="bfloat16")  # fmt: skip
    return StepWork(**{**base, **kw})


def test_gradient_reductions_hide_behind_the_backward_up_to_the_overlap():
    # 1.44e9 bytes all-reduced over 8: 1.75 x 1.44e9 / 360e9 = 7 ms + a start and 14 NVLink hops (AR8).
    grad = CollectiveWork("all-reduce", ("data",), 1.44e9, 1)
    st = step_time(_work(collectives=[grad]), "h100")
    (c,) = st.collectives
    assert c.time_s == pytest.approx(0.007 + AR8)
    window = 0.8 * 2 / 3 * 0.01  # 80% of the backward, 2/3 of 10 ms
    assert (c.overlap, c.exposed_s) == ("grad", pytest.approx((0.007 + AR8) - window))
    assert st.step_s == pytest.approx(0.01 + (0.007 + AR8) - window)
    # with remat full the backward (recompute included) is 3/4 of the matmul time
    st = step_time(_work(collectives=[grad], remat="full"), "h100")
    assert st.exposed_comm_s == pytest.approx((0.007 + AR8) - 0.8 * 3 / 4 * 0.01)
    # a small reduction hides entirely
    st = step_time(_work(collectives=[dataclasses.replace(grad, bytes=1.44e8)]), "h100")
    assert st.exposed_comm_s == 0 and st.comm_s == pytest.approx(0.0007 + AR8)


def test_fsdp_gathers_share_the_compute_window_with_the_reductions():
    # fsdp=8: 2 gathers of 2.88e9 bytes (7/8 of them -> 14 ms, + 2 x (a start + 7 hops)), one
    # reduce-scatter of 2.88e9 bytes (7 ms + a start + 7 hops). Window: 80% of 10 ms, the reduction's
    # share 80% x 2/3 x 10 ms; the gathers get the rest.
    gather = CollectiveWork("all-gather", ("fsdp",), 2 * 2.88e9, 2)
    scatter = CollectiveWork("reduce-scatter", ("fsdp",), 2.88e9, 1)
    st = step_time(_work(mesh={"fsdp": 8}, collectives=[gather, scatter]), "h100")
    g, s = st.collectives
    assert g.time_s == pytest.approx(0.014 + 2 * AG8) and s.time_s == pytest.approx(0.007 + AG8)
    hidden_grad = 0.8 * 2 / 3 * 0.01
    assert s.exposed_s == pytest.approx((0.007 + AG8) - hidden_grad)
    assert g.exposed_s == pytest.approx((0.014 + 2 * AG8) - (0.008 - hidden_grad))
    assert st.exposed_comm_s == pytest.approx((0.021 + 3 * AG8) - 0.008)


def test_tensor_collectives_permutes_and_pipelined_reductions_are_exposed():
    tp = CollectiveWork("all-reduce", ("tensor",), 3.6e8, 8)
    st = step_time(_work(mesh={"data": 2, "tensor": 4}, collectives=[tp]), "h100")
    assert st.collectives[0].overlap == "exposed: tensor-parallel, inside the layers"
    assert (
        st.exposed_comm_s == st.comm_s == pytest.approx(1.5 * 3.6e8 / NVLINK + 8 * (OP + 6 * HOP))
    )
    grad = CollectiveWork("all-reduce", ("data",), 1.44e8, 1)
    permute = CollectiveWork("collective-permute", ("stage",), 3.6e6, 10)
    st = step_time(_work(mesh={"stage": 2, "data": 4}, collectives=[grad, permute],
                         schedule="gpipe"), "h100")  # fmt: skip
    assert [c.overlap for c in st.collectives] == [
        "exposed: after the tick scan", "exposed: pipeline transfer between ticks"]  # fmt: skip
    assert st.exposed_comm_s == st.comm_s


def test_a_toy_step_priced_by_hand():
    work = _work(
        collectives=[CollectiveWork("all-reduce", ("data",), 1.44e9, 1)],
        bubble_flops=RATE * 0.002,  # 2 ms of the 10 are bubble
        memory_bound_bytes=2.68e9,  # 1 ms at 2.68 TB/s
        model_flops=8 * RATE * 0.006,
        memory_bytes=40 * 2**30,
    )
    st = step_time(work, "h100:1x8")
    assert (st.matmul_s, st.bubble_s, st.memory_bound_s) == pytest.approx((0.008, 0.002, 0.001))
    assert st.compute_s == pytest.approx(0.009)
    exposed = (0.007 + AR8) - 0.8 * 2 / 3 * 0.008
    assert st.exposed_comm_s == pytest.approx(exposed)
    step = 0.009 + exposed + 0.002
    assert st.step_s == pytest.approx(step)
    assert st.throughput == pytest.approx(8 * 4096 / step)
    assert st.throughput_per_device == pytest.approx(4096 / step)
    assert st.mfu == pytest.approx(0.6 * 0.006 / step)  # model FLOPs / (step x 8 x peak)
    assert st.fits and st.hbm_bytes == 80 * 2**30
    assert not step_time(dataclasses.replace(work, memory_bytes=73 * 2**30), "h100").fits
    data = json.loads(json.dumps(st.to_dict()))
    assert data["collectives"][0]["axes"] == ["data"] and data["step_s"] == st.step_s
    text = " ".join(data["assumptions"])
    for figure in ("60% of the dense bfloat16 peak (989.4 TFLOP/s)", "593.6 TFLOP/s",
                   "80% of 3350 GB/s HBM", "starts at 6.8 us", "0.6 us over NVLink", "5 us over InfiniBand",
                   "up to 80% of it", "90% of HBM", "MFU = model FLOPs"):  # fmt: skip
        assert figure in text
    assert "\n" not in st.describe() and st.describe().startswith("data=8 on h100:1x8: ")


def test_bad_inputs_are_refused():
    with pytest.raises(TopologyError, match=r"on target h100:2x8 \(16 devices\)"):
        step_time(_work(), "h100:2x8")
    with pytest.raises(StepTimeError, match=r"overlap=1.5 and memory_fraction=0.9: overlap is"):
        step_time(_work(), "h100", overlap=1.5)
    with pytest.raises(StepTimeError, match=r"bubble_flops=2e\+13 must lie within 0 and"):
        step_time(_work(bubble_flops=2e13), "h100")
    with pytest.raises(TargetError, match=r"no peak for dtype 'float16'"):
        step_time(_work(dtype="float16"), "h100")
    with pytest.raises(UnknownTargetError, match=r"unknown target 'h900'"):
        step_time(_work(), "h900")


@cache
def compiled(strategy: str, mesh: str, schedule: str | None = None):
    kw = {} if schedule is None else {"schedule": schedule, "microbatches": 4}
    program = sharding.build_program(models.llama, strategy, mesh, batch=BATCH, seq=SEQ, **kw)
    return program, program.report()


def test_work_from_report_reads_the_compiled_program():
    program, report = compiled("dp", "data=8")
    work = work_from_report(report, tokens=BATCH * SEQ, model_flops=8 * report.matmul_flops)
    got = [(c.kind, c.axes, c.bytes, c.count) for c in work.collectives]
    want = [(k, a, s.bytes, s.count) for (k, a), s in report.summary(by_axes=True).items()]
    assert got == want
    # dp computes 2 rows x 32 tokens per device, forward + backward = 3 x forward.
    assert work.matmul_flops == report.matmul_flops == 3 * 64 * (4 * LAYER_FWD + HEAD_FWD)
    assert work.memory_bytes == report.memory.allocated
    assert work.memory_bound_bytes == 2 * report.memory.argument
    st = step_time(work, "h100:1x8")
    assert st.step_s == pytest.approx(st.compute_s + st.exposed_comm_s)
    assert st.mfu == pytest.approx(8 * report.matmul_flops / (st.step_s * 8 * 494.7e12))
    json.dumps(st.to_dict())
    with pytest.raises(TopologyError, match=r"16 devices"):
        step_time(work, "h100:2x8")
    with pytest.raises(StepTimeError, match=r"no while loop of 7 iterations in the HLO, the gpipe"):
        work_from_report(report, tokens=1, schedule=make_schedule(4, 4, "gpipe"),
                         hlo_text=program.compiled.as_text())  # fmt: skip
    with pytest.raises(StepTimeError, match=r"the report has no mesh"):
        work_from_report(dataclasses.replace(report, mesh=None), tokens=1)


@pytest.mark.parametrize(
    ("strategy", "mesh", "markers"),
    [("tp", "data=2,tensor=4", {(REASSOCIATED, ("tensor",))}),
     ("tp_sp", "data=2,tensor=4", {(REASSOCIATED, ("tensor",)), (SCATTERED, ("tensor",))}),
     ("fsdp", "fsdp=8", {(SCATTERED, ("fsdp",))})],
)  # fmt: skip
def test_a_compiled_program_keeps_apart_what_a_gpu_runs_otherwise(strategy, mesh, markers):
    """The CPU program all-reduces each of q, k, v, gate and up's input gradients, and (with no
    reduce-scatter creation) writes each of SP's row-parallel outputs and fsdp's gradient
    reductions as an all-reduce and a slice; the closed form's share of them (`apart_of`) moves
    out of the compiled all-reduces, which a GPU target then prices as XLA for GPU runs them
    (the merged input gradients not at all, the others as reduce-scatters) and a TPU target as
    compiled."""
    _, report = compiled(strategy, mesh)
    sizes = sharding.MeshSpec.parse(mesh).sizes
    apart = apart_of(predict(models.llama, "tiny", strategy, sizes, BATCH, SEQ).traffic)
    assert set(apart) == markers
    plain = work_from_report(report, tokens=BATCH * SEQ)
    work = work_from_report(report, tokens=BATCH * SEQ, apart=apart)
    for axes in {a for _, a in markers}:  # the closed form's bytes, the program's executions
        (whole,) = [c for c in plain.collectives if (c.kind, c.axes) == ("all-reduce", axes)]
        got = [c for c in work.collectives if (c.kind, c.axes) == ("all-reduce", axes)]
        moved = {m: apart[m, a][0] for m, a in markers if a == axes}
        assert {c.what: c.bytes for c in got[1:]} == moved
        assert got[0].bytes == pytest.approx(whole.bytes - sum(moved.values()))
        assert sum(c.count for c in got) == whole.count and got[0].what == ""
    gpu, tpu = step_time(work, "h100"), step_time(work, "v5p:8")
    assert step_time(plain, "v5p:8").step_s == pytest.approx(tpu.step_s)
    assert gpu.comm_s < step_time(plain, "h100").comm_s
    merged = (REASSOCIATED, ("tensor",)) in markers
    assert len(gpu.collectives) == len(tpu.collectives) - merged
    scattered = {a for m, a in markers if m == SCATTERED}
    assert {c.axes for c in gpu.collectives if c.kind == "reduce-scatter"} == scattered


def test_gpipe_ticks_compute_on_zeros_so_the_compiled_count_is_what_runs():
    program, report = compiled("pp", "stage=4,data=2", "gpipe")
    with pytest.raises(StepTimeError, match=r"pass schedule=program.schedule"):
        work_from_report(report, tokens=BATCH * SEQ)
    work = work_from_report(report, tokens=BATCH * SEQ, schedule=program.schedule,
                            hlo_text=program.compiled.as_text())  # fmt: skip
    p = work.pipeline
    # Micro-batches of 2 rows x 32 tokens, one layer per stage: the forward tick loop runs all
    # m + p - 1 = 7 ticks, bubble ticks included.
    assert p["ticks"] == 7 and 64 * LAYER_FWD in p["tick_flops"]
    assert p["loop_flops"] == 7 * sum(p["tick_flops"])
    # The head runs outside the ticks on the stage's share of the data replica's 8 rows (2 of
    # them, 64 tokens): 3 x its forward.
    assert p["outside_flops"] == 3 * 64 * HEAD_FWD
    assert work.matmul_flops == p["charged_flops"] == report.matmul_flops
    assert work.bubble_flops == pytest.approx(3 / 7 * p["loop_flops"])
    st = step_time(work, "h100:1x8")
    assert st.bubble_s == pytest.approx(work.bubble_flops / (494.7e12 * 0.6))


def test_1f1b_is_priced_from_the_schedule_not_from_every_branch():
    program, report = compiled("pp", "stage=4,data=2", "1f1b")
    with pytest.raises(StepTimeError, match=r"pass hlo_text=program.compiled.as_text\(\)"):
        work_from_report(report, tokens=BATCH * SEQ, schedule=program.schedule)
    hlo = program.compiled.as_text()
    work = work_from_report(report, tokens=BATCH * SEQ, schedule=program.schedule, hlo_text=hlo)
    p = work.pipeline
    f, b, h = p["forward_tick_flops"], p["backward_tick_flops"], p["head_tick_flops"]
    # One layer per stage on micro-batches of 2 rows x 32 tokens; its backward is twice its
    # forward (nothing recomputed); the head and loss with their VJP, 3 x the head's forward,
    # run in the last stage's forward lane.
    assert (f, b, h, p["weight_tick_flops"]) == (64 * LAYER_FWD, 2 * f, 3 * 64 * HEAD_FWD, 0)
    # count_flops charges every lane of every tick, the head's conditional included: 10 ticks.
    assert report.matmul_flops == p["charged_flops"] == 10 * (f + b + h)
    # What runs, from the fused table (tick: F F F FBh FBh FBh FBh B B B as its slowest stage):
    # the last stage runs F, B and the head of one micro-batch in each of ticks 3-6; the rest of
    # the critical path, (p - 1)(F + B), is bubble.
    sched = make_schedule(4, 4, "1f1b")
    assert program.schedule.table == sched.table
    assert work.matmul_flops == p["critical_flops"] == 7 * f + 7 * b + 4 * h
    assert p["critical_flops"] == sched.tick_costs([f, f, f, f + h], b).critical
    assert p["busiest_device_flops"] == 4 * (f + b + h)
    assert work.bubble_flops == 3 * (f + b)
    assert any("charges every lane of each of the 10 ticks" in n for n in work.notes)


def test_1f1b_with_a_layer_loop_inside_each_stage():
    # stage=2: 2 layers per stage (a loop of 2 inside every lane), micro-batches of 1 row x 32
    # tokens. Table (p=2, m=4), slowest stage per tick: F FBh FBh FBh FBh B.
    program, report = compiled("pp", "stage=2,data=4", "1f1b")
    work = work_from_report(report, tokens=BATCH * SEQ, schedule=program.schedule,
                            hlo_text=program.compiled.as_text())  # fmt: skip
    p = work.pipeline
    f, b, h = p["forward_tick_flops"], p["backward_tick_flops"], p["head_tick_flops"]
    assert (p["ticks"], f, b, h) == (6, 32 * 2 * LAYER_FWD, 2 * f, 3 * 32 * HEAD_FWD)
    assert report.matmul_flops == 6 * (f + b + h)
    assert work.matmul_flops == 5 * f + 5 * b + 4 * h
    assert work.bubble_flops == work.matmul_flops - 4 * (f + b + h) == f + b


def test_work_from_prediction():
    pred = predict(models.llama, "tiny", "dp", {"data": 8}, BATCH, SEQ, dtype="bfloat16")
    work = work_from_prediction(pred)
    assert sum(c.bytes for c in work.collectives) == pred.collective_bytes()
    assert {(c.kind, c.axes) for c in work.collectives} == {("all-reduce", ("data",))}
    # Per-parameter reductions of one purpose run combined: one per layer (4), the token table,
    # the vectors and the head: 7 (the compiled program has 5: XLA combines further).
    assert work.collectives[0].count == 7 < sum(x.count for x in pred.traffic)
    assert (work.matmul_flops, work.model_flops) == (pred.critical_flops, 8 * pred.matmul_flops)
    assert (work.tokens, work.dtype, work.memory_bytes) == (BATCH * SEQ, "bfloat16",
                                                            pred.memory_bytes)  # fmt: skip
    st = step_time(work, "h100:1x8")
    assert 0 < st.mfu < 1 and st.fits


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_explicit_predictions_are_priced_from_their_lanes_in_lockstep(schedule):
    # predict's lanes for p = m = 4 on micro-batches of 2 rows x 32 tokens, one layer a stage:
    # F the layer's forward, B + W twice it, the head's forward and VJP on the last stage.
    pred = predict(models.llama, "tiny", "pp", {"stage": 4, "data": 2}, BATCH, SEQ,
                   pipeline=(schedule, 4, 1))  # fmt: skip
    lanes = pred.pipeline["lanes"]
    f, b, w, h, hw = (lanes[k] for k in ("forward", "backward", "weight", "head", "head_weight"))
    assert (f, b + w, h + hw) == (64 * LAYER_FWD, 2 * f, 3 * 64 * HEAD_FWD)
    assert (w > 0) == (hw > 0) == (schedule == "zb-h1")  # zb-h1: the head's dW in W too
    work = work_from_prediction(pred)
    assert work.model_flops is None and work.schedule == schedule
    costs = make_schedule(4, 4, schedule).tick_costs([f, f, f, f + h], b, [w, w, w, w + hw])
    assert work.matmul_flops == pytest.approx(costs.critical) == pred.critical_flops
    assert pred.matmul_flops == pytest.approx(costs.busiest) == 4 * (f + b + w + h + hw)
    assert work.bubble_flops == pytest.approx(costs.bubble)
    assert work.bubble_fraction == make_schedule(4, 4, schedule).bubble_fraction
    if schedule == "1f1b":
        assert work.matmul_flops == pytest.approx(7 * f + 7 * b + 4 * h)


def test_llama_8b_on_four_h100_nodes():
    cfg = models.llama.config("8b")
    assert models.llama.param_count(cfg) == 8_030_261_248  # Llama-3-8B, head untied
    assert (cfg.vocab_size, cfg.n_kv_heads, cfg.d_ff, cfg.rope_theta) == (128_256, 8, 14_336,
                                                                          500_000.0)  # fmt: skip
    pred = predict(models.llama, cfg, "fsdp", {"fsdp": 32}, 32, 8192, dtype="bfloat16",
                   remat="full")  # fmt: skip
    st = step_time(work_from_prediction(pred), "h100:4x8")
    assert st.warnings and st.warnings[0].startswith("fsdp=32 spans 4 nodes")
    assert {c.link for c in st.collectives} == {"InfiniBand"}
    assert st.fits and st.mfu is None and st.throughput_per_device > 0
