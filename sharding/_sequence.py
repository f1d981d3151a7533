"""The sequence layout of a train step's activations: what a strategy's ``"sequence"`` asks for.

``"sequence"`` names no parameter dimension; it says where dim 1 of the layer stack's
activations ``h[B, S, D]`` (and of the token arrays) goes. On ``context`` the batch and every
activation are split along the sequence (context parallelism; attention is left to GSPMD or to
a distributed kernel). On ``tensor`` it is Megatron sequence parallelism: between a layer's
tensor-parallel matmuls the norms and residual adds run on S/t of the sequence, the inputs of
the column-parallel matmuls are all-gathered and the row-parallel outputs reduce-scattered.
`SequenceLayout` is what `compile_train_step` asks of it: the checks, the layer stack's call and
the batch's shardings. Everything here acts through the stack seam (`sharding._stack`); the
model's code is never changed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx
from jax import sharding as jshard

from sharding._checks import StepConfigError
from sharding._manual import constrain
from sharding._mesh import BATCH_AXES
from sharding._resolve import path_str
from sharding._stack import StackCall, apply_layers, split_state


@dataclass
class SequenceLayout:
    """A strategy's sequence layout on one mesh, as `compile_train_step` uses it.

    ``axes``: the mesh axes of size > 1 the sequence is split over (empty: whole everywhere,
    and nothing here changes the step). ``roles``: the layer's modules that gather or scatter
    the sequence (`sequence_roles`), set by `bind`. ``length``: the stack's sequence length,
    recorded when the loss is first traced.
    """

    mesh: jshard.Mesh
    axes: tuple[str, ...]
    roles: dict[str, str] = field(default_factory=dict)
    seen: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, axis_map: Any, mesh: jshard.Mesh, *, pipeline: Any, stack: str | None,
           kernels: Any = ()):  # fmt: skip
        """The layout ``axis_map`` asks for, refused where none is supported (before tracing);
        ``kernels``: the names of the kernels the step substitutes."""
        axes = sequence_axes(axis_map, mesh)
        check_sequence_split(axes, mesh, pipeline=pipeline, stack=stack, kernels=kernels)
        return cls(mesh, axes)

    def bind(self, params: Any, param_shardings: Any, stack: str | None) -> None:
        """Read the roles of the layer's modules from the stack's parameter layouts."""
        if self.axes:
            self.roles = sequence_roles(params, param_shardings, stack, self.axes)

    def runner(self, wrap: Callable | None) -> Callable[[StackCall], Any] | None:
        """The stack's call under this layout, or None where the sequence is whole."""
        if not self.axes:
            return None
        return functools.partial(sequence_parallel_call, wrap=wrap, mesh=self.mesh,
                                 sequence=self.axes, roles=self.roles, seen=self.seen)  # fmt: skip

    @property
    def outer(self) -> tuple[str, ...]:
        """The axes that split the sequence outside the layers (`outer_sequence_axes`)."""
        return outer_sequence_axes(self.axes)

    def pin(self, module: nnx.Module) -> None:
        """Pin one layer's modules (`sequence_roles`): each role's input gathered or output
        scattered over the sequence, each gathered input gathered once."""
        if self.roles:
            pin_modules(module, self.roles, *_sequence_pins(self.mesh, self.axes))

    def enter(self, h: jax.Array) -> jax.Array:
        """The stack's input as the layers take it: whole over tensor, then split over the
        whole sequence (see `sequence_parallel_call`)."""
        if not self.roles:
            return h
        _, scatter = _sequence_pins(self.mesh, self.axes)
        return scatter(_constrain(h, outer_sequence_axes(self.axes), mesh=self.mesh))

    def leave(self, y: jax.Array) -> jax.Array:
        """The stack's output gathered back over tensor, for the vocabulary-split head."""
        return _sequence_pins(self.mesh, self.axes)[0](y) if self.roles else y

    def batch_shardings(self, batch_shapes: dict) -> tuple[dict, dict]:
        """({name: sharding} of the batch, of its accumulation micro-batches ``[k, B/k, ...]``)."""
        specs = sequence_batch_specs(batch_shapes, self.axes, self.seen[0] if self.seen else None)
        mesh, P = self.mesh, jshard.PartitionSpec
        return ({k: jshard.NamedSharding(mesh, s) for k, s in specs.items()},
                {k: jshard.NamedSharding(mesh, P(None, *s)) for k, s in specs.items()})  # fmt: skip


class SequenceLayoutError(StepConfigError):
    """A strategy that splits the sequence (its ``"sequence"`` entry) where it cannot."""


def sequence_axes(axis_map: Any, mesh: jshard.Mesh) -> tuple[str, ...]:
    """The mesh axes of size > 1 that the strategy's ``"sequence"`` splits the sequence over.

    Empty for a map without the name (hand-written maps, `AxisMap.identity()` of direct rules,
    which place parameters only) and where every axis it names has size 1 on this mesh (tp_sp on
    tensor=1 is tp), so a sequence strategy costs nothing where it cannot split.
    """
    if getattr(axis_map, "is_identity", False) or "sequence" not in axis_map:
        return ()
    entry = axis_map["sequence"]
    named = (entry,) if isinstance(entry, str) else tuple(entry or ())
    sizes = dict(mesh.shape)
    unknown = [a for a in named if a not in sizes]
    if unknown:
        raise SequenceLayoutError(
            f"the axis map sends 'sequence' to {entry!r}, but the mesh has no axis "
            f"{unknown[0]!r}; its axes are {', '.join(sizes)} (context or tensor split a sequence)"
        )
    return tuple(a for a in named if sizes[a] > 1)


def outer_sequence_axes(sequence: tuple[str, ...]) -> tuple[str, ...]:
    """The sequence axes that hold outside the tensor-parallel matmuls: the batch's and those of
    the activations before and after the stack. Megatron SP (``tensor``) splits the sequence only
    between the matmuls of a layer; the token arrays stay whole over tensor, since the embedding
    lookup and the vocabulary-split head need every position of their rows anyway (and int32 ids
    are the smallest thing in the step)."""
    return tuple(a for a in sequence if a != "tensor")


def check_sequence_split(sequence: tuple[str, ...], mesh: jshard.Mesh, *, pipeline: Any,
                         stack: str | None, kernels: Any = ()) -> None:  # fmt: skip
    """Refuse what no sequence layout supports yet, before anything traces."""
    if not sequence:
        return
    sizes = dict(mesh.shape)
    where = " x ".join(f"{a}={sizes[a]}" for a in sequence)
    missing = [k for k in ("attention", "positions") if k not in kernels]
    if pipeline is not None and "context" in sequence and missing:
        raise SequenceLayoutError(
            f"the strategy splits the sequence over {where} inside a pipeline, whose stages run "
            f"each layer on their own slice of the sequence; attention and positions must then "
            f"come from the context kernels, and the step has no {' or '.join(missing)} kernel. "
            f"Use build_program(..., context_method='allgather') (or spmdkit train "
            f"--context-method), or pass kernels= from sharding.context"
        )
    if stack is None:
        raise SequenceLayoutError(
            f"the strategy splits the sequence over {where}, which spmdkit applies to the "
            f"activations of the model's layer stack; name it with stack='<module path>' (e.g. "
            f"stack='layers'), or use a strategy without 'sequence' (dp, fsdp, tp, fsdp_tp)"
        )


def check_sequence_activation(h: Any, sequence: tuple[str, ...], mesh: jshard.Mesh) -> int:
    """The stack's input must be ``[batch, sequence, features]`` with the sequence divisible by
    the devices that split it; returns the sequence length."""
    sizes = dict(mesh.shape)
    where = " x ".join(f"{a}={sizes[a]}" for a in sequence)
    if h.ndim != 3:
        raise SequenceLayoutError(
            f"the strategy splits the sequence over {where}, but the stack's activations have "
            f"shape {tuple(h.shape)}, not [batch, sequence, features]: a workload without a "
            f"sequence (an MLP or a CNN, Workload.seq None) has nothing to split; use a strategy "
            f"without 'sequence' (dp, fsdp, tp, fsdp_tp)"
        )
    seq, split = h.shape[1], math.prod(sizes[a] for a in sequence)
    if seq % split:
        raise SequenceLayoutError(
            f"sequence length {seq} (--seq) is not divisible by {where} = {split} devices that "
            f"split the sequence; use --seq {_round_up(seq, split)} (a multiple of {split}), or "
            f"fewer devices on {' and '.join(sequence)}"
        )
    return seq


def sequence_roles(
    params: Any, param_shardings: Any, stack: str, sequence: tuple[str, ...]
) -> dict[str, str]:
    """{module path inside one layer: "gather" | "scatter"} for Megatron SP's two seams.

    Read from the stack's parameter layouts, whatever the model: a module whose kernel keeps
    its first (input) dimension whole over the sequence's parameter axes (``tensor``) and
    splits a later one is column-parallel, so its input is gathered over the sequence
    ("gather"); one whose first dimension is split and last whole is row-parallel, its output
    a partial sum that is reduce-scattered over the sequence ("scatter"). Kernels are
    ``[in..., out...]`` (`models.layers.Dense`, flax's Linear and DenseGeneral).
    """
    inner = set(sequence) - set(outer_sequence_axes(sequence))
    if not inner:
        return {}
    shardings, _ = split_state(param_shardings, stack)
    shapes, _ = split_state(params, stack)
    on = lambda e: bool(inner & set((e,) if isinstance(e, str) else (e or ())))  # noqa: E731
    kernels: dict[str, tuple] = {}  # module -> the spec of its widest parameter (its kernel)
    leaves = jax.tree_util.tree_flatten_with_path(shardings)[0]
    for (key, sh), leaf in zip(leaves, jax.tree.leaves(shapes), strict=True):
        # Without the leading layer axis; a spec may leave trailing whole dimensions out.
        spec = (tuple(sh.spec) + (None,) * len(leaf.shape))[1 : len(leaf.shape)]
        module = path_str(key).rpartition("/")[0]
        if len(spec) >= 2 and len(spec) > len(kernels.get(module, ())):
            kernels[module] = spec  # a bias [N, H] is narrower than its kernel [D, N, H]
    roles: dict[str, str] = {}
    for module, spec in kernels.items():
        if not on(spec[0]) and any(on(e) for e in spec[1:]):
            roles[module] = "gather"
        elif on(spec[0]) and not on(spec[-1]):
            roles[module] = "scatter"
    return roles


def _constrain(x: jax.Array, axes: tuple[str, ...], *, mesh: jshard.Mesh) -> jax.Array:
    """``x[B, S, ...]`` constrained to ``P(BATCH_AXES, axes, None, ...)`` (inside a pipeline's
    stages, on the axes still automatic there)."""
    seq = (axes[0] if len(axes) == 1 else axes) if axes else None
    return constrain(x, mesh, jshard.PartitionSpec(BATCH_AXES, seq, *([None] * (x.ndim - 2))))


@functools.cache
def _sequence_pins(mesh: jshard.Mesh, sequence: tuple[str, ...]) -> tuple[Callable, Callable]:
    """(gather, scatter) for ``[B, S, ...]`` activations, each with its conjugate backward.

    gather: split over all of ``sequence`` -> split over the outer axes only (all-gather over
    tensor); its backward reduce-scatters the partial-sum cotangent. scatter: a row-parallel
    matmul's partial sum -> split over all of ``sequence`` (reduce-scatter); its backward
    all-gathers the cotangent. Written as custom VJPs because the plain transposes let XLA
    pick other plans in backward (all-gathering weights, all-to-alls between heads and
    sequence) that are not sequence parallelism.
    """
    outer = outer_sequence_axes(sequence)
    constrain = functools.partial(_constrain, mesh=mesh)

    @jax.custom_vjp
    def gather(x: jax.Array) -> jax.Array:
        return constrain(x, outer)

    gather.defvjp(
        lambda x: (gather(x), None), lambda _, g: (constrain(constrain(g, outer), sequence),)
    )

    @jax.custom_vjp
    def scatter(y: jax.Array) -> jax.Array:
        return constrain(y, sequence)

    scatter.defvjp(
        lambda y: (scatter(y), None), lambda _, g: (constrain(constrain(g, sequence), outer),)
    )
    return gather, scatter


def sequence_parallel_call(
    call: StackCall,
    wrap: Callable | None,
    *,
    mesh: jshard.Mesh,
    sequence: tuple[str, ...],
    roles: dict[str, str],
    seen: list[int],
) -> jax.Array:
    """`scan_call` with the sequence split between the layers' matmuls (see `sequence_roles`).

    Pins alone at the layer boundaries are not enough: XLA then keeps the sequence split inside
    the layer and all-gathers the weights instead (measured). So each module `sequence_roles`
    names gets its input gathered or its output scattered, through a subclass of its class on
    the layer's merged instance (the model's code is untouched), and each gathered input is
    gathered once however many modules read it (q, k and v share one all-gather). The stack's
    input is made whole over tensor first (the lookup's partial sums all-reduced, as under tp)
    and sliced onto the sequence; its output is gathered back, so the vocabulary-split head
    sees whole rows.
    """
    # The carry may be (h, *side values), e.g. a mixture of experts' auxiliary loss: the
    # layout applies to h.
    carry = call.carry
    h = carry[0] if isinstance(carry, tuple) else carry
    seen.append(check_sequence_activation(h, sequence, mesh))
    gather, scatter = _sequence_pins(mesh, sequence)

    def layer(state: Any, h: Any, _: list) -> Any:
        module = nnx.merge(call.graphdef, state)
        pin_modules(module, roles, gather, scatter)
        return call.layer_call(module, h, *call.args, **call.kwargs)

    if not roles:
        return apply_layers(layer, call.state, carry, [], wrap)
    # Whole over tensor first: left free, XLA gathers the vocabulary-split table and head instead
    # and looks up and projects S/t of the sequence against whole weights.
    h = scatter(_constrain(h, outer_sequence_axes(sequence), mesh=mesh))
    out = apply_layers(layer, call.state, (h, *carry[1:]) if isinstance(carry, tuple) else h,
                       [], wrap)  # fmt: skip
    return (gather(out[0]), *out[1:]) if isinstance(out, tuple) else gather(out)


def pin_modules(module: nnx.Module, roles: dict[str, str], gather: Callable,
                scatter: Callable) -> None:  # fmt: skip
    """Give each module of one layer that `sequence_roles` names a subclass that gathers its
    input or scatters its output; an input several modules read (q, k, v) is gathered once."""
    gathered: dict[int, tuple[jax.Array, jax.Array]] = {}

    def gather_once(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.ndim < 3:  # tracers are jax.Arrays
            return x
        if id(x) not in gathered:
            gathered[id(x)] = (x, gather(x))  # x kept alive so its id is not reused
        return gathered[id(x)][1]

    for path, sub in nnx.iter_modules(module):
        role = roles.get("/".join(map(str, path)))
        if role:
            sub.__class__ = _pinned_class(type(sub), role, gather_once, scatter)


def _pinned_class(cls: type, role: str, gather: Callable, scatter: Callable) -> type:
    if role == "gather":

        def __call__(self, x, *args, **kwargs):
            return cls.__call__(self, gather(x), *args, **kwargs)

    else:

        def __call__(self, *args, **kwargs):
            y = cls.__call__(self, *args, **kwargs)
            return scatter(y) if isinstance(y, jax.Array) and y.ndim >= 3 else y

    return type(cls.__name__, (cls,), {"__call__": __call__})


def sequence_batch_specs(
    batch_shapes: dict, sequence: tuple[str, ...], seq_len: int | None
) -> dict[str, jshard.PartitionSpec]:
    """Each batch entry's layout: ``P(BATCH_AXES)``, and ``P(BATCH_AXES, outer)`` for an entry of
    rank >= 2 whose dim 1 is the sequence when the strategy splits it outside the layers."""
    outer = outer_sequence_axes(sequence)
    seq = (outer[0] if len(outer) == 1 else outer) if outer else None
    return {
        k: jshard.PartitionSpec(BATCH_AXES, seq)
        if seq and len(v.shape) >= 2 and v.shape[1] == seq_len
        else jshard.PartitionSpec(BATCH_AXES)
        for k, v in batch_shapes.items()
    }


def _round_up(n: int, k: int) -> int:
    return max(k, -(-n // k) * k)


__all__ = ["SequenceLayout", "SequenceLayoutError", "outer_sequence_axes", "sequence_axes",
           "sequence_roles"]  # fmt: skip
