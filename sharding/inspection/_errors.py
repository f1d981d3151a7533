"""The base of every inspection error."""

from __future__ import annotations

from sharding._errors import SpmdkitError


class InspectionError(SpmdkitError):
    """A compiled program, device kind or peak that cannot be inspected or priced as asked."""
