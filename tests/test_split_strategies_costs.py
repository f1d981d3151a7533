"""Context and expert parallelism in compare, plan and the cost model (issue 16).

compare and plan offer the sequence splits to a model whose attention runs through the kernel seam
once the sequence is long, and the expert splits to a model whose rules place experts; the
closed-form traffic of cp (every method) and ep equals the compiled programs'; plan answers a 128k
sequence and a Mixtral-sized model on 64 devices from closed forms.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import pytest

import models
from sharding import MeshSpec, Workload, build_program
from sharding.costmodel import (
    DEFAULT,
    EXPERT_STRATEGIES,
    SEQUENCE_STRATEGIES,
    called_for,
    layouts,
    predict,
)
from sharding.planning import plan

BATCH, SEQ = 16, 32


def work(family: str, **overrides) -> Workload:
    fam = models.get_family(family)
    return Workload.from_family(fam, fam.config("tiny", **overrides))


def test_long_sequences_and_experts_call_for_their_strategies():
    llama, moe = work("llama"), work("llama-moe")
    assert called_for(llama, 128) == ()
    assert called_for(llama, 2048) == SEQUENCE_STRATEGIES
    assert called_for(moe, 128) == EXPERT_STRATEGIES
    assert called_for(work("cnn"), None) == ()  # no sequence, no experts
    # compare's candidates (`spmdkit compare --seq 2048`): every default strategy, then these
    found = {x.strategy: x.mesh for x in layouts(8, 4, extra=called_for(llama, 2048))
             if not x.fallback}  # fmt: skip
    assert set(DEFAULT) <= set(found) and found["cp"] == "context=8"
    assert found["fsdp_cp"] == "fsdp=2,context=4"
    eps = [x for x in layouts(8, 4, extra=called_for(moe, 128)) if x.strategy == "ep"]
    assert [x.mesh for x in eps] == ["expert=8", "data=2,expert=4", "data=4,expert=2"]
    assert [x.fallback for x in eps] == [False, True, True]  # tried in turn until one places


@cache
def compiled(family: str, strategy: str, mesh: str, method: str | None):
    prog = build_program(work(family), strategy, mesh, batch=BATCH, seq=SEQ,
                         context_method=method)  # fmt: skip
    got = defaultdict(int)
    for op in prog.report().collectives:
        got[(op.kind.replace("reduce-scatter", "all-reduce"), op.axes)] += (
            op.bytes * op.multiplicity
        )
    return got


CASES = [
    ("llama", "cp", "data=2,context=4", "ring"),
    ("llama", "cp", "data=2,context=4", "allgather"),
    ("llama", "cp", "data=2,context=4", "ulysses"),
    ("llama-moe", "ep", "expert=4,data=2", None),
    ("llama-moe", "dp", "data=8", None),
    # fsdp beside a batch axis that is not data: the token table gathered for the lookup, the
    # matrices' gradients scattered over fsdp before the rest, the experts gathered once
    ("llama", "fsdp_cp", "fsdp=2,context=4", "ring"),
    ("llama", "fsdp_cp", "fsdp=2,context=4", "allgather"),
    ("llama", "fsdp_cp", "fsdp=2,context=4", "ulysses"),
    ("llama", "fsdp_cp", "data=2,fsdp=2,context=2", "ring"),
    ("llama-moe", "fsdp_ep", "fsdp=2,expert=4", None),
    ("llama-moe", "fsdp_ep", "data=2,fsdp=2,expert=2", None),
    # Megatron SP alone, with fsdp, with context (its gathers move S/c of the sequence)
    ("llama", "tp_sp", "data=2,tensor=4", None),
    ("llama", "fsdp_tp_sp", "data=2,fsdp=2,tensor=2", None),
    ("llama", "cp_tp_sp", "data=2,context=2,tensor=2", "ring"),
    # experts' hidden width over tensor: their buffers' cotangents summed over it in backward
    ("llama-moe", "ep_tp", "expert=2,tensor=2,data=2", None),
]


@pytest.mark.parametrize(("family", "strategy", "mesh", "method"), CASES)
def test_closed_form_traffic_matches_the_compiled_program(family, strategy, mesh, method):
    """Per (kind, mesh axes), within 2% of the step's bytes: the kernels' collectives, the
    gradients summed over the sequence shards (a second reduction, over context), an expert's
    gradients reduced over data only (its own expert holds it) and, under fsdp_cp and fsdp_ep,
    the token table gathered whole over fsdp, a matrix's gradient reduce-scattered over fsdp
    and then summed over the other batch axes, a vector's summed whole over all of them."""
    got = compiled(family, strategy, mesh, method)
    fam = models.get_family(family)
    pred = predict(fam, fam.config("tiny"), strategy, MeshSpec.parse(mesh).sizes, BATCH, SEQ,
                   context_method=method or "ring")  # fmt: skip
    want = defaultdict(int)
    for x in pred.traffic:
        want[(x.kind.replace("reduce-scatter", "all-reduce"), x.axes)] += x.bytes
    total = sum(got.values())
    for key in set(got) | set(want):
        assert abs(got[key] - want[key]) <= 0.02 * total, (key, got[key], want[key])


def test_plan_answers_a_128k_sequence_on_64_devices():
    """With flash attention nothing is S x S, but a 128k-token sequence's activations still fit
    only where each device holds a slice of them: the sequence split over context, or every
    layer's matmuls split 8 ways over tensor; the sequence split is the fastest."""
    result = plan(models.llama, size="8b-128k", target="h100:8x8", seq=131072, batch=8, aot=0)
    best = result.ranked[0]
    assert best.fits and best.layout.sizes["context"] > 1
    assert best.layout.strategy in ("cp", "fsdp_cp")
    assert all(x.layout.sizes["context"] > 1 or x.layout.sizes["tensor"] == 8
               for x in result.ranked if x.fits)  # fmt: skip


def test_plan_answers_a_mixtral_sized_model_on_64_devices():
    result = plan(models.get_family("llama-moe"), size="mixtral-8x7b", target="h100:8x8", aot=0)
    assert result.ranked[0].fits
    assert {x.layout.strategy for x in result.ranked} & set(EXPERT_STRATEGIES)
    # Its stack carries (h, aux): it pipelines under gpipe and circular only.
    assert {x.layout.schedule for x in result.ranked} - {None} <= {"gpipe", "circular"}
