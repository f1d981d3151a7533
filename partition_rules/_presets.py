"""Presets: a family's rule table paired with a strategy's axis map."""

from __future__ import annotations

from partition_rules import cnn, gpt2, llama, mlp
from partition_rules._rules import AxisMap, Rules
from partition_rules.strategies import STRATEGIES

FAMILY_RULES: dict[str, Rules] = {
    "llama": llama.RULES,
    "gpt2": gpt2.RULES,
    "mlp": mlp.RULES,
    "cnn": cnn.RULES,
}


def family_rules(family: str) -> Rules:
    """The rule table of a model family; raises ValueError listing the known families."""
    try:
        return FAMILY_RULES[family]
    except KeyError:
        raise ValueError(
            f"no partition rules for model family {family!r}; known families: "
            f"{', '.join(sorted(FAMILY_RULES))}"
        ) from None


def strategy(name: str) -> AxisMap:
    """The axis map of a strategy; raises ValueError listing the strategies that exist."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}; strategies that exist: {', '.join(STRATEGIES)}"
        ) from None


def preset(family: str, strategy_name: str) -> tuple[Rules, AxisMap]:
    """(rules, axis_map) for a model family under a named strategy.

    Example:
        >>> rules, axis_map = preset("llama", "fsdp_tp")
        >>> axis_map.mesh_axes(rules.match("lm_head/kernel")[1].axes[1])
        ('tensor',)
    """
    return family_rules(family), strategy(strategy_name)
