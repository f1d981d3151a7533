"""Type and range checks at the core's public boundaries, before anything traces or compiles.

A wrong type passed to `resolve`, `explain` or `compile_train_step` would otherwise surface deep
inside JAX as ``'str' object has no attribute 'shape'``; here it is a typed error naming the
argument, what was given and how to build the right thing.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from jax import sharding as jshard

from partition_rules import AxisMap, Rules
from sharding._errors import SpmdkitError
from sharding._mesh import MeshSpec, MeshSpecError


class ArgumentTypeError(SpmdkitError, TypeError):
    """A public function got an argument of the wrong kind (also a `TypeError`)."""


class StepConfigError(SpmdkitError):
    """A training step that cannot be built as asked."""


class StepArgumentError(StepConfigError):
    """A numeric argument of the step compiler out of its range."""


def _given(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_mesh(fn: str, mesh: Any, *, spec_ok: bool = False) -> None:
    """``mesh`` is a jax Mesh (or, with ``spec_ok``, also an AbstractMesh or a resolved MeshSpec)."""
    kinds: tuple[type, ...] = (jshard.Mesh,)
    if spec_ok:
        kinds = (jshard.Mesh, jshard.AbstractMesh, MeshSpec)
    if isinstance(mesh, kinds):
        if isinstance(mesh, MeshSpec) and -1 in mesh.sizes.values():
            raise MeshSpecError(
                f"{fn}(mesh={mesh!s}): the spec has a -1 axis; resolve it first, e.g. "
                f"MeshSpec.parse('{mesh!s}').resolve(8)"
            )
        return
    hint = (
        f"make_mesh({str(mesh)!r})" if isinstance(mesh, str | MeshSpec | dict) else "make_mesh(...)"
    )
    also = " or a MeshSpec (no devices needed)" if spec_ok else ""
    without = "" if spec_ok else " (sharding.explain places on a MeshSpec without devices)"
    raise ArgumentTypeError(
        f"{fn}(mesh=...): expected a jax.sharding.Mesh{also}, got {_given(mesh)}; build one with "
        f"sharding.{hint}{without}"
    )


def check_rules(fn: str, rules: Any, axis_map: Any) -> None:
    if not isinstance(rules, Rules):
        raise ArgumentTypeError(
            f"{fn}(rules=...): expected partition_rules.Rules, got {_given(rules)}; write "
            f"Rules([(regex, axes), ...]) or take a preset: rules, axis_map = "
            f"partition_rules.preset('llama', 'fsdp')"
        )
    if not isinstance(axis_map, AxisMap):
        raise ArgumentTypeError(
            f"{fn}(axis_map=...): expected partition_rules.AxisMap, got {_given(axis_map)}; write "
            f"AxisMap({{'embed': 'fsdp'}}) or partition_rules.strategy('fsdp')"
        )


def check_callable(fn: str, name: str, value: Any, what: str) -> None:
    if not callable(value):
        raise ArgumentTypeError(f"{fn}({name}=...): expected {what}, got {_given(value)}")


def check_optimizer(fn: str, optimizer: Any) -> None:
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise ArgumentTypeError(
            f"{fn}(optimizer=...): expected an optax GradientTransformation (with init and "
            f"update), got {_given(optimizer)}; e.g. optax.adamw(1e-3)"
        )


def check_positive_int(fn: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StepArgumentError(f"{fn}({name}={value!r}): give an integer >= 1")


def check_clip(fn: str, clip_norm: Any) -> None:
    if clip_norm is None:
        return
    if (
        isinstance(clip_norm, bool)
        or not isinstance(clip_norm, int | float)
        or not (math.isfinite(clip_norm) and clip_norm > 0)
    ):
        raise StepArgumentError(
            f"{fn}(clip_norm={clip_norm!r}): give a finite norm > 0, or None for no clipping"
        )


def check_batch_shapes(fn: str, batch_shapes: Any) -> None:
    ok = (
        isinstance(batch_shapes, dict)
        and batch_shapes
        and all(
            hasattr(v, "shape") and hasattr(v, "dtype") and len(v.shape) >= 1
            for v in batch_shapes.values()
        )
    )
    if not ok:
        raise ArgumentTypeError(
            f"{fn}(batch_shapes=...): expected a non-empty dict of name -> "
            f"jax.ShapeDtypeStruct with the batch as dimension 0, got {_given(batch_shapes)}; "
            f"e.g. models.llama.batch_shapes(cfg, 16, 64)"
        )


def takes_remat(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` accepts the ``remat=`` keyword (a named parameter or ``**kwargs``)."""
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: assume it follows the contract
        return True
    return any(p.name == "remat" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
