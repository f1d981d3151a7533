"""Closed-form traffic of pipelines combined with the sequence and expert splits.

pp_cp (every attention method), pp_tp_sp, pp_ep and llama-moe under pp and pp_tp, with gpipe
and circular (pp_cp and pp_tp_sp with 1f1b, zb-h1 and interleaved too): per (collective kind,
mesh axes), the cost model's bytes equal the compiled step's within 2% of its total. The
kernels' collectives run once per tick (bubble ticks included), the stage weights' gradients are
summed over the batch axes and context at once, and what is not modelled (an explicit schedule
with experts or remat) is refused before anything is computed.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import jax
import pytest

import models
from sharding import MeshSpec, Workload, build_program
from sharding.costmodel import CostModelError, predict

BATCH, SEQ, MICRO = 16, 32, 4
# The closed form's terms are jax 0.10.2's partitioner's (see the module `_pipesplits`).
NEWER_PARTITIONER = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 12)
CP, TP_SP, EP = "stage=2,data=2,context=2", "stage=2,data=2,tensor=2", "stage=2,expert=2,data=2"


@cache
def compiled(family: str, strategy: str, mesh: str, schedule: str, repeats: int, method,
             remat: str = "none"):  # fmt: skip
    fam = models.get_family(family)
    prog = build_program(Workload.from_family(fam, fam.config("tiny")), strategy, mesh,
                         batch=BATCH, seq=SEQ, schedule=schedule, microbatches=MICRO,
                         repeats=repeats if repeats > 1 else None,
                         context_method=method, remat=remat)  # fmt: skip
    got = defaultdict(int)
    for op in prog.report().collectives:
        got[(op.kind.replace("reduce-scatter", "all-reduce"), op.axes)] += (
            op.bytes * op.multiplicity
        )
    return got


def predicted(family: str, strategy: str, mesh: str, schedule: str, repeats: int, method,
              remat: str = "none"):  # fmt: skip
    fam = models.get_family(family)
    pred = predict(fam, fam.config("tiny"), strategy, MeshSpec.parse(mesh).sizes, BATCH, SEQ,
                   pipeline=(schedule, MICRO, repeats), context_method=method or "ring",
                   remat=remat)  # fmt: skip
    want = defaultdict(int)
    for x in pred.traffic:
        want[(x.kind.replace("reduce-scatter", "all-reduce"), x.axes)] += x.bytes
    return want


CASES = [
    ("llama", "pp_cp", CP, "gpipe", 1, "ring", "none"),
    ("llama", "pp_cp", CP, "gpipe", 1, "ulysses", "none"),
    ("llama", "pp_cp", CP, "circular", 2, "ring", "none"),
    ("llama", "pp_cp", CP, "circular", 2, "allgather", "full"),
    ("llama", "pp_tp_sp", TP_SP, "gpipe", 1, None, "none"),
    ("llama", "pp_tp_sp", TP_SP, "gpipe", 1, None, "full"),
    ("llama", "pp_tp_sp", "stage=2,tensor=4", "gpipe", 1, None, "none"),  # tp's lookup
    ("llama-moe", "pp_ep", EP, "gpipe", 1, None, "none"),
    ("llama-moe", "pp_ep", EP, "gpipe", 1, None, "full"),
    ("llama-moe", "pp", "stage=2,data=4", "gpipe", 1, None, "none"),
    ("llama-moe", "pp_tp", "stage=2,data=2,tensor=2", "circular", 2, None, "none"),
    # the explicit schedules: lanes per tick, the embedding and the head inside the scan
    ("llama", "pp_cp", CP, "1f1b", 1, "allgather", "none"),
    ("llama", "pp_cp", CP, "zb-h1", 1, "ulysses", "none"),
    ("llama", "pp_cp", CP, "interleaved", 2, "allgather", "none"),
    ("llama", "pp_tp_sp", TP_SP, "1f1b", 1, None, "none"),
    ("llama", "pp_tp_sp", TP_SP, "interleaved", 2, None, "none"),
]


@pytest.mark.parametrize(
    ("family", "strategy", "mesh", "schedule", "repeats", "method", "remat"), CASES
)
def test_closed_form_traffic_matches_the_compiled_pipeline(
    family, strategy, mesh, schedule, repeats, method, remat
):
    """Per (kind, mesh axes), within 2% of the step's bytes; and each split's own collectives
    are there, so a zero on both sides cannot pass for a match."""
    if strategy == "pp_cp" and repeats > 1 and NEWER_PARTITIONER:
        pytest.skip("measured on jax 0.10.2's partitioner: jax 0.12 compiles pp_cp's chunked "
                    "schedules with other collectives (README, Tested with)")  # fmt: skip
    got = compiled(family, strategy, mesh, schedule, repeats, method, remat)
    want = predicted(family, strategy, mesh, schedule, repeats, method, remat)
    total = sum(got.values())
    for key in set(got) | set(want):
        assert abs(got[key] - want[key]) <= 0.02 * total, (key, got[key], want[key])
    own = {"pp_cp": "context", "pp_tp_sp": "tensor", "pp_ep": "expert"}.get(strategy, "stage")
    assert any(own in axes and n > 0.05 * total for (_, axes), n in want.items())


def test_kernels_run_once_per_tick():
    """Bubble ticks compute on zeros: attention's bytes over context scale with the ticks
    (m + p - 1 for gpipe, m r + p - 1 for circular), not with the micro-batches."""
    gpipe = predicted("llama", "pp_cp", CP, "gpipe", 1, "ring")[("collective-permute",
                                                                 ("context",))]  # fmt: skip
    circular = predicted("llama", "pp_cp", CP, "circular", 2, "ring")[("collective-permute",
                                                                       ("context",))]  # fmt: skip
    # gpipe: 5 ticks of 2 layers; circular: 9 ticks of 1 layer (one chunk of 4 / (2 x 2))
    assert gpipe * 9 == circular * 10
    assert gpipe == compiled("llama", "pp_cp", CP, "gpipe", 1, "ring")[("collective-permute",
                                                                        ("context",))]  # fmt: skip


def test_stage_weights_are_reduced_over_data_and_context_at_once():
    want = predicted("llama", "pp_cp", CP, "gpipe", 1, "ring")
    got = compiled("llama", "pp_cp", CP, "gpipe", 1, "ring")
    assert want[("all-reduce", ("data", "context"))] == got[("all-reduce", ("data", "context"))]
    assert want[("all-reduce", ("data", "context"))] > 0


@pytest.mark.parametrize(
    ("strategy", "mesh", "schedule", "remat"),
    [
        ("pp_ep", EP, "1f1b", "none"),
        ("pp_cp", CP, "zb-h1", "full"),
        ("pp_tp_sp", TP_SP, "interleaved", "full"),
    ],
)
def test_explicit_schedules_with_experts_or_remat_are_refused(strategy, mesh, schedule, remat):
    repeats = 2 if schedule == "interleaved" else 1
    with pytest.raises(CostModelError, match=rf"schedule '{schedule}' with strategy "
                       rf"'{strategy}'.*remat '{remat}'.*not modelled in closed form.*spmdkit "
                       rf"compare --strategies {strategy} --schedule {schedule}"):  # fmt: skip
        predict(models.llama, "tiny", strategy, MeshSpec.parse(mesh).sizes, BATCH, SEQ,
                pipeline=(schedule, MICRO, repeats), remat=remat)  # fmt: skip


def test_experts_over_fsdp_in_a_pipeline_are_refused():
    moe = models.get_family("llama-moe")
    with pytest.raises(CostModelError, match=r"strategy 'pp_fsdp' on mesh stage=2,fsdp=4 .*4 "
                       r"experts.*not modelled in closed form.*spmdkit compare --strategies "
                       r"pp_fsdp --schedule gpipe"):  # fmt: skip
        predict(moe, "tiny", "pp_fsdp", {"stage": 2, "fsdp": 4}, BATCH, SEQ,
                pipeline=("gpipe", MICRO))  # fmt: skip
