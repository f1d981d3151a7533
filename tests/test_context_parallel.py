"""Context parallelism (`sharding.context`): each attention kernel against single-device
attention, each method's training step against the single-device step, the bytes each moves over
``context`` against its closed form, and the refusals.

Tiny sizes (llama tiny with 2 layers, batch 8, seq 32); every compiled program is built once
per module (cached) and shared by the tests that read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from closeness import assert_close

import models
from models.layers import causal_attention
from sharding import StrategyMeshError, Workload, build_program, make_mesh
from sharding.context import (
    ContextParallelError,
    allgather_attention,
    context_traffic,
    from_zigzag,
    ring_attention,
    to_zigzag,
    ulysses_attention,
    zigzag_positions,
)

BATCH, SEQ, LAYERS = 8, 32, 2
B, S, N, K, H = 4, 32, 8, 4, 8  # the kernels alone: grouped-query, 2 query heads per kv head


def full_attention(q, k, v):
    """Non-causal softmax attention, grouped-query (the reference of ring's causal=False)."""
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bsnh,btnh->bnst", q, k) * q.shape[-1] ** -0.5
    return jnp.einsum("bnst,btnh->bsnh", jax.nn.softmax(s, axis=-1), v)


# name -> (factory, zigzag layout in and out, single-device reference)
# Each runs the model's online softmax on its blocks (`models.attention.ONLINE_SOFTMAX`, the one
# `blockwise_attention` is built from).
CORE = models.attention.ONLINE_SOFTMAX
KERNELS = {
    "allgather": (lambda m: allgather_attention(m, CORE), True, causal_attention),
    "ring": (lambda m: ring_attention(m, CORE), True, causal_attention),
    "ring-noncausal": (lambda m: ring_attention(m, CORE, causal=False), False, full_attention),
    "ulysses": (lambda m: ulysses_attention(m, CORE), False, causal_attention),
}
KERNEL_MESHES = ("data=2,context=4", "data=2,context=2,tensor=2")


def inputs():
    kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, S, N, H))
    k, v = (jax.random.normal(key, (B, S, K, H)) for key in (kk, kv))
    return q, k, v, jax.random.normal(kw, (B, S, N, H))


def values_and_grads(attend, q, k, v, w):
    """The output and d(sum(out * w))/d(q, k, v), in one program."""
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(w)


@cache
def kernel_run(name: str, mesh_spec: str):
    factory, zigzag, _ = KERNELS[name]
    mesh = make_mesh(mesh_spec)
    c, attend = dict(mesh.shape)["context"], factory(mesh)

    def kernel(q, k, v):
        if not zigzag:
            return attend(q, k, v)
        return from_zigzag(attend(*(to_zigzag(x, c) for x in (q, k, v))), c)

    return jax.jit(lambda *a: values_and_grads(kernel, *a))(*inputs())


@pytest.mark.parametrize("mesh_spec", KERNEL_MESHES)
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_single_device_attention(name, mesh_spec):
    out, grads = kernel_run(name, mesh_spec)
    ref_out, ref_grads = jax.jit(lambda *a: values_and_grads(KERNELS[name][2], *a))(*inputs())
    assert_close(out, ref_out)
    assert_close(grads, ref_grads)


def test_zigzag_layout_balances_causal_work():
    order = zigzag_positions(SEQ, 4).reshape(4, -1)
    # Every device's queries see the same number of keys under the causal mask.
    assert len({int(np.sum(row + 1)) for row in order}) == 1
    x = jnp.arange(2 * SEQ).reshape(2, SEQ)
    np.testing.assert_array_equal(from_zigzag(to_zigzag(x, 4), 4), x)


def workload(family: str = "llama") -> Workload:
    fam = getattr(models, family)
    return Workload.from_family(fam, fam.config("tiny", n_layers=LAYERS))


def batch(family: str = "llama") -> dict:
    fam = getattr(models, family)
    made = fam.make_batch(fam.config("tiny", n_layers=LAYERS), BATCH, SEQ, key=jax.random.key(7))
    return {k: np.asarray(v) for k, v in made.items()}


@cache
def program(family: str, strategy: str, mesh_spec: str, method: str | None, remat="none"):
    return build_program(workload(family), strategy, mesh_spec, batch=BATCH, seq=SEQ,
                         context_method=method, remat=remat)  # fmt: skip


@cache
def one_device(family: str):
    """The reference program on one device and its seed-0 parameters (on the host)."""
    prog = build_program(workload(family), "dp", make_mesh("data=1", jax.devices()[:1]),
                         batch=BATCH, seq=SEQ)  # fmt: skip
    return prog, jax.device_get(prog.init(seed=0)["params"])


@cache
def loss_and_grads(family: str, strategy: str, mesh_spec: str, method: str | None):
    """One device's numbers (``mesh_spec="one device"``) or the program's, from the same
    parameters (the reference's, placed in the program's shardings; born-sharded init is tested
    in test_presets and test_step)."""
    ref, params = one_device(family)
    prog = ref if mesh_spec == "one device" else program(family, strategy, mesh_spec, method)
    loss, grads = prog.loss_and_grads(jax.device_put(params, prog.param_shardings), batch(family))
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


STEPS = [
    ("llama", "cp", "data=2,context=4", "ring"),
    ("llama", "cp", "data=2,context=4", "allgather"),
    ("llama", "cp", "data=2,context=4", "ulysses"),
    ("llama", "fsdp_cp", "fsdp=2,context=4", "ring"),
    ("llama", "fsdp_cp", "fsdp=2,context=4", "allgather"),
    ("llama", "fsdp_cp", "fsdp=2,context=4", "ulysses"),
    ("llama", "cp_tp_sp", "data=2,context=2,tensor=2", "allgather"),
    ("llama", "tp+cp", "context=2,tensor=2,data=2", "ulysses"),  # a composition without alias
    ("gpt2", "cp", "data=2,context=4", "ring"),
]


@pytest.mark.parametrize(("family", "strategy", "mesh_spec", "method"), STEPS,
                         ids=["-".join(c) for c in STEPS])  # fmt: skip
def test_step_matches_single_device(family, strategy, mesh_spec, method):
    loss, grads = loss_and_grads(family, strategy, mesh_spec, method)
    ref_loss, ref_grads = loss_and_grads(family, "dp", "one device", None)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)


BYTES = [
    ("cp", "data=2,context=4", "ring", "none"),
    ("cp", "data=2,context=4", "allgather", "none"),
    ("cp", "data=2,context=4", "ulysses", "none"),
    ("cp", "data=2,context=4", "ring", "full"),
    ("tp+cp", "context=2,tensor=2,data=2", "ulysses", "none"),  # heads split over tensor too
]
# The kinds only attention adds: under tp+cp XLA also moves activations over context where the
# tensor-parallel matmuls meet the split sequence, the strategy's doing, not the kernel's.
OWN_KINDS = {"ring": {"collective-permute"}, "allgather": {"reduce-scatter"},
             "ulysses": {"all-to-all"}}  # fmt: skip


@pytest.mark.parametrize(("strategy", "mesh_spec", "method", "remat"), BYTES,
                         ids=["-".join(c) for c in BYTES])  # fmt: skip
def test_context_bytes_match_the_closed_form(strategy, mesh_spec, method, remat):
    """Every collective over `context` but the gradients' all-reduce (the strategy's, not
    attention's), by kind, within 2% of `context_traffic`; under cp all of them."""
    report = program("llama", strategy, mesh_spec, method, remat).report()
    sizes = dict(make_mesh(mesh_spec).shape)
    cfg = workload().config
    want = defaultdict(int)
    for t in context_traffic(method, batch=BATCH, seq=SEQ, heads=cfg.n_heads,
                             kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, layers=LAYERS,
                             context=sizes["context"], tensor=sizes["tensor"],
                             batch_shards=sizes["data"] * sizes["fsdp"],
                             remat=remat != "none", batch_over_context=True):  # fmt: skip
        want[t.kind] += t.bytes
    got = defaultdict(int)
    own = [op for op in report.collectives if op.axes == ("context",) and op.kind != "all-reduce"
           and (strategy == "cp" or op.kind in OWN_KINDS[method])]  # fmt: skip
    for op in own:
        got[op.kind] += op.bytes * op.multiplicity
    assert set(got) == set(want), (dict(got), dict(want))
    for kind, nbytes in want.items():
        assert got[kind] == pytest.approx(nbytes, rel=0.02), kind


def test_a_model_without_the_kernel_hook_is_refused():
    work = dataclasses.replace(workload(), kernels=None)
    with pytest.raises(ContextParallelError, match=r"cannot be split over context.*kernels"):
        build_program(work, "cp", "data=2,context=4", batch=BATCH, seq=SEQ)


def test_a_hook_that_never_reaches_attention_or_positions_is_refused():
    # A hook that substitutes nothing: the loss never asks for the attention kernel.
    work = dataclasses.replace(workload(), kernels=lambda **_: contextlib.nullcontext())
    with pytest.raises(ContextParallelError, match=r"never asked for the attention kernel"):
        build_program(work, "cp", "data=2,context=4", batch=BATCH, seq=SEQ)

    # Attention through the seam, positions not: the zigzag reorder would put RoPE out of place.
    def attention_only(**kernels):
        return models.kernels.use(attention=kernels["attention"])

    work = dataclasses.replace(workload(), kernels=attention_only)
    with pytest.raises(ContextParallelError, match=r"takes its positions elsewhere.*'ulysses'"):
        build_program(work, "cp", "data=2,context=4", batch=BATCH, seq=SEQ)


def test_ulysses_needs_heads_divisible_by_context():
    # llama tiny: 8 query heads, 4 kv heads; context=8 cannot give each device a kv head.
    with pytest.raises(ContextParallelError, match=r"kv_heads=4 does not divide by 8"):
        build_program(workload(), "cp", "context=8", batch=BATCH, seq=SEQ,
                      context_method="ulysses")  # fmt: skip


def test_load_balancing_needs_seq_divisible_by_twice_context():
    with pytest.raises(ContextParallelError, match=r"seq=36 does not split into 2\*context=8"):
        build_program(workload(), "cp", "data=2,context=4", batch=BATCH, seq=36)


def test_unknown_or_pointless_methods_are_refused():
    with pytest.raises(ContextParallelError, match=r"context_method='stripes'.*'ring'"):
        build_program(workload(), "cp", "data=2,context=4", batch=BATCH, seq=SEQ,
                      context_method="stripes")  # fmt: skip
    with pytest.raises(ContextParallelError, match=r"mesh has context=1"):
        build_program(workload(), "dp", "data=8", batch=BATCH, seq=SEQ, context_method="ring")
    with pytest.raises(ContextParallelError, match=r"context=1.*context=4"):
        ring_attention(make_mesh("data=8"), CORE)


def test_a_workload_without_its_online_softmax_is_refused_context_parallelism():
    """The kernels run the model's own online softmax: one implementation, the model's."""
    import dataclasses

    bare = dataclasses.replace(workload(), attention_core=None)
    with pytest.raises(ContextParallelError, match=r"workload 'llama-tiny' gives none; pass "
                       r"attention_core=models.attention.ONLINE_SOFTMAX in its Workload"):  # fmt: skip
        build_program(bare, "cp", "data=2,context=4", batch=BATCH, seq=SEQ)


def test_a_mesh_axis_no_part_of_the_strategy_uses_is_refused():
    # pp places no "sequence": context=4 would split nothing (cp+pp does, test_pipeline_splits).
    with pytest.raises(StrategyMeshError, match=r"strategy 'pp' \(pp\) splits nothing over mesh "
                       r"axis context=4.*the part cp would.*use --strategy cp\+pp, or drop context"):  # fmt: skip
        build_program(workload(), "pp", "stage=2,context=4", batch=BATCH, seq=SEQ)


def test_docstring_examples_of_the_public_names(doctests):
    import sharding

    assert doctests(sharding.context) >= 2  # zigzag_positions, context_traffic
