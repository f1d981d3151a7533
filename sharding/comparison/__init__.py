"""Which strategy for this model on this cluster: `spmdkit compare`.

`compare` does all of it and returns a `Comparison` (`.table()`, `.to_json()`, `.plot(path)`,
`.recommendation`). Its parts: the layouts come from `sharding.costmodel.layouts`; `evaluate`
compiles one candidate for the target's device count and prices it with
`sharding.costmodel.step_time`; `measure_here` times steps on this process's devices;
`reference_flops` compiles the unsplit step for MFU's numerator; `rank`, `recommend` and
`comparison_table` answer in the guides' terms; `plot` draws the figure. Every error is a
`CompareError`.
"""

from sharding.comparison._compare import (
    DEFAULT_TARGET,
    Comparison,
    Skipped,
    check_output,
    compare,
)
from sharding.comparison._errors import (
    CompareArgumentError,
    CompareError,
    CompilerRefusedError,
    NoStrategyFitsError,
    NothingMeasuredError,
    OutputExistsError,
)
from sharding.comparison._evaluate import (
    Candidate,
    Settings,
    build,
    evaluate,
    measure_here,
    reference_flops,
)
from sharding.comparison._plot import plot
from sharding.comparison._verdict import (
    Recommendation,
    comparison_table,
    rank,
    recommend,
    scaled,
)

__all__ = [
    "DEFAULT_TARGET",
    "Candidate",
    "CompareArgumentError",
    "CompareError",
    "Comparison",
    "CompilerRefusedError",
    "NoStrategyFitsError",
    "NothingMeasuredError",
    "OutputExistsError",
    "Recommendation",
    "Settings",
    "Skipped",
    "build",
    "check_output",
    "compare",
    "comparison_table",
    "evaluate",
    "measure_here",
    "plot",
    "rank",
    "recommend",
    "reference_flops",
    "scaled",
]
