"""The errors of `compare`: one base, `CompareError`."""

from __future__ import annotations

from sharding._errors import SpmdkitError


class CompareError(SpmdkitError):
    """A comparison that cannot be made as asked: the message names the value and the fix."""


class CompareArgumentError(CompareError):
    """An argument of `compare` out of its range (checked before anything compiles)."""


class OutputExistsError(CompareError):
    """The output folder is a file, or already holds a comparison (pass --overwrite)."""


class NothingMeasuredError(CompareError):
    """Every layout was skipped: the model or the devices suit none of the strategies asked."""


class NoStrategyFitsError(CompareError):
    """Layouts ran, but none fits the memory budget."""
