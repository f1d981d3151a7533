"""Closed-form predictions of a training step, and the layout search behind `spmdkit plan`.

`layouts` lists the ways to split a model over N devices (`Layout`: a strategy on a mesh, with a
pipeline schedule), for `spmdkit compare` and `spmdkit plan` alike. `predict` gives one step's
per-device collective bytes (by kind and mesh axes), memory and FLOPs for a language-model family
on any mesh, without devices; `candidates` ranks every layout by an estimated step time on a
`DeviceProfile` (each an `Estimate`); `compile_candidate` checks one against an ahead-of-time
compile; `plan` does all of it for `spmdkit plan`. Every error is a `CostModelError`.
"""

from sharding.costmodel._layouts import (
    ORDER,
    Layout,
    UnknownStrategyError,
    layouts,
    meshes,
    strategy_names,
)
from sharding.costmodel._plan import DEFAULT_SIZES, PlanError, PlanResult, plan
from sharding.costmodel._predict import LM_FAMILIES, CostModelError, Prediction, predict
from sharding.costmodel._search import (
    PROFILES,
    DeviceProfile,
    Estimate,
    NoFittingStrategyError,
    NoValidLayoutError,
    candidates,
    comm_seconds,
    compile_candidate,
)
from sharding.costmodel._steptime import (
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
    "DEFAULT_SIZES",
    "LM_FAMILIES",
    "ORDER",
    "PROFILES",
    "CollectiveTime",
    "CollectiveWork",
    "CostModelError",
    "DeviceProfile",
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
    "candidates",
    "comm_seconds",
    "compile_candidate",
    "layouts",
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
