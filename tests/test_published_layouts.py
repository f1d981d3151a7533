"""The closed form on published layouts: uneven stages, and the four- and five-axis compositions
the largest runs used, each answered without devices (`sharding.costmodel.predict`).

Uneven stages (``stage_layers``; ``"auto"`` for counts as even as the stack allows) are priced
as a stack of ``stages x repeats x max(stage_layers)`` layers: every stage holds and runs its
chunks at the largest's size, the busiest stage's memory and traffic; the model's own parameter
count and, for an explicit schedule, each stage's own layers in the FLOPs of its lanes.
"""

from __future__ import annotations

import dataclasses

import pytest

import models
from benchmarks import plan_time
from sharding.costmodel import predict
from sharding.pipeline import LayerCountError, StageLayersError

LLAMA = models.llama
L70 = dataclasses.replace(LLAMA.config("70b"), n_layers=70)  # 70 layers: no 12 equal stages
L72 = dataclasses.replace(LLAMA.config("70b"), n_layers=72)


def test_uneven_stages_price_the_largest_stage():
    """70 layers on 12 stages: (5, 5, 6, ...) prices memory and traffic as 72 layers on 12
    equal stages, counts the model's own parameters, and runs fewer FLOPs on its critical path
    (two stages run 5 layers of their 6 slots)."""
    kw = dict(dtype="bfloat16")
    uneven = predict(LLAMA, L70, "pp", {"stage": 12, "data": 2}, 48, 4096,
                     pipeline=("1f1b", 24, 1, "auto"), **kw)  # fmt: skip
    padded = predict(LLAMA, L72, "pp", {"stage": 12, "data": 2}, 48, 4096,
                     pipeline=("1f1b", 24, 1), **kw)  # fmt: skip
    assert uneven.pipeline["stage_layers"] == [5, 5] + [6] * 10
    assert uneven.memory_bytes == padded.memory_bytes
    assert uneven.collective_bytes() == padded.collective_bytes()
    assert uneven.critical_flops < padded.critical_flops
    whole = predict(LLAMA, L70, "pp", {"stage": 2, "data": 2}, 48, 4096,
                    pipeline=("1f1b", 24, 1), **kw)  # fmt: skip
    assert uneven.n_params == whole.n_params
    assert any("uneven stages [5, 5, 6" in n for n in uneven.notes)


def test_stage_layers_given_by_hand_are_checked():
    given = predict(LLAMA, L70, "pp", {"stage": 12, "data": 2}, 48, 4096,
                    pipeline=("gpipe", 24, 1, (4,) + (6,) * 11))  # fmt: skip
    assert given.pipeline["stage_layers"][0] == 4
    with pytest.raises(StageLayersError, match=r"adds up to 71 layers.*n_layers=70"):
        predict(LLAMA, L70, "pp", {"stage": 12, "data": 2}, 48, 4096,
                pipeline=("gpipe", 24, 1, (5,) + (6,) * 11))  # fmt: skip


def test_a_stack_that_does_not_split_evenly_names_uneven_stages():
    with pytest.raises(LayerCountError, match=r"n_layers=126 does not split into stages=16.*"
                       r"pipeline=\('1f1b', 16, 1, 'auto'\) or a PipelineSpec with "
                       r"stage_layers"):  # fmt: skip
        predict(LLAMA, "3.1-405b", "fsdp+tp+pp", {"stage": 16, "fsdp": 8, "tensor": 8}, 128,
                8192, pipeline=("1f1b", 16, 1))  # fmt: skip


# The published layouts of issue 36, as benchmarks/plan_time.py times them: (size, strategy,
# mesh, batch, seq, pipeline, remat), a size given as a layer count being Llama 70B cut to it.
PUBLISHED = [
    (L70 if size == 70 else size, *rest) for _, size, *rest in plan_time.PUBLISHED
]  # fmt: skip


@pytest.mark.parametrize(("size", "strategy", "mesh", "batch", "seq", "pipeline", "remat"),
                         PUBLISHED, ids=[c[1] for c in PUBLISHED])  # fmt: skip
def test_published_layouts_are_priced(size, strategy, mesh, batch, seq, pipeline, remat):
    pred = predict(LLAMA, size, strategy, mesh, batch, seq, pipeline=pipeline, remat=remat,
                   dtype="bfloat16")  # fmt: skip
    assert pred.pipeline["name"] == pipeline[0]
    assert pred.memory_bytes > 0 and pred.critical_flops >= pred.matmul_flops > 0
    split = {a for a, n in mesh.items() if n > 1} - {"stage", "data"}
    # every axis the layout splits over moves bytes (the data-parallel one too, where it has one)
    for axis in split | ({"data"} & set(mesh)):
        assert any(axis in x.axes for x in pred.traffic), axis
