"""spmdkit's compiler: binds partition rules to a device mesh and builds SPMD programs."""

from sharding._explain import Explanation, explain
from sharding._init import abstract_params, init_sharded
from sharding._mesh import (
    AXES,
    MalformedMeshSpecError,
    MeshSizeMismatchError,
    MeshSpec,
    MeshSpecError,
    MultipleFillAxesError,
    UnknownMeshAxisNameError,
    make_mesh,
    mesh_sizes,
    simulate_cpu_devices,
)
from sharding._resolve import (
    DuplicateMeshAxisError,
    IndivisibleDimensionError,
    Placement,
    RankMismatchError,
    RuleError,
    UnknownLogicalAxisError,
    UnknownMeshAxisError,
    UnmatchedParameterError,
    path_str,
    plan,
    resolve,
    shard_abstract,
)
from sharding._units import fmt_bytes, fmt_count, parse_bytes

__all__ = [
    "AXES",
    "DuplicateMeshAxisError",
    "Explanation",
    "IndivisibleDimensionError",
    "MalformedMeshSpecError",
    "MeshSizeMismatchError",
    "MeshSpec",
    "MeshSpecError",
    "MultipleFillAxesError",
    "Placement",
    "RankMismatchError",
    "RuleError",
    "UnknownLogicalAxisError",
    "UnknownMeshAxisError",
    "UnknownMeshAxisNameError",
    "UnmatchedParameterError",
    "abstract_params",
    "explain",
    "fmt_bytes",
    "fmt_count",
    "init_sharded",
    "make_mesh",
    "mesh_sizes",
    "parse_bytes",
    "path_str",
    "plan",
    "resolve",
    "shard_abstract",
    "simulate_cpu_devices",
]
