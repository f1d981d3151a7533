"""The sharded training step computes the single-device step's numbers, for every strategy."""

from __future__ import annotations

from functools import cache

import jax
import numpy as np
import optax
import pytest
from closeness import assert_close

import models
from partition_rules import preset
from partition_rules.strategies import EXAMPLE_MESHES_8
from sharding import (
    AccumulationError,
    BatchShardingError,
    StepConfigError,
    compile_train_step,
    make_mesh,
    pipeline_for,
)

SEQ = 32
BATCH = 8
# Adam divides each update by sqrt(v): a gradient element within a few orders of magnitude of eps
# turns float32 summation-order noise (different on every mesh) into an O(lr) difference. A
# larger eps than the 1e-8 default keeps those elements damped, so the comparison can be tight.
OPTIMIZER = optax.adamw(1e-3, eps=1e-6)
STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp", "dp_tp")


def program(family: str, strategy: str, mesh_spec: str, *, batch=BATCH, accum=1, devices=None):
    fam = models.get_family(family)
    cfg = fam.config("tiny")
    seq = SEQ if fam.INPUT == "inputs" else None
    mesh = make_mesh(mesh_spec, devices)
    # A pp preset splits the layer stack over 'stage': it runs as a pipeline (GPipe, the default
    # schedule), never as an ordinary step with split weights (compile_train_step refuses that).
    pipeline = pipeline_for(strategy, dict(mesh.shape)["stage"])
    return compile_train_step(
        lambda rngs: fam.Model(cfg, rngs=rngs),
        fam.loss,
        OPTIMIZER,
        *preset(family, strategy),
        mesh,
        fam.batch_shapes(cfg, batch, seq),
        accum_steps=accum,
        pipeline=pipeline,
        stack="layers",
    )


def batch_for(family: str, batch: int = BATCH) -> dict:
    fam = models.get_family(family)
    cfg = fam.config("tiny")
    seq = SEQ if fam.INPUT == "inputs" else None
    return {
        k: np.asarray(v) for k, v in fam.make_batch(cfg, batch, seq, key=jax.random.key(7)).items()
    }


def value(x):
    """The array (or sharding) inside an nnx Variable of a State."""
    return x.get_value() if hasattr(x, "get_value") else x


def as_numpy(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def run(prog, batch, steps: int):
    """(loss, grads) of the first step and params after `steps` steps."""
    state = prog.init(seed=0)
    loss, grads = prog.loss_and_grads(state["params"], batch)
    loss, grads = float(loss), as_numpy(grads)
    for _ in range(steps):
        state, _ = prog.step(state, batch)
    return loss, grads, as_numpy(state["params"])


@cache
def single_device(family: str, batch: int = BATCH):
    prog = program(family, "dp", "data=1", batch=batch, devices=jax.devices()[:1])
    return run(prog, batch_for(family, batch), steps=3)


def assert_same(got, want):
    """Loss to rtol 1e-5, gradients as `closeness.assert_close`; parameters after Adam steps to
    rtol 1e-5 and 1% of one update (atol 1e-5 at lr 1e-3): see OPTIMIZER for why Adam needs that absolute
    slack on the rare element whose gradient is near zero."""
    loss, grads, params = got
    ref_loss, ref_grads, ref_params = want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)
    for p, r in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(p, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_strategy_matches_single_device(family: str, strategy: str):
    prog = program(family, strategy, EXAMPLE_MESHES_8[strategy])
    assert_same(run(prog, batch_for(family), steps=3), single_device(family))


def test_cnn_conv_dp_classifier_tp_matches_single_device():
    prog = program("cnn", "dp_tp", "data=4,tensor=2")
    head = value(prog.param_shardings["head"]["fc1"]["kernel"]).spec
    conv = value(prog.param_shardings["layers"]["conv1"]["kernel"]).spec
    assert tuple(head) == (None, "tensor") and all(a is None for a in conv)
    assert_same(run(prog, batch_for("cnn"), steps=3), single_device("cnn"))


def test_accumulation_equals_one_step_on_the_whole_batch():
    """k=4 micro-steps of 8 rows give the step of one 32-row batch."""
    whole = single_device("llama", 32)
    prog = program("llama", "fsdp_tp", EXAMPLE_MESHES_8["fsdp_tp"], batch=32, accum=4)
    assert_same(run(prog, batch_for("llama", 32), steps=3), whole)


def test_state_is_born_sharded_and_optimizer_state_follows_params():
    prog = program("llama", "fsdp", "fsdp=8")
    state = prog.init(seed=0)
    q = value(state["params"]["layers"]["attn"]["q"]["kernel"])
    assert q.sharding == value(prog.param_shardings["layers"]["attn"]["q"]["kernel"])
    assert q.addressable_shards[0].data.shape == (4, 8, 8, 8)  # embed 64 / fsdp 8
    mu = value(state["opt_state"][0].mu["layers"]["attn"]["q"]["kernel"])
    assert mu.sharding == q.sharding


def test_batch_not_divisible_by_data_x_fsdp():
    with pytest.raises(
        BatchShardingError,
        match=r"global batch 6 is not divisible by data=2xfsdp=2 = 4 devices.*multiple of 4 \(e\.g\. 8\)",
    ):
        program("llama", "fsdp_tp", "data=2,fsdp=2,tensor=2", batch=6)


def test_accumulation_must_divide_the_batch():
    with pytest.raises(
        AccumulationError, match=r"global batch 8 is not divisible by 3 accumulation steps"
    ):
        program("llama", "dp", "data=8", batch=8, accum=3)
    with pytest.raises(
        BatchShardingError,
        match=r"micro-batch 2 \(global batch 8 / 4 accumulation steps\) is not divisible by "
        r"data=8 = 8 devices.*multiple of 32",
    ):
        program("llama", "dp", "data=8", batch=8, accum=4)


def test_unknown_options_are_refused_before_compiling():
    fam = models.get_family("llama")
    cfg = fam.config("tiny")
    args = (lambda rngs: fam.Model(cfg, rngs=rngs), fam.loss, OPTIMIZER, *preset("llama", "dp"))
    mesh, shapes = make_mesh("data=8"), fam.batch_shapes(cfg, 8, 16)
    with pytest.raises(
        StepConfigError, match=r"unknown remat policy 'some'.*'none', 'full', 'dots'"
    ):
        compile_train_step(*args, mesh, shapes, remat="some")
    with pytest.raises(StepConfigError, match=r"unknown compute dtype 'fp8'"):
        compile_train_step(*args, mesh, shapes, compute_dtype="fp8")


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_and_bfloat16_keep_the_numbers(remat: str):
    fam = models.get_family("llama")
    cfg = fam.config("tiny")
    mesh, shapes = make_mesh("data=2,fsdp=2,tensor=2"), fam.batch_shapes(cfg, BATCH, SEQ)
    make = (
        lambda rngs: fam.Model(cfg, rngs=rngs),
        fam.loss,
        OPTIMIZER,
        *preset("llama", "fsdp_tp"),
    )
    prog = compile_train_step(*make, mesh, shapes, remat=remat)
    ref_loss, ref_grads, _ = single_device("llama")
    state = prog.init(0)
    loss, grads = prog.loss_and_grads(state["params"], batch_for("llama"))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert_close(as_numpy(grads), ref_grads)
    bf16 = compile_train_step(*make, mesh, shapes, remat=remat, compute_dtype="bfloat16")
    loss16, grads16 = bf16.loss_and_grads(state["params"], batch_for("llama"))
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads16))  # float32 master grads
    np.testing.assert_allclose(float(loss16), ref_loss, rtol=2e-2)
