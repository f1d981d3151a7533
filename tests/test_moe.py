"""Mixture of experts: the layer against loop references, llama-moe trained under every
non-pipelined strategy (expert parallelism included) and pipelined (gpipe, circular) against one
device, EP's all-to-all bytes against their closed form, and the refusals."""

from __future__ import annotations

import math
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from closeness import assert_close
from flax import nnx

from models import ModelConfigError, llama_moe, moe
from models.layers import make_stacked
from partition_rules import STRATEGIES as STRATEGY_MAPS
from partition_rules import Rules
from sharding import (
    IndivisibleDimensionError,
    StackCarryError,
    StepConfigError,
    StrategyMeshError,
    Workload,
    build_program,
    compile_train_step,
    make_mesh,
)
from sharding.experts import ExpertParallelError, ep_all_to_all_bytes, expert_parallel
from sharding.pipeline import PipelineSpec

B, S = 8, 16
# E=4, k=2: capacity_factor 2 gives C = S, so nothing can drop; 1.0 drops (checked below).
NO_DROPS, DROPS = 2.0, 1.0
STRATEGIES = {
    "dp": "data=8",
    "fsdp": "fsdp=8",
    "ep": "expert=4,data=2",
    "fsdp_ep": "fsdp=2,expert=4",
    "ep_tp": "expert=2,tensor=2,data=2",
}


def work(capacity_factor: float | None, **overrides) -> Workload:
    return Workload.from_family(
        llama_moe, llama_moe.config("tiny", capacity_factor=capacity_factor, **overrides)
    )


def batch():
    return llama_moe.make_batch(llama_moe.config("tiny"), B, S, key=jax.random.key(7))


@cache
def program(capacity_factor, strategy: str, mesh: str):
    devices = jax.devices()[:1] if mesh == "data=1" else None
    return build_program(work(capacity_factor), strategy, mesh, batch=B, seq=S, devices=devices)


@cache
def seed0_params():
    """The one-device program's seed-0 parameters, on the host (the capacity factor changes no
    parameter). Programs compared with one device start from these, placed in their own
    shardings; `test_training_step_equals_one_device` also checks born-sharded init."""
    return jax.device_get(program(NO_DROPS, "dp", "data=1").init(0)["params"])


@cache
def loss_and_grads(capacity_factor, strategy: str, mesh: str, born: bool = False):
    prog = program(capacity_factor, strategy, mesh)
    if born:
        params = prog.init(0)["params"]
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(seed0_params()), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
    else:
        params = jax.device_put(seed0_params(), prog.param_shardings)
    loss, grads = prog.loss_and_grads(params, batch())
    return float(loss), jax.tree.map(np.asarray, grads)


def assert_same(got, want):
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert_close(got[1], want[1])


# --- the layer, on one device ------------------------------------------------------------------


def loop_route(logits, k, cap):
    """Top-k, renormalised weights, choice-major queue slots and the kept mask, by hand."""
    b, s, e = logits.shape
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expert = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(probs, expert, -1)
    weight = top / top.sum(-1, keepdims=True)
    slot = np.zeros((b, s, k), int)
    for i in range(b):
        used = np.zeros(e, int)
        for j in range(k):  # every first choice queues before any second choice
            for t in range(s):
                slot[i, t, j] = used[expert[i, t, j]]
                used[expert[i, t, j]] += 1
    counts = np.bincount(expert.reshape(-1), minlength=e)
    aux = e * np.sum(counts / expert.size * probs.mean((0, 1)))
    return expert, weight, slot, slot < cap, aux


def test_routing_capacity_and_aux_loss_match_a_loop():
    logits = np.asarray(jax.random.normal(jax.random.key(0), (3, 12, 4)), np.float64) * 2
    cap = moe.capacity(12, 4, 2, 1.0)
    assert cap == math.ceil(2 * 12 / 4 * 1.0) == 6
    r = moe.route(jnp.asarray(logits, jnp.float32), 2)
    expert, weight, slot, kept, aux = loop_route(logits, 2, cap)
    np.testing.assert_array_equal(r.expert_BSK, expert)
    np.testing.assert_array_equal(r.slot_BSK, slot)
    np.testing.assert_allclose(r.weight_BSK, weight, rtol=1e-5)
    assert float(moe.aux_loss(r)) == pytest.approx(aux, rel=1e-5)
    stats = moe.routing_stats(r.expert_BSK, r.slot_BSK, 4, cap)
    assert stats["tokens_per_expert"] == np.bincount(expert.reshape(-1), minlength=4).tolist()
    assert stats["kept_per_expert"] == np.bincount(expert[kept], minlength=4).tolist()
    assert stats["dropped_fraction"] == pytest.approx(1 - kept.mean())
    assert 0 < stats["dropped_fraction"] < 1  # this draw overflows some expert
    # Uniform routing is the loss's minimum, 1.0; all tokens on one expert give E.
    assert float(moe.aux_loss(moe.route(jnp.zeros((1, 8, 4)), 2))) == pytest.approx(1.0)


def layer_and_input(capacity_factor):
    layer = moe.MoE(32, 16, n_experts=4, top_k=2, capacity_factor=capacity_factor, std=0.2,
                    out_std=0.2, rngs=nnx.Rngs(3))  # fmt: skip
    return layer, jax.random.normal(jax.random.key(4), (2, 12, 32))


def test_experts_match_a_loop_over_tokens_with_drops():
    layer, x = layer_and_input(1.0)
    y, _ = layer(x)
    logits = np.asarray(layer.router(x), np.float64)
    expert, weight, _, kept, _ = loop_route(logits, 2, layer.capacity(12))
    assert not kept.all()
    gate, up, down = (np.asarray(p[...], np.float64) for p in (layer.gate, layer.up, layer.down))
    xs = np.asarray(x, np.float64)
    want = np.zeros_like(xs)
    for i, t, j in zip(*np.nonzero(kept), strict=True):
        e, v = expert[i, t, j], xs[i, t]
        g = v @ gate[e]
        want[i, t] += weight[i, t, j] * ((g / (1 + np.exp(-g)) * (v @ up[e])) @ down[e])
    assert_close(y, want)  # float32 against float64


def test_dropless_ragged_dot_equals_capacity_path_without_drops():
    layer, x = layer_and_input(None)
    r = layer.routing(x)
    w = (layer.gate[...], layer.up[...], layer.down[...])

    def run(kernel, cap):
        def f(x, *w):
            return jnp.sum(jnp.sin(kernel(x, r.expert_BSK, r.slot_BSK, r.weight_BSK, *w, cap)))

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x, *w)

    (v1, g1), (v2, g2) = run(moe.experts_dropless, None), run(moe.experts_local, 12)
    assert float(v1) == pytest.approx(float(v2), rel=1e-5)
    assert_close(g1, g2)
    assert layer(x)[0].shape == x.shape  # capacity_factor=None runs the dropless kernel


# --- llama-moe under every non-pipelined strategy -------------------------------------------


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_training_step_equals_one_device(strategy):
    """Born-sharded init, then loss and every gradient, capacity large enough that nothing
    drops."""
    assert_same(
        loss_and_grads(NO_DROPS, strategy, STRATEGIES[strategy], born=True),
        loss_and_grads(NO_DROPS, "dp", "data=1"),
    )


@pytest.mark.parametrize("capacity_factor", [DROPS, None], ids=["drops", "dropless"])
def test_expert_parallel_equals_one_device_with_drops_and_dropless(capacity_factor):
    """Capacity is per sequence, so EP drops exactly the single-device tokens; dropless under EP
    runs C = S slots, the ragged_dot numbers."""
    cfg = llama_moe.config("tiny", capacity_factor=capacity_factor)
    report = llama_moe.routing_report(llama_moe.Model(cfg, rngs=nnx.Rngs(0)), batch()["inputs"])
    dropped = [layer["dropped_fraction"] for layer in report]
    assert (max(dropped) > 0) == (capacity_factor is not None)
    assert_same(
        loss_and_grads(capacity_factor, "ep", STRATEGIES["ep"]),
        loss_and_grads(capacity_factor, "dp", "data=1"),
    )


def test_bfloat16_with_remat_trains_under_ep_tp():
    """bfloat16 compute, each layer rematerialised (the stack's (h, aux) carry through the remat
    wrapper), experts split over expert and their width over tensor: the loss stays within
    bfloat16 rounding of the float32 one and falls."""
    prog = build_program(work(NO_DROPS), "ep_tp", STRATEGIES["ep_tp"], batch=B, seq=S,
                         compute_dtype="bfloat16", remat="full")  # fmt: skip
    state, losses = prog.init(0), []
    for _ in range(3):
        state, metrics = prog.step(state, batch())
        losses.append(float(metrics["loss"]))
    assert losses[0] == pytest.approx(loss_and_grads(NO_DROPS, "dp", "data=1")[0], rel=2e-2)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("strategy", ["ep", "ep_tp"])
def test_all_to_all_bytes_match_the_closed_form(strategy):
    sizes = dict(make_mesh(STRATEGIES[strategy]).shape)
    cfg = llama_moe.config("tiny", capacity_factor=NO_DROPS)
    ops = [op for op in program(NO_DROPS, strategy, STRATEGIES[strategy]).report().collectives
           if op.kind == "all-to-all"]  # fmt: skip
    assert {op.axes for op in ops} == {("expert",)}
    assert sum(op.multiplicity for op in ops) == 4 * cfg.n_layers  # 2 forward, 2 backward
    measured = sum(op.bytes * op.multiplicity for op in ops)
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    want = ep_all_to_all_bytes(B * S, cfg.d_model, cfg.n_experts, cfg.top_k, NO_DROPS,
                               sizes["expert"], 4, cfg.n_layers, seq_len=S, batch_shards=shards)  # fmt: skip
    assert measured == pytest.approx(want, rel=0.02)


def test_routing_report_counts_every_assignment():
    cfg = llama_moe.config("tiny", capacity_factor=DROPS)
    report = llama_moe.routing_report(llama_moe.Model(cfg, rngs=nnx.Rngs(0)), batch()["inputs"])
    assert [r["layer"] for r in report] == list(range(cfg.n_layers))
    for r in report:
        assert sum(r["tokens_per_expert"]) == B * S * cfg.top_k
        assert all(k <= min(t, B * r["capacity"])
                   for k, t in zip(r["kept_per_expert"], r["tokens_per_expert"], strict=True))  # fmt: skip
        kept = sum(r["kept_per_expert"]) / (B * S * cfg.top_k)
        assert r["dropped_fraction"] == pytest.approx(1 - kept)


# --- refusals ---------------------------------------------------------------------------------


def test_bad_routing_configs_are_refused():
    with pytest.raises(ModelConfigError, match=r"top_k=5 with n_experts=4;.*1 <= top_k <= 4"):
        llama_moe.config("tiny", top_k=5)
    with pytest.raises(ModelConfigError, match=r"capacity_factor=0.0; use a number > 0"):
        llama_moe.config("tiny", capacity_factor=0.0)
    with pytest.raises(ModelConfigError, match=r"aux_loss_coef=-1; use a number >= 0"):
        llama_moe.config("tiny", aux_loss_coef=-1)


def test_experts_the_expert_axis_does_not_divide_are_refused():
    # Under an ep strategy the placement refuses first: the experts' dimension over expert=4.
    with pytest.raises(IndivisibleDimensionError, match=r"layers/moe/down.*expert"):
        build_program(work(NO_DROPS, n_experts=6, top_k=2), "ep", "expert=4,data=2", batch=B,
                      seq=S)  # fmt: skip
    # Weights whole (dp) on an expert mesh: no part of dp uses expert.
    with pytest.raises(StrategyMeshError, match=r"strategy 'dp' \(dp\) splits nothing over mesh "
                                                r"axis expert=4.*use --strategy ep"):  # fmt: skip
        build_program(work(NO_DROPS, n_experts=6, top_k=2), "dp", "expert=4,data=2", batch=B,
                      seq=S)  # fmt: skip
    ids, weights = jnp.zeros((6, 4, 2), jnp.int32), jnp.zeros((4, 8, 8))
    with pytest.raises(ExpertParallelError, match=r"batch 6 does not split into 8 shards"):
        expert_parallel(make_mesh("expert=4,data=2"))(
            jnp.zeros((6, 4, 8)), ids, ids, jnp.zeros((6, 4, 2)), weights, weights, weights, 4
        )


# --- llama-moe in pipelines -------------------------------------------------------------------

# (strategy, mesh, schedule): the experts whole in each stage; the balancing loss crosses stages.
PIPELINES = [("pp", "stage=2,data=4", "gpipe", NO_DROPS),
             ("pp_tp", "stage=2,data=2,tensor=2", "circular", NO_DROPS),
             ("pp_fsdp", "stage=2,fsdp=4", "gpipe", NO_DROPS),
             ("pp_ep", "stage=2,expert=2,data=2", "gpipe", NO_DROPS),
             ("pp_ep", "stage=2,expert=4", "circular", NO_DROPS),
             # Compositions: tensor inside the stages beside the experts' split.
             ("ep+tp+pp", "stage=2,expert=2,tensor=2", "gpipe", NO_DROPS),
             ("ep+tp+pp", "stage=2,expert=2,tensor=2", "circular", NO_DROPS),
             # Drops: capacity counts every expert, not the device's own, inside the stages.
             ("pp_ep", "stage=2,expert=2,data=2", "gpipe", DROPS)]  # fmt: skip
MICRO = 2


def grouped_reference(params, data: int, capacity_factor: float = NO_DROPS):
    """One device: the cross-entropy of the whole batch plus the balancing loss averaged over the
    pipeline's groups of rows, each micro-batch (rows k::m) on each data shard, as a pipeline
    computes it (like gradient accumulation: a batch statistic is per micro-batch)."""
    cfg, inputs = llama_moe.config("tiny", capacity_factor=capacity_factor), batch()["inputs"]
    graphdef = nnx.split(llama_moe.Model(cfg, rngs=nnx.Rngs(0)), nnx.Param)[0]

    def loss(p):
        model = nnx.merge(graphdef, p)
        logits, _ = model.forward(inputs)
        rows, b = np.arange(B), B // MICRO
        groups = np.stack([rows[k::MICRO][d * b // data : (d + 1) * b // data]
                           for k in range(MICRO) for d in range(data)])  # fmt: skip
        # One forward per group, as a batch of groups (one compiled forward, not one per group).
        aux = jnp.mean(jax.vmap(lambda x: model.forward(x)[1])(inputs[groups]))
        return llama_moe.loss_from_logits(logits, batch()) + cfg.aux_loss_coef * aux

    key = (data, capacity_factor)  # every program starts from the same (seed 0) parameters
    if key not in _REFERENCES:
        one = jax.device_put(jax.device_get(params), jax.devices()[0])
        value, grads = jax.jit(jax.value_and_grad(loss))(one)
        _REFERENCES[key] = float(value), jax.tree.map(np.asarray, grads)
    return _REFERENCES[key]


_REFERENCES: dict = {}


@pytest.mark.parametrize(("strategy", "mesh", "schedule", "capacity_factor"), PIPELINES,
                         ids=[f"{p[0]}-{p[2]}-cf{p[3]}" for p in PIPELINES])  # fmt: skip
def test_pipelines_carry_the_load_balancing_loss(strategy, mesh, schedule, capacity_factor):
    """gpipe and circular carry ``(h, aux)``: each stage adds its layers' terms per micro-batch,
    and the step equals one device computing the loss over the same groups of rows."""
    prog = build_program(work(capacity_factor), strategy, mesh, batch=B, seq=S,
                         schedule=schedule, microbatches=MICRO)  # fmt: skip
    params = jax.device_put(seed0_params(), prog.param_shardings)
    loss, grads = prog.loss_and_grads(params, batch())
    # The batch shards the stages are manual over: data, fsdp and expert.
    sizes = dict(make_mesh(mesh).shape)
    got = (float(loss), jax.tree.map(np.asarray, grads))
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    assert_same(got, grouped_reference(params, shards, capacity_factor))


def test_expert_parallel_stages_send_tokens_to_their_experts():
    """pp_ep: each stage's experts split over expert (a quarter of them per device), tokens
    moved by all-to-alls over expert inside the stages, exactly the kernel's bytes per tick."""
    prog = build_program(work(NO_DROPS), "pp_ep", "stage=2,expert=4", batch=B, seq=S,
                         schedule="gpipe", microbatches=MICRO)  # fmt: skip
    gate = prog.param_shardings["layers"]["moe"]["gate"]
    gate = gate.get_value() if hasattr(gate, "get_value") else gate
    assert tuple(gate.spec)[:2] == ("stage", "expert")
    cfg = llama_moe.config("tiny", capacity_factor=NO_DROPS)
    got = sum(op.bytes * op.multiplicity for op in prog.report().collectives
              if op.kind == "all-to-all" and op.axes == ("expert",))  # fmt: skip
    # gpipe runs each stage's layers on one micro-batch per tick, m + p - 1 ticks.
    ticks, per_stage = MICRO + 1, cfg.n_layers // 2
    one = ep_all_to_all_bytes(B // MICRO * S, cfg.d_model, cfg.n_experts, cfg.top_k, NO_DROPS,
                              4, 4, per_stage, seq_len=S, batch_shards=4)  # fmt: skip
    assert got == one * ticks


def test_what_pipelines_cannot_run_of_a_mixture_of_experts_is_refused():
    with pytest.raises(StackCarryError, match=r"carries side values.*1f1b runs what follows the "
                                              r"stack per micro-batch.*gpipe or circular"):  # fmt: skip
        build_program(work(NO_DROPS), "pp", "stage=2,data=4", batch=B, seq=S, schedule="1f1b",
                      microbatches=MICRO)  # fmt: skip
    with pytest.raises(StrategyMeshError, match=r"'pp' \(pp\) splits nothing over mesh axis "
                                                r"expert=4.*use --strategy ep\+pp"):  # fmt: skip
        build_program(work(NO_DROPS), "pp", "stage=2,expert=4", batch=B, seq=S)
    with pytest.raises(StepConfigError, match=r"expert=2 and fsdp=2: expert parallelism inside "
                                              r"a pipeline's stages runs with data, tensor or "
                                              r"context beside it, not fsdp"):  # fmt: skip
        build_program(work(NO_DROPS), "fsdp+ep+pp", "stage=2,expert=2,fsdp=2", batch=B, seq=S)


class Damped(nnx.Module):
    """A user's layer whose side value is not a sum of per-layer terms (it halves it)."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(0.1 * jax.random.normal(rngs.params(), (8, 8)))

    def __call__(self, carry):
        h, side = carry
        return h + jnp.tanh(h @ self.w[...]), 0.5 * side + jnp.mean(h**2)


class DampedNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = make_stacked(Damped, 4, rngs)

    def __call__(self, x):
        return self.blocks((x, jnp.zeros((), jnp.float32)))


def test_side_values_a_layer_does_not_add_to_are_refused():
    """Stages sum their terms apart: a side value each layer rescales would come out wrong."""

    def loss(model, batch):
        h, side = model(batch["x"])
        return jnp.mean(h**2) + side

    with pytest.raises(StackCarryError, match=r"side values that its layers do not simply add"):
        compile_train_step(DampedNet, loss, optax.sgd(0.1), Rules([(r"blocks/w", ("layers", None,
                           None))]), STRATEGY_MAPS["pp"], make_mesh("stage=2,data=4"),
                           {"x": jax.ShapeDtypeStruct((B, 4, 8), jnp.float32)},
                           pipeline=PipelineSpec("gpipe", MICRO), stack="blocks")  # fmt: skip


@pytest.mark.parametrize(("schedule", "method"), [("gpipe", "allgather"), ("circular", "ring")])
def test_experts_beside_context_inside_stages_equal_one_device(schedule, method):
    """ep+cp+pp: each stage's experts over expert and its sequence over context. Without the
    balancing loss (a statistic of each device's own tokens, which here are a slice of the
    sequence) and with nothing dropped, the step is one device's exactly."""
    plain = work(NO_DROPS, aux_loss_coef=0.0)
    prog = build_program(plain, "ep+cp+pp", "stage=2,expert=2,context=2", batch=B, seq=S,
                         schedule=schedule, microbatches=MICRO, context_method=method)  # fmt: skip
    one = build_program(plain, "dp", "data=1", batch=B, seq=S, devices=jax.devices()[:1])
    got = prog.loss_and_grads(jax.device_put(seed0_params(), prog.param_shardings), batch())
    want = one.loss_and_grads(jax.device_put(seed0_params(), one.param_shardings), batch())
    assert_same(*((float(v[0]), jax.tree.map(np.asarray, v[1])) for v in (got, want)))
