"""Partition rules: which logical axes each parameter has, and where each logical axis goes.

Pure data about names: no devices, no meshes, no JAX objects, and no knowledge of `sharding` (which
binds these to a mesh with `sharding.resolve`). Input that cannot be used raises a
`PartitionRulesError` (a `ValueError`): `MalformedRuleError`, `RuleConflictError`,
`UnknownPresetError`, `AxisRenameError`.

The shipped strategies map the shipped logical axis names (`LOGICAL_AXES`); for a rule table
with names of your own, ``strategy("fsdp_tp", embed="hidden", mlp="ffn")`` renames them.

Example:
    >>> rules, axis_map = preset("llama", "fsdp_tp")
    >>> [axis_map.mesh_axes(e) for e in rules.match("layers/mlp/up/kernel")[1].axes]
    [(), ('fsdp',), ('tensor',)]
"""

from partition_rules import cnn, gpt2, llama, llama_moe, mlp, strategies
from partition_rules._compose import ALIASES, PARTS, Composition, CompositionError, composition
from partition_rules._presets import (
    FAMILY_RULES,
    AxisRenameError,
    family_rules,
    preset,
    strategy,
)
from partition_rules._rules import (
    AxisEntry,
    AxisMap,
    MalformedRuleError,
    MeshAxes,
    PartitionRulesError,
    Rule,
    RuleConflictError,
    Rules,
    UnknownPresetError,
    direct_rules,
)
from partition_rules.strategies import LOGICAL_AXES, PIPELINE_STRATEGIES, STRATEGIES

__all__ = [
    "ALIASES",
    "FAMILY_RULES",
    "LOGICAL_AXES",
    "PARTS",
    "PIPELINE_STRATEGIES",
    "STRATEGIES",
    "AxisEntry",
    "AxisMap",
    "AxisRenameError",
    "Composition",
    "CompositionError",
    "MalformedRuleError",
    "MeshAxes",
    "PartitionRulesError",
    "Rule",
    "RuleConflictError",
    "Rules",
    "UnknownPresetError",
    "cnn",
    "composition",
    "direct_rules",
    "family_rules",
    "gpt2",
    "llama",
    "llama_moe",
    "mlp",
    "preset",
    "strategies",
    "strategy",
]
