"""Pipelined steps compute the single-device step's numbers, for every schedule, and their compiled
programs have the shape the schedule promises."""

from __future__ import annotations

from functools import cache

import jax
import numpy as np
import optax
import pytest
from closeness import assert_close
from jax_versions import NEWER_PARTITIONER

from models import gpt2, llama
from partition_rules import preset
from sharding import compile_train_step, make_mesh
from sharding.pipeline import (
    LayerCountError,
    PipelineConfigError,
    PipelineSpec,
    TooFewMicrobatchesError,
)

CFG = llama.config("tiny")
SEQ, F32 = 32, 4


def program(
    strategy,
    mesh,
    schedule=None,
    m=4,
    r=1,
    batch=16,
    family=llama,
    tx=None,
    devices=None,
    remat="none",
):
    cfg = family.config("tiny")
    spec = None
    if schedule is not None:
        spec = PipelineSpec(schedule, m, r)
    return compile_train_step(
        lambda rngs: family.Model(cfg, rngs=rngs),
        family.loss,
        tx or optax.sgd(1e-3),
        *preset(family.__name__.split(".")[-1], strategy),
        make_mesh(mesh, devices),
        family.batch_shapes(cfg, batch, SEQ),
        pipeline=spec,
        stack="layers",
        remat=remat,
    )


def batch_of(family=llama, batch=16):
    cfg = family.config("tiny")
    return {
        k: np.asarray(v)
        for k, v in family.make_batch(cfg, batch, SEQ, key=jax.random.key(5)).items()
    }


@cache
def reference(family=llama, batch=16):
    """One device's (params, loss, grads) for seed 0."""
    prog = program("dp", "data=1", family=family, batch=batch, devices=jax.devices()[:1])
    params = jax.device_get(prog.init(0)["params"])
    loss, grads = prog.loss_and_grads(params, batch_of(family, batch))
    return params, float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


def assert_matches_reference(prog, family=llama, batch=16, born=False):
    """Loss and gradients equal one device's from the same parameters. The parameters are the
    reference's, placed in the program's shardings; with ``born`` the program initialises them
    itself (compiled, sharded: stacked over stages in its own layer order), and they must equal
    the reference's exactly first."""
    ref_params, ref_loss, ref_grads = reference(family, batch)
    if born:
        params = prog.init(0)["params"]
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        params = jax.device_put(ref_params, prog.param_shardings)
    loss, grads = prog.loss_and_grads(params, batch_of(family, batch))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


# (schedule, stages p, micro-batches m, repeats r): for every schedule the fewest micro-batches
# it takes (m = p: the fill and the drain meet, no steady state) and more than p (a steady
# state), on 2 stages and, where the 4-layer tiny model allows it (circular and interleaved need
# p*r | 4), on 4.
CASES = [
    ("gpipe", 2, 2, 1),
    ("gpipe", 4, 8, 1),
    ("circular", 2, 2, 2),
    ("circular", 2, 8, 2),
    ("1f1b", 2, 2, 1),
    ("1f1b", 2, 8, 1),
    ("1f1b", 4, 4, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved", 2, 2, 2),
    ("interleaved", 2, 4, 2),
    ("zb-h1", 2, 2, 1),
    ("zb-h1", 4, 8, 1),
]


@pytest.mark.parametrize(("schedule", "p", "m", "r"), CASES)
def test_schedule_matches_single_device_with_data_parallel(schedule, p, m, r):
    """stage=p alongside data=8/p: loss and every gradient equal the one-device step."""
    batch = 16 if m * (8 // p) <= 16 else 32
    prog = program("pp", f"stage={p},data={8 // p}", schedule, m, r, batch=batch)
    assert_matches_reference(prog, batch=batch, born=r > 1 and m == p)


@pytest.mark.parametrize("schedule", ["gpipe", "circular", "1f1b", "interleaved", "zb-h1"])
def test_schedule_with_tensor_parallel_stages(schedule):
    r = 2 if schedule in ("circular", "interleaved") else 1
    prog = program("pp_tp", "stage=2,data=2,tensor=2", schedule, 4, r)
    assert_matches_reference(prog, born=schedule in ("circular", "interleaved"))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_explicit_schedules_with_tied_embeddings_and_fsdp_stages(schedule):
    """gpt2 ties the head to the embedding: both uses of the table must add their gradients."""
    prog = program("pp_fsdp", "stage=2,fsdp=4", schedule, 4, family=gpt2)
    assert_matches_reference(prog, family=gpt2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_three_adamw_steps_match(schedule):
    tx = optax.adamw(1e-3, eps=1e-6)  # see tests/test_step.py for why eps is raised
    batch = batch_of()
    runs = []
    for prog in (
        program("dp", "data=1", tx=tx, devices=jax.devices()[:1]),
        program("pp_tp", "stage=2,data=2,tensor=2", schedule, 4, tx=tx),
    ):
        state = prog.init(0)
        losses = []
        for _ in range(3):
            state, metrics = prog.step(state, batch)
            losses.append(float(metrics["loss"]))
        runs.append((losses, [np.asarray(x) for x in jax.tree.leaves(state["params"])]))
    (ref_losses, ref_params), (losses, params) = runs
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(params, ref_params, strict=True):
        # Adam divides by sqrt(v): an element whose gradient is near zero moves by up to one
        # update (lr 1e-3) either way; 1% of an update is what reordering explains.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("schedule", "p", "m", "r", "ticks"),
    [
        ("gpipe", 4, 8, 1, 8 + 4 - 1),
        ("circular", 2, 4, 2, 2 * 4 + 2 - 1),
        ("1f1b", 4, 8, 1, 8 + 2 * 4 - 2),
        ("zb-h1", 4, 8, 1, 3 * 8 + 4 - 1),
    ],
)
def test_ticks_permute_bytes_and_one_gradient_reduction(schedule, p, m, r, ticks):
    batch = 32
    prog = program("pp", f"stage={p},data={8 // p}", schedule, m, r, batch=batch)
    report = prog.report()
    activation = (batch // m // (8 // p)) * SEQ * CFG.d_model * F32  # one micro-batch, per device
    permutes = [op for op in report.collectives if op.kind == "collective-permute"]
    assert permutes and all(op.axes == ("stage",) for op in permutes)
    # Forward activations (and backward cotangents) cross one stage boundary per tick.
    assert {op.multiplicity for op in permutes} == {ticks}
    assert {op.bytes for op in permutes} == {activation}
    assert report.count("collective-permute") == 2 * ticks
    # The data-parallel gradient reduction runs once per step, never inside the tick loop.
    over_data = [
        op for op in report.collectives if op.kind == "all-reduce" and "data" in (op.axes or ())
    ]
    assert over_data and all(op.multiplicity == 1 for op in over_data)
    layer_bytes = (
        llama.param_count(CFG) * F32 - 2 * CFG.vocab_size * CFG.d_model * F32 - CFG.d_model * F32
    )
    assert report.collective_bytes("all-reduce", "data") >= layer_bytes // p


def test_explicit_schedules_hold_a_bounded_number_of_micro_batches():
    """Compiled temporaries (p=4, data=2, one sequence per micro-batch and device): fused 1F1B
    keeps at most 2p-1 micro-batches' residuals whatever m, and the first stage embeds each
    micro-batch itself (no whole-batch stack input or its gradient), so its temporaries are flat
    in m: within 5% from m=8 to m=32. GPipe without remat keeps all m. zb-h1 holds no more
    than 1f1b (on jax 0.12 within 2%: its scheduler keeps 1% more, tests/jax_versions.py)."""
    temp = {}
    for schedule, m in (("1f1b", 8), ("1f1b", 32), ("gpipe", 8), ("gpipe", 32), ("zb-h1", 32)):
        prog = program("pp", "stage=4,data=2", schedule, m, batch=2 * m)
        temp[schedule, m] = prog.report().memory.temp
    assert temp["1f1b", 32] <= 1.05 * temp["1f1b", 8]
    activation = 1 * SEQ * CFG.d_model * F32
    assert temp["gpipe", 32] - temp["gpipe", 8] >= 10 * activation * (32 - 8)
    assert temp["zb-h1", 32] <= (1.02 if NEWER_PARTITIONER else 1) * temp["1f1b", 32]


def test_pipeline_errors_before_compiling():
    with pytest.raises(
        PipelineConfigError, match=r"global batch 16 must split into 3 micro-batches"
    ):
        program("pp", "stage=2,data=4", "gpipe", 3)
    with pytest.raises(TooFewMicrobatchesError, match=r"m=2|microbatches=2"):
        program("pp", "stage=4,data=2", "1f1b", 2)
    with pytest.raises(LayerCountError, match=r"n_layers=4"):
        program("pp", "stage=4,data=2", "circular", 4, 2)
    with pytest.raises(
        PipelineConfigError,
        match=r"stack parameter layers/.* layer axis is not split over 'stage'.*pp, pp_tp, pp_fsdp",
    ):
        program("fsdp_tp", "stage=2,fsdp=2,tensor=2", "gpipe", 4)


def test_pipeline_needs_a_stage_axis():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = PipelineSpec("gpipe", 4, 1)
    with pytest.raises(
        PipelineConfigError, match=r"needs a 'stage' mesh axis; this mesh has data=8"
    ):
        compile_train_step(
            lambda rngs: llama.Model(CFG, rngs=rngs),
            llama.loss,
            optax.sgd(1e-3),
            *preset("llama", "pp"),
            mesh,
            llama.batch_shapes(CFG, 16, SEQ),
            pipeline=spec,
            stack="layers",
        )


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_gpipe_recomputes_only_what_the_remat_policy_asks(remat):
    """Counted in the compiled HLO: a gpipe tick's backward executes twice its forward's matmul
    FLOPs without remat; with dots (the matmuls against weights saved) it also recomputes
    attention's two products (q.k and p.v, batch dimensions: not saved); with full remat it
    recomputes each layer once, per layer (never a checkpoint nested in another), except the
    layer's last matmul (the MLP's down projection), whose output the backward does not need."""
    import sharding
    from sharding.costmodel import work_from_report

    work = sharding.Workload.from_family(llama, CFG)
    prog = sharding.build_program(work, "pp", "stage=2,data=4", batch=16, seq=SEQ,
                                  schedule="gpipe", microbatches=4, remat=remat)  # fmt: skip
    ticks = work_from_report(prog.report(), tokens=16 * SEQ, schedule=prog.schedule,
                             hlo_text=prog.compiled.as_text(), remat=remat).pipeline  # fmt: skip
    forward, back = sorted(ticks["tick_flops"])
    tokens = 16 // 4 // 4 * SEQ  # one micro-batch on one device
    down = 2 * tokens * CFG.d_ff * CFG.d_model  # a layer's last matmul
    layers = CFG.n_layers // 2
    attention = 2 * 2 * tokens * SEQ * CFG.n_heads * CFG.head_dim  # q.k and p.v, one layer
    recompute = {"none": 0, "dots": layers * attention, "full": forward - layers * down}[remat]
    assert back == 2 * forward + recompute


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_pp_fsdp_gathers_each_stage_once_per_step(schedule):
    """pp x fsdp: a stage's weights are all-gathered over fsdp once per step, as they enter the
    stages (manual over fsdp for the batch: one gather per stacked array), not once per layer
    per tick; the numbers stay the one device's."""
    prog = program("pp_fsdp", "stage=2,fsdp=4", schedule, 4, 2 if schedule == "interleaved" else 1)
    report = prog.report()
    stack_arrays = len(jax.tree.leaves(prog.abstract_state["params"]["layers"]))
    gathers = [op for op in report.collectives if op.kind == "all-gather" and op.axes == ("fsdp",)]
    # A stage's L/p = 2 layers: [2, ...] (gpipe), [1, 1, 2, ...] (1f1b, zb-h1), [1, r=2, 1, ...]
    whole = [op for op in gathers if op.shape.split("[")[1].startswith(("2,", "1,2,", "1,1,2,"))]
    assert sum(op.multiplicity for op in whole) == stack_arrays  # [L/p, ...] each, once
    # No weight is gathered per tick. The explicit schedules' first stage embeds each
    # micro-batch itself, and the embedding's backward gathers that micro-batch's rows (token
    # ids and their gradient, rows split over fsdp) to scatter into the table.
    rows = 16 // 4  # one micro-batch on one data replica
    per_tick = {op.shape for op in gathers if op.multiplicity > 1}
    assert per_tick <= {f"f32[{rows},{SEQ},{CFG.d_model}]", f"s32[{rows},{SEQ},1]"}
    assert_matches_reference(prog, born=True)


@pytest.mark.parametrize("family", ["llama", "user"])
def test_stage_work_splits_the_backward_without_repeating_work(family):
    """The pieces the explicit schedules run, compiled on one device: without remat the backward
    executes exactly twice the forward's matmul FLOPs (nothing recomputed), and zb-h1's input
    gradient (B) and weight gradient (W) add up to it exactly (W repeats none of B's matmuls)."""
    import user_models as um

    import sharding
    from sharding.pipeline import stage_work

    work = sharding.Workload.from_family(llama, CFG) if family == "llama" else um.transformer()
    w = stage_work(work, 2, 2, SEQ if family == "llama" else None)
    assert w["backward"] == 2 * w["forward"]
    assert w["input_grad"] + w["weight_grad"] == w["backward"]
    assert 0 < w["weight_grad"] < w["input_grad"]
    assert w["head_backward"] == 2 * w["head_forward"]


@pytest.mark.parametrize(
    ("schedule", "remat"),
    [("1f1b", "full"), ("zb-h1", "full"), ("zb-h1", "dots"), ("interleaved", "full")],
)
def test_explicit_schedules_under_remat_match_one_device(schedule, remat):
    r = 2 if schedule == "interleaved" else 1
    assert_matches_reference(program("pp", "stage=2,data=4", schedule, 4, r, remat=remat))


def test_stage_work_under_full_remat_splits_the_recompute_too():
    """With remat full the backward recomputes each layer (but its last matmul) once; zb-h1's B
    takes the recompute and the input gradient, W still only the weight-gradient matmuls."""
    import sharding
    from sharding.pipeline import stage_work

    work = sharding.Workload.from_family(llama, CFG)
    plain, full = stage_work(work, 2, 2, SEQ), stage_work(work, 2, 2, SEQ, remat="full")
    down = 2 * 2 * SEQ * CFG.d_ff * CFG.d_model  # a layer's last matmul, on 2 x SEQ tokens
    assert full["backward"] == plain["backward"] + plain["forward"] - 2 * down
    assert full["input_grad"] + full["weight_grad"] == full["backward"]
    assert full["weight_grad"] == plain["weight_grad"]
