"""The user's loss with its layer stack pipelined: the seam between the model and the pipeline.

The stack's call is taken over (`sharding._stack`), so everything before and after it, the
user's loss included, is exactly the user's function. gpipe and circular run the whole loss once
with the stack replaced by `scan_pipeline`; 1f1b, interleaved and zb-h1 split the loss at the
stack and run what follows it per micro-batch on the last stage (`explicit_pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax import sharding as jshard

from sharding._stack import (
    LayerFn,
    StackCall,
    StackCarryError,
    join_state,
    split_state,
    taken_over,
)
from sharding.pipeline._balance import layer_slots
from sharding.pipeline._explicit import explicit_pipeline
from sharding.pipeline._scan import (
    PipelineConfigError,
    rows_over_stages,
    scan_pipeline,
    stage_view,
    to_microbatches,
)
from sharding.pipeline._schedule import Schedule


@dataclass(frozen=True)
class Extras:
    """The stack call's extra inputs, split into arrays (cut into micro-batches) and the rest.

    Every array must have the batch as its leading axis: it is split into micro-batches with the
    activations, so micro-batch i's rows reach the layers computing micro-batch i.
    """

    arrays: list[jax.Array]
    rebuild: Callable[[list], tuple[tuple, dict]]

    @classmethod
    def of(cls, call: StackCall, path: str) -> Extras:
        leaves, treedef = jax.tree.flatten((call.args, call.kwargs))
        h = activations(call)
        rows = h.shape[0]
        where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]
        for i in where:
            x = leaves[i]
            if x.ndim == 0 or x.shape[0] != rows:
                name = _leaf_name(call, i)
                raise PipelineConfigError(
                    f"the stack {path!r} is called with {name} of shape {tuple(x.shape)}, but a "
                    f"pipeline cuts every array input of the stack into micro-batches along its "
                    f"first axis, which must be the batch ({rows} rows, as for h "
                    f"{tuple(h.shape)}); broadcast it in the model, e.g. "
                    f"jnp.broadcast_to(x, ({rows}, *x.shape))"
                )

        def rebuild(arrays: list) -> tuple[tuple, dict]:
            out = list(leaves)
            for i, a in zip(where, arrays, strict=True):
                out[i] = a
            return jax.tree.unflatten(treedef, out)

        return cls([leaves[i] for i in where], rebuild)

    def layer_fn(self, call: StackCall, pin: Callable[[nnx.Module], None] | None = None) -> LayerFn:
        """One layer on ``h`` with its extra inputs, its modules pinned by ``pin`` (Megatron
        sequence parallelism's gathers and scatters; nothing without it)."""

        def layer(state: Any, h: jax.Array, arrays: list) -> jax.Array:
            args, kwargs = self.rebuild(arrays)
            module = nnx.merge(call.graphdef, state)
            if pin is not None:
                pin(module)
            return call.layer_call(module, h, *args, **kwargs)

        return layer


@dataclass(frozen=True)
class Whole:
    """The sequence layout of a step that does not split the sequence: the interface
    `sharding._sequence.SequenceLayout` gives a pipeline (``axes`` split the stack's activations,
    ``outer`` the batch and what is outside the stack; ``pin`` a layer's modules; ``enter`` and
    ``leave`` the stack's input and output)."""

    axes: tuple[str, ...] = ()
    outer: tuple[str, ...] = ()

    def pin(self, module: nnx.Module) -> None:
        return None

    def enter(self, h: jax.Array) -> jax.Array:
        return h

    def leave(self, y: jax.Array) -> jax.Array:
        return y


def _leaf_name(call: StackCall, i: int) -> str:
    n_args = len(jax.tree.leaves(call.args))
    if i < n_args:
        return f"extra positional input {i + 1}"
    names = [k for k, v in call.kwargs.items() for _ in jax.tree.leaves(v)]
    return f"{names[i - n_args]}="


def _only_call(calls: list[StackCall], path: str) -> StackCall:
    if len(calls) != 1:
        raise PipelineConfigError(
            f"the loss called the stack {path!r} {len(calls)} times; a pipeline runs the stack "
            f"once per micro-batch, so the model must call it exactly once per loss "
            f"(self.{path.rsplit('/', 1)[-1]}(h, ...))"
        )
    return calls[0]


@dataclass(frozen=True)
class Staging:
    """Where a pipelined step puts everything, answered once by the step compiler
    (`sharding.compile_train_step`'s layout) and read here as it is.

    ``stack``: the layer stack's module path; ``manual``: the axes the stages are manual over
    besides ``stage`` (`replicas`); ``gathered``: the parameters' shardings without ``fsdp``
    (None when fsdp is 1): the stages' weights (and, in the explicit schedules, what the loss
    reads per micro-batch outside the stack) are gathered whole over fsdp once per step as they
    enter, still split over tensor, and their gradients summed once;
    ``stage_layers``: balanced stages (`layer_slots`); ``sequence``: how the strategy splits the
    sequence (`Whole`'s interface: over context the stages are manual over it, over tensor,
    Megatron SP, each layer's modules are pinned and the activations cross stages split);
    ``shardings``: the parameters' shardings (a stack weight split over a manual axis, an
    expert's over ``expert``, enters its stage split so).
    """

    mesh: jshard.Mesh
    stack: str
    schedule: Schedule
    manual: tuple[str, ...]
    gathered: Any = None
    stage_layers: tuple[int, ...] | None = None
    sequence: Any = Whole()
    shardings: Any = None

    @property
    def dims(self) -> list | None:
        """Per stack weight (flattened), the manual axes that split its own dimensions (after
        the layer axis), None for one they do not; None when none is split so."""
        shardings = self.gathered if self.gathered is not None else self.shardings  # as entered
        if shardings is None:
            return None
        manual = self.manual
        kept = lambda e: tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a in manual)  # noqa: E731
        dims = []
        for sh in jax.tree.leaves(split_state(shardings, self.stack)[0]):
            own = tuple((k[0] if len(k) == 1 else k) if (k := kept(e)) else None
                        for e in tuple(sh.spec)[1:])  # fmt: skip
            dims.append(own if any(own) else None)
        return dims if any(dims) else None

    @property
    def whole(self) -> tuple[Any, Any]:
        """(the stack's, the rest's) shardings whole over fsdp, (None, None) without fsdp."""
        return (None, None) if self.gathered is None else split_state(self.gathered, self.stack)

    @property
    def slots(self) -> tuple[int, ...] | None:
        """``stage_layers`` where the stages are unequal, None for equal ones."""
        if self.stage_layers is None or len(set(self.stage_layers)) == 1:
            return None
        return self.stage_layers


def pipelined_loss(
    loss_fn: Callable[[nnx.Module, dict], jax.Array],
    model: nnx.Module,
    batch: dict[str, jax.Array],
    where: Staging,
    wrap: Callable | None,
) -> jax.Array:
    """``loss_fn(model, batch)``, the user's function as written, with the stack at module path
    ``where.stack`` pipelined over ``stage`` as ``where`` places it (`Staging`); ``wrap``: each
    layer's remat policy.

    gpipe and circular run the whole loss once with the stack's call replaced by the pipeline.
    1f1b, interleaved and zb-h1 run the part after the stack per micro-batch on the last stage
    and average: exact for a loss that is a mean over the batch's rows (plus terms that read no
    stack weight).
    """
    if where.schedule.explicit:
        return _loss_explicit(loss_fn, model, batch, where, wrap)
    stack, schedule, mesh, layout = where.stack, where.schedule, where.mesh, where.sequence
    stage_layers, dims = where.slots, where.dims
    m = schedule.microbatches

    def run(call: StackCall) -> Any:
        extras = Extras.of(call, stack)
        h, sides = activations(call), side_values(call, stack)
        if sides:
            check_added(extras.layer_fn(call), call.state, h, sides, extras.arrays, stack)
        seq = _seq_len(h)
        h_m = to_microbatches(layout.enter(h), m, mesh, layout.axes, seq)
        extras_m = [to_microbatches(x, m, mesh, layout.outer, seq) for x in extras.arrays]
        layers = _gather(call.state, where.whole[0])  # once per step, whole over fsdp
        # What follows the stack runs on 1/p of each data shard's rows per stage (as MaxText's
        # head runs over all devices), not on all of them on every stage: the last stage's
        # rows are reduce-scattered over the stages rather than all-reduced to each.
        slots = None if stage_layers is None else layer_slots(stage_layers, schedule.stages,
                                                              schedule.repeats)  # fmt: skip
        out = scan_pipeline(extras.layer_fn(call, layout.pin), layers, h_m, extras_m, mesh=mesh,
                            schedule=schedule, wrap=wrap, rows=True, slots=slots,
                            sequence=layout.outer, sides=sides, dims=dims,
                            manual=where.manual, spread="tensor" not in layout.axes)  # fmt: skip
        y = rows_over_stages(layout.leave(out[0] if sides else out), mesh, layout.outer, seq)
        if not sides:
            return y
        return (y, *(s + mean.astype(s.dtype) for s, mean in zip(sides, out[1:], strict=True)))

    with taken_over(model, stack, run) as calls:
        value = loss_fn(model, batch)
    _only_call(calls, stack)
    return value


def _loss_explicit(
    loss_fn: Callable[[nnx.Module, dict], jax.Array],
    model: nnx.Module,
    batch: dict[str, jax.Array],
    where: Staging,
    wrap: Callable | None,
) -> jax.Array:
    stack, schedule, mesh, layout = where.stack, where.schedule, where.mesh, where.sequence
    stage_layers = where.slots
    p, m, r = schedule.stages, schedule.microbatches, schedule.repeats
    graphdef, state = nnx.split(model)

    def passthrough(call: StackCall) -> jax.Array:
        if isinstance(call.carry, tuple):
            raise StackCarryError(
                f"the stack {stack!r} carries side values past its activations ((h, aux): a "
                f"mixture of experts' load-balancing loss, say); {schedule.name} runs what "
                f"follows the stack per micro-batch on the last stage and passes activations "
                f"alone between stages. Use --schedule gpipe or circular, which carry the side "
                f"values (each stage adds its layers' terms)"
            )
        return call.carry

    # The stack's input: the user's loss traced with the stack passing its input through. Only
    # the part before the stack is used (XLA drops the rest as dead code).
    with taken_over(model, stack, passthrough) as calls:
        loss_fn(model, batch)
    call = _only_call(calls, stack)
    extras = Extras.of(call, stack)
    _, rest = split_state(state, stack)
    # The stages' weights and what the loss reads per micro-batch outside the stack, gathered
    # whole over fsdp once per step.
    rest, layers, valid = _gather(rest, where.whole[1]), _gather(call.state, where.whole[0]), None
    if stage_layers is None:
        layers = stage_view(layers, p, r)
    else:  # stage s, chunk c holds layer_slots' index[s, c]; spare slots are skipped
        index, valid = layer_slots(stage_layers, p, r)
        layers = jax.tree.map(lambda w: w[jnp.asarray(index)], layers)
    # After the stack nothing may read a layer weight: the last stage holds only its own.
    layer_shapes = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype), call.state)

    def head_loss(rest: Any, y: jax.Array, batch_i: dict, stack_state: Any = layer_shapes):
        model_i = nnx.merge(graphdef, join_state(stack_state, rest, stack))
        with taken_over(model_i, stack, lambda _: layout.leave(y)) as calls:
            value = loss_fn(model_i, batch_i)
        _only_call(calls, stack)
        return value

    def embed(rest: Any, batch_i: dict, stack_state: Any = layer_shapes) -> jax.Array:
        """The stack's input for one micro-batch: the loss up to the stack (XLA drops the rest)."""
        model_i = nnx.merge(graphdef, join_state(stack_state, rest, stack))
        with taken_over(model_i, stack, lambda c: c.h) as calls:
            loss_fn(model_i, batch_i)
        return _only_call(calls, stack).h

    seq = _seq_len(call.h)
    batch_m = {k: to_microbatches(v, m, mesh, layout.outer, seq) for k, v in batch.items()}
    y_i = jax.ShapeDtypeStruct((call.h.shape[0] // m, *call.h.shape[1:]), call.h.dtype)
    b_i = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in batch_m.items()}
    if reads_inputs(lambda st, r, y, b: head_loss(r, y, b, st), (call.state, rest, y_i, b_i)):
        raise PipelineConfigError(
            f"the loss reads weights of the stack {stack!r} outside the stack's call (a penalty "
            f"on the layer weights, say); {schedule.name} runs what follows the stack per "
            f"micro-batch on the last stage, which holds only its own layers. Put the penalty in "
            f"the optimizer (optax.add_decayed_weights) or use schedule 'gpipe' or 'circular', "
            f"which run the loss exactly as written"
        )
    extras_m = [to_microbatches(x, m, mesh, layout.outer, seq) for x in extras.arrays]
    # What precedes the stack runs per micro-batch on the first stage, so no activation of the
    # whole batch is ever held: the step's temporaries stay flat in the micro-batch count.
    if reads_inputs(lambda st, r, b: embed(r, b, st), (call.state, rest, b_i)):
        raise PipelineConfigError(
            f"the stack {stack!r}'s input is computed from the stack's own weights; "
            f"{schedule.name} computes it per micro-batch on the first stage, which holds only "
            f"its own layers. Compute the input without the layer weights, or use schedule "
            f"'gpipe' or 'circular', which run the loss exactly as written"
        )
    return explicit_pipeline(extras.layer_fn(call, layout.pin), wrap, head_loss, embed, layers,
                             rest, extras_m, batch_m, mesh=mesh, schedule=schedule, valid=valid,
                             sequence=layout.outer, seq=seq, enter=layout.enter, dims=where.dims,
                             manual=where.manual, spread="tensor" not in layout.axes)  # fmt: skip


def activations(call: StackCall) -> jax.Array:
    """The activations the stack carries (its carry, or the first value of a tuple carry)."""
    return call.carry[0] if isinstance(call.carry, tuple) else call.carry


def side_values(call: StackCall, path: str) -> tuple:
    """The side values a tuple carry holds past the activations, refused unless each is a
    floating-point array a layer can add its own term to."""
    if not isinstance(call.carry, tuple):
        return ()
    sides = tuple(call.carry[1:])
    for i, x in enumerate(sides):
        if not (isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.inexact)):
            raise StackCarryError(
                f"the stack {path!r} carries {type(x).__name__} "
                f"{getattr(x, 'dtype', '')} as side value {i + 1} of its (h, ...) carry; a "
                f"pipeline sums the side values' per-layer terms, so each must be a "
                f"floating-point array (an auxiliary loss), or the model must keep it out of "
                f"the carry"
            )
    return sides


# Primitives that move or re-type a value without changing it (what a sharding pin adds).
_LAYOUT_ONLY = frozenset({"reshard", "sharding_constraint", "copy", "copy_p", "pvary", "pcast",
                          "convert_element_type"})  # fmt: skip


def check_added(layer_fn: LayerFn, state: Any, h: jax.Array, sides: tuple, arrays: list,
                path: str) -> None:  # fmt: skip
    """Refuse side values a layer does not just add its own term to.

    A pipeline's stages each start a micro-batch's side values from zeros and the terms are
    summed afterwards, which is the layers' own computation only if each returns ``side +
    term(h)``: the derivative of a side value out with respect to the one in is then the
    identity, which the linearized layer shows as its input passed straight through (traced
    abstractly on the first layer; nothing runs).
    """
    first = jax.tree.map(lambda a: a[0], state)

    def out(side: tuple) -> tuple:
        return tuple(layer_fn(first, (h, *side), arrays)[1:])

    _, linear = jax.linearize(out, sides)
    jaxpr = jax.make_jaxpr(linear)(sides).jaxpr
    alias = {v: v for v in jaxpr.invars}  # each value that is an input, moved but not changed
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _LAYOUT_ONLY and len(eqn.invars) == 1 and eqn.invars[0] in alias:
            alias[eqn.outvars[0]] = alias[eqn.invars[0]]
    if [alias.get(v) for v in jaxpr.outvars] != list(jaxpr.invars):
        raise StackCarryError(
            f"the stack {path!r} carries side values that its layers do not simply add to "
            f"(each layer must return side + its own term, as llama-moe's load-balancing loss "
            f"does): a pipeline's stages compute their terms apart and sum them. Keep the "
            f"value out of the carry, or use a strategy without 'stage'"
        )


def _seq_len(h: jax.Array) -> int | None:
    """The stack's sequence length: dim 1 of activations ``[B, S, D]`` (None otherwise)."""
    return h.shape[1] if h.ndim == 3 else None


def _gather(state: Any, shardings: Any) -> Any:
    """``state`` constrained to ``shardings`` (None, or a tree of another shape: as it is)."""
    if shardings is None or jax.tree.structure(state) != jax.tree.structure(shardings):
        return state
    return jax.tree.map(lax.with_sharding_constraint, state, shardings)


def reads_inputs(fn: Callable, args: tuple) -> bool:
    """Whether ``fn(*args)`` reads any array of ``args[0]`` (traced abstractly, nothing runs)."""
    closed = jax.make_jaxpr(fn)(*args)
    first = set(closed.jaxpr.invars[: len(jax.tree.leaves(args[0]))])
    used = {v for eqn in closed.jaxpr.eqns for v in eqn.invars if not hasattr(v, "val")}
    used |= {v for v in closed.jaxpr.outvars if not hasattr(v, "val")}
    return bool(first & used)


__all__ = ["Extras", "Staging", "Whole", "pipelined_loss", "reads_inputs"]
