"""Measure every strategy on one model and device count, and recommend: `spmdkit compare`.

`compare` does all of it and returns a `Comparison` (`.table()`, `.to_json()`, `.plot(path)`,
`.recommendation`). Its parts: the layouts come from `sharding.costmodel.layouts`, `measure`
compiles and times one, `reference` compiles the unsplit step for MFU's numerator, `recommend` and
`comparison_table` answer in the guides' terms, `plot` draws the figure. Every error is a
`CompareError`.
"""

from sharding.comparison._compare import Comparison, check_output, compare
from sharding.comparison._errors import (
    CompareArgumentError,
    CompareError,
    NoStrategyFitsError,
    NothingMeasuredError,
    OutputExistsError,
)
from sharding.comparison._measure import CompareConfig, Result, Skipped, build, measure, reference
from sharding.comparison._plot import plot
from sharding.comparison._verdict import Recommendation, comparison_table, recommend

__all__ = [
    "CompareArgumentError",
    "CompareConfig",
    "CompareError",
    "Comparison",
    "NoStrategyFitsError",
    "NothingMeasuredError",
    "OutputExistsError",
    "Recommendation",
    "Result",
    "Skipped",
    "build",
    "check_output",
    "compare",
    "comparison_table",
    "measure",
    "plot",
    "recommend",
    "reference",
]
