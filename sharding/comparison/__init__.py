"""Measure every strategy on one model and device count, and recommend: `spmdkit compare`.

`candidates` lists what to try, `measure` compiles and times one, `reference` compiles the unsplit
step for MFU's numerator, `recommend` and `comparison_table` answer in the guides' terms, `plot`
draws the figure.
"""

from sharding.comparison._measure import (
    Candidate,
    CompareConfig,
    Result,
    Skipped,
    build,
    candidates,
    measure,
    reference,
)
from sharding.comparison._plot import plot
from sharding.comparison._verdict import SPLITS, Recommendation, comparison_table, recommend

__all__ = [
    "SPLITS",
    "Candidate",
    "CompareConfig",
    "Recommendation",
    "Result",
    "Skipped",
    "build",
    "candidates",
    "comparison_table",
    "measure",
    "plot",
    "recommend",
    "reference",
]
