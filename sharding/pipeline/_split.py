"""Split one layer's backward into the input gradient (zb-h1's B) and the weight gradient (W).

A layer's weight gradients need the gradients at the outputs of the operations that use each
weight, and most of those lie on the path from the layer's output gradient to its input
gradient: running the whole backward twice, once for each, would repeat every matmul of that
path. So the backward's jaxpr is cut in two. B runs the equations the input gradient needs and
hands over every value of its own that W's equations read (the boundary: gradients at the
weights' outputs, mostly); W runs only the equations left, the weight-gradient matmuls. Together
they execute each equation of the backward once.

The cut is made on the jaxpr traced from the actual values (so their sharding types carry over)
in every trace that needs it; tracing is deterministic, so B's boundary and W's inputs line up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _is_drop(v: Any) -> bool:
    return type(v).__name__ == "DropVar"


class Split:
    """The equations of ``fn(*args)``'s jaxpr that its first ``n_w`` outputs alone need (W), and
    the others (B), with the values B hands over to W.

    ``args`` are the actual (traced) arguments; ``keep`` the indices of those W receives itself
    (the layer's weights and residuals): any other argument W reads becomes part of the boundary.
    """

    def __init__(self, fn: Callable, args: Sequence[Any], n_w: int, keep: set[int]):
        flat, self.in_tree = jax.tree.flatten(list(args))
        nested = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(self.in_tree, xs)))(*flat)
        # Calls inlined (a remat'd layer's recompute is one `checkpoint` equation, a jitted
        # helper one `pjit`): the cut can then fall inside them.
        self.closed = jax.make_jaxpr(
            lambda *xs: _evaluate(nested.jaxpr, nested.consts, list(xs), inline=True)
        )(*flat)
        jaxpr = self.closed.jaxpr
        self.n_w = n_w
        outs = jaxpr.outvars
        need_b = {v for v in outs[n_w:] if not _is_literal(v)}
        self.b_eqns, w_side = [], []
        for eqn in reversed(jaxpr.eqns):
            if any(v in need_b for v in eqn.outvars if not _is_drop(v)):
                self.b_eqns.append(eqn)
                need_b.update(v for v in eqn.invars if not _is_literal(v))
            else:
                w_side.append(eqn)
        self.b_eqns.reverse()
        need_w = {v for v in outs[:n_w] if not _is_literal(v)}
        self.w_eqns = []
        for eqn in w_side:  # reversed order: a consumer before its producers
            if any(v in need_w for v in eqn.outvars if not _is_drop(v)):
                self.w_eqns.append(eqn)
                need_w.update(v for v in eqn.invars if not _is_literal(v))
        self.w_eqns.reverse()
        produced_w = {v for e in self.w_eqns for v in e.outvars}
        owner = [a for a, x in enumerate(args) for _ in jax.tree.leaves(x)]  # flat input -> arg
        kept_in = {v for v, a in zip(jaxpr.invars, owner, strict=True) if a in keep}
        consts = set(jaxpr.constvars)
        # In the jaxpr's own order (sets iterate in no fixed order across traces).
        made = [*jaxpr.invars, *(v for e in self.b_eqns for v in e.outvars)]
        self.boundary = [v for v in made if v in need_w and v not in produced_w
                         and v not in kept_in and v not in consts]  # fmt: skip
        self.kept_in = [v for v in jaxpr.invars if v in kept_in]

    def input_grads(self, args: Sequence[Any]) -> tuple[list, list]:
        """B: ``(outputs after the first n_w, boundary values)``."""
        env = self._env(jax.tree.leaves(list(args)), self.closed.jaxpr.invars)
        _run(self.b_eqns, env)
        outs = [_read(env, v) for v in self.closed.jaxpr.outvars[self.n_w :]]
        return outs, [env[v] for v in self.boundary]

    def weight_grads(self, kept: Sequence[Any], boundary: Sequence[Any]) -> list:
        """W: the first ``n_w`` outputs from the arguments W keeps and B's boundary values."""
        env = self._env(jax.tree.leaves(list(kept)), self.kept_in)
        env.update(zip(self.boundary, boundary, strict=True))
        _run(self.w_eqns, env)
        return [_read(env, v) for v in self.closed.jaxpr.outvars[: self.n_w]]

    def _env(self, values: list, invars: list) -> dict:
        env = dict(zip(self.closed.jaxpr.constvars, self.closed.consts, strict=True))
        env.update(zip(invars, values, strict=True))
        return env


def _read(env: dict, v: Any) -> Any:
    if _is_literal(v):
        return jnp.broadcast_to(jnp.asarray(v.val, v.aval.dtype), v.aval.shape)
    return env[v]


_CALLS = (
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "checkpoint",
    "remat",
    "remat2",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
)


def _inner(eqn: Any) -> tuple[Any, Any] | None:
    """(jaxpr, consts) of a call-like equation whose body can be evaluated in place, else None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if inner is not None:
            return (inner.jaxpr, inner.consts) if hasattr(inner, "jaxpr") else (inner, ())
    return None


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: list, *, inline: bool) -> list:
    """``jaxpr`` evaluated on ``args``; with ``inline``, call-like equations run their bodies."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        inner = _inner(eqn) if inline else None
        if inner is None:
            _run([eqn], env)
            continue
        outs = _evaluate(inner[0], inner[1], [_read(env, v) for v in eqn.invars], inline=True)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not _is_drop(v):
                env[v] = x
    return [_read(env, v) for v in jaxpr.outvars]


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over: ``aval.vma``, which jax 0.10 keeps in
    ``aval.manual_axis_type.varying`` and jax 0.12 in ``aval.mat.varying``."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    for holder in ("mat", "manual_axis_type"):
        if vma is None:
            vma = getattr(getattr(aval, holder, None), "varying", None)
    return frozenset(vma or ())


def _already_varying(eqn: Any, invals: list, env: dict) -> bool:
    """A ``pvary`` whose operands already vary over its axes: a remat body inlined on values the
    surrounding lane made varying (zb-h1's split backward). The cast is then the identity, and
    its outputs are its inputs."""
    axes = set(eqn.params.get("axes", ()))
    if not all(axes <= varying_axes(x) for x in invals):
        return False
    for v, x in zip(eqn.outvars, invals, strict=True):
        if not _is_drop(v):
            env[v] = x
    return True


def _vary_alike(values: list) -> list:
    """``values`` cast to vary over the same manual axes, the union of theirs
    (`lax.pcast(..., to="varying")`, the identity on values): what the original body's own
    casts did before it was inlined."""
    arrays = [x for x in values if hasattr(x, "dtype")]
    union = frozenset().union(*(varying_axes(x) for x in arrays))
    return [jax.lax.pcast(x, tuple(sorted(union - varying_axes(x))), to="varying")
            if hasattr(x, "dtype") and union - varying_axes(x) else x for x in values]  # fmt: skip


def _run(eqns: list, env: dict) -> None:
    """Evaluate ``eqns`` in order, reading and writing ``env`` (as `jax.core.eval_jaxpr`)."""
    for eqn in eqns:
        invals = [_read(env, v) for v in eqn.invars]
        if eqn.primitive.name == "pvary" and _already_varying(eqn, invals, env):
            continue
        params = eqn.primitive.get_bind_params(eqn.params)
        if isinstance(params, tuple):  # older jax: (subfuns, params)
            subfuns, params = params
            invals = [*subfuns, *invals]
        try:
            outs = eqn.primitive.bind(*invals, **params)
        except ValueError as err:  # a remat body inlined on values a lane made varying
            if "varying manual axes" not in str(err):
                raise
            outs = eqn.primitive.bind(*_vary_alike(invals), **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not _is_drop(v):
                env[v] = x
