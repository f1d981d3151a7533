"""Closed-form predictions of a training step, and the layout search behind `spmdkit plan`.

`layouts` lists the ways to split a model over N devices (`Layout`: a strategy on a mesh, with a
pipeline schedule), for `spmdkit compare` and `spmdkit plan` alike. `predict` gives one step's
per-device collective bytes (by kind and mesh axes), memory and FLOPs for a language-model family
on any mesh, without devices. `step_time` prices a step's work (`StepWork`, from a compiled
program's report or a prediction) on a `sharding.targets.Target`: the one step-time model of
compare and plan. `candidates` ranks every layout of a family on a target from the closed forms
(each an `Estimate`, the global batch searched as micro-steps). `sharding.planning`, above this
package and `sharding.comparison`, compiles estimates beside their formula and runs
`spmdkit plan`; nothing here imports a command. Every error is a `CostModelError`.
"""

from sharding._attention import live_fraction
from sharding.costmodel._accuracy import (
    ACCURACY_FILE,
    Accuracy,
    error_to_expect,
    expected_error,
    layout_kind,
)
from sharding.costmodel._batching import (
    accumulated,
    micro_steps,
    pipeline_microbatches,
    rows_per_pass,
)
from sharding.costmodel._lanes import lane_runs
from sharding.costmodel._layouts import (
    DEFAULT,
    EXPERT_STRATEGIES,
    LONG_SEQUENCE,
    ORDER,
    SEQUENCE_STRATEGIES,
    Layout,
    UnknownStrategyError,
    called_for,
    layouts,
    meshes,
    strategy_names,
)
from sharding.costmodel._passes import APART, REASSOCIATED, SCATTERED, apart_class, apart_of
from sharding.costmodel._predict import (
    LM_FAMILIES,
    OPTIMIZER_MOMENTS,
    CostModelError,
    Prediction,
    predict,
)
from sharding.costmodel._search import (
    MAX_COMPILES,
    Check,
    Estimate,
    NoFittingStrategyError,
    NoValidLayoutError,
    candidates,
    few_layouts,
    memory_budget,
    rank_estimates,
)
from sharding.costmodel._setup import DTYPE_BYTES
from sharding.costmodel._steptime import (
    MEMORY_FRACTION,
    CollectiveTime,
    CollectiveWork,
    StepTime,
    StepTimeError,
    StepWork,
    ring_factor,
    ring_hops,
    step_time,
)
from sharding.costmodel._stepwork import work_from_prediction, work_from_report
from sharding.costmodel._traffic import Traffic
from sharding.costmodel._zero import UPDATED_WEIGHTS

__all__ = [
    "ACCURACY_FILE",
    "APART",
    "DEFAULT",
    "DTYPE_BYTES",
    "EXPERT_STRATEGIES",
    "LM_FAMILIES",
    "LONG_SEQUENCE",
    "MAX_COMPILES",
    "MEMORY_FRACTION",
    "OPTIMIZER_MOMENTS",
    "ORDER",
    "REASSOCIATED",
    "SCATTERED",
    "SEQUENCE_STRATEGIES",
    "UPDATED_WEIGHTS",
    "Accuracy",
    "Check",
    "CollectiveTime",
    "CollectiveWork",
    "CostModelError",
    "Estimate",
    "Layout",
    "NoFittingStrategyError",
    "NoValidLayoutError",
    "Prediction",
    "StepTime",
    "StepTimeError",
    "StepWork",
    "Traffic",
    "UnknownStrategyError",
    "accumulated",
    "apart_class",
    "apart_of",
    "called_for",
    "candidates",
    "error_to_expect",
    "expected_error",
    "few_layouts",
    "lane_runs",
    "layout_kind",
    "layouts",
    "live_fraction",
    "memory_budget",
    "meshes",
    "micro_steps",
    "pipeline_microbatches",
    "predict",
    "rank_estimates",
    "ring_factor",
    "ring_hops",
    "rows_per_pass",
    "step_time",
    "strategy_names",
    "work_from_prediction",
    "work_from_report",
]
