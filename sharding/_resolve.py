"""Bind partition rules to a mesh: Rules + AxisMap + abstract params + mesh -> NamedShardings.

Every check runs before anything compiles, and every problem in the tree is reported at once, one
bullet per parameter, grouped by kind, each kind with its remedy. The error type says the kind
when there is one kind; a mixed report is a plain `RuleError` (the base class of them all).
"""

from __future__ import annotations

import difflib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax import sharding as jshard

from partition_rules import AxisMap, Rules
from sharding._checks import check_mesh, check_rules
from sharding._errors import SpmdkitError
from sharding._mesh import mesh_sizes


class RuleError(SpmdkitError):
    """A parameter tree that the rules cannot place on the mesh. `problems` lists each one."""

    def __init__(self, message: str, problems: list[Problem] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


class UnmatchedParameterError(RuleError):
    """No rule matches a parameter path."""


class RankMismatchError(RuleError):
    """A rule gives a different number of axes than the parameter has dimensions."""


class UnknownLogicalAxisError(RuleError):
    """A rule uses a logical axis name the axis map does not define."""


class UnknownMeshAxisError(RuleError):
    """A logical axis maps to a mesh axis the mesh does not have."""


class DuplicateMeshAxisError(RuleError):
    """One mesh axis would split two dimensions of the same parameter."""


class IndivisibleDimensionError(RuleError):
    """A dimension's size is not a multiple of the product of the mesh axes splitting it."""


_FIXES: dict[type[RuleError], str] = {
    UnmatchedParameterError: "add a rule for each path, e.g. Rule(r'final_norm/scale', ('norm',)), "
    "or end the table with Rule(r'.*', None) to replicate the rest explicitly",
    RankMismatchError: "give the rule one axis entry per dimension (None for an unsplit dimension), "
    "or make its pattern stricter so it does not catch this parameter",
    UnknownLogicalAxisError: "add the name to the axis map (None to replicate it) or fix the "
    "spelling in the rule",
    UnknownMeshAxisError: "map the logical axis to an axis the mesh has, or add that axis to the "
    "mesh",
    DuplicateMeshAxisError: "a mesh axis can split only one dimension of a parameter: map one of "
    "the logical axes elsewhere or to None",
    IndivisibleDimensionError: "pick mesh sizes that divide the dimension (the sizes that would are "
    "listed; --mesh in the commands), a strategy that leaves it unsplit (--strategy), or map its "
    "logical axis to None in the AxisMap",
}


@dataclass(frozen=True)
class Problem:
    kind: type[RuleError]
    path: str
    detail: str


@dataclass(frozen=True)
class Placement:
    """Where one parameter goes, and which rule put it there."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    rule_index: int
    pattern: str
    logical: tuple[Any, ...] | None
    spec: tuple[Any, ...]
    per_device_shape: tuple[int, ...]
    bytes_per_device: int
    bytes_total: int

    def partition_spec(self) -> jshard.PartitionSpec:
        return jshard.PartitionSpec(*self.spec)


def path_str(key_path: tuple) -> str:
    """'/'-joined parameter path from a jax key path (drops the `.value` of nnx Variables)."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(getattr(k, "key", k)))
    if parts and isinstance(key_path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def _place(
    path: str,
    shape: tuple[int, ...],
    dtype: Any,
    rules: Rules,
    axis_map: AxisMap,
    sizes: dict[str, int],
) -> tuple[Placement | None, list[Problem], list[int]]:
    """Place one parameter; returns (placement or None, problems, indices of rules that matched)."""
    matching = [i for i, r in enumerate(rules) if r.matches(path)]
    if not matching:
        return None, [Problem(UnmatchedParameterError, path, f"{path} shape={shape}")], []
    index = matching[0]
    rule = rules[index]
    where = f"{path} shape={shape} (rule {index} {rule.pattern!r})"
    logical = rule.axes
    if logical is None:
        logical_dims: tuple = (None,) * len(shape)
    elif len(logical) != len(shape):
        detail = (
            f"{where}: rule gives {len(logical)} axes {logical} for a rank-{len(shape)} parameter"
        )
        return None, [Problem(RankMismatchError, path, detail)], matching
    else:
        logical_dims = logical

    problems: list[Problem] = []
    spec: list[Any] = []
    splits: list[int] = []
    seen: dict[str, int] = {}
    for dim, entry in enumerate(logical_dims):
        names = (entry,) if isinstance(entry, str) else (entry or ())
        unknown = [n for n in names if n not in axis_map]
        for n in unknown:
            close = difflib.get_close_matches(n, list(axis_map), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(
                Problem(
                    UnknownLogicalAxisError,
                    path,
                    f"{where}: dim {dim} uses logical axis {n!r}{hint}; the axis map defines "
                    + ", ".join(map(repr, axis_map)),
                )
            )
        if unknown:
            spec.append(None)
            continue
        mesh_axes = axis_map.mesh_axes(entry)
        missing = [a for a in mesh_axes if a not in sizes]
        for a in missing:
            problems.append(
                Problem(
                    UnknownMeshAxisError,
                    path,
                    f"{where}: dim {dim} ({entry!r}) maps to mesh axis {a!r}; mesh axes are "
                    + ", ".join(f"{k}={v}" for k, v in sizes.items()),
                )
            )
        repeated = sorted({a for a in mesh_axes if mesh_axes.count(a) > 1})
        for a in repeated:
            problems.append(
                Problem(
                    DuplicateMeshAxisError,
                    path,
                    f"{where}: dim {dim} ({entry!r}) lists mesh axis {a!r} twice ({mesh_axes})",
                )
            )
        for a in dict.fromkeys(mesh_axes):
            if a in seen:
                problems.append(
                    Problem(
                        DuplicateMeshAxisError,
                        path,
                        f"{where}: mesh axis {a!r} splits dim {seen[a]} and dim {dim} "
                        f"(logical axes {logical_dims[seen[a]]!r} and {entry!r})",
                    )
                )
            seen.setdefault(a, dim)
        if missing:
            spec.append(None)
            continue
        split = math.prod(sizes[a] for a in mesh_axes)
        if shape[dim] % split:
            axes_txt = "x".join(f"{a}={sizes[a]}" for a in mesh_axes)
            ok = [d for d in range(1, min(shape[dim], 64) + 1) if shape[dim] % d == 0]
            problems.append(
                Problem(
                    IndivisibleDimensionError,
                    path,
                    f"{where}: dim {dim} ({entry!r}) has size {shape[dim]}, not divisible by "
                    f"{axes_txt} (product {split}); split sizes that divide it: {ok}",
                )
            )
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        splits.append(split)
    if problems:
        return None, problems, matching

    local = tuple(s // d for s, d in zip(shape, splits, strict=True))
    itemsize = np.dtype(dtype).itemsize
    placement = Placement(
        path=path,
        shape=tuple(shape),
        dtype=np.dtype(dtype).name,
        rule_index=index,
        pattern=rule.pattern,
        logical=logical,
        spec=tuple(spec),
        per_device_shape=local,
        bytes_per_device=math.prod(local) * itemsize,
        bytes_total=math.prod(shape) * itemsize,
    )
    return placement, [], matching


UNMATCHED_REASON = "matched no parameter"


@dataclass
class Placements:
    """The placement of every leaf of a parameter tree, in tree order."""

    sizes: dict[str, int]
    placements: list[Placement]
    treedef: Any
    unused_rules: list[dict] = field(default_factory=list)


def place(rules: Rules, axis_map: AxisMap, abstract_params: Any, mesh: Any) -> Placements:
    """Check and place every parameter; raise one `RuleError` listing every problem.

    ``mesh`` is a jax Mesh, an AbstractMesh or a resolved `MeshSpec` (no devices needed).
    """
    check_rules("place", rules, axis_map)
    check_mesh("place", mesh, spec_ok=True)
    sizes = mesh_sizes(mesh)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    placements: list[Placement] = []
    problems: list[Problem] = []
    matched_by: dict[int, list[str]] = defaultdict(list)
    won: set[int] = set()
    for key_path, leaf in leaves:
        path = path_str(key_path)
        placement, probs, matching = _place(
            path, tuple(leaf.shape), leaf.dtype, rules, axis_map, sizes
        )
        for i in matching:
            matched_by[i].append(path)
        if matching:
            won.add(matching[0])
        problems.extend(probs)
        if placement is not None:
            placements.append(placement)
    if problems:
        raise _report(problems, len(leaves), sizes)

    unused = []
    for i, rule in enumerate(rules):
        if i in won:
            continue
        if not matched_by[i]:
            unused.append({"index": i, "pattern": rule.pattern, "reason": UNMATCHED_REASON})
        else:
            first = next(
                j for j in range(i) if j in won and set(matched_by[j]) & set(matched_by[i])
            )
            unused.append(
                {"index": i, "pattern": rule.pattern, "reason": f"shadowed by rule {first}"}
            )
    return Placements(sizes, placements, treedef, unused)


def _report(problems: list[Problem], n_params: int, sizes: dict[str, int]) -> RuleError:
    by_kind: dict[type[RuleError], list[Problem]] = defaultdict(list)
    for p in problems:
        by_kind[p.kind].append(p)
    mesh_txt = ",".join(f"{k}={v}" for k, v in sizes.items())
    n_bad = len({p.path for p in problems})
    lines = [f"cannot place {n_bad} of {n_params} parameters on mesh {mesh_txt}:"]
    for kind, probs in by_kind.items():
        label = kind.__doc__.strip().rstrip(".") if kind.__doc__ else kind.__name__
        lines.append(f"{kind.__name__} ({label}):")
        lines.extend(f"  - {p.detail}" for p in probs)
        lines.append(f"  fix: {_FIXES[kind]}")
    cls = next(iter(by_kind)) if len(by_kind) == 1 else RuleError
    return cls("\n".join(lines), problems)


def resolve(rules: Rules, axis_map: AxisMap, abstract_params: Any, mesh: jshard.Mesh) -> Any:
    """The `NamedSharding` of every parameter, as a tree shaped like `abstract_params`.

    Args:
        rules: the family's rule table (first match wins).
        axis_map: logical axis -> mesh axes (a strategy), or `AxisMap.identity()`.
        abstract_params: a tree of arrays or `jax.ShapeDtypeStruct` (e.g. from `nnx.eval_shape`).
        mesh: the `jax.sharding.Mesh` to place on.

    Example:
        >>> from partition_rules import preset
        >>> shardings = resolve(*preset("llama", "fsdp_tp"), params, mesh)  # doctest: +SKIP
    """
    return resolve_reporting(rules, axis_map, abstract_params, mesh, fn="resolve")[0]


def resolve_reporting(
    rules: Rules, axis_map: AxisMap, abstract_params: Any, mesh: jshard.Mesh, *, fn: str
) -> tuple[Any, list[dict]]:
    """`resolve`, and the rules that matched no parameter at all (almost always a typo'd regex).

    Rules that matched parameters placed by an earlier rule (a catch-all after complete rules)
    are left out: they are a normal way to write a table, not a mistake.
    """
    check_rules(fn, rules, axis_map)
    check_mesh(fn, mesh)
    p = place(rules, axis_map, abstract_params, mesh)
    shardings = [jshard.NamedSharding(mesh, pl.partition_spec()) for pl in p.placements]
    unmatched = [u for u in p.unused_rules if u["reason"] == UNMATCHED_REASON]
    return jax.tree_util.tree_unflatten(p.treedef, shardings), unmatched


def shard_abstract(abstract_params: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s of any tree (parameters, train state, batch) carrying `shardings`:
    what `jit(...).lower` takes to compile ahead of time without materialising anything."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params, shardings
    )
