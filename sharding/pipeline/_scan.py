"""Pipeline parallelism as one SPMD program: a `lax.scan` over ticks inside a `shard_map` that is
manual over ``stage`` only, so data, fsdp and tensor stay automatic inside each stage.

The stacked layers ``[L, ...]`` (sharded over ``stage`` on the leading axis by the pp presets) are
viewed as ``[p, L/p, ...]``: stage ``s`` owns a contiguous block of layers and no weight moves.
Embedding, head and loss stay outside the pipelined region under GSPMD. Activations move to the
next stage with `lax.ppermute` between ticks; the tick tables come from `sharding.pipeline._schedule`.

gpipe and circular differentiate through the scan (each stage's body rematerialised, so a stage
keeps only its inputs per micro-batch). 1f1b runs forward and backward in the same scan: an
explicit per-stage VJP, cotangents shifted to the previous stage, weight gradients accumulated in
the carry; it is wrapped in a `jax.custom_vjp` so the step differentiates it like any loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax import sharding as jshard

from sharding.pipeline._errors import PipelineError
from sharding.pipeline._onefoneb import one_f_one_b
from sharding.pipeline._schedule import Schedule, check_layers, make_schedule

P = jshard.PartitionSpec
from sharding._mesh import BATCH_AXES  # noqa: E402


class PipelineConfigError(PipelineError):
    """A pipeline that cannot be laid out on this mesh, preset or batch."""


@dataclass(frozen=True)
class PipelineSpec:
    """How to pipeline: the schedule, micro-batches per step and (circular) repeats.

    ``input_key`` names the batch entry the model's ``embed`` takes; ``loss_from_logits`` is the
    family's ``(logits, batch) -> loss``, used per micro-batch by 1f1b at the last stage.
    """

    schedule: str = "gpipe"
    microbatches: int = 4
    repeats: int = 1
    input_key: str = "inputs"
    loss_from_logits: Callable[[jax.Array, dict], jax.Array] | None = None

    def table(self, stages: int) -> Schedule:
        return make_schedule(stages, self.microbatches, self.schedule, self.repeats)


def check_pipeline(
    spec: PipelineSpec, mesh: jshard.Mesh, axis_map: Any, n_layers: int, batch: int
) -> Schedule:
    """Every pipeline precondition, checked before tracing; returns the schedule table."""
    sizes = dict(mesh.shape)
    if "stage" not in sizes:
        raise PipelineConfigError(
            f"a {spec.schedule} pipeline needs a 'stage' mesh axis; this mesh has "
            + ", ".join(f"{k}={v}" for k, v in sizes.items())
            + ". Build the mesh with sharding.make_mesh, e.g. 'stage=2,data=4'."
        )
    stages = sizes["stage"]
    layers_to = axis_map.get("layers")
    if stages > 1 and layers_to != "stage":
        raise PipelineConfigError(
            f"mesh has stage={stages} but the preset maps 'layers' to {layers_to!r}, so the layer "
            f"stack would not be split into stages; use a pipeline preset (pp, pp_tp, pp_fsdp)"
        )
    schedule = spec.table(stages)
    check_layers(n_layers, stages, spec.repeats)
    split = sizes.get("data", 1) * sizes.get("fsdp", 1)
    if batch % spec.microbatches or (batch // spec.microbatches) % split:
        raise PipelineConfigError(
            f"global batch {batch} must split into {spec.microbatches} micro-batches of a size "
            f"divisible by data x fsdp = {split}; use a batch that is a multiple of "
            f"{spec.microbatches * split} or change --microbatches"
        )
    return schedule


def to_microbatches(x: jax.Array, m: int, mesh: jshard.Mesh) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] keeping each device's rows local (micro-batch k: rows k::m)."""
    x = jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
    spec = P(None, BATCH_AXES, *([None] * (x.ndim - 2)))
    return lax.with_sharding_constraint(x, jshard.NamedSharding(mesh, spec))


def from_microbatches(x: jax.Array) -> jax.Array:
    """Inverse of `to_microbatches`."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _stage_view(layers: Any, stages: int, repeats: int) -> Any:
    """[L, ...] -> [stages, repeats, L/(stages*repeats), ...]: stage s, repeat j holds layers
    (j*stages + s)*Lr ... in circular order (for repeats=1 a free reshape of the sharded axis)."""

    def view(w: jax.Array) -> jax.Array:
        per = w.shape[0] // (stages * repeats)
        w = w.reshape(repeats, stages, per, *w.shape[1:])
        return jnp.swapaxes(w, 0, 1)

    return jax.tree.map(view, layers)


def _shift_next(x: Any, stages: int) -> Any:
    """Send to stage s+1 (the last stage sends to stage 0, used by circular's next repeat)."""
    return lax.ppermute(x, "stage", [(s, (s + 1) % stages) for s in range(stages)])


def scan_pipeline(
    layers_gdef: nnx.GraphDef,
    layers: Any,
    h_m: jax.Array,
    *,
    mesh: jshard.Mesh,
    schedule: Schedule,
    wrap: Callable | None,
) -> jax.Array:
    """gpipe / circular forward of the layer stack over micro-batches ``h_m: [m, b, ...]``.

    Returns the last stage's outputs ``[m, b, ...]``. Differentiated by autodiff through the scan.
    """
    p, m, r, ticks = schedule.stages, schedule.microbatches, schedule.repeats, schedule.ticks
    stage_layers = _stage_view(layers, p, r)

    def run(w: Any, h_m: jax.Array) -> jax.Array:
        # This stage's [r, L/(p r), ...]. Cast to data-varying here, outside the tick loop: the
        # transpose of this cast is the data-parallel gradient psum, which then runs once per
        # step instead of once per tick (XLA otherwise reduces each tick's weight gradient).
        w = jax.tree.map(lambda a: lax.pcast(a[0], "data", to="varying"), w)
        sid = lax.axis_index("stage")
        # Hoisted so the transpose (a psum over stage of the input cotangent) runs once per step.
        h_m = lax.pcast(h_m, "stage", to="varying")

        @jax.checkpoint  # a stage keeps only its input per micro-batch; backward recomputes
        def apply(j: jax.Array, h: jax.Array) -> jax.Array:
            block = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, 0, keepdims=False), w)
            return _apply_layers(layers_gdef, block, h, wrap)

        def tick(carry: tuple, t: jax.Array) -> tuple[tuple, jax.Array]:
            arriving, circ = carry
            k = t - sid  # position of this stage's work in its repeat-major stream
            valid = (k >= 0) & (k < r * m)
            i, j = k % m, jnp.clip(k // m, 0, r - 1)
            # Stage 0 takes a fresh micro-batch in repeat 0 and its own last-stage output later.
            fresh = h_m[jnp.clip(i, 0, m - 1)]
            first = fresh if r == 1 else jnp.where(j == 0, fresh, circ[i])
            x = jnp.where(sid == 0, first, arriving)
            # Bubble ticks compute on zeros: no NaN, and no cotangent reaches a real value.
            x = jnp.where(valid, x, jnp.zeros_like(x))
            y = apply(j, x)
            sent = _shift_next(y, p)
            # Stage 0 keeps what the last stage finished (micro-batch i of repeat j) for repeat j+1.
            done = t - (p - 1)
            keep = (sid == 0) & (done >= 0)
            circ = (
                jnp.where(keep, circ.at[jnp.clip(done % m, 0, m - 1)].set(sent), circ)
                if r > 1
                else circ
            )
            return (sent, circ), y

        zeros = jnp.zeros_like(h_m[0])
        circ0 = jnp.zeros_like(h_m) if r > 1 else jnp.zeros((0,), h_m.dtype)
        _, ys = lax.scan(
            tick,
            (zeros, circ0),
            jnp.arange(ticks),
        )
        outs = ys[ticks - m :]  # last stage, final repeat: micro-batches 0..m-1 in order
        return lax.psum(jnp.where(sid == p - 1, outs, jnp.zeros_like(outs)), "stage")

    spec_layers = jax.tree.map(lambda _: P("stage"), stage_layers)
    # Manual over stage (the schedule) and data (so the gradient psum can be placed); fsdp and
    # tensor stay automatic inside each stage.
    batch_spec = P(None, "data")
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(spec_layers, batch_spec),
        out_specs=batch_spec,
        axis_names={"stage", "data"},
    )(stage_layers, h_m)


def _apply_layers(
    layers_gdef: nnx.GraphDef, block: Any, h: jax.Array, wrap: Callable | None
) -> jax.Array:
    """Apply a stack of layers (leading axis) to h with a scan, each layer wrapped by `wrap`."""

    def body(h: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        return nnx.merge(layers_gdef, layer)(h), None

    if wrap is not None:
        body = wrap(body)
    h, _ = lax.scan(body, h, block)
    return h


def pipelined_loss(
    model: nnx.Module,
    batch: dict[str, jax.Array],
    spec: PipelineSpec,
    schedule: Schedule,
    mesh: jshard.Mesh,
    wrap: Callable | None,
) -> jax.Array:
    """The model's loss with its layer stack pipelined over ``stage``."""
    h_m = to_microbatches(model.embed(batch[spec.input_key]), schedule.microbatches, mesh)
    layers_gdef, layers = nnx.split(model.layers)
    if schedule.name == "1f1b":
        return _loss_1f1b(model, batch, spec, schedule, mesh, wrap, h_m)
    out = scan_pipeline(layers_gdef, layers, h_m, mesh=mesh, schedule=schedule, wrap=wrap)
    return spec.loss_from_logits(model.head(from_microbatches(out)), batch)


def _loss_1f1b(
    model: nnx.Module,
    batch: dict[str, jax.Array],
    spec: PipelineSpec,
    schedule: Schedule,
    mesh: jshard.Mesh,
    wrap: Callable | None,
    h_m: jax.Array,
) -> jax.Array:
    graphdef, state = nnx.split(model)
    layers_gdef = nnx.split(model.layers)[0]
    p = schedule.stages
    layers = jax.tree.map(lambda w: w.reshape(p, w.shape[0] // p, *w.shape[1:]), state["layers"])
    rest = nnx.State({k: v for k, v in state.items() if k != "layers"})
    # The head never touches the layers: merge with shapes only, so no layer array is captured.
    layer_shapes = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype), state["layers"])

    def stage_fn(w: Any, x: jax.Array) -> jax.Array:
        return _apply_layers(layers_gdef, w, x, wrap)

    def head_loss(rest: Any, y: jax.Array, batch_i: dict) -> jax.Array:
        full = nnx.State({**dict(rest), "layers": layer_shapes})
        return spec.loss_from_logits(nnx.merge(graphdef, full).head(y), batch_i)

    batch_m = {k: to_microbatches(v, schedule.microbatches, mesh) for k, v in batch.items()}
    return one_f_one_b(
        stage_fn, head_loss, layers, rest, h_m, batch_m, mesh=mesh, schedule=schedule
    )


__all__ = [
    "PipelineConfigError",
    "PipelineSpec",
    "check_pipeline",
    "from_microbatches",
    "pipelined_loss",
    "scan_pipeline",
    "to_microbatches",
]
