"""The layer stack as a seam: find it by module path and take over its call.

A model names where it splits into pre-stack / stack / post-stack by one module path (the
workload's ``stack``, e.g. ``"layers"`` or ``"decoder/blocks"``). The stack is a module whose
parameters all carry the layer count as their leading axis (`models.layers.make_stacked` builds
one) and the model applies it with one call, ``self.blocks(h, *extras, **kw_extras)``.

spmdkit never rewrites the user's forward or loss. While the user's loss is traced, the stack's
instance gets a subclass whose ``__call__`` runs spmdkit's version of the same computation: the
layers one by one under a remat policy with the activations pinned to the batch sharding, or the
layers pipelined over the ``stage`` axis. Everything before and after the call, the loss
included, is the user's code as written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from sharding._checks import StepConfigError


class StackError(StepConfigError):
    """The workload's ``stack`` does not name a stacked module the model calls once."""


class StackCarryError(StackError):
    """A stack whose layers carry more than one array (``(h, aux)``) where only activations can
    go: a pipeline schedule that runs the loss per micro-batch, or side values that are not
    floating-point arrays."""


@dataclass
class StackCall:
    """One call of the stack: its split module, the carried input and the extra inputs.

    ``carry`` is ``h``, or a tuple ``(h, *side)`` when the layers carry side values past the
    activations (a mixture of experts' load-balancing loss): each layer takes and returns the
    tuple, adding its own term to each side value. The scanned stack and the gpipe and circular
    pipelines run those; ``h`` refuses them where one activation array must go.
    """

    graphdef: nnx.GraphDef
    state: Any
    layer_call: Callable
    carry: Any
    args: tuple
    kwargs: dict
    path: str = "the stack"

    @property
    def h(self) -> jax.Array:
        """The carried activations (what a pipeline moves between stages)."""
        if isinstance(self.carry, tuple):
            raise StackCarryError(
                f"the stack {self.path!r} carries a tuple of {len(self.carry)} values from layer "
                f"to layer (activations and side values such as a mixture of experts' "
                f"load-balancing loss), and this use of it takes one activation array; pipeline "
                f"it with --schedule gpipe or circular, or use a strategy without 'stage'"
            )
        return self.carry

    def apply_layer(self, layer_state: Any, h: jax.Array, args: tuple, kwargs: dict) -> jax.Array:
        """One layer (its state without the leading axis) applied to ``h``."""
        return self.layer_call(nnx.merge(self.graphdef, layer_state), h, *args, **kwargs)


# A layer: (one layer's state, h, its extra inputs as a list of arrays) -> h.
LayerFn = Callable[[Any, jax.Array, list], jax.Array]


def apply_layers(
    layer_fn: LayerFn, block: Any, h: jax.Array, extras: list, wrap: Callable | None
) -> jax.Array:
    """Apply a stack of layers (leading axis) to h with a scan, each layer wrapped by `wrap`.

    ``h`` may be a tuple ``(h, *side)`` (see `StackCall`): `wrap` then sees the activations
    alone, the side values riding through it as inputs and outputs of the wrapped layer.
    """
    if isinstance(h, tuple):

        def one(x: jax.Array, layer_side: tuple) -> tuple[jax.Array, tuple]:
            out = layer_fn(layer_side[0], (x, *layer_side[1]), extras)
            return out[0], tuple(out[1:])

        step = wrap(one) if wrap else one

        def body_side(carry: tuple, layer: Any) -> tuple[tuple, None]:
            x, side = step(carry[0], (layer, carry[1:]))
            return (x, *side), None

        return jax.lax.scan(body_side, h, block)[0]

    def body(h: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        return layer_fn(layer, h, extras), None

    h, _ = jax.lax.scan(wrap(body) if wrap else body, h, block)
    return h


def scan_call(call: StackCall, wrap: Callable | None) -> jax.Array:
    """The stack's own computation (its layers in order, in a scan), each layer under ``wrap``."""
    layer = lambda st, h, _: call.apply_layer(st, h, call.args, call.kwargs)  # noqa: E731
    return apply_layers(layer, call.state, call.carry, [], wrap)


def path_parts(path: str) -> tuple[str, ...]:
    return tuple(p for p in path.split("/") if p)


def find_stack(model: nnx.Module, path: str, *, who: str = "stack") -> nnx.Module:
    """The module at ``path`` ("a/b"), checked to be a stack of identical layers."""
    node: Any = model
    for i, part in enumerate(path_parts(path)):
        child = getattr(node, part, None) if not part.isdigit() else _index(node, int(part))
        if child is None:
            where = "/".join(path_parts(path)[:i]) or "the model"
            kids = [k for k, v in vars(node).items() if isinstance(v, nnx.Module | nnx.List)]
            raise StackError(
                f"{who}={path!r}: {where} has no submodule {part!r}; its submodules are "
                f"{', '.join(kids) or '(none)'}. Name the module that holds the stacked layers"
            )
        node = child
    if isinstance(node, list | tuple | nnx.List):
        raise StackError(
            f"{who}={path!r} is a Python list of {len(node)} blocks; pipelines and toolkit remat "
            f"need them stacked on a leading axis and called once. Build it with "
            f"models.layers.make_stacked(lambda rngs: Block(..., rngs=rngs), {len(node)}, rngs) "
            f"and call it as self.{path_parts(path)[-1]}(h, ...) instead of looping; strategies "
            f"without a pipeline or remat also train the list as it is (stack=None)"
        )
    if not isinstance(node, nnx.Module) or layer_class(node) is None:
        raise StackError(
            f"{who}={path!r} is a {type(node).__name__}, not a stack built by "
            f"models.layers.make_stacked; build the layers with make_stacked(make_block, n, "
            f"rngs) so spmdkit knows one layer's call, and call the stack as "
            f"self.{path_parts(path)[-1]}(h, ...)"
        )
    return node


def layer_class(stack: Any) -> type | None:
    """The class of one layer: the stack class's ``layer_class`` attribute (the contract
    `models.layers.make_stacked` implements), None for a module that is not a stack."""
    return getattr(type(stack), "layer_class", None)


def _index(node: Any, i: int) -> Any:
    try:
        return node[i]
    except (TypeError, IndexError, KeyError):
        return None


def n_layers(stack: nnx.Module) -> int:
    """The stack's depth: the leading axis every parameter shares."""
    leading = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(nnx.state(stack))}
    if len(leading) != 1 or None in leading:
        raise StackError(
            f"the stack's parameters disagree on their leading (layer) axis: "
            f"{sorted(map(str, leading))}"
        )
    return leading.pop()


@contextlib.contextmanager
def taken_over(
    model: nnx.Module, path: str, run: Callable[[StackCall], jax.Array]
) -> Iterator[list[StackCall]]:
    """While open, ``model``'s stack at ``path`` calls ``run(StackCall)`` instead of its layers.

    Yields the list of calls made (so a caller can insist on exactly one).
    """
    stack = find_stack(model, path)
    layer_call = layer_class(stack).__call__
    graphdef, state = nnx.split(stack)
    calls: list[StackCall] = []
    original = type(stack)

    def __call__(self, h, *args, remat=None, **kwargs):
        if remat is not None:
            raise StackError(
                f"the model passed remat= to its stack {path!r} while spmdkit applies the remat "
                f"policy itself; call the stack without remat (compile_train_step(remat=...) "
                f"chooses the policy)"
            )
        call = StackCall(graphdef, state, layer_call, h, args, kwargs, path)
        calls.append(call)
        return run(call)

    stack.__class__ = type(original.__name__, (original,), {"__call__": __call__})
    try:
        yield calls
    finally:
        stack.__class__ = original


def split_state(state: Any, path: str) -> tuple[Any, Any]:
    """(the stack's sub-state, everything else) of a model's state (or of a tree shaped like it,
    such as its shardings)."""
    head = _key(state, path_parts(path)[0])
    if not path_parts(path)[1:]:
        return state[head], type(state)({k: v for k, v in state.items() if k != head})
    inside, rest = split_state(state[head], "/".join(path_parts(path)[1:]))
    return inside, type(state)({**dict(state.items()), head: rest})


def join_state(stack_state: Any, rest: Any, path: str) -> Any:
    """Inverse of `split_state`."""
    head = _key(rest, path_parts(path)[0]) if path_parts(path)[0] in rest else path_parts(path)[0]
    tail = "/".join(path_parts(path)[1:])
    value = join_state(stack_state, rest[head], tail) if tail else stack_state
    return type(rest)({**dict(rest.items()), head: value})


def _key(state: Any, part: str) -> Any:
    return int(part) if part not in state and part.isdigit() else part


__all__ = ["LayerFn", "StackCall", "StackCarryError", "StackError", "apply_layers", "find_stack", "join_state", "layer_class", "n_layers", "scan_call", "split_state",
           "taken_over"]  # fmt: skip
