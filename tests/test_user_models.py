"""Models written in the tests (`tests/user_models.py`), own names throughout: every strategy and
every pipeline schedule that applies computes the loss and gradients of a plain one-device
`jax.jit` of the user's own loss (float32, `closeness.assert_close`), and a pipeline never computes another loss.
"""

from __future__ import annotations

from functools import cache

import jax
import numpy as np
import pytest
import user_models as um
from closeness import assert_close
from flax import nnx

from sharding import StackError, StepConfigError, build_program
from sharding.pipeline import PipelineConfigError

BATCH = 16


def program(work, strategy, mesh, schedule=None, *, m=4, remat="none"):
    repeats = 2 if schedule in ("circular", "interleaved") else None
    return build_program(work, strategy, mesh, batch=BATCH, schedule=schedule,
                         microbatches=m if schedule else None, repeats=repeats, remat=remat)  # fmt: skip


@cache
def init_params(work_key: tuple):
    """The train state's parameters for a workload, made once on one device."""
    work = WORKLOADS[work_key]()
    prog = build_program(work, "dp", "data=1", batch=BATCH, devices=jax.devices()[:1])
    return jax.device_get(prog.init(0)["params"])


@cache
def synthetic_batch(work_key: tuple):
    return jax.device_get(WORKLOADS[work_key]().synthetic_batch(BATCH))


@cache
def reference(work_key: tuple):
    """Loss and gradients of the user's loss under a plain jax.jit on one device (compiled once
    per workload: the workloads are built the same way each time)."""
    work = WORKLOADS[work_key]()
    graphdef = nnx.graphdef(work.abstract())
    params = init_params(work_key)
    f = jax.jit(jax.value_and_grad(lambda p, b: work.loss(nnx.merge(graphdef, p), b)))
    loss, grads = f(*jax.device_put((params, synthetic_batch(work_key)), jax.devices()[0]))
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


def assert_matches_reference(prog, work, work_key):
    batch = synthetic_batch(work_key)
    params = init_params(work_key)
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings), batch)
    ref_loss, ref_grads = reference(work_key)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)
    return float(loss)


WORKLOADS = {
    ("decoder", "stacked"): lambda: um.transformer("stacked"),
    ("decoder", "list"): lambda: um.transformer("list"),
    ("decoder", "l2"): lambda: um.transformer("stacked", um.l2_loss),
    ("decoder", "head_l2"): lambda: um.transformer("stacked", um.head_l2_loss),
    ("cnn",): um.cnn,
    ("fused",): um.fused,
}
SPLITS = [
    ("dp", "data=8", None),
    ("fsdp", "fsdp=8", None),
    ("tp", "data=2,tensor=4", None),
    ("fsdp_tp", "data=2,fsdp=2,tensor=2", None),
]
PIPELINES = [
    ("pp", "stage=2,data=4", "gpipe"),
    ("pp", "stage=2,data=4", "circular"),
    ("pp", "stage=2,data=4", "1f1b"),
    ("pp", "stage=2,data=4", "interleaved"),
    ("pp", "stage=2,data=4", "zb-h1"),
    ("pp_tp", "stage=2,data=2,tensor=2", "1f1b"),
    ("pp_fsdp", "stage=2,fsdp=4", "zb-h1"),
    ("pp_tp", "stage=2,data=2,tensor=2", "interleaved"),
]


@pytest.mark.parametrize(("strategy", "mesh", "schedule"), SPLITS + PIPELINES)
def test_stacked_transformer_matches_one_device(strategy, mesh, schedule):
    """Extra per-layer inputs (a mask, a position bias with its own gradient) reach every layer."""
    key = ("decoder", "stacked")
    assert_matches_reference(program(WORKLOADS[key](), strategy, mesh, schedule),
                             WORKLOADS[key](), key)  # fmt: skip


@pytest.mark.parametrize(("strategy", "mesh", "schedule"), SPLITS)
def test_list_of_blocks_trains_under_every_split(strategy, mesh, schedule):
    key = ("decoder", "list")
    work = WORKLOADS[key]()
    assert_matches_reference(program(work, strategy, mesh), work, key)


def test_list_of_blocks_cannot_pipeline_and_says_how_to_stack():
    work = um.transformer("list")
    with pytest.raises(StepConfigError, match=r"pipeline splits the model's layer stack.*stack="):
        program(work, "pp", "stage=2,data=4", "gpipe")
    listed = type(work)(**{**work.__dict__, "stack": "blocks"})
    with pytest.raises(StackError, match=r"'blocks' is a Python list of 4 blocks.*make_stacked"):
        program(listed, "pp", "stage=2,data=4", "gpipe")


@pytest.mark.parametrize(
    ("strategy", "mesh", "schedule"),
    [("dp", "data=8", None), ("fsdp", "fsdp=8", None), ("dp_tp", "data=2,tensor=4", None),
     ("pp", "stage=2,data=4", "gpipe"), ("pp", "stage=2,data=4", "1f1b")],
)  # fmt: skip
def test_user_cnn_matches_one_device(strategy, mesh, schedule):
    key = ("cnn",)
    assert_matches_reference(program(um.cnn(), strategy, mesh, schedule), um.cnn(), key)


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_pipeline_runs_the_users_loss_with_its_l2_penalty(schedule):
    """A penalty on every weight, the stack's included: pipelined == unpipelined == one device."""
    key = ("decoder", "l2")
    work = WORKLOADS[key]()
    piped = assert_matches_reference(program(work, "pp", "stage=2,data=4", schedule), work, key)
    plain = assert_matches_reference(program(work, "dp", "data=8"), work, key)
    without = reference(("decoder", "stacked"))[0]  # the same batch, no penalty
    assert piped == pytest.approx(plain, rel=1e-6)
    assert piped > without + 0.1  # the penalty is really in the pipelined loss


def test_1f1b_refuses_a_loss_that_reads_stack_weights_after_the_stack():
    with pytest.raises(PipelineConfigError, match=r"reads weights of the stack 'blocks'.*gpipe"):
        program(um.transformer("stacked", um.l2_loss), "pp", "stage=2,data=4", "1f1b").init(0)


def test_1f1b_runs_a_penalty_on_weights_outside_the_stack():
    key = ("decoder", "head_l2")
    assert_matches_reference(program(WORKLOADS[key](), "pp", "stage=2,data=4", "1f1b"),
                             WORKLOADS[key](), key)  # fmt: skip


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_toolkit_remat_recomputes_a_plain_loss(remat):
    """The user's loss takes no remat keyword; the policy still reaches every layer: the
    compiled step recomputes matmuls (more FLOPs than without remat; dots recomputes only
    attention's products, which have batch dimensions, fewer than full), same numbers."""
    work = um.transformer("stacked")
    base = program(work, "dp", "data=8").report().matmul_flops
    prog = program(work, "dp", "data=8", remat=remat)
    flops = prog.report().matmul_flops
    full = program(work, "dp", "data=8", remat="full").report().matmul_flops
    assert base < flops <= full
    if remat == "dots":
        assert flops < full
    assert_matches_reference(prog, work, ("decoder", "stacked"))


def test_remat_without_a_stack_is_refused():
    with pytest.raises(StepConfigError, match=r"remat='full'.*no stack was named.*stack="):
        program(um.transformer("list"), "dp", "data=8", remat="full")


def test_stack_inputs_without_a_batch_axis_are_refused_by_pipelines():
    """A [S, D] position bias (S = 16) under a global batch of 32 rows: a plain scan takes it
    as it is, a pipeline cannot cut it into micro-batches and says how to give it rows."""
    work = um.transformer("shared_bias")
    build_program(work, "dp", "data=8", batch=32)
    with pytest.raises(PipelineConfigError, match=r"pos_bias= of shape \(16, 32\).*first axis, "
                       r"which must be the batch \(32 rows.*jnp.broadcast_to"):  # fmt: skip
        build_program(work, "pp", "stage=2,data=4", batch=32, schedule="gpipe", microbatches=4)


def test_unknown_stack_path_lists_the_submodules():
    work = um.transformer("stacked")
    wrong = type(work)(**{**work.__dict__, "stack": "layers"})
    with pytest.raises(StackError, match=r"stack='layers'.*no submodule 'layers'.*blocks"):
        program(wrong, "dp", "data=8")


# A fused qkv projection split over tensor (or fsdp) needs XLA's collective-permutes inside the
# stage body: under a schedule whose stages take different branches in one tick they would wait
# for stages that never come, unless every branch runs in lock-step (sharding.pipeline).
FUSED = [
    ("pp_tp", "stage=2,data=2,tensor=2", "1f1b"),
    ("pp_tp", "stage=2,data=2,tensor=2", "zb-h1"),
    ("pp_tp", "stage=2,data=2,tensor=2", "interleaved"),
    ("pp_tp_sp", "stage=2,data=2,tensor=2", "zb-h1"),
    ("pp_fsdp", "stage=2,fsdp=4", "interleaved"),
    # A composition with no alias: the stages manual over fsdp too (tensor splits inside them).
    ("fsdp+tp+pp", "stage=2,fsdp=2,tensor=2", "1f1b"),
]


@cache
def fused_gpipe_loss() -> float:
    work = um.fused()
    return assert_matches_reference(program(work, "pp_tp", "stage=2,data=2,tensor=2", "gpipe"),
                                    work, ("fused",))  # fmt: skip


@pytest.mark.parametrize(("strategy", "mesh", "schedule"), FUSED)
def test_fused_qkv_trains_under_every_explicit_schedule(strategy, mesh, schedule):
    """Loss and gradients equal one device's and gpipe's; the tick loop runs in lock-step where a
    stage's body is partitioned (over tensor: fsdp is manual inside a pipeline, each stage
    gathering its own weights), and the permutes XLA inserts for the cut are inside it."""
    work = um.fused()
    prog = program(work, strategy, mesh, schedule)
    hlo = prog.compiled.as_text()
    assert ("/pipeline_lockstep/" in hlo) == ("tensor" in mesh)
    if "tensor" in mesh:  # the cut of the fused projection, inside F
        permutes = [line for line in hlo.splitlines() if " collective-permute(" in line]
        assert any("pipeline_lockstep/" in line and "/pipeline_F/" in line for line in permutes)
    loss = assert_matches_reference(prog, work, ("fused",))
    assert loss == pytest.approx(fused_gpipe_loss(), rel=1e-6)


def test_stages_without_an_automatic_axis_keep_their_own_branches():
    """pp over data alone: nothing inside a stage can be partitioned, so each stage skips what
    its cell leaves idle (no lock-step: zb-h1 keeps its bubble-free ticks)."""
    prog = program(um.transformer("stacked"), "pp", "stage=2,data=4", "zb-h1")
    assert "pipeline_lockstep" not in prog.compiled.as_text()
