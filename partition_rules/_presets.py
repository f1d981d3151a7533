"""Presets: a family's rule table paired with a strategy's axis map."""

from __future__ import annotations

from partition_rules import cnn, gpt2, llama, mlp
from partition_rules._rules import AxisMap, Rules, UnknownPresetError
from partition_rules.strategies import STRATEGIES

FAMILY_RULES: dict[str, Rules] = {
    "llama": llama.RULES,
    "gpt2": gpt2.RULES,
    "mlp": mlp.RULES,
    "cnn": cnn.RULES,
}


def family_rules(family: str) -> Rules:
    """The rule table of a model family; `UnknownPresetError` listing the known families.

    Example:
        >>> family_rules("gpt2").match("wte/embedding")[1].axes
        ('vocab', 'embed')
    """
    if not isinstance(family, str) or family not in FAMILY_RULES:
        raise UnknownPresetError(
            f"no partition rules for model family {family!r}; known families: "
            f"{', '.join(sorted(FAMILY_RULES))}. For a model of your own, write its Rules table "
            f"and pass it with an axis map (e.g. strategy('fsdp')) instead of a preset"
        )
    return FAMILY_RULES[family]


def strategy(name: str) -> AxisMap:
    """The axis map of a strategy; `UnknownPresetError` listing the strategies that exist.

    Example:
        >>> strategy("fsdp")["embed"]
        'fsdp'
    """
    if not isinstance(name, str) or name not in STRATEGIES:
        raise UnknownPresetError(
            f"unknown strategy {name!r}; strategies that exist: {', '.join(STRATEGIES)}"
        )
    return STRATEGIES[name]


def preset(family: str, strategy_name: str) -> tuple[Rules, AxisMap]:
    """(rules, axis_map) for a model family under a named strategy.

    Example:
        >>> rules, axis_map = preset("llama", "fsdp_tp")
        >>> axis_map.mesh_axes(rules.match("lm_head/kernel")[1].axes[1])
        ('tensor',)
    """
    return family_rules(family), strategy(strategy_name)
