"""What a pipeline stage does in one tick: `Kind`, `Action`, and a cell of actions."""

from __future__ import annotations

import enum
from typing import NamedTuple


class Kind(enum.StrEnum):
    """One stage's kind of work; the value is its one-letter diagram label.

    ``BACKWARD`` is the whole backward (input and weight gradients) except in schedules that
    split it (zb-h1), where it is the input gradient only and ``WEIGHT`` the weight gradient.
    """

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    IDLE = "."


class Action(NamedTuple):
    """One stage's work on one micro-batch (and chunk of layers) in one tick.

    ``repeat`` is the chunk: circular's repeat, interleaved's virtual stage round (stage ``s``
    with chunk ``c`` is virtual stage ``c*p + s``); 0 for the other schedules.

    Example:
        >>> Action(Kind.FORWARD, 3).label(), Action(Kind.BACKWARD, 3, 1).label(repeats=True)
        ('F3', 'B3r1')
    """

    kind: Kind
    microbatch: int | None = None
    repeat: int = 0

    def label(self, repeats: bool = False) -> str:
        """``F3`` / ``B3`` / ``W3`` / ``.``; with ``repeats``, ``F3r1`` is chunk 1."""
        if self.kind is Kind.IDLE:
            return "."
        return f"{self.kind}{self.microbatch}" + (f"r{self.repeat}" if repeats else "")


IDLE = Action(Kind.IDLE)
Cell = tuple[Action, ...]  # the actions of one stage in one tick, in the order they run
