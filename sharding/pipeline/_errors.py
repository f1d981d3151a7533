"""The base of every pipeline error (schedules, layouts, stage splits), the schedule's own, and
the checks of its sizes."""

from __future__ import annotations

import math
from typing import Any

from sharding._errors import SpmdkitError


class PipelineError(SpmdkitError):
    """A pipeline that cannot be built as asked: schedule, stages, micro-batches or layout."""


class ScheduleError(PipelineError):
    """A pipeline schedule that cannot be built as asked."""


class ScheduleSizeError(ScheduleError):
    """Stages, micro-batches or repeats is not an integer >= 1."""


class UnknownScheduleError(ScheduleError):
    """The schedule name is not one of `SCHEDULES`."""


class RepeatsError(ScheduleError):
    """Circular or interleaved with fewer than 2 repeats, or repeats given to another schedule."""


class TooFewMicrobatchesError(ScheduleError):
    """A schedule other than gpipe with fewer micro-batches than stages, or interleaved with
    micro-batches that are not a multiple of the stages."""


class LayerCountError(ScheduleError):
    """The layer count does not split evenly over stages x repeats."""


def check_layers(n_layers: int, stages: int, repeats: int = 1) -> int:
    """Layers per stage per repeat, ``n_layers / (stages * repeats)``, or `LayerCountError`.

    Example:
        >>> check_layers(32, 4, 2)
        4

    ``check_layers(30, 4)`` raises, naming 28 and 32 as the nearest layer counts and the
    (stages, repeats) pairs that split 30 layers, such as (3, 1), (5, 1), (3, 2).
    """
    _check_sizes(n_layers=n_layers, stages=stages, repeats=repeats)
    parts = stages * repeats
    if n_layers % parts == 0:
        return n_layers // parts
    below = n_layers // parts * parts
    below_txt = f"{below} below" if below else f"none below ({parts} is the fewest)"
    # The 8 pairs nearest what was asked, shown in order; one stage is no pipeline at all.
    divisors = [d for d in range(1, math.isqrt(n_layers) + 1) if n_layers % d == 0]
    divisors = sorted({*divisors, *(n_layers // d for d in divisors)})
    pairs = [(a, b) for a in divisors for b in divisors if n_layers % (a * b) == 0 and a > 1]
    pairs.sort(key=lambda q: (abs(q[0] - stages) + abs(q[1] - repeats), abs(q[0] - stages)))
    pairs = sorted(pairs[:8])
    raise LayerCountError(
        f"n_layers={n_layers} does not split into stages={stages} x repeats={repeats} = "
        f"{parts} equal chunks of layers. Nearest valid layer counts: {below_txt}, "
        f"{below + parts} above. Valid (stages, repeats) for n_layers={n_layers}: "
        f"{', '.join(map(str, pairs)) or 'none, one layer is no pipeline'}"
    )


_SIZE_HINTS = {
    "n_layers": "n_layers is the depth of the stacked layers",
    "stages": "stages is the size of the 'stage' mesh axis",
    "microbatches": "microbatches the micro-batches per step (1 for no micro-batching)",
    "repeats": "repeats the circular repeats (1 unless schedule='circular')",
}


def _check_sizes(**sizes: Any) -> None:
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        got = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        hints = ", ".join(_SIZE_HINTS[k] for k in bad)
        raise ScheduleSizeError(f"{', '.join(bad)} must be integers >= 1, got {got}; {hints}")
