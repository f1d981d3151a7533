"""1f1b, interleaved and zb-h1 in one SPMD program: the whole step as one `lax.scan` over ticks.

Each tick every stage looks up its cell in the schedule table (`sharding.pipeline._tables`) and
runs up to three actions, each under a `lax.cond` so an idle stage skips it (on real devices a
tick costs its slowest stage's actions, nothing more):

- F: the forward of one micro-batch through one chunk of layers. Every layer's VJP residuals are
  kept in a ring of slots (weights are not copied: a residual that *is* a layer weight is read
  back from the weights), so the backward recomputes nothing unless the remat policy says so
  (then it keeps what the policy saves). The last virtual stage runs what follows the stack (the
  head and the user's loss) and its VJP at once, so the micro-batch's gradient starts there.
- B: the backward from the stored residuals; with zb-h1 the input gradient only, keeping each
  layer's output gradient for W.
- W: zb-h1's weight gradient, which nobody waits for, filling the ticks 1f1b leaves idle.

Where a collective inside a branch could wait for stages that skip it, the branches run in
lock-step instead (`sharding.pipeline._lockstep`).

Activations move to the next stage and input gradients to the previous one with one `ppermute`
each per tick (a ring when stages hold several chunks), each tensor rank sending its share
(`shift_spread`); weight gradients accumulate in the carry
and the data-parallel reduction runs once, after the scan. The scan computes the loss *and* its
gradients, so it is exposed to autodiff through `jax.custom_vjp` whose backward scales them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax import sharding as jshard

from sharding._stack import LayerFn
from sharding.pipeline._kinds import IDLE, Kind
from sharding.pipeline._layers import (
    Layers,
    auto_batch_axes,
    layer_spec,
    micro_spec,
    per_leaf,
    psum32,
    shift_spread,
    stage_weights,
    summed_grad,
    uniform,
    varying,
)
from sharding.pipeline._lockstep import Lockstep, sends
from sharding.pipeline._schedule import Schedule
from sharding.pipeline._split import Split

P = jshard.PartitionSpec


# Per tick and stage, what each lane reads: -1 where the lane is idle.
_FIELDS = {
    Kind.FORWARD: ("micro", "chunk", "act", "res", "cot"),
    Kind.BACKWARD: ("micro", "chunk", "res", "cot", "wct"),
    Kind.WEIGHT: ("micro", "chunk", "res", "wct"),
}


def tables(schedule: Schedule) -> dict[str, np.ndarray]:
    """``[ticks, stages]`` int32 arrays: per lane (``F.micro``, ``B.res``, ...) the micro-batch,
    chunk and buffer slots of its action, -1 when idle; ``arrive.act`` / ``arrive.cot``: the slot
    an arriving activation / input gradient is written to, -1 when none arrives."""
    shape, of = (schedule.ticks, schedule.stages), schedule.slots.of
    out = {f"{k}.{f}": np.full(shape, -1, np.int32) for k, fs in _FIELDS.items() for f in fs}
    for name in ("arrive.act", "arrive.cot"):
        out[name] = np.full(shape, -1, np.int32)
    for t, row in enumerate(schedule.table):
        for s, cell in enumerate(row):
            for a in cell:
                key = (s, a.microbatch, a.repeat)
                for f in _FIELDS[a.kind]:
                    value = {"micro": a.microbatch, "chunk": a.repeat}.get(f)
                    out[f"{a.kind}.{f}"][t, s] = of.get((f, *key), -1) if value is None else value
            for name, grid in (("act", schedule.activation_in), ("cot", schedule.cotangent_in)):
                a = grid[t][s]
                if a is not IDLE:
                    out[f"arrive.{name}"][t, s] = of[(name, s, a.microbatch, a.repeat)]
    return out


def explicit_pipeline(
    layer_fn: LayerFn,
    wrap: Callable | None,
    head_loss: Callable[[Any, jax.Array, Any], jax.Array],
    embed: Callable[[Any, Any], jax.Array],
    layers: Any,
    rest: Any,
    extras_m: list[jax.Array],
    batch_m: Any,
    *,
    mesh: jshard.Mesh,
    schedule: Schedule,
    valid: np.ndarray | None = None,
    sequence: tuple[str, ...] = (),
    seq: int | None = None,
    enter: Callable | None = None,
    dims: list | None = None,
    manual: tuple[str, ...],
    spread: bool = True,
) -> jax.Array:
    """Mean loss over micro-batches; differentiable w.r.t. `layers`, `rest` and the
    floating-point `extras_m`.

    Args:
        layer_fn: ``(layer_state, h, extras_i) -> h``, one layer; ``wrap``: its remat policy.
        head_loss: ``(rest, y, batch_i) -> loss of micro-batch i`` (what follows the stack).
        embed: ``(rest, batch_i) -> x``, the stack's input for micro-batch i (what precedes the
            stack), run by the first stage in its forward and differentiated in its backward.
        layers: the stacked layers viewed as ``[p, r, Lr, ...]`` (stage s, chunk c holds
            virtual stage ``c*p + s``), sharded over ``stage``.
        valid: ``[p, r, Lr]`` bools for balanced stages: False marks a spare layer slot (see
            `sharding.pipeline._balance`); None when every stage has ``Lr`` layers.
        rest: every other parameter (head, norms, embeddings), replicated over ``stage``.
        extras_m: the stack's extra inputs, each ``[m, b, ...]``; batch_m: the batch as
            ``[m, b, ...]``.
        sequence, seq: the axes splitting the stack's sequence (of length ``seq``) outside the
            layers; over context, the region is manual over it too (``manual``) and each
            device's loss is the mean over its slice of the sequence. ``enter``: applied to the
            stack's input after ``embed`` (Megatron SP's split over the sequence), None: none.
        dims, manual: per leaf of ``layers`` (flattened), the manual axes splitting its own
            dimensions; the axes the stages are manual over besides stage (`Staging.manual`).
        spread: each tensor rank sends its share between stages (`shift_spread`); False: SP.
    """
    auto = sorted(a for a, n in mesh.shape.items() if n > 1 and a not in {"stage", *manual})
    floats = [jnp.issubdtype(x.dtype, jnp.inexact) for x in extras_m]
    fixed = [x for x, f in zip(extras_m, floats, strict=True) if not f]

    def merged(fex: list) -> list:
        it_f, it_x = iter(fex), iter(fixed)
        return [next(it_f) if f else next(it_x) for f in floats]

    def run(layers: Any, rest: Any, fex: list) -> tuple[jax.Array, tuple]:
        layer_specs = per_leaf(lambda _, d: layer_spec(d), layers, dims)
        micro = lambda x: micro_spec(x, manual, seq)  # noqa: E731
        body = functools.partial(_body, Layers(layer_fn, wrap, floats, spread), head_loss, embed,
                                 schedule, floats, valid, manual, enter, dims, bool(auto))  # fmt: skip
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(layer_specs, jax.tree.map(lambda _: P(), rest),
                      [micro(x) for x in extras_m], jax.tree.map(micro, batch_m)),
            out_specs=(P(), (layer_specs, jax.tree.map(lambda _: P(), rest),
                             [micro(x) for x in fex])),
            axis_names={"stage", *manual},
        )(layers, rest, merged(fex), batch_m)  # fmt: skip

    @jax.custom_vjp
    def loss(layers: Any, rest: Any, fex: list) -> jax.Array:
        return run(layers, rest, fex)[0]

    def bwd(grads: tuple, g: jax.Array) -> tuple:
        return jax.tree.map(lambda x: (g * x).astype(x.dtype), grads)

    loss.defvjp(run, bwd)
    return loss(layers, rest, [x for x, f in zip(extras_m, floats, strict=True) if f])


def _body(
    chunk: Layers,
    head_loss: Callable,
    embed: Callable,
    schedule: Schedule,
    floats: list[bool],
    valid_tab: np.ndarray | None,
    reps: tuple[str, ...],
    enter: Callable | None,
    dims: list | None,
    auto: bool,
    layers: Any,
    rest: Any,
    extras_m: list,
    batch_m: Any,
) -> tuple[jax.Array, tuple]:
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    tab = {k: jnp.asarray(x) for k, x in tables(schedule).items()}
    n = schedule.slots
    split = schedule.splits_backward
    sid = lax.axis_index("stage")
    # Varying casts hoisted out of the tick loop: their transposes (the gradient psums over data,
    # and over stage for `rest`) then run once per step.
    everywhere = ("stage", *reps)
    w = stage_weights(layers, dims, reps)  # [v, Lr, ...]
    rest = jax.tree.map(lambda a: varying(a, everywhere), rest)
    extras_m = [varying(a, "stage") for a in extras_m]
    batch_m = jax.tree.map(lambda a: varying(a, "stage"), batch_m)
    batch0 = jax.tree.map(lambda a: a[0], batch_m)
    x_shape = jax.eval_shape(embed, rest, batch0)
    zero_x = varying(jnp.zeros(x_shape.shape, x_shape.dtype), everywhere)

    def rows(fn: Callable) -> Callable:
        """``fn`` with its output's rows kept split over the automatic batch axes (fsdp, expert),
        as the stage's activations are: otherwise XLA may compute it whole on every device."""
        return lambda *a: lax.with_sharding_constraint(fn(*a), P(auto_batch_axes()))

    def entered(r: Any, b: Any) -> jax.Array:
        """The stack's input for micro-batch b, laid out as the layers take it."""
        x = rows(embed)(r, b)
        return x if enter is None else enter(x)

    def inputs(i: jax.Array) -> tuple[list, list]:
        """Micro-batch i's extra inputs: (the differentiable ones, the others in order)."""
        ex = [a[i] for a in extras_m]
        return [e for e, f in zip(ex, floats, strict=True) if f], ex

    def weights(c: jax.Array) -> Any:
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, c, 0, keepdims=False), w)

    valid_s = None if valid_tab is None else jnp.asarray(valid_tab)[sid]  # [r, Lr]

    def valid(c: jax.Array) -> jax.Array | None:
        return None if valid_s is None else lax.dynamic_index_in_dim(valid_s, c, 0, False)

    # The residuals' shapes from an abstract forward of one chunk; lock-step lanes (_lockstep)?
    fex0, ex0 = inputs(0)
    traced = jax.make_jaxpr(lambda: chunk.forward(weights(0), zero_x, fex0, ex0, valid(0))[1],
                            return_shape=True)()  # fmt: skip
    res_shapes = traced[1]
    lockstep = auto or sends(traced[0].jaxpr)
    chunk.lockstep = lockstep
    step = Lockstep(lockstep, schedule, tables(schedule))
    branch, zeroed, put, add = step.branch, step.zeroed, step.put, step.add

    def ring(n_slots: int, like: Any) -> Any:
        return jax.tree.map(
            lambda a: varying(jnp.zeros((max(n_slots, 1), *a.shape), a.dtype), everywhere),
            like,
        )

    def get(buf: Any, slot: jax.Array) -> Any:
        return jax.tree.map(lambda b: b[slot], buf)

    def forward(c: dict, t: jax.Array) -> tuple[dict, jax.Array]:
        i, k = tab["F.micro"][t, sid], tab["F.chunk"][t, sid]
        on = step.real(i)  # lock-step: is this stage's F real?
        first, last = (sid == 0) & (k == 0), (sid == p - 1) & (k == v - 1)
        batch_i = jax.tree.map(lambda a: a[i], batch_m)
        with jax.named_scope("pipeline_embed"):  # the first stage computes its micro-batch's input
            x, _ = branch(first, "embed.F", t, on, uniform(entered),
                          uniform(lambda r_, b_: zero_x), rest, batch_i)  # fmt: skip
        x = jnp.where(first, x, c["act"][jnp.maximum(tab["F.act"][t, sid], 0)])
        fex, ex = inputs(i)
        y, res = chunk.forward(weights(k), x, fex, ex, valid(k))
        c = {**c, "res": put(c["res"], tab["F.res"][t, sid], res, on)}
        if split:  # the head's weight gradient waits for W, like the layers'
            with jax.named_scope("pipeline_head"):
                (value, dy, kept), keep = branch(last, "head.F", t, on, uniform(head_b),
                                                 uniform(no_head_b), rest, y, batch_i)  # fmt: skip
            value = zeroed(keep, value)
            c["head"] = put(c["head"], tab["F.res"][t, sid], kept, on)
        else:

            def head(_: None) -> tuple:
                value, vjp = jax.vjp(lambda r_, y_: head_loss(r_, y_, batch_i) / m, rest, y)
                return (value.astype(jnp.float32), *vjp(jnp.ones_like(value)))

            def no_head(_: None) -> tuple:
                return jnp.zeros_like(c["loss"]), jax.tree.map(jnp.zeros_like, rest), zero_x

            with jax.named_scope("pipeline_head"):
                (value, drest, dy), keep = branch(last, "head.F", t, on, head, no_head, None)
            value, drest = zeroed(keep, (value, drest))
            c["grest"] = jax.tree.map(jnp.add, c["grest"], drest)
        c["loss"] = c["loss"] + value
        c["cot"] = jnp.where(last & on, c["cot"].at[jnp.maximum(tab["F.cot"][t, sid], 0)].set(dy),
                             c["cot"])  # fmt: skip
        return c, y

    def backward(c: dict, t: jax.Array) -> tuple[dict, jax.Array]:
        i, k = tab["B.micro"][t, sid], tab["B.chunk"][t, sid]
        on = step.real(i)
        fex, _ = inputs(i)
        ct = c["cot"][tab["B.cot"][t, sid]]
        dx, dfex, out = chunk.backward(weights(k), get(c["res"], tab["B.res"][t, sid]), ct, fex,
                                       weights=not split, valid=valid(k))  # fmt: skip
        c = dict(c)
        if split:
            c["wct"] = put(c["wct"], tab["B.wct"][t, sid], out, on)
        else:
            c["gw"] = add(c["gw"], jnp.maximum(k, 0), out, on)
        first = (sid == 0) & (k == 0)
        batch_i = jax.tree.map(lambda a: a[i], batch_m)

        def embed_grad(r: Any, b: Any, g: jax.Array) -> Any:
            g = lax.with_sharding_constraint(g.astype(x_shape.dtype), P(auto_batch_axes()))
            return jax.vjp(lambda r_: entered(r_, b), r)[1](g)[0]

        with jax.named_scope("pipeline_embed"):  # ... and its gradient, from the input gradient
            drest, keep = branch(first, "embed.B", t, on, uniform(embed_grad),
                                 uniform(lambda r_, b_, g_: jax.tree.map(jnp.zeros_like, r_)),
                                 rest, batch_i, dx)  # fmt: skip
        c["grest"] = jax.tree.map(jnp.add, c["grest"], zeroed(keep, drest))
        c["dex"] = add(c["dex"], jnp.maximum(i, 0), dfex, on)
        return c, dx

    def weight(c: dict, t: jax.Array) -> tuple[dict, jax.Array]:
        k = tab["W.chunk"][t, sid]
        on = step.real(k)
        slot = tab["W.res"][t, sid]
        dw = chunk.weight_grad(weights(k), get(c["res"], slot), get(c["wct"], tab["W.wct"][t, sid]),
                               c["back"], valid(k))  # fmt: skip
        c = {**c, "gw": add(c["gw"], jnp.maximum(k, 0), dw, on)}
        last = (sid == p - 1) & (k == v - 1)
        with jax.named_scope("pipeline_head_w"):
            drest, keep = branch(last, "head.W", t, on, uniform(head_w), uniform(no_head_w),
                                 get(c["head"], slot))  # fmt: skip
        c["grest"] = jax.tree.map(jnp.add, c["grest"], zeroed(keep, drest))
        return c, zero_x

    def lane(kind: str, run: Callable, c: dict, t: jax.Array) -> tuple[dict, jax.Array]:
        # The scope names the conditional in the HLO (`sharding.costmodel` prices each lane).
        with jax.named_scope(f"pipeline_{kind}"):
            active = step.lane(kind, t, tab[f"{kind}.micro"][t, sid] >= 0)
            return lax.cond(active, run, lambda c_, _: (c_, zero_x), c, t)

    ring_to = [(s, (s + 1) % p) for s in range(p)] if v > 1 else [(s, s + 1) for s in range(p - 1)]
    ring_from = [(b, a) for a, b in ring_to]

    def tick(c: dict, t: jax.Array) -> tuple[dict, None]:
        a_slot, c_slot = tab["arrive.act"][t, sid], tab["arrive.cot"][t, sid]
        c = {**c, "act": jnp.where(a_slot >= 0, c["act"].at[jnp.maximum(a_slot, 0)].set(c["sent"]),
                                   c["act"]),
             "cot": jnp.where(c_slot >= 0, c["cot"].at[jnp.maximum(c_slot, 0)].set(c["back"]),
                              c["cot"])}  # fmt: skip
        c, y = lane("F", forward, c, t)
        c, dx = lane("B", backward, c, t)
        if split:
            c, _ = lane("W", weight, c, t)
        c["sent"] = shift_spread(y, lambda v: lax.ppermute(v, "stage", ring_to), chunk.spread)
        c["back"] = shift_spread(dx, lambda v: lax.ppermute(v, "stage", ring_from), chunk.spread)
        return c, None

    carry = {
        "sent": zero_x,
        "back": zero_x,
        "act": ring(n.activations, zero_x),
        "cot": ring(n.cotangents, zero_x),
        "res": ring(n.residuals, res_shapes),
        "gw": jax.tree.map(jnp.zeros_like, w),
        "grest": jax.tree.map(jnp.zeros_like, rest),
        "dex": [jnp.zeros_like(a) for a, f in zip(extras_m, floats, strict=True) if f],
        "loss": lax.pcast(jnp.zeros((), jnp.float32), everywhere, to="varying"),
    }
    if split:  # what follows the stack, its VJP cut in two like a layer's (`Split`)

        def head_split() -> Split:
            def vjp(r: Any, y: jax.Array, b: Any) -> list:
                value, pullback = jax.vjp(lambda r_, y_: head_loss(r_, y_, b) / m, r, y)
                drest, dy = pullback(jnp.ones_like(value))
                return [*jax.tree.leaves(drest), dy, value.astype(jnp.float32)]

            return Split(vjp, [rest, zero_x, batch0], len(jax.tree.leaves(rest)), keep={0})

        def head_b(r: Any, y: jax.Array, b: Any) -> tuple:
            (dy, value), kept = head_split().input_grads([r, y, b])
            return value, dy, kept

        kept_shapes = jax.eval_shape(lambda: head_b(rest, zero_x, batch0)[2])

        def no_head_b(r: Any, y: jax.Array, b: Any) -> tuple:
            zeros = [jnp.zeros(a.shape, a.dtype) for a in kept_shapes]
            return jnp.zeros((), jnp.float32), zero_x, zeros

        def head_w(kept: list) -> Any:
            drest = head_split().weight_grads([rest], kept)
            return jax.tree.unflatten(jax.tree.structure(rest), drest)

        def no_head_w(kept: list) -> Any:
            return jax.tree.map(jnp.zeros_like, rest)

        carry["head"] = ring(n.residuals, kept_shapes)
        # B's boundary values per layer, from an abstract backward of one chunk
        res0 = get(carry["res"], 0)
        wct = jax.eval_shape(lambda: chunk.backward(weights(0), res0, carry["cot"][0], fex0,
                                                    weights=False, valid=valid(0))[2])  # fmt: skip
        carry["wct"] = ring(n.weight_cotangents, wct)
    with jax.named_scope("pipeline_lockstep") if lockstep else contextlib.nullcontext():
        carry, _ = lax.scan(tick, carry, jnp.arange(schedule.ticks))
    n_data = math.prod(lax.axis_size(a) for a in reps)
    # The loss is the mean over data replicas (and sequence slices) of each one's micro-batch
    # mean.
    value = lax.psum(carry["loss"], everywhere) / n_data
    gw = per_leaf(lambda g, d: summed_grad(g, d, reps)[None] / n_data, carry["gw"], dims)
    grest = jax.tree.map(lambda g: psum32(g, everywhere) / n_data, carry["grest"])
    # Every stage reads the extra inputs: their gradients add up over stages.
    dex = [psum32(g, "stage") / n_data for g in carry["dex"]]
    return value, (gw, grest, dex)


__all__ = ["explicit_pipeline", "tables"]
