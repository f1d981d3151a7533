"""ZeRO-1 in the closed form: what splitting the optimizer state over ``data`` (the ``zero1``
part of a strategy, `partition_rules`) changes in one step.

The program (`sharding.StepLayout`) splits each optimizer-state array of a parameter over the
strategy's ``"optimizer"`` axes on its largest dimension they divide, on top of the parameter's
layout, and keeps an array none of whose dimensions they divide whole (the program's report
lists them; refused where that is every array); the parameters stay as their rules place them.
Each device updates its slice of every split parameter, so the updated float32 weights are
all-gathered over those axes once per step, one gather per split array, after the update
(measured on XLA:CPU: the gradients' all-reduces stay as they were). The split arrays'
optimizer state per device divides by the axes' size.
"""

from __future__ import annotations

import math
from typing import Any

from partition_rules import composition
from sharding._shardings import OptimizerSplitError
from sharding.costmodel._traffic import Param, Traffic

# The purpose of the weight gathers: `step_time` prices them after the update, where nothing is
# left to hide them (or behind the next step's first micro-batch, where a program overlaps them).
UPDATED_WEIGHTS = "updated weights gathered after the optimizer update (zero1)"


def optimizer_axes(s: Any) -> tuple[str, ...]:
    """The mesh axes of size > 1 setup ``s``'s strategy splits the optimizer state over."""
    entry = composition(s.strategy).axis_map.get("optimizer")
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return tuple(a for a in axes if s.sizes.get(a, 1) > 1)


def _per_device(s: Any, q: Param) -> list[int]:
    """``q``'s shape on one device under its rules (each dimension over its logical name's axes)."""
    axis_map = composition(s.strategy).axis_map
    out = []
    for n, name in zip(q.shape, q.logical, strict=False):
        entry = axis_map.get(name) if isinstance(name, str) else None
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        out.append(n // math.prod(s.sizes.get(a, 1) for a in axes))
    return out + list(q.shape[len(out) :])


def split_params(s: Any) -> list[Param]:
    """The parameters whose optimizer state zero1 splits (a dimension per device divides by the
    axes' size; the program keeps the others whole and its report lists them); [] without zero1.

    Raises:
        OptimizerSplitError: zero1 asked, and the axes divide no parameter's dimension.
    """
    axes = optimizer_axes(s)
    n = math.prod(s.sizes[a] for a in axes)
    if n == 1:
        return []
    split = [q for q in s.params if any(d % n == 0 for d in _per_device(s, q))]
    if not split:
        q = s.params[0]
        local = _per_device(s, q)
        raise OptimizerSplitError(
            f"zero1 splits the optimizer state over {'x'.join(axes)}={n}, and {n} divides no "
            f"dimension of any of its arrays (e.g. {q.path}, {local} per device under its "
            f"parameter's layout); use a mesh whose {'x'.join(axes)} size divides one of "
            f"{sorted(set(local))}, or drop zero1 from the strategy"
        )
    return split


def optimizer_share(s: Any) -> float:
    """The share of the (float32, per device) parameter bytes whose optimizer state a device
    holds: 1 without zero1, about 1/n with it (the arrays kept whole count whole)."""
    split = split_params(s)
    if not split:
        return 1.0
    n = math.prod(s.sizes[a] for a in optimizer_axes(s))
    held = {q.path: _local_bytes(s, q) for q in s.params}
    cut = sum(held[q.path] for q in split)
    return (sum(held.values()) - cut + cut / n) / sum(held.values())


def _local_bytes(s: Any, q: Param) -> float:
    return q.nbytes / math.prod(s.sizes[a] for a in q.axes)


def updated_weight_gathers(s: Any) -> list[Traffic]:
    """The float32 weights each device updated a slice of, gathered over the optimizer axes:
    one all-gather per split parameter array, of its bytes per device (the gathered output)."""
    axes = optimizer_axes(s)
    return [Traffic("all-gather", axes, round(_local_bytes(s, q)), 1, UPDATED_WEIGHTS)
            for q in split_params(s)]  # fmt: skip


__all__ = [
    "UPDATED_WEIGHTS",
    "optimizer_axes",
    "optimizer_share",
    "split_params",
    "updated_weight_gathers",
]
