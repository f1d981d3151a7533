"""Closed-form predictions of a training step, and the layout search behind `spmdkit plan`.

`layouts` lists the ways to split a model over N devices (`Layout`: a strategy on a mesh, with a
pipeline schedule), for `spmdkit compare` and `spmdkit plan` alike. `predict` gives one step's
per-device collective bytes (by kind and mesh axes), memory and FLOPs for a language-model family
on any mesh, without devices. `step_time` prices a step's work (`StepWork`, from a compiled
program's report or a prediction) on a `sharding.targets.Target`: the one step-time model of
compare and plan. `candidates` ranks every layout of a family on a target from the closed forms,
`compiled_candidates` a few layouts of any workload from their compiled programs (each an
`Estimate`); `check_candidate` compiles one estimate for the target beside its formula (`Check`);
`plan` does all of it for `spmdkit plan`. Every error is a `CostModelError`.
"""

from sharding._attention import live_fraction
from sharding.costmodel._check import check_candidate
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
from sharding.costmodel._plan import DEFAULT_SIZES, MAX_AOT_DEVICES, PlanError, PlanResult, plan
from sharding.costmodel._predict import LM_FAMILIES, CostModelError, Prediction, predict
from sharding.costmodel._search import (
    MAX_COMPILES,
    Check,
    Estimate,
    NoFittingStrategyError,
    NoValidLayoutError,
    candidates,
    compiled_candidates,
    few_layouts,
    memory_budget,
)
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

__all__ = [
    "DEFAULT",
    "DEFAULT_SIZES",
    "EXPERT_STRATEGIES",
    "LM_FAMILIES",
    "LONG_SEQUENCE",
    "MAX_AOT_DEVICES",
    "MAX_COMPILES",
    "MEMORY_FRACTION",
    "ORDER",
    "SEQUENCE_STRATEGIES",
    "Check",
    "CollectiveTime",
    "CollectiveWork",
    "CostModelError",
    "Estimate",
    "Layout",
    "NoFittingStrategyError",
    "NoValidLayoutError",
    "PlanError",
    "PlanResult",
    "Prediction",
    "StepTime",
    "StepTimeError",
    "StepWork",
    "Traffic",
    "UnknownStrategyError",
    "called_for",
    "candidates",
    "check_candidate",
    "compiled_candidates",
    "few_layouts",
    "layouts",
    "live_fraction",
    "memory_budget",
    "meshes",
    "plan",
    "predict",
    "ring_factor",
    "ring_hops",
    "step_time",
    "strategy_names",
    "work_from_prediction",
    "work_from_report",
]
