"""ZeRO-1 in the closed form: what splitting the optimizer state over ``data`` (the ``zero1``
part of a strategy, `partition_rules`) changes in one step.

The program (`sharding.StepLayout`) splits each optimizer-state array of a parameter over the
strategy's ``"optimizer"`` axes on its largest dimension they divide, on top of the parameter's
layout; the parameters stay as their rules place them. Each device updates its slice of every
parameter, so the updated float32 weights are all-gathered over those axes once per step, one
gather per parameter array, after the update (measured on XLA:CPU: the gradients' all-reduces
stay as they were). The optimizer state per device divides by the axes' size.
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


def optimizer_split(s: Any) -> int:
    """What the optimizer state per device divides by under zero1 (1 without it), checked as the
    program checks it.

    Raises:
        OptimizerSplitError: a parameter none of whose dimensions the axes divide.
    """
    axes = optimizer_axes(s)
    n = math.prod(s.sizes[a] for a in axes)
    if n == 1:
        return 1
    for q in s.params:
        local = _per_device(s, q)
        if not any(d % n == 0 for d in local):
            raise OptimizerSplitError(
                f"zero1 splits the optimizer state over {'x'.join(axes)}={n}, and {q.path} "
                f"(shape {q.shape}, {local} per device under its rules) has no dimension {n} "
                f"divides; use a mesh whose {'x'.join(axes)} size divides one of "
                f"{sorted(set(local))}, or drop zero1 from the strategy"
            )
    return n


def updated_weight_gathers(s: Any) -> list[Traffic]:
    """The float32 weights each device updated a slice of, gathered over the optimizer axes:
    one all-gather per parameter array, of its bytes per device (the gathered output)."""
    axes = optimizer_axes(s)
    if optimizer_split(s) == 1:
        return []
    return [Traffic("all-gather", axes, round(q.nbytes / math.prod(s.sizes[a] for a in q.axes)),
                    1, UPDATED_WEIGHTS) for q in s.params]  # fmt: skip


__all__ = ["UPDATED_WEIGHTS", "optimizer_axes", "optimizer_split", "updated_weight_gathers"]
