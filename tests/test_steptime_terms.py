"""The step-time model's terms: rings over rails, accumulation's reductions on each platform,
input gradients summed before their all-reduce on GPU, collective matmuls, bucketed gradient
reductions, and the memory-bound bytes of the non-matmul work, each by hand."""

from __future__ import annotations

import pytest

import models
from sharding.costmodel import (
    REASSOCIATED,
    SCATTERED,
    CollectiveWork,
    StepWork,
    predict,
    step_time,
    work_from_prediction,
)
from sharding.targets import PROFILES, TargetProfileError, load_profile, target

RATE = 989.4e12 * 0.6  # bf16 matmul FLOP/s per H100 at the default fraction
OP, HOP = 6.8e-6, 0.6e-6  # an NCCL op's start and one NVLink ring step (the h100 profile)
NVLINK = 450e9 * 0.8


def _work(**kw) -> StepWork:
    """10 ms of bf16 matmuls per device on data=2, tensor=4."""
    base = dict(mesh={"data": 2, "tensor": 4}, matmul_flops=RATE * 0.01, collectives=[],
                tokens=8 * 4096, dtype="bfloat16")  # fmt: skip
    return StepWork(**{**base, **kw})


@pytest.mark.parametrize(
    ("tgt", "mesh", "axis", "want"),
    [
        # 8 of the group on each node: 8 NICs of 25 GB/s, under NVLink's 300.
        ("a100:4x8", "data=32", "data", (4, 8, 200e9, "InfiniBand")),
        # one on each node: its own NIC.
        ("a100:4x8", "data=4,tensor=8", "data", (4, 1, 25e9, "InfiniBand")),
        # 8 x 50 GB/s = 400 under NVLink's 450.
        ("h100:2x8", "data=16", "data", (2, 8, 400e9, "InfiniBand")),
        # inside a node: NVLink.
        ("h100:2x8", "data=2,tensor=8", "tensor", (1, 8, 450e9, "NVLink")),
    ],
)
def test_groups_spanning_nodes_run_their_rings_over_rails(tgt, mesh, axis, want):
    g = target(tgt).topology(mesh).group(axis)
    assert (g.nodes, g.per_node, g.ring_link.bandwidth, g.ring_link.name) == want
    # a device's own point-to-point bytes leave by its own NIC (or NVLink inside a node)
    assert g.link.bandwidth == (want[2] if g.inside_node else target(tgt).device.inter_bw)


def test_permutes_and_all_to_all_cross_nodes_at_one_nic_rings_at_k():
    # data=16 on two nodes of 8: the ring gets 8 NICs (400 GB/s, under NVLink's 450), a permute
    # or an all-to-all only its own (50 GB/s).
    ring = CollectiveWork("all-gather", ("data",), 1.6e9, 1)
    permute = CollectiveWork("collective-permute", ("data",), 1.6e9, 1)
    a2a = CollectiveWork("all-to-all", ("data",), 1.6e9, 1)
    st = step_time(_work(mesh={"data": 16}, collectives=[ring, permute, a2a]), "h100:2x8")
    r, p, a = st.collectives
    assert r.bandwidth_s == pytest.approx(15 / 16 * 1.6e9 / (400e9 * 0.8))
    assert p.bandwidth_s == pytest.approx(1.6e9 / (50e9 * 0.8))
    assert a.bandwidth_s == pytest.approx(15 / 16 * 1.6e9 / (50e9 * 0.8))
    assert {r.link, p.link, a.link} == {"InfiniBand"}


def test_accumulated_all_reduces_run_once_after_the_loop_where_xla_sinks_them():
    # 4 micro-steps: the program shows the data all-reduce 4 times (4 x 1.44e9 bytes), each
    # behind its micro-step's backward, and fsdp's reduce-scatter 4 times.
    grad = CollectiveWork("all-reduce", ("data",), 4 * 1.44e9, 4)
    scatter = CollectiveWork("reduce-scatter", ("fsdp",), 4 * 1e8, 4)
    tp = CollectiveWork("all-reduce", ("tensor",), 3.6e8, 8)
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    gpu = step_time(_work(mesh=mesh, collectives=[grad, scatter, tp], accum=4), "h100")
    g, r, t = gpu.collectives
    # XLA for GPU moves the all-reduce out of the loop: once, exposed (nothing left to hide it)
    assert (g.bytes, g.count, g.overlap) == (1.44e9, 1, "exposed: after the accumulation loop")
    assert g.exposed_s == g.time_s == pytest.approx(1.44e9 / NVLINK + OP + 2 * HOP)
    # the reduce-scatters stay in the loop (their code motion is off by default), hidden
    assert (r.bytes, r.count, r.overlap, r.exposed_s) == (4e8, 4, "grad", 0)
    # so does an all-reduce over fsdp: the CPU program's reduce-scatter (a slice of its sum),
    # which XLA for GPU turns into one before it sinks anything
    fsdp_ar = CollectiveWork("all-reduce", ("fsdp",), 4 * 1e8, 4)
    (f,) = step_time(_work(mesh=mesh, collectives=[fsdp_ar], accum=4), "h100").collectives
    assert (f.bytes, f.count, f.overlap) == (4e8, 4, "grad")
    assert (t.bytes, t.count) == (3.6e8, 8)
    assert any("they run once per step, after the loop, exposed" in a for a in gpu.assumptions)
    # XLA for TPU is not documented to sink them: the count the program shows, behind compute.
    tpu = step_time(_work(mesh=mesh, collectives=[grad, scatter, tp], accum=4), "v5p:8")
    assert [(c.bytes, c.count) for c in tpu.collectives] == [(4 * 1.44e9, 4), (4e8, 4), (3.6e8, 8)]
    assert tpu.collectives[0].overlap == "grad"
    assert any("once per micro-step" in a for a in tpu.assumptions)
    # one micro-step: nothing to sink.
    one = step_time(_work(mesh=mesh, collectives=[grad]), "h100")
    assert (one.collectives[0].bytes, one.collectives[0].overlap) == (4 * 1.44e9, "grad")


def test_platform_of_a_profile(tmp_path):
    assert load_profile(_profile(tmp_path, 'platform = "tpu"')).platform == "tpu"
    assert load_profile(_profile(tmp_path, "")).platform == "gpu"
    with pytest.raises(TargetProfileError, match=r"platform='npu' \(one of 'gpu', 'tpu'\)"):
        load_profile(_profile(tmp_path, 'platform = "npu"'))
    with pytest.raises(TargetProfileError, match=r"platform=\['gpu'\] \(one of 'gpu', 'tpu'\)"):
        load_profile(_profile(tmp_path, 'platform = ["gpu"]'))


def _profile(tmp_path, extra: str):
    path = tmp_path / "dev.toml"
    path.write_text(
        "peak_tflops_bf16 = 100\npeak_tflops_f32 = 50\nhbm_gib = 16\nhbm_gb_per_s = 1000\n"
        "devices_per_node = 8\nintra_node_gb_per_s = 100\nintra_node_latency_us = 1\n"
        f"inter_node_gb_per_s = 10\ninter_node_latency_us = 5\n{extra}\n"
    )
    return path


@pytest.mark.parametrize(
    ("family", "strategy", "mesh", "pipeline", "per_layer"),
    [(models.llama, "tp", {"data": 2, "tensor": 4}, None, (2, 3)),
     # the experts' kernels are not column-parallel: attention's q, k, v alone, one input
     (models.llama_moe, "ep_tp", {"expert": 2, "data": 2, "tensor": 2}, None, (1, 2)),
     (models.llama, "pp_tp", {"stage": 2, "data": 2, "tensor": 2}, ("1f1b", 4, 1), (2, 3))],
)  # fmt: skip
def test_input_gradients_of_one_input_take_one_all_reduce_on_gpu(
    family, strategy, mesh, pipeline, per_layer
):
    """llama's q, k, v read one input and gate, up another: of its 5 column-parallel input
    gradients per layer, the CPU program all-reduces each, XLA for GPU sums 3 into the other
    2's all-reduces (AllReduceReassociate); a TPU target prices all 5."""
    pred = predict(family, "tiny", strategy, mesh, 16, 32, pipeline=pipeline)
    rows = {t.what: t for t in pred.traffic if t.axes == ("tensor",) and t.kind == "all-reduce"}
    kept = next(t for w, t in rows.items() if "column-parallel input gradients" in w and
                w != REASSOCIATED)  # fmt: skip
    merged = rows[REASSOCIATED]
    # per layer, or per B-lane run of a chunk's layers: 1f1b runs them as often as each other
    assert kept.count * per_layer[1] == merged.count * per_layer[0]
    assert kept.bytes * per_layer[1] == merged.bytes * per_layer[0]
    if pipeline is None:
        layers = family.config("tiny").n_layers
        assert (kept.count, merged.count) == (per_layer[0] * layers, per_layer[1] * layers)
    work = work_from_prediction(pred)
    gpu, tpu = step_time(work, "h100"), step_time(work, "v5p:8")
    priced = [c.bytes for c in tpu.collectives if (c.kind, c.axes) == ("all-reduce", ("tensor",))]
    assert sum(priced) - merged.bytes == pytest.approx(
        sum(c.bytes for c in gpu.collectives if (c.kind, c.axes) == ("all-reduce", ("tensor",)))
    )
    assert any("summed first by XLA for gpu (AllReduceReassociate)" in a for a in gpu.assumptions)
    assert any("priced one per kernel" in a for a in tpu.assumptions)


def test_sequence_parallel_row_outputs_are_reduce_scatters_on_gpu():
    """Megatron SP reduces each row-parallel output onto the sequence split: the CPU program
    writes an all-reduce and a slice (as tp's all-reduce, same operand); XLA for GPU makes the
    pair one reduce-scatter, (n-1)/n of the operand instead of 2(n-1)/n. tp has none."""
    mesh = {"data": 2, "tensor": 4}
    sp = predict(models.llama, "tiny", "tp_sp", mesh, 16, 32, remat="full")
    tp = predict(models.llama, "tiny", "tp", mesh, 16, 32, remat="full")
    assert not [t for t in tp.traffic if SCATTERED in t.what]
    rows = [t for t in sp.traffic if SCATTERED in t.what]
    layers = models.llama.config("tiny").n_layers
    assert sorted(t.count for t in rows) == [layers, 2 * layers]  # recomputed: all but the carry
    assert {t.kind for t in rows} == {"all-reduce"}
    work = work_from_prediction(sp)
    at = next(i for i, c in enumerate(work.collectives) if SCATTERED in c.what)
    gpu, tpu = step_time(work, "h100"), step_time(work, "v5p:8")
    (rs,) = [c for c in gpu.collectives if c.kind == "reduce-scatter"]  # the only one
    ar = tpu.collectives[at]  # the TPU prices every row as the program shows it
    assert (rs.kind, rs.factor, ar.kind, ar.factor) == ("reduce-scatter", 3 / 4, "all-reduce", 1.5)
    assert rs.bytes == ar.bytes == sum(t.bytes for t in rows)
    assert any("reduce-scatters: XLA for gpu" in a for a in gpu.assumptions)


def test_collective_matmuls_hide_tensor_traffic_only_where_the_program_overlaps_it():
    # 3.6e9 bytes all-reduced over tensor=4: 1.5 x 3.6e9 / 360e9 = 15 ms + 8 x (start + 6 hops).
    tp = CollectiveWork("all-reduce", ("tensor",), 3.6e9, 8)
    exposed = step_time(_work(collectives=[tp]), "h100")
    assert exposed.collectives[0].overlap == "exposed: tensor-parallel, inside the layers"
    over = step_time(_work(collectives=[tp], tensor_overlap=True), "h100")
    (c,) = over.collectives
    assert c.time_s == pytest.approx(0.015 + 8 * (OP + 6 * HOP))
    assert (c.overlap, c.exposed_s) == ("tensor", pytest.approx(c.time_s - 0.8 * 0.01))
    assert over.step_s == pytest.approx(exposed.step_s - 0.008)
    assert any("collective matmuls" in a for a in over.assumptions)
    # a pipeline's gathers of what crossed stages are no collective matmul: exposed all the same
    pp_tp = predict(models.llama, "tiny", "pp_tp", {"stage": 2, "data": 2, "tensor": 2}, 16, 32,
                    pipeline=("gpipe", 4, 1))  # fmt: skip
    what = next(x.what for x in pp_tp.traffic if x.kind == "all-gather" and x.axes == ("tensor",))
    shifted = CollectiveWork("all-gather", ("tensor",), 3.6e8, 8, what)
    (g,) = step_time(_work(collectives=[shifted], tensor_overlap=True), "h100").collectives
    assert (g.overlap, g.exposed_s) == ("exposed: pipeline transfer between ticks", g.time_s)


@pytest.mark.parametrize(("accum", "microbatches", "schedule"), [(4, 1, None), (1, 4, "1f1b")])
def test_bucketed_reductions_hide_behind_one_micro_batch_where_the_program_buckets_them(
    accum, microbatches, schedule
):
    # 1.44e9 bytes all-reduced over data=2 on NVLink once per step, after the accumulation loop
    # or the tick scan: exposed, unless the program reduces them in buckets during the last
    # micro-batch's backward (and gathers the weights in the next first forward): then they hide
    # behind 80% of one micro-batch's 10 ms / 4 of matmuls.
    grad = CollectiveWork("all-reduce", ("data",), accum * 1.44e9, accum)
    kw = dict(mesh={"data": 2, "tensor": 4}, collectives=[grad], accum=accum,
              microbatches=microbatches, schedule=schedule)  # fmt: skip
    plain = step_time(_work(**kw), "h100")
    (c,) = plain.collectives
    assert c.overlap.startswith("exposed: after the") and c.exposed_s == c.time_s
    over = step_time(_work(**kw, reduction_overlap=True), "h100")
    (b,) = over.collectives
    assert b.time_s == c.time_s == pytest.approx(1.44e9 / NVLINK + OP + 2 * HOP)
    assert (b.overlap, b.exposed_s) == ("micro", pytest.approx(b.time_s - 0.8 * 0.01 / 4))
    assert over.step_s == pytest.approx(plain.step_s - 0.002)
    assert any("in buckets during the last micro-batch's backward" in a for a in over.assumptions)


# llama tiny: d_model 64, 2 RMSNorms, a gated MLP of 128, rope over 8 query and 4 key heads of 8,
# a vocabulary of 256; 2 rows of 64 tokens on one device, float32 (4 bytes).
FWD = 2 * (2 + 3) * 64 + 3 * 128 + 2 * (8 + 4) * 8  # norms read+write, residuals, SwiGLU, rope
BWD = 2 * (3 + 3) * 64 + 5 * 128 + 2 * (8 + 4) * 8
LOSS = 4 * 4 * 256  # 4 float32 passes over the logits


def test_elementwise_bytes_by_hand():
    def bytes_of(strategy, mesh, attention, remat="none"):
        pred = predict(models.llama, "tiny", strategy, mesh, 2, 64, attention=attention,
                       remat=remat)  # fmt: skip
        return pred.elementwise_bytes

    # the reference kernel materialises 8 heads x 64 keys of scores: 5 float32 passes and 5 in
    # the compute dtype (float32 here too).
    scores = 8 * 64 * (5 * 4 + 5 * 4)
    assert bytes_of("dp", {"data": 1}, "xla") == 128 * (4 * ((FWD + BWD) * 4 + scores) + LOSS)
    # a flash kernel keeps its scores on chip
    assert bytes_of("dp", {"data": 1}, "blockwise") == 128 * (4 * (FWD + BWD) * 4 + LOSS)
    # remat runs the forward's elementwise work again (2 more passes of each kind of score)
    again = 8 * 64 * (7 * 4 + 7 * 4)
    assert bytes_of("dp", {"data": 1}, "xla", "full") == 128 * (
        4 * ((2 * FWD + BWD) * 4 + again) + LOSS
    )
    # tensor=2: the MLP, heads and vocabulary split; the norms and residuals repeat on each
    # device, unless sequence parallelism splits them too.
    fwd_tp = 2 * 5 * 64 + 3 * 64 + 2 * 6 * 8
    bwd_tp = 2 * 6 * 64 + 5 * 64 + 2 * 6 * 8
    assert bytes_of("tp", {"tensor": 2}, "blockwise") == 128 * (
        4 * (fwd_tp + bwd_tp) * 4 + LOSS / 2
    )
    fwd_sp, bwd_sp = fwd_tp - 2 * 5 * 32, bwd_tp - 2 * 6 * 32
    assert bytes_of("tp+sp", {"tensor": 2}, "blockwise") == 128 * (
        4 * (fwd_sp + bwd_sp) * 4 + LOSS / 2
    )


def test_a_mixture_of_experts_moves_its_experts_capacity_slots():
    # llama-moe tiny: 4 experts of d_ff 128, top 2 at capacity 1.25 over 64 tokens: 40 slots an
    # expert, 2.5 experts' worth of SwiGLU per token (320 wide), on 2 rows of 64 tokens.
    pred = predict(models.llama_moe, "tiny", "dp", {"data": 1}, 2, 64, attention="blockwise")
    fwd = 2 * (2 + 3) * 64 + 3 * 320 + 2 * (8 + 4) * 8
    bwd = 2 * (3 + 3) * 64 + 5 * 320 + 2 * (8 + 4) * 8
    assert pred.elementwise_bytes == 128 * (4 * (fwd + bwd) * 4 + LOSS)


def test_elementwise_bytes_are_priced_at_the_memory_bandwidth():
    pred = predict(models.llama, "tiny", "dp", {"data": 8}, 16, 64, dtype="bfloat16",
                   attention="xla", accum=2)  # fmt: skip
    one = predict(models.llama, "tiny", "dp", {"data": 8}, 8, 64, dtype="bfloat16",
                  attention="xla")  # fmt: skip
    assert pred.elementwise_bytes == 2 * one.elementwise_bytes  # k micro-steps: k times
    work = work_from_prediction(pred)
    assert work.memory_bound_bytes == 2 * pred.argument_bytes + pred.elementwise_bytes
    assert work.accum == 2
    st = step_time(work, "h100")
    assert st.memory_bound_s == pytest.approx(work.memory_bound_bytes / (3.35e12 * 0.8))


def test_every_fraction_names_where_it_comes_from(tmp_path):
    st = step_time(_work(), "h100")
    text = " ".join(st.assumptions)
    assert (
        "(figures: NVIDIA H100 datasheet (SXM5); DGX H100 user guide; latencies: NCCL's "
        "tuning model (src/graph/tuning.cc))" in text
    )
    assert "the 60%: spmdkit's default: large bf16 GEMMs sustain 65-75%" in text
    assert "the 80%: spmdkit's default: streaming kernels reach 80-90%" in text
    assert "(spmdkit's default: NCCL's bus bandwidth reaches about 80%" in text
    assert "Overlap (80%: spmdkit's default: the first layer's gather" in text
    assert "Overlap (50%: as given)" in " ".join(
        step_time(_work(), "h100", overlap=0.5).assumptions
    )
    assert PROFILES["v5p"].source.endswith("latencies: orders of magnitude (an ICI hop ~1 us, "
                                           "DCN tens of us)")  # fmt: skip
    # a profile's own fraction is the profile's
    spec = load_profile(_profile(tmp_path, 'matmul_fraction = 0.7\nsource = "our GEMM runs"'))
    assert spec.source_of("matmul_fraction") == "the profile's: our GEMM runs"
    assert spec.source_of("link_fraction").startswith("spmdkit's default")


def test_lanes_run_in_lock_step_for_other_stages_are_bubble():
    # pp_tp: collectives inside the lanes, so every stage runs a lane whenever any stage does.
    pred = predict(models.llama, "tiny", "pp_tp", {"stage": 2, "tensor": 2, "data": 2}, 16, 32,
                   pipeline=("1f1b", 4, 1))  # fmt: skip
    assert pred.pipeline["lockstep"]
    work = work_from_prediction(pred)
    # the critical path prices lock-step ticks; the busiest stage's own actions are its work
    assert work.matmul_flops == pred.critical_flops
    assert work.bubble_flops == pred.critical_flops - pred.matmul_flops > 0
    assert step_time(work, "h100").bubble_s > 0
