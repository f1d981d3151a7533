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


class CompilerRefusedError(CompareError, ValueError):
    """The target's compiler refused a layout at every remat policy and accumulation tried:
    libtpu refuses a program whose buffers exceed the chip's HBM (RESOURCE_EXHAUSTED). Compare
    lists the layout as skipped, with the compiler's own words."""
