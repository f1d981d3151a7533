"""The sequence layout of activations: Megatron sequence parallelism on ``tensor`` (tp_sp,
fsdp_tp_sp) and the sequence split over ``context`` (cp, fsdp_cp, attention left to GSPMD).

Each strategy against the single-device step (loss and gradients, float32); the collectives SP
adds against a closed form written here from the model's shapes and against the cost model; its
temporaries against tp's; and the layouts it refuses, before anything compiles.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import jax
import numpy as np
import optax
import pytest
from closeness import assert_close
from flax import nnx
from jax import sharding as jshard

from models import gpt2, llama, mlp
from partition_rules import STRATEGIES, AxisRenameError, preset, strategy
from sharding import (
    BATCH_AXES,
    MeshSpec,
    StepConfigError,
    Workload,
    compile_train_step,
    make_mesh,
)
from sharding.costmodel import predict
from sharding.pipeline import PipelineSpec

CFG = llama.config("tiny", n_layers=2)
BATCH, SEQ, F32 = 8, 32, 4
MESHES = {"tp": "data=2,tensor=4", "tp_sp": "data=2,tensor=4",
          "fsdp_tp_sp": "data=2,fsdp=2,tensor=2", "cp": "data=2,context=4",
          "fsdp_cp": "fsdp=2,context=4", "cp_tp_sp": "data=2,context=2,tensor=2"}  # fmt: skip


def make(rngs: nnx.Rngs, cfg: llama.Config = CFG) -> llama.Model:
    return llama.Model(cfg, rngs=rngs)


@cache
def program(strategy: str, remat: str = "none", seq: int = SEQ, batch: int = BATCH,
            cfg: llama.Config = CFG, optimizer: str = "sgd"):  # fmt: skip
    """One compiled program per case, shared by the module's tests."""
    tx = optax.sgd(1e-3) if optimizer == "sgd" else optax.adamw(1e-3)
    return compile_train_step(lambda rngs: make(rngs, cfg), llama.loss, tx,
                              *preset("llama", strategy), make_mesh(MESHES[strategy]),
                              llama.batch_shapes(cfg, batch, seq), remat=remat, stack="layers")  # fmt: skip


@cache
def reference():
    """Params, batch, and loss and gradients of the plain step on one device."""
    model = make(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    batch = llama.make_batch(CFG, BATCH, SEQ, key=jax.random.key(1))
    one = jax.devices()[0]
    params, batch = jax.device_put((params, batch), one)
    loss, grads = jax.jit(jax.value_and_grad(lambda p, b: llama.loss(nnx.merge(graphdef, p), b)))(
        params, batch
    )
    return params, batch, float(loss), grads


@pytest.mark.parametrize(
    ("strategy", "remat"),
    [
        ("tp_sp", "none"),
        ("tp_sp", "full"),
        ("fsdp_tp_sp", "none"),
        ("cp", "none"),
        ("fsdp_cp", "full"),
        ("cp_tp_sp", "none"),
    ],
)
def test_loss_and_gradients_equal_one_device(strategy, remat):
    params, batch, ref_loss, ref_grads = reference()
    prog = program(strategy, remat)
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings), batch)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


def test_gpt2_sequence_parallel_equals_one_device():
    # Biases beside their kernels (a module's role comes from its kernel), a tied head, learned
    # positions added before the stack.
    cfg = gpt2.config("tiny")
    model = gpt2.Model(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    batch = gpt2.make_batch(cfg, BATCH, SEQ, key=jax.random.key(1))
    one = jax.jit(jax.value_and_grad(lambda p, b: gpt2.loss(nnx.merge(graphdef, p), b)))
    ref_loss, ref_grads = one(*jax.device_put((params, batch), jax.devices()[0]))
    prog = compile_train_step(lambda rngs: gpt2.Model(cfg, rngs=rngs), gpt2.loss,
                              optax.sgd(1e-3), *preset("gpt2", "tp_sp"), make_mesh(MESHES["tp_sp"]),
                              gpt2.batch_shapes(cfg, BATCH, SEQ), stack="layers")  # fmt: skip
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings), batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(grads, ref_grads)
    assert prog.report().collective_bytes("all-gather", "tensor") > 0


def test_accumulation_with_the_batch_split_over_context_equals_one_device():
    params, batch, ref_loss, ref_grads = reference()
    prog = compile_train_step(make, llama.loss, optax.sgd(1e-3), *preset("llama", "cp"),
                              make_mesh(MESHES["cp"]), llama.batch_shapes(CFG, BATCH, SEQ),
                              accum_steps=2, stack="layers")  # fmt: skip
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings), batch)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


def test_batch_split_over_context_and_whole_over_tensor():
    spec = lambda s: {k: v.spec for k, v in program(s).batch_shardings.items()}  # noqa: E731
    # cp: the token arrays split along the sequence too; SP keeps them whole over tensor (the
    # lookup and the vocabulary-split head read whole rows).
    assert spec("cp") == {k: jshard.PartitionSpec(BATCH_AXES, "context") for k in spec("cp")}
    assert spec("tp_sp") == {k: jshard.PartitionSpec(BATCH_AXES) for k in spec("tp_sp")}


def _by_kind(report) -> dict[tuple, int]:
    got: dict[tuple, int] = defaultdict(int)
    for op in report.collectives:
        got[(op.kind, op.axes)] += op.bytes * op.multiplicity
    return got


@pytest.mark.parametrize("remat", ["none", "full"])
def test_sequence_parallel_collectives_equal_closed_form(remat):
    """What tp_sp adds to tp, from the shapes: all-gathers over tensor of one [B/d, S, D]
    activation (before the two column-parallel blocks, attention and MLP; the two row-parallel
    outputs' cotangents; the stack's output and input cotangent; the recomputed forward under
    remat), and the norm gradients all-reduced over tensor (norms see S/t)."""
    d, n_layers = 2, CFG.n_layers
    act = BATCH // d * SEQ * CFG.d_model * F32
    groups, rows = 2, 2  # attention's and the MLP's input; o and down
    gathers = n_layers * (groups + rows) + 2 + (n_layers * groups if remat == "full" else 0)
    norms = n_layers * 2 * CFG.d_model * F32  # attn_norm, mlp_norm
    sp, tp = _by_kind(program("tp_sp", remat).report()), _by_kind(program("tp", remat).report())
    assert sp[("all-gather", ("tensor",))] == gathers * act
    assert tp[("all-gather", ("tensor",))] == 0
    # The row-parallel outputs are reduce-scattered instead of all-reduced: XLA:CPU writes that
    # as an all-reduce and a slice, same operand.
    assert sp[("all-reduce", ("tensor",))] == tp[("all-reduce", ("tensor",))] + norms
    assert sp[("all-reduce", ("data",))] == tp[("all-reduce", ("data",))]
    assert set(sp) == set(tp) | {("all-gather", ("tensor",))}


# fsdp_tp_sp on the batch and model tests/test_costmodel.py holds fsdp_tp's own terms at.
COSTED = {"tp_sp": (BATCH, CFG, "sgd"), "fsdp_tp_sp": (16, llama.config("tiny"), "adamw")}


@pytest.mark.parametrize(("strategy", "remat"), [("tp_sp", "none"), ("tp_sp", "full"),
                                                 ("fsdp_tp_sp", "none")])  # fmt: skip
def test_cost_model_matches_compiled_within_2_percent(strategy, remat):
    batch, cfg, optimizer = COSTED[strategy]
    report = program(strategy, remat, SEQ, batch, cfg, optimizer).report()
    sizes = MeshSpec.parse(MESHES[strategy]).sizes
    pred = predict(llama, cfg, strategy, sizes, batch, SEQ, optimizer=optimizer, remat=remat)
    total = report.collective_bytes()
    want: dict[tuple, int] = defaultdict(int)
    got = _by_kind(report)
    for x in pred.traffic:  # XLA:CPU's reduce-scatters are all-reduces plus a slice
        kind = x.kind if (x.kind, x.axes) in got else x.kind.replace("reduce-scatter", "all-reduce")
        want[(kind, x.axes)] += x.bytes
    assert pred.collective_bytes() == pytest.approx(total, rel=0.02)
    for key in set(got) | set(want):
        assert abs(got[key] - want[key]) <= 0.02 * total, (key, got[key], want[key])


@pytest.mark.parametrize("remat", ["none", "full"])
def test_sequence_parallel_needs_fewer_temporaries_than_tp(remat):
    # Norms, residuals and what they save for backward hold S/t of the sequence.
    sp, tp = program("tp_sp", remat, 64).report(), program("tp", remat, 64).report()
    assert sp.memory.temp < tp.memory.temp


def test_size_one_sequence_axis_is_the_base_strategy():
    prog = compile_train_step(make, llama.loss, optax.sgd(1e-3), *preset("llama", "tp_sp"),
                              make_mesh("data=8"), llama.batch_shapes(CFG, BATCH, SEQ),
                              stack="layers")  # fmt: skip
    assert prog.batch_shardings["inputs"].spec == jshard.PartitionSpec(BATCH_AXES)
    assert prog.report().count("all-gather") == 0


# --- refused before compiling -------------------------------------------------------------------


def test_sequence_not_divisible_names_seq_and_a_length_that_works():
    with pytest.raises(StepConfigError, match=r"sequence length 30 \(--seq\).*context=4.*--seq 32"):
        program("cp", "none", 30)
    with pytest.raises(StepConfigError, match=r"sequence length 34 \(--seq\).*tensor=4.*--seq 36"):
        program("tp_sp", "none", 34)


def test_workload_without_a_sequence_is_refused():
    cfg = mlp.config("tiny")
    assert Workload.from_family(mlp, cfg).seq is None
    with pytest.raises(StepConfigError, match=r"without a sequence.*Workload.seq None.*dp, fsdp"):
        compile_train_step(lambda rngs: mlp.Model(cfg, rngs=rngs), mlp.loss, optax.sgd(1e-3),
                           *preset("mlp", "cp"), make_mesh("data=2,context=4"),
                           mlp.batch_shapes(cfg, BATCH), stack="layers")  # fmt: skip


def test_pipeline_over_context_without_the_context_kernels_is_refused():
    # The stages run each layer on their slice of the sequence: model attention there would
    # attend within the slice only.
    axis_map = STRATEGIES["pp"].replace(sequence="context")
    with pytest.raises(StepConfigError, match=r"inside a pipeline.*no attention or positions "
                       r"kernel.*context_method"):  # fmt: skip
        compile_train_step(make, llama.loss, optax.sgd(1e-3), preset("llama", "pp")[0], axis_map,
                           make_mesh("stage=2,context=4"), llama.batch_shapes(CFG, BATCH, SEQ),
                           pipeline=PipelineSpec("gpipe", 4), stack="layers")  # fmt: skip


def test_sequence_layout_needs_the_stack_seam():
    with pytest.raises(StepConfigError, match=r"stack='<module path>'"):
        compile_train_step(make, llama.loss, optax.sgd(1e-3), *preset("llama", "cp"),
                           make_mesh("data=2,context=4"), llama.batch_shapes(CFG, BATCH, SEQ))  # fmt: skip


def test_sequence_on_an_axis_the_mesh_lacks_is_refused():
    axis_map = STRATEGIES["dp"].replace(sequence="contxt")
    with pytest.raises(StepConfigError, match=r"'contxt'.*context or tensor"):
        compile_train_step(make, llama.loss, optax.sgd(1e-3), preset("llama", "dp")[0], axis_map,
                           make_mesh("data=8"), llama.batch_shapes(CFG, BATCH, SEQ), stack="layers")  # fmt: skip


def test_the_sequence_axis_cannot_be_renamed():
    """The step compiler reads "sequence" by name: a rename would silently keep the sequence
    whole, so it is refused."""
    with pytest.raises(AxisRenameError, match=r"strategy\('cp', sequence='tokens'\): 'sequence' "
                                              r"names no parameter dimension"):  # fmt: skip
        strategy("cp", sequence="tokens")
