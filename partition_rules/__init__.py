"""Partition rules: which logical axes each parameter has, and where each logical axis goes.

Pure data about names: no devices, no meshes, no JAX objects. `sharding.resolve` binds these to a
mesh.
"""

from partition_rules import cnn, gpt2, llama, mlp, strategies
from partition_rules._presets import FAMILY_RULES, family_rules, preset, strategy
from partition_rules._rules import (
    AxisEntry,
    AxisMap,
    MeshAxes,
    Rule,
    RuleConflictError,
    Rules,
    direct_rules,
)
from partition_rules.strategies import PIPELINE_STRATEGIES, STRATEGIES

__all__ = [
    "FAMILY_RULES",
    "PIPELINE_STRATEGIES",
    "STRATEGIES",
    "AxisEntry",
    "AxisMap",
    "MeshAxes",
    "Rule",
    "RuleConflictError",
    "Rules",
    "cnn",
    "direct_rules",
    "family_rules",
    "gpt2",
    "llama",
    "mlp",
    "preset",
    "strategies",
    "strategy",
]
