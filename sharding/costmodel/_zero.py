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
from sharding._shardings import optimizer_axes, optimizer_split_dim, unsplittable
from sharding.costmodel._traffic import Param, Traffic

# The purpose of the weight gathers: `step_time` prices them after the update, where nothing is
# left to hide them (or behind the next step's first micro-batch, where a program overlaps them).
UPDATED_WEIGHTS = "updated weights gathered after the optimizer update (zero1)"


def split_params(s: Any) -> list[Param]:
    """The parameters whose optimizer state zero1 splits (`optimizer_split_dim` of their shape
    per device; the program keeps the others whole and its report lists them); [] without it.

    Raises:
        OptimizerSplitError: zero1 asked, and the axes divide no parameter's dimension.
    """
    axes = optimizer_axes(composition(s.strategy).axis_map, s.sizes)
    n = math.prod(s.sizes[a] for a in axes)
    if n == 1:
        return []
    split = [q for q in s.params if optimizer_split_dim(q.local, n) is not None]
    if not split:
        raise unsplittable(axes, n, s.params[0].path, s.params[0].local)
    return split


def optimizer_share(s: Any, split: list[Param]) -> float:
    """The share of the (float32, per device) parameter bytes whose optimizer state a device
    holds, ``split`` the parameters zero1 splits (`split_params`): 1 without any."""
    if not split:
        return 1.0
    n = math.prod(s.sizes[a] for a in optimizer_axes(composition(s.strategy).axis_map, s.sizes))
    held = sum(_local_bytes(s, q) for q in s.params)
    return (held - sum(_local_bytes(s, q) * (1 - 1 / n) for q in split)) / held


def _local_bytes(s: Any, q: Param) -> float:
    return q.nbytes / math.prod(s.sizes[a] for a in q.axes)


def updated_weight_gathers(s: Any, split: list[Param]) -> list[Traffic]:
    """The float32 weights each device updated a slice of, gathered over the optimizer axes:
    one all-gather per split parameter array (``split``: `split_params`), of its bytes per
    device (the gathered output)."""
    axes = optimizer_axes(composition(s.strategy).axis_map, s.sizes)
    return [Traffic("all-gather", axes, round(_local_bytes(s, q)), 1, UPDATED_WEIGHTS)
            for q in split]  # fmt: skip


__all__ = ["UPDATED_WEIGHTS", "optimizer_share", "split_params", "updated_weight_gathers"]
