"""Pipeline parallelism as one SPMD program: a `lax.scan` over ticks inside a `shard_map` that is
manual over ``stage``, ``data`` and ``fsdp`` (plus ``expert`` and ``context`` where the mesh
splits them: `replicas`), so tensor stays automatic inside each stage.

The stacked layers ``[L, ...]`` (sharded over ``stage`` on the leading axis by the pp presets) are
viewed as ``[p, L/p, ...]``: stage ``s`` owns a contiguous block of layers and no weight moves.
Activations move to the next stage with `lax.ppermute` between ticks, each tensor rank sending
its share (`shift_spread`, Megatron's scatter/gather); the tick tables come from
`sharding.pipeline._schedule`. This module holds the pipeline's settings (`PipelineSpec`), their
checks, micro-batching and gpipe/circular's scan, which autodiff differentiates: the remat policy
applies to each layer, as without a pipeline (full: a layer keeps its input and is recomputed
once; none: nothing is recomputed). `sharding.pipeline._loss` runs the user's loss around it;
1f1b, interleaved and zb-h1 run `sharding.pipeline._explicit` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax import sharding as jshard

from sharding._manual import manual_axes
from sharding._stack import LayerFn, apply_layers
from sharding.pipeline._balance import check_stage_layers
from sharding.pipeline._errors import PipelineError
from sharding.pipeline._layers import (
    layer_spec,
    micro_spec,
    per_leaf,
    psum32,
    psum_scatter32,
    replicas,
    row_axes,
    seq_tail,
    shift_spread,
    stage_weights,
    varying,
)
from sharding.pipeline._schedule import Schedule, check_layers, make_schedule

P = jshard.PartitionSpec
from sharding._mesh import BATCH_AXES  # noqa: E402


class PipelineConfigError(PipelineError):
    """A pipeline that cannot be laid out on this mesh, preset or batch."""


@dataclass(frozen=True)
class PipelineSpec:
    """How to pipeline: the schedule, micro-batches per step, chunks per stage (``repeats``:
    circular, interleaved) and, for balanced stages, the layers of each virtual stage
    (``stage_layers``, e.g. ``(3, 4, 4, 5)``; `balance_layers` chooses them; None: equal).

    What is pipelined is the workload's layer stack (``compile_train_step(stack=...)``); the loss
    is always the user's own function, run around the pipelined stack.
    """

    schedule: str = "gpipe"
    microbatches: int = 4
    repeats: int = 1
    stage_layers: tuple[int, ...] | None = None

    def table(self, stages: int) -> Schedule:
        return make_schedule(stages, self.microbatches, self.schedule, self.repeats)


def check_pipeline(spec: PipelineSpec, mesh: jshard.Mesh, n_layers: int, batch: int) -> Schedule:
    """Every pipeline precondition on sizes, checked before tracing; returns the schedule table."""
    sizes = dict(mesh.shape)
    if "stage" not in sizes:
        raise PipelineConfigError(
            f"a {spec.schedule} pipeline needs a 'stage' mesh axis; this mesh has "
            + ", ".join(f"{k}={v}" for k, v in sizes.items())
            + ". Build the mesh with sharding.make_mesh, e.g. 'stage=2,data=4'."
        )
    schedule = spec.table(sizes["stage"])
    if spec.stage_layers is None:
        check_layers(n_layers, sizes["stage"], spec.repeats)
    else:
        check_stage_layers(spec.stage_layers, n_layers, sizes["stage"], spec.repeats)
    split = math.prod(sizes.get(a, 1) for a in BATCH_AXES)
    if batch % spec.microbatches or (batch // spec.microbatches) % split:
        raise PipelineConfigError(
            f"global batch {batch} must split into {spec.microbatches} micro-batches of a size "
            f"divisible by {' x '.join(BATCH_AXES)} = {split}; use a batch that is a multiple of "
            f"{spec.microbatches * split} or change --microbatches"
        )
    return schedule


def to_microbatches(
    x: jax.Array, m: int, mesh: jshard.Mesh, sequence: tuple[str, ...] = (), seq: int | None = None
) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] keeping each device's rows local (micro-batch k: rows k::m).

    ``sequence``: the mesh axes that split dim 1 of an array whose dim 1 is the stack's
    sequence (length ``seq``), kept split (context parallelism inside a pipeline).
    """
    x = jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
    spec = P(None, BATCH_AXES, *seq_tail(x.shape[1:], sequence, seq))
    return lax.with_sharding_constraint(x, jshard.NamedSharding(mesh, spec))


def from_microbatches(x: jax.Array) -> jax.Array:
    """Inverse of `to_microbatches`."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def stage_view(layers: Any, stages: int, repeats: int) -> Any:
    """[L, ...] -> [stages, repeats, L/(stages*repeats), ...]: stage s, repeat j holds layers
    (j*stages + s)*Lr ... in circular order (for repeats=1 a free reshape of the sharded axis)."""

    def view(w: jax.Array) -> jax.Array:
        per = w.shape[0] // (stages * repeats)
        w = w.reshape(repeats, stages, per, *w.shape[1:])
        return jnp.swapaxes(w, 0, 1)

    return jax.tree.map(view, layers)


def _shift_next(x: Any, stages: int, spread: bool) -> Any:
    """Send to stage s+1 (the last stage sends to stage 0, used by circular's next repeat), each
    tensor rank its share unless the activations cross split already (`shift_spread`)."""
    pairs = [(s, (s + 1) % stages) for s in range(stages)]
    return shift_spread(x, lambda v: lax.ppermute(v, "stage", pairs), spread)


def scan_pipeline(
    layer_fn: LayerFn,
    layers: Any,
    h_m: jax.Array,
    extras_m: list[jax.Array] | None = None,
    *,
    mesh: jshard.Mesh,
    schedule: Schedule,
    wrap: Callable | None,
    rows: bool = False,
    slots: tuple[np.ndarray, np.ndarray] | None = None,
    sequence: tuple[str, ...] = (),
    sides: tuple[Any, ...] = (),
    dims: list | None = None,
    manual: tuple[str, ...] | None = None,
    spread: bool = True,
) -> Any:
    """gpipe / circular forward of the layer stack over micro-batches ``h_m: [m, b, ...]``.

    ``extras_m``: the stack's extra inputs, each ``[m, b, ...]``; micro-batch i's reach every
    layer that computes micro-batch i. ``wrap``: the remat policy of each layer
    (`sharding.remat_wrapper`), None to store every layer's residuals and recompute nothing.
    Returns the last stage's outputs ``[m, b, ...]``, on every stage; with ``rows``, as the
    ``[m * b, ...]`` rows of `from_microbatches`, split over the manual batch axes and ``stage``
    (each stage receives its share of the last stage's rows, a reduce-scatter instead of an
    all-reduce) where they divide; else on every stage.
    ``slots``: balanced stages' ``(index, valid)`` from `layer_slots` (spare slots skipped).
    ``sequence``: ``("context",)`` when the sequence is split over context (`replicas`).
    ``sides``: the shapes of the side values the layers carry past the activations (a mixture
    of experts' load-balancing loss; `sharding._stack.StackCall`). Each layer adds its own term
    to them: each stage starts every micro-batch from zeros and adds its layers' terms, and the
    result is ``(outputs, *sides)`` with each side value the mean over micro-batches and the
    manual batch shards (data, expert) of their sums over the layers (a batch statistic per
    micro-batch, as with gradient accumulation). ``dims``: per leaf of ``layers`` (flattened),
    the manual axes splitting its own dimensions (`layer_dims`), None when none is.
    ``manual``: the axes the stages are manual over besides ``stage``, as the step placed them
    (`Staging.manual`); None: `replicas` of ``sequence`` on ``mesh``. ``spread``: each tensor
    rank sends its share of the activations to the next stage (`shift_spread`); False where
    they cross split already (Megatron SP).
    Differentiated by autodiff through the scan.
    """
    reps = replicas(sequence, mesh) if manual is None else manual
    rows_axes = row_axes(reps)
    p, m, r, ticks = schedule.stages, schedule.microbatches, schedule.repeats, schedule.ticks
    sizes = dict(mesh.shape)
    per_shard = h_m.shape[1] // math.prod(sizes[a] for a in rows_axes)
    scatter = rows and (per_shard * m) % p == 0
    if slots is None:
        stage_layers, valid_tab = stage_view(layers, p, r), None
    else:
        stage_layers = jax.tree.map(lambda w: w[jnp.asarray(slots[0])], layers)
        valid_tab = jnp.asarray(slots[1])
    extras_m = list(extras_m or [])

    def run(w: Any, h_m: jax.Array, extras_m: list) -> jax.Array:
        # This stage's [r, L/(p r), ...]. Cast to varying over the manual axes each weight is
        # replicated on, outside the tick loop: the transpose of this cast is the gradient psum
        # over them (data-parallel, and context, expert), which then runs once per step instead
        # of once per tick (XLA otherwise reduces each tick's weight gradient).
        w = stage_weights(w, dims, reps)
        sid = lax.axis_index("stage")
        # Hoisted so the transpose (a psum over stage of the input cotangent) runs once per step.
        h_m = varying(h_m, "stage")
        extras_m = [varying(e, "stage") for e in extras_m]

        # The remat policy applies to each layer, as without a pipeline (full: keep each layer's
        # input, recompute the layer in backward, where its last matmul is not needed: MaxText's
        # work); none recomputes nothing. Never a checkpoint nested in another.
        #
        # Weights sliced inside a tick would be per-tick residuals of autodiff: the forward scan
        # would store a copy of the stage's weights per tick ([ticks, L/p, ...]) for backward.
        # gpipe's one block is taken once, outside the ticks; its layers are the xs of
        # `apply_layers`' scan, which autodiff reads in place. Circular's layer i of repeat j is
        # sliced inside the layer's checkpoint (full, dots), which keeps w once and slices again
        # in backward; without remat the slices (and what the layer derives from them) are still
        # kept per tick: no policy saves all activations but no weight-derived value.
        ok = None if valid_tab is None else valid_tab[sid]  # [r, Lr]: balanced stages' real slots
        if r == 1 and ok is None:
            whole = jax.tree.map(lambda a: a[0], w)

            def apply(j: jax.Array, h: jax.Array, extras: list) -> jax.Array:
                return apply_layers(layer_fn, whole, h, extras, wrap)
        elif r == 1:
            whole = (jax.tree.map(lambda a: a[0], w), ok[0])

            def real(state: tuple, h: jax.Array, extras: list) -> jax.Array:
                return lax.cond(state[1], lambda x: layer_fn(state[0], x, extras), lambda x: x, h)

            def apply(j: jax.Array, h: jax.Array, extras: list) -> jax.Array:
                return apply_layers(real, whole, h, extras, wrap)
        else:
            per = jax.tree.leaves(w)[0].shape[1]

            def apply(j: jax.Array, h: jax.Array, extras: list) -> jax.Array:
                def layer(i: jax.Array, h: jax.Array, extras: list) -> jax.Array:
                    take = lambda a, k: lax.dynamic_index_in_dim(a, k, 0, False)  # noqa: E731
                    lw = jax.tree.map(lambda a: take(take(a, j), i), w)
                    if ok is None:
                        return layer_fn(lw, h, extras)
                    run = lambda x: layer_fn(lw, x, extras)  # noqa: E731
                    return lax.cond(ok[j, i], run, lambda x: x, h)

                return apply_layers(layer, jnp.arange(per), h, extras, wrap)

        every = tuple(sorted(manual_axes()))

        def stage_apply(j: jax.Array, x: jax.Array, extras: list) -> tuple[jax.Array, tuple]:
            """The stage's layers on micro-batch x: (activations, its terms of the sides)."""
            if not sides:
                return apply(j, x, extras), ()
            zeros = tuple(varying(jnp.zeros(a.shape, a.dtype), every) for a in sides)
            out = apply(j, (x, *zeros), extras)
            return out[0], tuple(out[1:])

        def tick(carry: tuple, t: jax.Array) -> tuple[tuple, jax.Array]:
            arriving, circ, acc = carry
            k = t - sid  # position of this stage's work in its repeat-major stream
            valid = (k >= 0) & (k < r * m)
            i, j = jnp.clip(k % m, 0, m - 1), jnp.clip(k // m, 0, r - 1)
            # Stage 0 takes a fresh micro-batch in repeat 0 and its own last-stage output later.
            fresh = h_m[i]
            first = fresh if r == 1 else jnp.where(j == 0, fresh, circ[i])
            x = jnp.where(sid == 0, first, arriving)
            # Bubble ticks compute on zeros: no NaN, and no cotangent reaches a real value.
            x = jnp.where(valid, x, jnp.zeros_like(x))
            y, terms = stage_apply(j, x, [e[i] for e in extras_m])
            acc = tuple(
                a + jnp.where(valid, d, jnp.zeros_like(d)) for a, d in zip(acc, terms, strict=True)
            )
            sent = _shift_next(y, p, spread)
            # Stage 0 keeps what the last stage finished (micro-batch i of repeat j) for repeat j+1.
            done = t - (p - 1)
            keep = (sid == 0) & (done >= 0)
            circ = (
                jnp.where(keep, circ.at[jnp.clip(done % m, 0, m - 1)].set(sent), circ)
                if r > 1
                else circ
            )
            return (sent, circ, acc), y

        zeros = jnp.zeros_like(h_m[0])
        circ0 = jnp.zeros_like(h_m) if r > 1 else jnp.zeros((0,), h_m.dtype)
        acc0 = tuple(varying(jnp.zeros(a.shape, a.dtype), every) for a in sides)
        (_, _, acc), ys = lax.scan(tick, (zeros, circ0, acc0), jnp.arange(ticks))
        # Every micro-batch's terms are on the stages that ran its layers: their sum over stages,
        # averaged over micro-batches and data shards.
        groups = m * math.prod(lax.axis_size(a) for a in reps)
        means = tuple(psum32(a, every) / groups for a in acc)
        outs = ys[ticks - m :]  # last stage, final repeat: micro-batches 0..m-1 in order
        outs = jnp.where(sid == p - 1, outs, jnp.zeros_like(outs))
        if not rows:
            return psum32(outs, "stage"), means
        outs = from_microbatches(outs)  # this data shard's rows, in their global order
        return (psum_scatter32(outs, "stage") if scatter else psum32(outs, "stage")), means

    spec_layers = per_leaf(lambda _, d: layer_spec(d), stage_layers, dims)
    # Manual over stage (the schedule), data and fsdp (so the gradient sums can be placed);
    # tensor stays automatic inside each stage.
    seq = h_m.shape[2] if h_m.ndim == 4 else None
    batch_spec = micro_spec(h_m, reps, seq)
    tail = seq_tail(h_m.shape[1:], tuple(a for a in reps if a not in rows_axes), seq)
    out_spec = batch_spec if not rows else P((*rows_axes, "stage") if scatter else rows_axes, *tail)
    outs, means = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(spec_layers, batch_spec, [micro_spec(e, reps, seq) for e in extras_m]),
        out_specs=(out_spec, tuple(P() for _ in sides)),
        axis_names={"stage", *reps},
    )(stage_layers, h_m, extras_m)
    return (outs, *means) if sides else outs


def rows_over_stages(
    y: jax.Array, mesh: jshard.Mesh, sequence: tuple[str, ...] = (), seq: int | None = None
) -> jax.Array:
    """The stack's output with its rows split over the batch axes and ``stage`` (its sequence
    over ``sequence``, as `to_microbatches`).

    What follows the stack (the user's head and loss) then runs on 1/p of each data shard's rows
    on each stage, as on a mesh without stages, instead of on all of them on every stage. A batch
    that does not divide stays as it is (split over the batch axes only).
    """
    axes = (*BATCH_AXES, "stage")
    if y.ndim == 0 or y.shape[0] % int(np.prod([dict(mesh.shape).get(a, 1) for a in axes])):
        return y
    spec = P(axes, *seq_tail(y.shape, sequence, seq))
    return lax.with_sharding_constraint(y, jshard.NamedSharding(mesh, spec))


__all__ = [
    "PipelineConfigError",
    "PipelineSpec",
    "check_pipeline",
    "from_microbatches",
    "scan_pipeline",
    "to_microbatches",
]
