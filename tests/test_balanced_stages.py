"""Balanced stages: uneven layer counts per (virtual) stage compute the one-device numbers under
every explicit schedule and pipeline strategy, are checked before compiling, and are chosen from
measured costs (`balanced_stages`), for the shipped models and a model written here."""

from __future__ import annotations

import dataclasses
from functools import cache

import jax
import numpy as np
import pytest
import user_models as um
from closeness import assert_close
from flax import nnx

from models import llama
from sharding import Workload, build_program
from sharding.pipeline import (
    PipelineSpec,
    StageLayersError,
    balance_layers,
    balanced_stages,
    stage_report,
    workload_stage_costs,
)

CFG = dataclasses.replace(llama.config("tiny"), n_layers=8)
BATCH, SEQ = 16, 32


def program(strategy, mesh, schedule, stage_layers, *, m=4, repeats=None, cfg=CFG, devices=None):
    work = Workload.from_family(llama, cfg)
    return build_program(work, strategy, mesh, batch=BATCH, seq=SEQ, schedule=schedule,
                         microbatches=m if schedule else None, repeats=repeats,
                         stage_layers=stage_layers, devices=devices)  # fmt: skip


def batch_of():
    return jax.device_get(llama.make_batch(CFG, BATCH, SEQ, key=jax.random.key(3)))


@cache
def reference():
    prog = program("dp", "data=1", None, None, devices=jax.devices()[:1])
    params = jax.device_get(prog.init(0)["params"])
    loss, grads = prog.loss_and_grads(params, batch_of())
    return params, float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize(
    ("strategy", "mesh", "schedule", "repeats", "stage_layers"),
    [
        ("pp", "stage=2,data=4", "1f1b", None, (3, 5)),
        ("pp_tp", "stage=2,data=2,tensor=2", "zb-h1", None, (6, 2)),
        ("pp_fsdp", "stage=2,fsdp=4", "1f1b", None, (1, 7)),
        ("pp", "stage=2,data=4", "interleaved", 2, (1, 3, 3, 1)),
        ("pp", "stage=4,data=2", "zb-h1", None, (1, 2, 2, 3)),
        ("pp", "stage=2,data=4", "gpipe", None, (3, 5)),
        ("pp_tp", "stage=2,data=2,tensor=2", "circular", 2, (1, 3, 3, 1)),
        # the rest of every schedule x {pp, pp_tp, pp_fsdp}
        ("pp_tp", "stage=2,data=2,tensor=2", "gpipe", None, (5, 3)),
        ("pp_fsdp", "stage=2,fsdp=4", "gpipe", None, (2, 6)),
        ("pp", "stage=2,data=4", "circular", 2, (2, 1, 3, 2)),
        ("pp_fsdp", "stage=2,fsdp=4", "circular", 2, (1, 2, 2, 3)),
        ("pp_tp", "stage=2,data=2,tensor=2", "1f1b", None, (5, 3)),
        ("pp_tp", "stage=2,data=2,tensor=2", "interleaved", 2, (2, 2, 1, 3)),
        ("pp_fsdp", "stage=2,fsdp=4", "interleaved", 2, (3, 1, 2, 2)),
        ("pp_fsdp", "stage=2,fsdp=4", "zb-h1", None, (2, 6)),
    ],
)
def test_uneven_stages_match_one_device(strategy, mesh, schedule, repeats, stage_layers):
    prog = program(strategy, mesh, schedule, stage_layers, repeats=repeats)
    assert prog.pipeline.stage_layers == stage_layers
    params, ref_loss, ref_grads = reference()
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings), batch_of())
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


def test_uneven_stages_on_a_user_model_with_extra_layer_inputs():
    """The test decoder's mask and position bias (with its own gradient) reach every real layer."""
    work = um.transformer("stacked")
    one = build_program(work, "dp", "data=1", batch=BATCH, devices=jax.devices()[:1])
    params = jax.device_get(one.init(0)["params"])
    batch = jax.device_get(work.synthetic_batch(BATCH))
    ref_loss, ref_grads = one.loss_and_grads(params, batch)
    prog = build_program(work, "pp", "stage=2,data=4", batch=BATCH, schedule="1f1b",
                         microbatches=4, stage_layers=(1, 3))  # fmt: skip
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings), batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_close(grads, ref_grads)


@pytest.mark.parametrize(
    ("stage_layers", "error", "match"),
    [
        (
            (2, 3),
            StageLayersError,
            r"stage_layers=\[2, 3\] adds up to 5 layers, but the stack "
            r"has n_layers=8; the counts must add up to 8",
        ),
        ((8,), StageLayersError, r"has 1 counts, but stages=2 makes 2 virtual stages"),
        ((0, 8), StageLayersError, r"every count must be an integer >= 1"),
    ],
)
def test_bad_stage_layers_are_refused_before_compiling(stage_layers, error, match):
    with pytest.raises(error, match=match):
        program("pp", "stage=2,data=4", "1f1b", stage_layers)


def test_auto_balance_moves_layers_off_the_stage_that_runs_the_head():
    """A vocabulary of 8192 makes the head cost about 13 layers: 'auto' leaves the last stage
    one layer, as `balance_layers` does on the measured costs, and evens out the stages."""
    cfg = dataclasses.replace(llama.config("tiny"), n_layers=16, vocab_size=8192)
    work = Workload.from_family(llama, cfg)
    costs = workload_stage_costs(work, 2, SEQ)
    head = 2 * 2 * SEQ * cfg.d_model * cfg.vocab_size
    assert costs["after"] == head and costs["before"] == 0
    spec = PipelineSpec("1f1b", 8)
    counts = balanced_stages(work, spec, 4, 2, SEQ)
    assert counts == balance_layers(16, 4, layer=costs["layer"], last=head) == (5, 5, 5, 1)
    model = nnx.eval_shape(lambda: llama.Model(cfg, rngs=nnx.Rngs(0)))
    even = stage_report(model, spec, 4, 2, SEQ)
    balanced = stage_report(model, dataclasses.replace(spec, stage_layers=counts), 4, 2, SEQ)
    assert [s.layers for s in balanced.stages][3] == (15,)
    assert balanced.imbalance < even.imbalance
    # gpipe runs the head outside the pipeline: nothing to balance.
    assert balanced_stages(work, PipelineSpec("gpipe", 8), 4, 2, SEQ) == (4, 4, 4, 4)


def test_build_program_balances_automatically():
    cfg = dataclasses.replace(llama.config("tiny"), n_layers=8, vocab_size=8192)
    prog = program("pp", "stage=4,data=2", "zb-h1", "auto", cfg=cfg)
    assert prog.pipeline.stage_layers == (3, 2, 2, 1)


def test_train_takes_stage_layers(tmp_path, capsys):
    from sharding.cli import main

    metrics = tmp_path / "m.jsonl"
    args = ["train", "--strategy", "pp", "--mesh", "stage=2,data=4", "--schedule", "zb-h1",
            "--batch", "16", "--seq", "32", "--steps", "2", "--metrics", str(metrics)]  # fmt: skip
    assert main([*args, "--stage-layers", "1,3"]) == 0
    assert len(metrics.read_text().splitlines()) == 2
    with pytest.raises(SystemExit) as e:
        main([*args, "--stage-layers", "1,x", "--overwrite"])
    assert e.value.code == 2
    assert "'1,x': give layers per stage as whole numbers separated by commas" in (
        capsys.readouterr().err
    )
    code = main([*args, "--stage-layers", "1,2", "--overwrite"])
    assert code != 0
    assert "stage_layers=[1, 2] adds up to 3 layers" in capsys.readouterr().err
