"""Sharding constraints that also hold inside a manual region: a pipeline's stages.

A pipeline runs each stage's layers inside a `jax.shard_map` that is manual over ``stage`` and
``data``, and over ``context`` when the sequence is split there (`sharding.pipeline`). Megatron
sequence parallelism pins the layers' activations with sharding constraints, which inside such a
region may name only the axes still automatic, on the current abstract mesh: `constrain` trims
the others from the spec. The context kernels read `manual_axes` to run on the region's own
slice of the sequence (`sharding.context`) instead of opening a shard_map of their own (a
shard_map nested in the pipeline's cannot be differentiated on jax 0.10.2: the residuals of its
partial evaluation are laid out over the outer region's manual axes too, which the compiler
refuses).

Outside any manual region `constrain` is the plain constraint, so a step without a pipeline
compiles exactly as before.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import sharding as jshard

P = jshard.PartitionSpec


def manual_axes() -> frozenset[str]:
    """The mesh axes an enclosing `jax.shard_map` has made manual (empty outside one)."""
    return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def trim(spec: P, gone: frozenset[str]) -> P:
    """``spec`` without the axes in ``gone`` (an entry left with no axis becomes None)."""

    def entry(e: Any) -> Any:
        if e is None:
            return None
        kept = tuple(a for a in ((e,) if isinstance(e, str) else e) if a not in gone)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(entry(e) for e in spec))


def constrain(x: jax.Array, mesh: jshard.Mesh, spec: P) -> jax.Array:
    """``with_sharding_constraint(x, NamedSharding(mesh, spec))``, inside a manual region on the
    axes still automatic there."""
    gone = manual_axes()
    if not gone:
        return jax.lax.with_sharding_constraint(x, jshard.NamedSharding(mesh, spec))
    abstract = jax.sharding.get_abstract_mesh()
    return jax.lax.with_sharding_constraint(x, jshard.NamedSharding(abstract, trim(spec, gone)))


__all__ = ["constrain", "manual_axes", "trim"]
