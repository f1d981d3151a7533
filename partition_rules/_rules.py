"""Partition rules as plain data: regex over parameter paths -> logical axes -> mesh axes.

Two levels, one resolution (see DESIGN.md):

1. A `Rules` table says what each dimension of a parameter *is*: ``layers/attn/q/kernel`` ->
   ``("layers", "embed", "heads", "head_dim")``. Patterns are matched against the whole
   "/"-joined parameter path with `re.fullmatch`; the first rule that matches wins.
2. An `AxisMap` says where each logical axis *goes* on the mesh: ``{"embed": "fsdp",
   "heads": "tensor"}``. A logical axis maps to one mesh axis, a tuple of mesh axes, or None
   (replicated).

Rules written straight to mesh axes (regex -> PartitionSpec, as in big_vision or MaxText) are the
same `Rules` type used with `AxisMap.identity()`. Nothing here knows about devices or JAX.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

# One entry per dimension: a name, a tuple of names (split over several axes), or None.
AxisEntry = str | tuple[str, ...] | None
MeshAxes = str | tuple[str, ...] | None


class PartitionRulesError(ValueError):
    """Rules, axis maps or preset names that cannot be used: the message says what to write.

    `partition_rules` knows nothing of `sharding`, so this is a plain `ValueError` (as every
    spmdkit error is) rather than a `sharding.SpmdkitError`.
    """


class RuleConflictError(PartitionRulesError):
    """Two rule sets or axis maps define the same key differently."""


class MalformedRuleError(PartitionRulesError, TypeError):
    """A rule that is not a (regex, axes) pair, a bad regex, or an axis entry of the wrong kind.

    Also a `TypeError`: most of these are values of the wrong type.
    """


class UnknownPresetError(PartitionRulesError):
    """A model family or strategy name that has no rule table or axis map."""


_AXES_HELP = "an axis name, a tuple of axis names, or None (replicated)"


def _normalise_entry(entry: object, where: str) -> AxisEntry:
    if entry is None or (isinstance(entry, str) and entry):
        return entry
    if isinstance(entry, tuple | list) and all(isinstance(e, str) and e for e in entry):
        return tuple(entry) if len(entry) != 1 else entry[0]
    raise MalformedRuleError(
        f"{where}: each dimension must be {_AXES_HELP}; got {entry!r}"
        + (", a non-string name" if isinstance(entry, tuple | list) else "")
    )


def _is_partition_spec(obj: object) -> bool:
    # Duck-typed so this package never imports jax (jax.P is not a tuple subclass in 0.10).
    cls = type(obj)
    return cls.__name__ in ("P", "PartitionSpec") and cls.__module__.startswith("jax")


@dataclass(frozen=True)
class Rule:
    """One row of a rule table: `pattern` (regex, full match) -> one axis entry per dimension.

    ``axes=None`` replicates every dimension whatever the rank: write ``Rule(".*", None)`` last as
    the explicit catch-all (unmatched parameters are an error, never silently replicated).

    Example:
        >>> Rule(r"layers/attn/q/kernel", ("layers", "embed", "heads", "head_dim")).matches(
        ...     "layers/attn/q/kernel")
        True
    """

    pattern: str
    axes: tuple[AxisEntry, ...] | None
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # axes=None replicates a parameter of any rank: the explicit catch-all.
        if _is_partition_spec(self.axes):
            # JAX semantics for a direct rule: P() replicates whatever the rank.
            axes_in = tuple(self.axes)
            object.__setattr__(self, "axes", axes_in if axes_in else None)
        if not isinstance(self.pattern, str):
            raise MalformedRuleError(
                f"rule pattern {self.pattern!r} is a {type(self.pattern).__name__}; a pattern is "
                f"a regex string over '/'-joined parameter paths, e.g. r'layers/mlp/.*/kernel'"
            )
        if self.axes is not None:
            if not isinstance(self.axes, tuple | list):
                hint = f"({self.axes!r},) for a vector" if isinstance(self.axes, str) else ""
                raise MalformedRuleError(
                    f"rule {self.pattern!r}: axes must be a tuple (one entry per dimension) or "
                    f"None (replicate any rank), got {self.axes!r}; write e.g. "
                    f"{hint or repr(('embed', 'mlp')) + ' for a matrix'}"
                )
            axes = tuple(_normalise_entry(a, f"rule {self.pattern!r}") for a in self.axes)
            object.__setattr__(self, "axes", axes)
        try:
            object.__setattr__(self, "_regex", re.compile(self.pattern))
        except re.error as e:
            raise MalformedRuleError(
                f"rule pattern {self.pattern!r} is not a valid regex: {e}; escape literal "
                f"brackets and parentheses with a backslash"
            ) from None

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None

    def names(self) -> Iterator[str]:
        """Every axis name this rule mentions, in order."""
        for entry in self.axes or ():
            if isinstance(entry, str):
                yield entry
            elif entry is not None:
                yield from entry


@dataclass(frozen=True)
class Rules:
    """An ordered rule table; the first rule whose pattern matches a path wins.

    Build from `Rule`s or ``(pattern, axes)`` pairs. ``a + b`` appends b's rules after a's (so a's
    take precedence) and raises `RuleConflictError` if both define one pattern differently.

    Example:
        >>> rules = Rules([("embed/embedding", ("vocab", "embed")), (".*", None)])
        >>> rules.match("final_norm/scale")[0]
        1
    """

    rules: tuple[Rule, ...]

    def __init__(self, rules: Iterable[Rule | tuple[str, Iterable[AxisEntry]]] = ()) -> None:
        if isinstance(rules, str | bytes | Mapping) or not isinstance(rules, Iterable):
            raise MalformedRuleError(
                f"Rules takes a list of (regex, axes) pairs, got a {type(rules).__name__} "
                f"{_short(rules)}; e.g. Rules([(r'layers/mlp/.*/kernel', ('layers', 'embed', "
                f"'mlp')), (r'.*', None)])"
                + ("; for a dict write Rules(d.items())" if isinstance(rules, Mapping) else "")
            )
        built = []
        for i, r in enumerate(rules):
            if isinstance(r, Rule):
                built.append(r)
                continue
            if not isinstance(r, tuple | list) or len(r) != 2:
                raise MalformedRuleError(
                    f"rule {i} is {_short(r)}, not a (regex, axes) pair; write e.g. "
                    f"(r'layers/mlp/.*/kernel', ('layers', 'embed', 'mlp')), or (r'.*', None) to "
                    f"replicate whatever is left"
                )
            built.append(Rule(r[0], r[1]))
        object.__setattr__(self, "rules", tuple(built))

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __getitem__(self, i: int) -> Rule:
        return self.rules[i]

    def __add__(self, other: Rules) -> Rules:
        mine = {r.pattern: r for r in self.rules}
        clashes = [
            f"  - {r.pattern!r}: {mine[r.pattern].axes} vs {r.axes}"
            for r in other.rules
            if r.pattern in mine and mine[r.pattern].axes != r.axes
        ]
        if clashes:
            raise RuleConflictError(
                "cannot combine rule tables that give one pattern two meanings:\n"
                + "\n".join(clashes)
                + "\nRename or drop one of the two rules."
            )
        return Rules(self.rules + tuple(r for r in other.rules if r.pattern not in mine))

    def match(self, path: str) -> tuple[int, Rule] | None:
        """The index and rule that place `path`, or None if no rule matches."""
        for i, rule in enumerate(self.rules):
            if rule.matches(path):
                return i, rule
        return None


@dataclass(frozen=True)
class AxisMap(Mapping[str, MeshAxes]):
    """Logical axis name -> mesh axis, tuple of mesh axes, or None (replicated).

    ``a | b`` merges two maps and raises `RuleConflictError` when they map one name differently.
    `AxisMap.identity()` maps every name to itself: rules written straight to mesh axes.

    Example:
        >>> fsdp_tp = AxisMap({"embed": "fsdp"}) | AxisMap({"heads": "tensor"})
        >>> fsdp_tp["heads"]
        'tensor'
    """

    mapping: Mapping[str, MeshAxes] = field(default_factory=dict)
    is_identity: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mapping, Mapping):
            raise MalformedRuleError(
                f"AxisMap takes a dict of logical axis -> mesh axes, got a "
                f"{type(self.mapping).__name__} {_short(self.mapping)}; e.g. "
                f"AxisMap({{'embed': 'fsdp', 'heads': 'tensor', 'norm': None}})"
            )
        bad = [k for k in self.mapping if not isinstance(k, str) or not k]
        if bad:
            raise MalformedRuleError(
                f"axis map key {bad[0]!r} is not a logical axis name; keys are the names rules "
                f"use (strings such as 'embed'), values {_AXES_HELP} of the mesh"
            )
        clean = {k: _normalise_entry(v, f"axis map entry {k!r}") for k, v in self.mapping.items()}
        object.__setattr__(self, "mapping", dict(sorted(clean.items())))

    @classmethod
    def identity(cls) -> AxisMap:
        return cls({}, is_identity=True)

    def __getitem__(self, name: str) -> MeshAxes:
        if self.is_identity:
            return name
        return self.mapping[name]

    def __contains__(self, name: object) -> bool:
        return self.is_identity or name in self.mapping

    def __iter__(self) -> Iterator[str]:
        return iter(self.mapping)

    def __len__(self) -> int:
        return len(self.mapping)

    def __hash__(self) -> int:
        return hash((tuple(self.mapping.items()), self.is_identity))

    def __or__(self, other: AxisMap) -> AxisMap:
        if self.is_identity or other.is_identity:
            raise RuleConflictError("an identity AxisMap cannot be merged with another map")
        clashes = [
            f"  - {k!r}: {self.mapping[k]!r} vs {v!r}"
            for k, v in other.mapping.items()
            if k in self.mapping and self.mapping[k] != v
        ]
        if clashes:
            raise RuleConflictError(
                "cannot merge axis maps that send one logical axis to two places:\n"
                + "\n".join(clashes)
                + "\nDecide which mesh axis the logical axis uses and keep only that entry."
            )
        return AxisMap({**self.mapping, **other.mapping})

    def replace(self, **changes: MeshAxes) -> AxisMap:
        """A copy with some names remapped (no conflict check: this is an explicit override)."""
        return AxisMap({**self.mapping, **changes})

    def mesh_axes(self, entry: AxisEntry) -> tuple[str, ...]:
        """The mesh axes one dimension entry lands on, in order (empty: replicated)."""
        names = (entry,) if isinstance(entry, str) else (entry or ())
        out: list[str] = []
        for name in names:
            target = self[name]
            if isinstance(target, str):
                out.append(target)
            elif target is not None:
                out.extend(target)
        return tuple(out)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def direct_rules(rules: Iterable[tuple[str, Iterable[MeshAxes]]]) -> tuple[Rules, AxisMap]:
    """Rules written straight to mesh axes (regex -> PartitionSpec) and the identity map for them.

    Example:
        >>> rules, axis_map = direct_rules([(r".*kernel", ("fsdp", "tensor")), (r".*", None)])
        >>> axis_map.mesh_axes(rules[0].axes[0])
        ('fsdp',)
    """
    return Rules(rules), AxisMap.identity()
