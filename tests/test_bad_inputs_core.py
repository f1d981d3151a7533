"""Bad input to the core (mesh, placement, the step compiler) and to commands at their door:
one typed error each, raised before anything compiles, naming the value and the fix."""

from __future__ import annotations

import math
import subprocess
import sys

import jax
import optax
import pytest
from flax import nnx

import sharding
from models import llama
from partition_rules import preset
from sharding import MeshSpec, compile_train_step, explain, make_mesh, parse_bytes, resolve

CFG = llama.config("tiny")
RULES, AXIS_MAP = preset("llama", "fsdp_tp")
_, PARAMS = sharding.abstract_params(lambda: llama.Model(CFG, rngs=nnx.Rngs(0)))


def step(**change):
    """compile_train_step for llama tiny with one argument changed."""
    args = {
        "make_model": lambda rngs: llama.Model(CFG, rngs=rngs),
        "loss_fn": llama.loss,
        "optimizer": optax.adamw(1e-3),
        "rules": RULES,
        "axis_map": AXIS_MAP,
        "mesh": make_mesh("data=2,fsdp=2,tensor=2"),
        "batch_shapes": llama.batch_shapes(CFG, 8, 32),
    }
    positional = [args.pop(k) if k not in change else change.pop(k) for k in list(args)]
    return compile_train_step(*positional, **change)


API = [
    (
        "resolve-needs-more-than-1-device",
        lambda: MeshSpec.parse("data=2,fsdp=-1,tensor=2").resolve(1),
        sharding.MeshSizeMismatchError,
        r"multiply to 4, which does not divide 1.*e\.g\. 'data=1'",
    ),
    (
        "resolve-wrong-count",
        lambda: MeshSpec.parse("data=2,tensor=4").resolve(4),
        sharding.MeshSizeMismatchError,
        r"multiplies to 8 devices but 4 are available",
    ),
    (
        "mesh-size-word",
        lambda: make_mesh("data=two"),
        sharding.MalformedMeshSpecError,
        r"cannot read 'data=two'.*e\.g\. 'data=2,tensor=4'",
    ),
    (
        "mesh-unknown-axis",
        lambda: make_mesh("gpu=8"),
        sharding.UnknownMeshAxisNameError,
        r"unknown axis 'gpu'; the axes are stage, data, fsdp, expert, context, tensor",
    ),
    (
        "mesh-two-fills",
        lambda: MeshSpec(data=-1, fsdp=-1),
        sharding.MultipleFillAxesError,
        r"at most one axis may be -1",
    ),
    ("mesh-zero", lambda: MeshSpec(data=0), sharding.MalformedMeshSpecError, r"data=0 \(int\)"),
    (
        "mesh-axis-twice",
        lambda: make_mesh("data=2,data=4"),
        sharding.MalformedMeshSpecError,
        r"'data' is given twice",
    ),
    (
        "resolve-spec-string",
        lambda: resolve(RULES, AXIS_MAP, PARAMS, "data=8"),
        sharding.ArgumentTypeError,
        r"resolve\(mesh=\.\.\.\).*got str 'data=8'.*make_mesh\('data=8'\)",
    ),
    (
        "resolve-meshspec",
        lambda: resolve(RULES, AXIS_MAP, PARAMS, MeshSpec(data=8)),
        sharding.ArgumentTypeError,
        r"got MeshSpec.*make_mesh\('data=8'\)",
    ),
    (
        "resolve-rules-not-rules",
        lambda: resolve("fsdp", AXIS_MAP, PARAMS, make_mesh("data=8")),
        sharding.ArgumentTypeError,
        r"resolve\(rules=\.\.\.\).*got str 'fsdp'.*preset",
    ),
    (
        "resolve-axis-map-dict",
        lambda: resolve(RULES, {"embed": "fsdp"}, PARAMS, make_mesh("data=8")),
        sharding.ArgumentTypeError,
        r"axis_map=\.\.\.\).*AxisMap\(\{'embed': 'fsdp'\}\)",
    ),
    (
        "explain-unfilled-spec",
        lambda: explain(RULES, AXIS_MAP, PARAMS, "data=-1"),
        sharding.MeshSpecError,
        r"-1 axis; resolve it first",
    ),
    (
        "explain-indivisible",
        lambda: explain(*preset("llama", "tp"), PARAMS, "tensor=8"),
        sharding.IndivisibleDimensionError,
        r"kv_heads.*tensor=8",
    ),
    (
        "step-mesh-string",
        lambda: step(mesh="data=2,fsdp=2,tensor=2"),
        sharding.ArgumentTypeError,
        r"compile_train_step\(mesh=\.\.\.\).*make_mesh\('data=2,fsdp=2,tensor=2'\)",
    ),
    (
        "step-optimizer-name",
        lambda: step(optimizer="adamw"),
        sharding.ArgumentTypeError,
        r"optimizer=\.\.\.\).*got str 'adamw'.*optax\.adamw\(1e-3\)",
    ),
    (
        "step-loss-none",
        lambda: step(loss_fn=None),
        sharding.ArgumentTypeError,
        r"loss_fn=\.\.\.\).*got NoneType",
    ),
    (
        "step-make-model-instance",
        lambda: step(make_model=CFG),
        sharding.ArgumentTypeError,
        r"make_model=\.\.\.\).*rngs -> nnx\.Module",
    ),
    (
        "step-accum-zero",
        lambda: step(accum_steps=0),
        sharding.StepArgumentError,
        r"accum_steps=0\): give an integer >= 1",
    ),
    (
        "step-accum-float",
        lambda: step(accum_steps=2.0),
        sharding.StepArgumentError,
        r"accum_steps=2\.0\)",
    ),
    (
        "step-clip-negative",
        lambda: step(clip_norm=-1.0),
        sharding.StepArgumentError,
        r"clip_norm=-1\.0\): give a finite norm > 0, or None",
    ),
    (
        "step-clip-nan",
        lambda: step(clip_norm=math.nan),
        sharding.StepArgumentError,
        r"clip_norm=nan\)",
    ),
    (
        "step-dtype",
        lambda: step(compute_dtype="fp8"),
        sharding.StepConfigError,
        r"unknown compute dtype 'fp8'",
    ),
    (
        "step-remat",
        lambda: step(remat="some"),
        sharding.StepConfigError,
        r"unknown remat policy 'some'",
    ),
    (
        "step-empty-batch",
        lambda: step(batch_shapes={}),
        sharding.ArgumentTypeError,
        r"batch_shapes=\.\.\.\).*batch_shapes\(cfg, 16, 64\)",
    ),
    (
        "step-pipeline-name",
        lambda: step(pipeline="1f1b"),
        sharding.StepConfigError,
        r"pipeline='1f1b'\).*PipelineSpec\('1f1b', microbatches=8\)",
    ),
    (
        "step-batch-indivisible",
        lambda: step(batch_shapes=llama.batch_shapes(CFG, 6, 32)),
        sharding.BatchShardingError,
        r"global batch 6 is not divisible by data=2xfsdp=2 = 4",
    ),
    (
        "step-pp-preset-without-pipeline",
        lambda: step(
            rules=preset("llama", "pp")[0],
            axis_map=preset("llama", "pp")[1],
            mesh=make_mesh("stage=2,data=4"),
        ),
        sharding.StepConfigError,
        r"split over the 'stage' mesh axis \(stage=2; e\.g\. layers/.*no pipeline was given",
    ),
    (
        "step-remat-with-a-plain-loss",
        lambda: step(loss_fn=lambda model, batch: llama.loss(model, batch), remat="full"),
        sharding.StepConfigError,
        r"remat='full'\): spmdkit applies a remat policy to each layer.*no stack was named.*"
        r"stack='layers'",
    ),
    (
        "bytes-unit",
        lambda: parse_bytes("80i"),
        sharding.SizeFormatError,
        r"cannot read '80i' as a size.*'80GB'",
    ),
    ("bytes-empty", lambda: parse_bytes(""), sharding.SizeFormatError, r"cannot read ''"),
    (
        "devices-zero",
        lambda: sharding.setup_devices("data=4", 0),
        sharding.MeshSpecError,
        r"--devices 0: give a device count >= 1",
    ),
    (
        "devices-disagree",
        lambda: sharding.setup_devices("data=4", 2),
        sharding.MeshSpecError,
        r"--mesh data=4 spans 4 devices but --devices is 2.*--devices 4",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [r[1:] for r in API], ids=[r[0] for r in API])
def test_api_refuses(call, error, match, unchanged):
    with unchanged(), pytest.raises(error, match=match):
        call()


CLI = [
    ("no-command", [], r"required: COMMAND"),
    ("unknown-command", ["fit"], r"invalid choice: 'fit'"),
    (
        "explain-fill-without-devices",
        ["explain", "--mesh", "data=-1"],
        r"--mesh data=-1 has a -1 axis; give --devices N",
    ),
    (
        "explain-indivisible",
        ["explain", "--mesh", "tensor=8", "--strategy", "tp"],
        r"(?s)IndivisibleDimensionError.*kv_heads.*--mesh.*--strategy",
    ),
    ("explain-unknown-axis", ["explain", "--mesh", "gpu=8"], r"unknown axis 'gpu'"),
    ("explain-devices-zero", ["explain", "--devices", "0"], r"--devices: 0 must be >= 1"),
    ("explain-devices-word", ["explain", "--devices", "eight"], r"'eight' is not a whole number"),
    (
        "explain-unknown-size",
        ["explain", "--size", "huge"],
        r"--size 'huge': unknown llama size; sizes: tiny, maxtext-tiny",
    ),
    (
        "explain-mesh-vs-devices",
        ["explain", "--mesh", "data=3", "--devices", "8"],
        r"multiplies to 3 devices but 8",
    ),
    ("explain-unknown-strategy", ["explain", "--strategy", "zero3"], r"unknown strategy 'zero3'"),
    ("train-sp-without-tp", ["train", "--strategy", "sp+pp"], r"sp without tp.*write tp\+sp\+pp"),
    (
        "train-ep-on-a-dense-model",
        ["train", "--strategy", "ep", "--mesh", "expert=4,data=2"],
        r"'ep' \(ep\) splits experts over expert, and the model has none.*drop ep",
    ),
    (
        "train-an-axis-no-part-uses",
        ["train", "--strategy", "fsdp", "--mesh", "stage=2,fsdp=4"],
        r"'fsdp' \(fsdp\) splits nothing over mesh axis stage=2.*use --strategy fsdp\+pp",
    ),
    (
        "explain-unknown-model",
        ["explain", "--model", "bert"],
        r"--model 'bert': not a shipped model \(cnn, gpt2, llama, llama-moe, mlp\) and not "
        r"'package.module:attribute'",
    ),
]


@pytest.mark.parametrize(("args", "match"), [r[1:] for r in CLI], ids=[r[0] for r in CLI])
def test_cli_refuses(args, match, refused):
    refused(args, match)


def test_a_mesh_larger_than_a_one_device_host_is_an_error_not_a_recursion(tmp_path):
    """The README's first block on a host with one CPU device (was a 2,495-line RecursionError)."""
    code = "from sharding import make_mesh; make_mesh('data=2,fsdp=-1,tensor=2')"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert "RecursionError" not in proc.stderr and len(proc.stderr.splitlines()) < 40
    assert "MeshSizeMismatchError" in proc.stderr and "which does not divide 1" in proc.stderr


def test_train_on_more_devices_than_given_is_refused_before_jax_starts(refused):
    refused(["train", "--mesh", "data=2,tensor=2", "--strategy", "dp_tp", "--devices", "1"],
            r"--mesh data=2,tensor=2 spans 4 devices but --devices is 1", subprocess_=True)  # fmt: skip


def test_jax_sees_eight_devices_here():
    assert jax.device_count() == 8


def test_a_plain_loss_without_remat_trains_like_the_contract_loss():
    """loss(model, batch) with no remat keyword works when no remat policy is asked for."""
    batch = llama.make_batch(CFG, 8, 32)
    losses = []
    for loss_fn in (llama.loss, lambda model, batch: llama.loss(model, batch)):
        program = step(loss_fn=loss_fn)
        state = program.init(0)
        _, metrics = program.step(state, program.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
