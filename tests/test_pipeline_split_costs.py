"""Closed-form traffic of pipelines combined with the sequence and expert splits.

pp_cp (every attention method), pp_tp_sp, pp_ep and llama-moe under pp and pp_tp, with gpipe
and circular; every explicit schedule (1f1b, zb-h1, interleaved) with the sequence splits,
tensor, fsdp and remat: per (collective kind, mesh axes), the cost model's bytes equal the
compiled step's within 2% of its total. Under gpipe and circular the kernels' collectives run
once per tick (bubble ticks included); under the explicit schedules once per run of the lane
holding them, as `work_from_report` prices the compiled program (a static count charges every
tick). The stage weights' gradients are summed over the batch axes and context at once, and
what is not modelled (an explicit schedule with experts) is refused before anything is computed.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import pytest
from jax_versions import NEWER_PARTITIONER, REGROUP

import models
from sharding import MeshSpec, Workload, build_program
from sharding.costmodel import CostModelError, lane_runs, predict, work_from_report
from sharding.pipeline import Kind, make_schedule

BATCH, SEQ, MICRO = 16, 32, 4
CP, TP_SP, EP = "stage=2,data=2,context=2", "stage=2,data=2,tensor=2", "stage=2,expert=2,data=2"


@cache
def compiled(family: str, strategy: str, mesh: str, schedule: str, repeats: int, method,
             remat: str = "none"):  # fmt: skip
    fam = models.get_family(family)
    prog = build_program(Workload.from_family(fam, fam.config("tiny")), strategy, mesh,
                         batch=BATCH, seq=SEQ, schedule=schedule, microbatches=MICRO,
                         repeats=repeats if repeats > 1 else None,
                         context_method=method, remat=remat)  # fmt: skip
    # What runs: the lanes' collectives as often as their lanes run (the compiled count charges
    # every tick; gpipe and circular run every tick, so theirs is what runs).
    work = work_from_report(prog.report(), tokens=BATCH * SEQ, schedule=prog.schedule,
                            hlo_text=prog.compiled.as_text())  # fmt: skip
    got = defaultdict(int)
    for c in work.collectives:
        got[(c.kind.replace("reduce-scatter", "all-reduce"), c.axes)] += c.bytes
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
    # remat, tensor without SP and fsdp inside the lanes (tensor: lanes in lock-step)
    ("llama", "pp_cp", CP, "zb-h1", 1, "ring", "full"),
    ("llama", "pp_tp_sp", TP_SP, "1f1b", 1, None, "dots"),
    ("llama", "pp_tp_sp", TP_SP, "zb-h1", 1, None, "full"),
    ("llama", "pp_tp", TP_SP, "interleaved", 2, None, "full"),
    ("llama", "fsdp+tp+pp", "stage=2,fsdp=2,tensor=2", "1f1b", 1, None, "full"),
    ("llama", "pp_fsdp", "stage=2,fsdp=4", "interleaved", 2, None, "none"),
]


@pytest.mark.parametrize(
    ("family", "strategy", "mesh", "schedule", "repeats", "method", "remat"), CASES
)
def test_closed_form_traffic_matches_the_compiled_pipeline(
    family, strategy, mesh, schedule, repeats, method, remat
):
    """Per (kind, mesh axes), within 2% of the step's bytes; and each split's own collectives
    are there, so a zero on both sides cannot pass for a match."""
    if repeats > 1 and NEWER_PARTITIONER and (strategy == "pp_cp" or schedule == "interleaved"):
        pytest.skip(REGROUP)
    got = compiled(family, strategy, mesh, schedule, repeats, method, remat)
    want = predicted(family, strategy, mesh, schedule, repeats, method, remat)
    total = sum(got.values())
    for key in set(got) | set(want):
        assert abs(got[key] - want[key]) <= 0.02 * total, (key, got[key], want[key])
    own = {"pp_cp": "context", "pp_tp_sp": "tensor", "pp_ep": "expert", "fsdp+tp+pp": "fsdp"}.get(
        strategy, "stage"
    )
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


def test_explicit_schedules_with_experts_are_refused():
    with pytest.raises(CostModelError, match=r"schedule '1f1b' with strategy 'pp_ep'.*expert "
                       r"split inside its stages is not modelled in closed form.*spmdkit "
                       r"compare --strategies pp_ep --schedule 1f1b"):  # fmt: skip
        predict(models.llama, "tiny", "pp_ep", MeshSpec.parse(EP).sizes, BATCH, SEQ,
                pipeline=("1f1b", MICRO, 1))  # fmt: skip


def test_lanes_in_lock_step_run_on_every_tick_some_stage_works():
    """1f1b, p = 2, m = 4: six ticks, five with a forward somewhere. With tensor the lanes run
    in lock-step, so a lane's reductions run five times; without, m = 4 times."""
    one = make_schedule(2, MICRO, "1f1b")
    assert one.ticks == 6
    assert lane_runs(one, Kind.FORWARD, True) == 5 and lane_runs(one, Kind.FORWARD, False) == 4


def test_experts_over_fsdp_in_a_pipeline_are_refused():
    moe = models.get_family("llama-moe")
    with pytest.raises(CostModelError, match=r"strategy 'pp_fsdp' on mesh stage=2,fsdp=4 .*4 "
                       r"experts.*not modelled in closed form.*spmdkit compare --strategies "
                       r"pp_fsdp --schedule gpipe"):  # fmt: skip
        predict(moe, "tiny", "pp_fsdp", {"stage": 2, "fsdp": 4}, BATCH, SEQ,
                pipeline=("gpipe", MICRO))  # fmt: skip
