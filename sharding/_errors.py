"""The root of every error spmdkit raises for input it cannot take.

Each concept has one base (`MeshSpecError`, `RuleError`, `StepConfigError` in the core;
`PipelineError`, `InspectionError`, `CostModelError`, `CompareError`, `TrainingError` in the
sub-packages), all subclasses of `SpmdkitError`, itself a `ValueError`: catch the base of a concept
to handle its failures, or `SpmdkitError` for all of them. Every message names the offending value
and what to write instead.
"""

from __future__ import annotations


class SpmdkitError(ValueError):
    """Input spmdkit cannot take: the message says which value and what to change."""
