"""Abstract and born-sharded model state: shapes without memory, values without a full copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax import sharding as jshard

from partition_rules import AxisMap, Rules
from sharding._resolve import resolve


def _split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leftover = [k for k, _ in nnx.to_flat_state(rest)]
    if leftover:
        names = ", ".join("/".join(map(str, k)) for k in leftover[:5])
        raise ValueError(
            f"{type(model).__name__} holds non-parameter state ({names}); spmdkit models keep only "
            f"nnx.Param leaves so that every leaf has a partition rule"
        )
    return graphdef, params


def abstract_params(make_model: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, parameter State of `jax.ShapeDtypeStruct`s) without allocating anything.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> _, params = abstract_params(lambda: llama.Model(llama.config("70b"), rngs=nnx.Rngs(0)))
        >>> params["lm_head"]["kernel"].shape
        (8192, 32000)
    """
    model = nnx.eval_shape(make_model)
    return _split_params(model)


def init_sharded(
    make_model: Callable[[], nnx.Module], rules: Rules, axis_map: AxisMap, mesh: jshard.Mesh
) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """Initialise parameters directly into their shardings: (graphdef, params, shardings).

    The initialiser is jitted with `out_shardings`, so no device ever holds the full model, and
    (with JAX's partitionable threefry) the values are identical on every mesh for the same seed.
    """
    graphdef, abstract = abstract_params(make_model)
    shardings = resolve(rules, axis_map, abstract, mesh)

    params = jax.jit(lambda: _split_params(make_model())[1], out_shardings=shardings)()
    return graphdef, params, shardings


def state_bytes(abstract: Any, shardings: Any | None = None) -> int:
    """Bytes of one device's shards of an abstract tree (the whole tree without shardings)."""
    leaves = jax.tree.leaves(abstract)
    if shardings is None:
        return sum(x.size * x.dtype.itemsize for x in leaves)
    return sum(
        int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
        for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True)
    )
