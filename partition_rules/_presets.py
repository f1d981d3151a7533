"""Presets: a family's rule table paired with a strategy's axis map."""

from __future__ import annotations

from partition_rules import cnn, gpt2, llama, llama_moe, mlp
from partition_rules._compose import composition
from partition_rules._rules import AxisMap, MeshAxes, PartitionRulesError, Rules, UnknownPresetError
from partition_rules.strategies import STRATEGIES


class AxisRenameError(PartitionRulesError):
    """A `strategy` renaming that cannot be applied: an unknown shipped logical axis, one user
    name given for two shipped names, or a name that is not a non-empty string."""


FAMILY_RULES: dict[str, Rules] = {
    "llama": llama.RULES,
    "gpt2": gpt2.RULES,
    "mlp": mlp.RULES,
    "cnn": cnn.RULES,
    "llama-moe": llama_moe.RULES,
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


def strategy(name: str, **names: str | tuple[str, ...]) -> AxisMap:
    """The axis map of a strategy, optionally over your own logical axis names.

    ``name``: a strategy name (`STRATEGIES`) or a composition of parts, e.g. ``"fsdp+tp+pp"``
    (`partition_rules.composition`). Without keywords: its shipped map. Each keyword renames one shipped
    logical axis (`strategies.LOGICAL_AXES`) to the name your rule table uses, or to a tuple of
    names that all go where it goes. Shipped names you do not rename keep their entries; where
    one of your names equals a shipped name you did not rename, yours wins.

    Raises:
        UnknownPresetError: `name` is not a strategy or composition (the message lists them;
            `CompositionError` says which part is wrong).
        AxisRenameError: a keyword that is not a shipped logical axis, one of your names given
            for two shipped names, or a name that is not a non-empty string.

    Example:
        >>> m = strategy("fsdp_tp", embed="hidden", heads="n_heads", mlp=("ffn", "expert_ffn"),
        ...              layers="blocks")
        >>> m["hidden"], m["n_heads"], m["ffn"], m["expert_ffn"], m["blocks"], m["vocab"]
        ('fsdp', 'tensor', 'tensor', 'tensor', None, 'tensor')
        >>> strategy("fsdp")["embed"]
        'fsdp'
    """
    known = isinstance(name, str) and name in STRATEGIES
    base = STRATEGIES[name] if known else composition(name).axis_map
    if not names:
        return base
    what = {"sequence": "where the activations' sequence goes",
            "optimizer": "which mesh axis splits the optimizer state"}  # fmt: skip
    for fixed in [k for k in what if k in names]:  # read by this name: renamed, it would vanish
        raise AxisRenameError(
            f"strategy({name!r}, {fixed}={names[fixed]!r}): {fixed!r} names no parameter "
            f"dimension (it says {what[fixed]}) and cannot be renamed; drop {fixed}= and rename "
            f"only the axes your rule table uses"
        )
    renamed = _user_names(name, base, names)
    kept = {k: v for k, v in base.items() if k not in names and k not in renamed}
    return AxisMap({**kept, **renamed})


def _user_names(name: str, base: AxisMap, names: dict[str, object]) -> dict[str, MeshAxes]:
    """{user name: mesh axes} from strategy(name, shipped=user, ...), every name checked."""
    unknown = [k for k in names if k not in base]
    if unknown:
        key, value = unknown[0], names[unknown[0]]
        swapped = isinstance(value, str) and value in base
        example = (
            f"{value}={key!r} (swapped?)" if swapped else f"strategy({name!r}, embed='hidden')"
        )
        raise AxisRenameError(
            f"strategy({name!r}, {key}=...): {key!r} is not a shipped logical axis; the keywords "
            f"name shipped axes ({', '.join(base)}) and their values your names, e.g. {example}"
        )
    owner: dict[str, str] = {}
    for shipped, users in names.items():
        group = users if isinstance(users, tuple | list) else (users,)
        bad = [u for u in group if not isinstance(u, str) or not u]
        if bad or not group:
            raise AxisRenameError(
                f"strategy({name!r}, {shipped}={users!r}): "
                f"{'no name' if not group else repr(bad[0])} is not a logical axis name; give a "
                f"non-empty string or a tuple of them, e.g. {shipped}='my_{shipped}' or "
                f"{shipped}=('a', 'b')"
            )
        for u in group:
            if owner.get(u, shipped) != shipped:
                raise AxisRenameError(
                    f"strategy({name!r}, ...): your name {u!r} is given for both {owner[u]!r} "
                    f"and {shipped!r}; one logical axis goes to one place: keep {u!r} on one "
                    f"keyword and give the other axis its own name"
                )
            owner[u] = shipped
    return {u: base[shipped] for u, shipped in owner.items()}


def preset(family: str, strategy_name: str) -> tuple[Rules, AxisMap]:
    """(rules, axis_map) for a model family under a named strategy.

    Example:
        >>> rules, axis_map = preset("llama", "fsdp_tp")
        >>> axis_map.mesh_axes(rules.match("lm_head/kernel")[1].axes[1])
        ('tensor',)
    """
    return family_rules(family), strategy(strategy_name)
