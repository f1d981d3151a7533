"""The errors of context parallelism: one base, raised before anything compiles."""

from __future__ import annotations

from sharding._errors import SpmdkitError


class ContextParallelError(SpmdkitError):
    """A context-parallel setting spmdkit cannot run: the message names the value and the fix."""


__all__ = ["ContextParallelError"]
