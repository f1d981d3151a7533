"""1F1B in one SPMD program: forward and backward of every micro-batch in a single `lax.scan`.

Each tick every stage looks up its action in the schedule table (`sharding.pipeline._schedule`) and runs
one branch of a `lax.switch`: idle, the forward of a micro-batch, or its backward as an explicit
VJP of the stage (recomputed from the stored stage input, so a stage holds at most p inputs
instead of GPipe's m). The last stage applies the head and the per-micro-batch loss inside its
backward, so its cotangent starts there. Activations move to the next stage and cotangents to
the previous one with one `ppermute` each per tick; weight gradients accumulate in the carry and
the data-parallel reduction happens once, after the scan.

The whole thing computes the loss *and* its gradients in the forward pass, so it is exposed to
autodiff through `jax.custom_vjp` whose backward only scales the stored gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax import sharding as jshard

from sharding.pipeline._schedule import Kind, Schedule

P = jshard.PartitionSpec
_CODES = {Kind.IDLE: 0, Kind.FORWARD: 1, Kind.BACKWARD: 2}


def varying(x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """``lax.pcast(x, axes, to="varying")`` whose transpose, the psum of x's cotangent over
    ``axes``, runs in float32: gradients of bfloat16 weights are summed in float32 (and XLA:CPU
    cannot promote a bfloat16 all-reduce whose reducer Shardy tagged with a sharding)."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float32:
        return lax.pcast(x, axes, to="varying")
    return lax.pcast(x.astype(jnp.float32), axes, to="varying").astype(x.dtype)


def psum32(x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """``lax.psum`` computed in float32 for floating-point x (see `varying`)."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float32:
        return lax.psum(x, axes)
    return lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)


def _tables(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[ticks, stages] int32 arrays: action code, its micro-batch, and the micro-batch whose
    activation arrives from the previous stage (-1: none)."""
    kind = np.array([[_CODES[a.kind] for a in row] for row in schedule.table], np.int32)
    micro = np.array([[a.microbatch or 0 for a in row] for row in schedule.table], np.int32)
    arrive = np.array(
        [
            [-1 if a.kind is Kind.IDLE else a.microbatch for a in row]
            for row in schedule.activation_in
        ],
        np.int32,
    )
    return kind, micro, arrive


def one_f_one_b(
    stage_fn: Callable[[Any, jax.Array, list], jax.Array],
    head_loss: Callable[[Any, jax.Array, Any], jax.Array],
    layers: Any,
    rest: Any,
    h_m: jax.Array,
    extras_m: list[jax.Array],
    batch_m: Any,
    *,
    mesh: jshard.Mesh,
    schedule: Schedule,
) -> jax.Array:
    """Mean loss over micro-batches; differentiable w.r.t. `layers`, `rest`, `h_m` and the
    floating-point `extras_m`.

    Args:
        stage_fn: ``(stage_layers, x, extras_i) -> y``: one stage's layers ([L/p, ...] leaves).
        head_loss: ``(rest, y, batch_i) -> loss of micro-batch i`` (what follows the stack).
        layers: the stacked layers viewed as ``[p, L/p, ...]``, sharded over ``stage``.
        rest: every other parameter (head, norms, embeddings), replicated over ``stage``.
        h_m: the stack's input as micro-batches ``[m, b, ...]``; extras_m: its extra inputs,
            each ``[m, b, ...]``; batch_m: the batch as ``[m, b, ...]``.
    """
    floats = [jnp.issubdtype(x.dtype, jnp.inexact) for x in extras_m]
    fixed = [x for x, f in zip(extras_m, floats, strict=True) if not f]

    def merged(fex: list) -> list:
        it_f, it_x = iter(fex), iter(fixed)
        return [next(it_f) if f else next(it_x) for f in floats]

    @jax.custom_vjp
    def loss(layers: Any, rest: Any, h_m: jax.Array, fex: list) -> jax.Array:
        return _run(layers, rest, h_m, fex)[0]

    def fwd(layers: Any, rest: Any, h_m: jax.Array, fex: list) -> tuple[jax.Array, tuple]:
        value, grads = _run(layers, rest, h_m, fex)
        return value, grads

    def bwd(grads: tuple, g: jax.Array) -> tuple:
        return jax.tree.map(lambda x: (g * x).astype(x.dtype), grads)

    loss.defvjp(fwd, bwd)

    def _run(layers: Any, rest: Any, h_m: jax.Array, fex: list) -> tuple[jax.Array, tuple]:
        layer_specs = jax.tree.map(lambda _: P("stage"), layers)
        rest_specs = jax.tree.map(lambda _: P(), rest)
        batch_specs = jax.tree.map(lambda _: P(None, "data"), batch_m)
        micro = P(None, "data")
        extra_specs = [micro] * len(extras_m)
        fex_specs = [micro] * len(fex)
        return jax.shard_map(
            functools.partial(_pipeline_body, stage_fn, head_loss, schedule, floats),
            mesh=mesh,
            in_specs=(layer_specs, rest_specs, micro, extra_specs, batch_specs),
            out_specs=(P(), (layer_specs, rest_specs, micro, fex_specs)),
            axis_names={"stage", "data"},
        )(layers, rest, h_m, merged(fex), batch_m)

    return loss(layers, rest, h_m, [x for x, f in zip(extras_m, floats, strict=True) if f])


def _pipeline_body(
    stage_fn: Callable,
    head_loss: Callable,
    schedule: Schedule,
    floats: list[bool],
    layers: Any,
    rest: Any,
    h_m: jax.Array,
    extras_m: list,
    batch_m: Any,
) -> tuple[jax.Array, tuple]:
    p, m = schedule.stages, schedule.microbatches
    kind_tab, micro_tab, arrive_tab = (jnp.asarray(t) for t in _tables(schedule))
    sid = lax.axis_index("stage")
    last = p - 1
    # Varying casts hoisted out of the tick loop: their transposes (the gradient psums over data,
    # and over stage for `rest`) then run once per step.
    w = jax.tree.map(lambda a: varying(a[0], "data"), layers)
    rest = jax.tree.map(lambda a: varying(a, ("stage", "data")), rest)
    h_m = varying(h_m, "stage")
    extras_m = [varying(a, "stage") for a in extras_m]
    batch_m = jax.tree.map(lambda a: varying(a, "stage"), batch_m)
    zero_x = jnp.zeros_like(h_m[0])

    def pick(i: jax.Array) -> tuple[list, list]:
        """Micro-batch i's extra inputs: (the differentiable ones, all of them in order)."""
        ex = [a[i] for a in extras_m]
        return [e for e, f in zip(ex, floats, strict=True) if f], ex

    def with_floats(fex: list, ex: list) -> list:
        it = iter(fex)
        return [next(it) if f else e for e, f in zip(ex, floats, strict=True)]

    def forward(c: dict, i: jax.Array) -> tuple[dict, jax.Array, jax.Array]:
        x = jnp.where(sid == 0, h_m[i], c["slots"][i % p])
        return c, stage_fn(w, x, pick(i)[1]), zero_x

    def backward(c: dict, i: jax.Array) -> tuple[dict, jax.Array, jax.Array]:
        x = jnp.where(sid == 0, h_m[i], c["slots"][i % p])
        batch_i = jax.tree.map(lambda a: a[i], batch_m)
        fex, ex = pick(i)

        def stage(w_: Any, x_: jax.Array, fex_: list) -> jax.Array:
            return stage_fn(w_, x_, with_floats(fex_, ex))

        def through_head(_: None) -> tuple:
            f = lambda w_, r_, x_, e_: head_loss(r_, stage(w_, x_, e_), batch_i) / m  # noqa: E731
            value, vjp = jax.vjp(f, w, rest, x, fex)
            return (value, *vjp(jnp.ones_like(value)))

        def inner(_: None) -> tuple:
            _, vjp = jax.vjp(stage, w, x, fex)
            dw, dx, dfex = vjp(c["cot_in"])
            return c["loss"] * 0, dw, jax.tree.map(jnp.zeros_like, rest), dx, dfex

        value, dw, drest, dx, dfex = lax.cond(sid == last, through_head, inner, None)
        c = dict(c)
        c["gw"] = jax.tree.map(jnp.add, c["gw"], dw)
        c["grest"] = jax.tree.map(jnp.add, c["grest"], drest)
        c["dh"] = jnp.where(sid == 0, c["dh"].at[i].set(dx), c["dh"])
        c["dex"] = [acc.at[i].add(d) for acc, d in zip(c["dex"], dfex, strict=True)]
        c["loss"] = c["loss"] + value.astype(jnp.float32)
        return c, zero_x, dx

    def idle(c: dict, i: jax.Array) -> tuple[dict, jax.Array, jax.Array]:
        return c, zero_x, zero_x

    def tick(c: dict, t: jax.Array) -> tuple[dict, None]:
        arriving = arrive_tab[t, sid]
        slot = jnp.maximum(arriving, 0) % p
        slots = jnp.where(arriving >= 0, c["slots"].at[slot].set(c["act_in"]), c["slots"])
        c = {**c, "slots": slots}
        c, y, dx = lax.switch(kind_tab[t, sid], [idle, forward, backward], c, micro_tab[t, sid])
        c["act_in"] = lax.ppermute(y, "stage", [(s, s + 1) for s in range(p - 1)])
        c["cot_in"] = lax.ppermute(dx, "stage", [(s + 1, s) for s in range(p - 1)])
        return c, None

    carry = {
        "act_in": zero_x,
        "cot_in": zero_x,
        "slots": jnp.broadcast_to(zero_x, (p, *zero_x.shape)),
        "gw": jax.tree.map(jnp.zeros_like, w),
        "grest": jax.tree.map(jnp.zeros_like, rest),
        "dh": jnp.zeros_like(h_m),
        "dex": [jnp.zeros_like(a) for a, f in zip(extras_m, floats, strict=True) if f],
        "loss": lax.pcast(jnp.zeros((), jnp.float32), ("stage", "data"), to="varying"),
    }
    carry, _ = lax.scan(tick, carry, jnp.arange(schedule.ticks))
    n_data = lax.axis_size("data")
    # The loss is the mean over data replicas of each replica's micro-batch mean.
    value = lax.psum(carry["loss"], ("stage", "data")) / n_data
    gw = jax.tree.map(lambda g: psum32(g, "data")[None] / n_data, carry["gw"])
    grest = jax.tree.map(lambda g: psum32(g, ("stage", "data")) / n_data, carry["grest"])
    dh = psum32(carry["dh"], "stage") / n_data
    # Every stage reads the extra inputs: their cotangents add up over stages.
    dex = [psum32(g, "stage") / n_data for g in carry["dex"]]
    return value, (gw, grest, dh, dex)
