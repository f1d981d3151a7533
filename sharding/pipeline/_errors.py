"""The base of every pipeline error (schedules, layouts, stage splits)."""

from __future__ import annotations

from sharding._errors import SpmdkitError


class PipelineError(SpmdkitError):
    """A pipeline that cannot be built as asked: schedule, stages, micro-batches or layout."""
