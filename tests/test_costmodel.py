"""The cost model's closed forms against the compiled programs they predict.

Every strategy on llama tiny and gpt2 tiny, 8 simulated devices: collective bytes per step (in
total and per kind and mesh axes), parameter / optimizer / argument memory per device, and matmul
FLOPs, held to 5% of what `compile_train_step(...).report()` reads from the executable.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import cache

import optax
import pytest
from rich.console import Console

import models
from partition_rules import preset
from partition_rules.strategies import EXAMPLE_MESHES_8
from sharding import MeshSpec, RuleError, compile_train_step, make_mesh, state_bytes
from sharding.costmodel import CostModelError, predict
from sharding.pipeline import PipelineConfigError, PipelineSpec

BATCH, SEQ, MICROBATCHES = 16, 32, 4
CASES = [
    ("dp", None),
    ("fsdp", None),
    ("tp", None),
    ("fsdp_tp", None),
    ("pp", "gpipe"),
    ("pp", "1f1b"),
    ("pp", "interleaved"),
    ("pp", "zb-h1"),
]
# Interleaved needs each stage's layers in 2 chunks: 4 layers on 2 stages.
MESHES = {"interleaved": "stage=2,data=4"}
EXPLICIT = [(fam, s) for fam in ("llama", "gpt2") for s in ("1f1b", "interleaved", "zb-h1")]
PARAMS = [(fam, strategy, sched) for fam in ("llama", "gpt2") for strategy, sched in CASES]
IDS = [f"{fam}-{strategy}{'-' + sched if sched else ''}" for fam, strategy, sched in PARAMS]


def _pipeline(family: str, schedule: str | None) -> PipelineSpec | None:
    if schedule is None:
        return None
    return PipelineSpec(schedule, MICROBATCHES, 2 if schedule == "interleaved" else 1)


def _mesh(strategy: str, schedule: str | None) -> str:
    return MESHES.get(schedule, EXAMPLE_MESHES_8[strategy])


@cache
def measured(family: str, strategy: str, schedule: str | None):
    """(program, report) compiled once per case for the whole module."""
    fam = models.get_family(family)
    cfg = fam.config("tiny")
    prog = compile_train_step(
        lambda rngs: fam.Model(cfg, rngs=rngs),
        fam.loss,
        optax.adamw(1e-3),
        *preset(family, strategy),
        make_mesh(_mesh(strategy, schedule)),
        fam.batch_shapes(cfg, BATCH, SEQ),
        pipeline=_pipeline(family, schedule),
        stack="layers",
    )
    return prog, prog.report()


def predicted(family: str, strategy: str, schedule: str | None):
    sizes = MeshSpec.parse(_mesh(strategy, schedule)).sizes
    cfg = models.get_family(family).config("tiny")
    return predict(
        models.get_family(family),
        cfg,
        strategy,
        sizes,
        BATCH,
        SEQ,
        pipeline=_pipeline(family, schedule),
    )


@pytest.mark.parametrize(("family", "strategy", "schedule"), PARAMS, ids=IDS)
def test_collective_bytes_per_step_match_the_compiled_program(family, strategy, schedule):
    _, report = measured(family, strategy, schedule)
    pred = predicted(family, strategy, schedule)
    total = report.collective_bytes()
    assert pred.collective_bytes() == pytest.approx(total, rel=0.05)
    # Per kind and axes too. XLA:CPU emits FSDP's gradient reduce-scatter as an all-reduce plus
    # a slice (no reduce-scatter creation pass); the operand, so the bytes, are the same. An
    # explicit psum_scatter (gpipe's outputs over stage) stays a reduce-scatter.
    got, want = defaultdict(int), defaultdict(int)
    for op in report.collectives:
        got[(op.kind, op.axes)] += op.bytes * op.multiplicity
    for x in pred.traffic:
        scatter = x.kind == "reduce-scatter" and (x.kind, x.axes) in got
        want[(x.kind if scatter else x.kind.replace("reduce-scatter", "all-reduce"), x.axes)] += (
            x.bytes
        )
    for key in set(got) | set(want):
        assert abs(got[key] - want[key]) <= 0.05 * total, (key, got[key], want[key])


@pytest.mark.parametrize(("family", "strategy", "schedule"), PARAMS, ids=IDS)
def test_param_and_optimizer_memory_per_device_match(family, strategy, schedule):
    prog, report = measured(family, strategy, schedule)
    pred = predicted(family, strategy, schedule)
    state, shardings = prog.abstract_state, prog.state_shardings
    params = state_bytes(state["params"], shardings["params"])
    opt = state_bytes(state["opt_state"], shardings["opt_state"])
    assert pred.param_bytes == pytest.approx(params, rel=0.05)
    assert pred.optimizer_bytes == pytest.approx(opt, rel=0.05)
    assert pred.grad_bytes == pred.param_bytes
    # State + batch is what the executable takes as arguments.
    assert pred.argument_bytes == pytest.approx(report.memory.argument, rel=0.05)


@pytest.mark.parametrize(
    ("family", "strategy"), [(f, s) for f in ("llama", "gpt2") for s, sch in CASES if not sch]
)
def test_matmul_flops_match_outside_pipelines(family, strategy):
    _, report = measured(family, strategy, None)
    assert predicted(family, strategy, None).matmul_flops == pytest.approx(
        report.matmul_flops, rel=0.05
    )


def test_gpipe_flops_count_the_bubble_ticks():
    # Bubble ticks compute on zeros and the stage body is recomputed in backward: the compiled
    # count sits near 4 passes x ticks, not 3 passes x micro-batches.
    _, report = measured("llama", "pp", "gpipe")
    pred = predicted("llama", "pp", "gpipe")
    assert pred.matmul_flops == pytest.approx(report.matmul_flops, rel=0.1)
    assert pred.bubble_fraction == pytest.approx(report.extra["bubble_fraction"], abs=1e-4)


@pytest.mark.parametrize(("family", "schedule"), EXPLICIT, ids=[f"{f}-{s}" for f, s in EXPLICIT])
def test_explicit_schedules_lanes_and_critical_path_match(family, schedule):
    """The closed form's lanes (F, B, W, head per micro-batch and chunk) against those read off
    the compiled program, and the critical path both price by `Schedule.tick_costs`."""
    from sharding.costmodel import work_from_report

    prog, report = measured(family, "pp", schedule)
    work = work_from_report(report, tokens=BATCH * SEQ, schedule=prog.schedule,
                            hlo_text=prog.compiled.as_text())  # fmt: skip
    pred = predicted(family, "pp", schedule)
    got, want = work.pipeline["lanes"], pred.pipeline["lanes"]
    for k in ("forward", "backward", "weight", "head"):
        assert want[k] == pytest.approx(got[k], rel=0.05, abs=1.0), k
    assert pred.critical_flops == pytest.approx(work.matmul_flops, rel=0.05)
    assert pred.matmul_flops == pytest.approx(work.pipeline["busiest_device_flops"], rel=0.05)


def test_prediction_scales_to_70b_without_devices():
    pred = predict(models.llama, "70b", "fsdp_tp", {"fsdp": 64, "tensor": 8}, 512, 4096,
                   dtype="bfloat16", remat="full")  # fmt: skip
    assert pred.n_params == models.llama.param_count(models.llama.config("70b"))
    assert pred.param_bytes == pytest.approx(pred.n_params * 4 / 512, rel=0.01)
    # ZeRO-3 over 64 gathers each layer's tensor slice twice (in bf16) and reduces it once
    # (float32): about (2 * 2 + 4) bytes per parameter / tensor.
    layers = pred.collective_bytes("all-gather", "fsdp") + pred.collective_bytes("reduce-scatter")
    assert layers == pytest.approx(pred.n_params * 8 / 8, rel=0.05)
    json.dumps(pred.to_dict())
    Console(file=None, width=160, record=True).print(pred)


def test_rejects_what_it_cannot_predict():
    with pytest.raises(CostModelError, match=r"global batch 12 is not divisible by data x fsdp"):
        predict(models.llama, "tiny", "dp", {"data": 8}, 12, 32)
    with pytest.raises(CostModelError, match=r"language-model families"):
        predict(models.mlp, "tiny", "dp", {"data": 8}, 8, None)
    with pytest.raises(CostModelError, match=r"need stage >= 2 and a pipeline"):
        predict(models.llama, "tiny", "pp", {"stage": 2, "data": 4}, 16, 32)
    with pytest.raises(PipelineConfigError, match=r"micro-batches of a size divisible by"):
        predict(
            models.llama, "tiny", "pp", {"stage": 2, "data": 4}, 8, 32, pipeline=("gpipe", 4, 1)
        )
    with pytest.raises(CostModelError, match=r"unknown optimizer 'lion'"):
        predict(models.llama, "tiny", "dp", {"data": 8}, 8, 32, optimizer="lion")
    with pytest.raises(RuleError, match=r"not divisible by tensor=16"):
        predict(models.llama, "tiny", "tp", {"tensor": 16}, 8, 32)


def test_docstring_examples_of_the_public_names(doctests):
    import sharding.costmodel

    assert doctests(sharding.costmodel) >= 8  # Layout, layouts, meshes, strategy_names, ...
