"""Per-stage loads and the FLOP price of the bubble, measured from compiled programs."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx

from models import llama
from sharding import make_mesh
from sharding.pipeline import LayerCountError, PipelineSpec, stack_flop_overhead, stage_report


def abstract_llama(n_layers: int = 4) -> nnx.Module:
    cfg = dataclasses.replace(llama.config("tiny"), n_layers=n_layers)
    return nnx.eval_shape(lambda: llama.Model(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize(
    ("stages", "m", "schedule", "repeats", "n_layers"),
    [(2, 2, "gpipe", 1, 4), (2, 8, "gpipe", 1, 4), (4, 4, "gpipe", 1, 8), (2, 4, "circular", 2, 8)],
)
def test_flop_overhead_is_the_bubble(stages, m, schedule, repeats, n_layers):
    spec = PipelineSpec(schedule, m, repeats)
    mesh = make_mesh(f"stage={stages},data={8 // stages}")
    got = stack_flop_overhead(abstract_llama(n_layers), spec, mesh, batch=32, seq_len=32)
    assert got["theory"] == (repeats * m + stages - 1) / (repeats * m)
    assert got["overhead"] == pytest.approx(got["theory"], rel=0.02)


def test_flop_overhead_refuses_1f1b():
    with pytest.raises(ValueError, match=r"1f1b's ticks branch \(lax\.cond\)"):
        stack_flop_overhead(
            abstract_llama(), PipelineSpec("1f1b", 4), make_mesh("stage=2,data=4"), 16, 32
        )


def test_1f1b_charges_the_head_to_the_last_stage():
    report = stage_report(abstract_llama(8), PipelineSpec("1f1b", 8), 4, 2, 32)
    layer_flops = report.stages[0].forward_flops // 2
    assert [s.layers for s in report.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.forward_flops for s in report.stages[:3]] == [2 * layer_flops] * 3
    assert report.stages[3].forward_flops == 2 * layer_flops + report.shared_forward_flops
    assert report.imbalance == pytest.approx(
        4 * report.stages[3].forward_flops / sum(s.forward_flops for s in report.stages)
    )


def test_circular_stages_own_interleaved_blocks_and_balance():
    model = abstract_llama(8)
    report = stage_report(model, PipelineSpec("circular", 4, 2), 2, 2, 32)
    assert [s.layers for s in report.stages] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert report.imbalance == 1.0
    layers = nnx.state(model.layers)
    layer_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layers))
    assert sum(s.param_bytes for s in report.stages) == layer_bytes
    assert report.to_dict()["imbalance"] == 1.0


def test_stage_report_names_valid_layer_counts():
    with pytest.raises(LayerCountError, match=r"Nearest valid layer counts: 4 below, 8 above"):
        stage_report(abstract_llama(6), PipelineSpec("gpipe", 4), 4, 2, 32)
