"""Pipeline parallelism in one SPMD program: schedule tables, the scan pipeline, 1F1B, stages.

`make_schedule` builds a pure table of what every stage does at every tick (`render` draws it);
`PipelineSpec` asks `compile_train_step` to pipeline the stacked layers over the ``stage`` mesh
axis under that schedule; `stage_report` and `stack_flop_overhead` show how the stages are
loaded and what the bubble costs in FLOPs. Every error is a `PipelineError`.
"""

from sharding.pipeline._balance import StageLayersError, balance_layers, check_stage_layers
from sharding.pipeline._errors import PipelineError
from sharding.pipeline._layers import replicas as stage_manual_axes
from sharding.pipeline._loss import Staging, pipelined_loss
from sharding.pipeline._scan import PipelineConfigError, PipelineSpec, check_pipeline
from sharding.pipeline._schedule import (
    EXPLICIT,
    SCHEDULES,
    Action,
    Kind,
    LayerCountError,
    RepeatsError,
    Schedule,
    ScheduleError,
    ScheduleSizeError,
    TickCosts,
    TooFewMicrobatchesError,
    UnknownScheduleError,
    check_layers,
    make_schedule,
    render,
)
from sharding.pipeline._stages import (
    StageLoad,
    StageReport,
    balanced_stages,
    stack_flop_overhead,
    stage_report,
    stage_work,
    workload_stage_costs,
)

__all__ = [
    "EXPLICIT",
    "SCHEDULES",
    "Action",
    "Kind",
    "LayerCountError",
    "PipelineConfigError",
    "PipelineError",
    "PipelineSpec",
    "RepeatsError",
    "Schedule",
    "ScheduleError",
    "ScheduleSizeError",
    "StageLayersError",
    "StageLoad",
    "StageReport",
    "Staging",
    "TickCosts",
    "TooFewMicrobatchesError",
    "UnknownScheduleError",
    "balance_layers",
    "balanced_stages",
    "check_layers",
    "check_pipeline",
    "check_stage_layers",
    "make_schedule",
    "pipelined_loss",
    "render",
    "stack_flop_overhead",
    "stage_manual_axes",
    "stage_report",
    "stage_work",
    "workload_stage_costs",
]
