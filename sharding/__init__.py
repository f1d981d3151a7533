"""spmdkit's compiler: binds partition rules to a device mesh and builds SPMD programs.

The core (this namespace): the mesh (`MeshSpec`, `make_mesh`, `setup_devices`), placing rules on
it (`resolve`, `place`, `explain`), born-sharded state (`init_sharded`) and the train-step compiler
(`compile_train_step`). One sub-package per concept:

    sharding.pipeline     schedule tables, the scan pipeline (GPipe, circular, 1F1B), stages
    sharding.context      context parallelism: ring, all-gather and Ulysses attention
    sharding.experts      expert parallelism: a mixture of experts' all-to-all over expert
    sharding.inspection   compiled-program facts: collectives, memory, FLOPs, device peaks
    sharding.costmodel    closed-form predictions and the layout search (`spmdkit plan`)
    sharding.comparison   measure strategies side by side and recommend (`spmdkit compare`)
    sharding.training     data, checkpoints, elastic restarts, multi-process runs

The entry points behind the commands are here too: `compare` (`spmdkit compare`), `plan`,
`explain`, `fit` (`spmdkit train`), `reshard` and `launch`; each returns data with `.table()`,
`.to_json()` and (where a picture applies) `.plot()`.

Every error for input spmdkit cannot take is a `SpmdkitError` (a `ValueError`), grouped under one
base per concept.
"""

from sharding import (
    comparison,
    context,
    costmodel,
    experts,
    inspection,
    pipeline,
    planning,
    targets,
    training,
)
from sharding._attention import AttentionChoiceError
from sharding._bound import BoundStrategy, StrategyMeshError
from sharding._checks import ArgumentTypeError, StepArgumentError
from sharding._devices import cpu_only, setup_devices
from sharding._errors import SpmdkitError
from sharding._explain import Explanation, explain
from sharding._init import abstract_params, init_sharded, state_bytes
from sharding._mesh import (
    AXES,
    BATCH_AXES,
    SEQUENCE_AXIS,
    MalformedMeshSpecError,
    MeshSizeMismatchError,
    MeshSpec,
    MeshSpecError,
    MultipleFillAxesError,
    UnknownMeshAxisNameError,
    make_mesh,
    mesh_sizes,
    mesh_text,
    simulate_cpu_devices,
)
from sharding._recipe import build_program, pipeline_for
from sharding._resolve import (
    DuplicateMeshAxisError,
    IndivisibleDimensionError,
    Placement,
    Placements,
    RankMismatchError,
    RuleError,
    UnknownLogicalAxisError,
    UnknownMeshAxisError,
    UnmatchedParameterError,
    path_str,
    place,
    resolve,
    shard_abstract,
)
from sharding._sequence import SequenceLayoutError
from sharding._shardings import OptimizerSplitError
from sharding._stack import StackCarryError, StackError
from sharding._step import (
    AccumulationError,
    BatchShardingError,
    StepConfigError,
    TrainProgram,
    compile_train_step,
    remat_wrapper,
)
from sharding._units import SizeFormatError, fmt_bytes, fmt_count, parse_bytes
from sharding._workload import Workload, WorkloadError, load_workload
from sharding.comparison import compare
from sharding.planning import plan
from sharding.training import fit, launch, reshard

__all__ = [
    "AXES",
    "BATCH_AXES",
    "SEQUENCE_AXIS",
    "AccumulationError",
    "ArgumentTypeError",
    "AttentionChoiceError",
    "BatchShardingError",
    "BoundStrategy",
    "DuplicateMeshAxisError",
    "Explanation",
    "IndivisibleDimensionError",
    "MalformedMeshSpecError",
    "MeshSizeMismatchError",
    "MeshSpec",
    "MeshSpecError",
    "MultipleFillAxesError",
    "OptimizerSplitError",
    "Placement",
    "Placements",
    "RankMismatchError",
    "RuleError",
    "SequenceLayoutError",
    "SizeFormatError",
    "SpmdkitError",
    "StackCarryError",
    "StackError",
    "StepArgumentError",
    "StepConfigError",
    "StrategyMeshError",
    "TrainProgram",
    "UnknownLogicalAxisError",
    "UnknownMeshAxisError",
    "UnknownMeshAxisNameError",
    "UnmatchedParameterError",
    "Workload",
    "WorkloadError",
    "abstract_params",
    "build_program",
    "compare",
    "comparison",
    "compile_train_step",
    "context",
    "costmodel",
    "cpu_only",
    "experts",
    "explain",
    "fit",
    "fmt_bytes",
    "fmt_count",
    "init_sharded",
    "inspection",
    "launch",
    "load_workload",
    "make_mesh",
    "mesh_sizes",
    "mesh_text",
    "parse_bytes",
    "path_str",
    "pipeline",
    "pipeline_for",
    "place",
    "plan",
    "planning",
    "remat_wrapper",
    "reshard",
    "resolve",
    "setup_devices",
    "shard_abstract",
    "simulate_cpu_devices",
    "state_bytes",
    "targets",
    "training",
]
