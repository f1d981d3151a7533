"""The base of every training-runtime error: data, checkpoints, elastic policy, processes."""

from __future__ import annotations

from sharding._errors import SpmdkitError


class TrainingError(SpmdkitError):
    """A run that cannot start or continue as asked: its data, checkpoints or processes."""
