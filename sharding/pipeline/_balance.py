"""Uneven layer counts per stage: checking them, laying the stack out, choosing them.

The first stage also embeds the tokens and the last one runs the head and the loss, so equal
layer counts make a bottleneck stage (the guides warn against one): in lock-step every tick costs
its slowest stage. ``stage_layers`` gives each virtual stage (stage ``s`` of chunk ``c`` is
virtual stage ``c*p + s``, in pipeline order) its own number of consecutive layers;
`balance_layers` picks the counts that minimise the slowest stage's work.

Each stage still runs one program: it holds ``max(stage_layers)`` layer slots, the spare ones
skipped by a `lax.cond` (no FLOPs on real devices) and filled with a copy of a real layer's
weights that receives no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sharding.pipeline._schedule import ScheduleError


class StageLayersError(ScheduleError):
    """``stage_layers`` that do not lay the stack out over the virtual stages."""


def check_stage_layers(
    stage_layers: Sequence[int], n_layers: int, stages: int, repeats: int = 1
) -> tuple[int, ...]:
    """``stage_layers`` as a tuple, or `StageLayersError` naming what to change.

    Example:
        >>> check_stage_layers([3, 5], 8, 2)
        (3, 5)
    """
    virtual = stages * repeats
    counts = tuple(stage_layers)
    where = f"stage_layers={list(counts)}"
    if any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 for n in counts):
        raise StageLayersError(f"{where}: every count must be an integer >= 1 (a stage with no "
                               f"layers is no stage; use fewer stages)")  # fmt: skip
    if len(counts) != virtual:
        what = f"stages={stages}" + (f" x repeats={repeats}" if repeats > 1 else "")
        raise StageLayersError(
            f"{where} has {len(counts)} counts, but {what} makes {virtual} virtual stages: give "
            f"one count per virtual stage, in pipeline order (stage s of chunk c is c*p + s)"
        )
    if sum(counts) != n_layers:
        raise StageLayersError(
            f"{where} adds up to {sum(counts)} layers, but the stack has n_layers={n_layers}; "
            f"the counts must add up to {n_layers}"
        )
    return tuple(int(n) for n in counts)


def layer_slots(
    stage_layers: Sequence[int], stages: int, repeats: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """``(index, valid)``, each ``[stages, repeats, max(stage_layers)]``: the stack layer each slot
    of each stage's chunk holds, and whether it is a real one (spare slots copy the chunk's
    first layer and are skipped).

    Example:
        >>> index, valid = layer_slots([1, 3], 2)
        >>> index[:, 0].tolist(), valid[:, 0].tolist()
        ([[0, 0, 0], [1, 2, 3]], [[True, False, False], [True, True, True]])
    """
    width = max(stage_layers)
    index = np.zeros((stages, repeats, width), np.int32)
    valid = np.zeros((stages, repeats, width), bool)
    start = 0
    for k, n in enumerate(stage_layers):
        c, s = divmod(k, stages)
        index[s, c, :n] = np.arange(start, start + n)
        index[s, c, n:] = start
        valid[s, c, :n] = True
        start += n
    return index, valid


def balance_layers(
    n_layers: int,
    stages: int,
    *,
    layer: float = 1.0,
    first: float = 0.0,
    last: float = 0.0,
    repeats: int = 1,
) -> tuple[int, ...]:
    """Layers per virtual stage minimising the slowest one's work, in lock-step.

    Args:
        layer: one layer's cost (any unit: FLOPs, seconds).
        first, last: what the first virtual stage does beyond its layers (the embedding, if it
            runs there) and the last (the head and loss, in 1f1b, interleaved and zb-h1).

    Greedy from equal counts: a layer moves off the slowest virtual stage while that lowers the
    maximum (or, at the same maximum, the spread).

    Example:
        >>> balance_layers(16, 4, layer=1.0, last=2.0)
        (5, 4, 4, 3)
    """
    virtual = stages * repeats
    if n_layers < virtual:
        raise StageLayersError(
            f"n_layers={n_layers} cannot give each of the {virtual} virtual stages a layer; use "
            f"at most {n_layers} stages x repeats"
        )
    extra = [0.0] * virtual
    extra[0] += first
    extra[-1] += last

    def cost(counts: Sequence[int]) -> tuple[float, float]:
        work = [n * layer + e for n, e in zip(counts, extra, strict=True)]
        return max(work), float(np.var(work))

    base, more = divmod(n_layers, virtual)
    counts = [base + (1 if k >= virtual - more else 0) for k in range(virtual)]
    best = tuple(counts)
    while True:
        work = [n * layer + e for n, e in zip(counts, extra, strict=True)]
        slow = int(np.argmax(work))
        moves = []
        for k in range(virtual):
            if k != slow and counts[slow] > 1:
                trial = list(counts)
                trial[slow] -= 1
                trial[k] += 1
                moves.append((cost(trial), trial))
        if not moves:
            break
        (top, spread), trial = min(moves, key=lambda x: x[0])
        if (top, spread) >= cost(counts):
            break
        counts = trial
        best = tuple(counts)
    return best
