"""The training runtime: the loop (`fit`), data, checkpoints (orbax), elastic restarts, processes.

`fit(family, TrainConfig(...))` is everything `spmdkit train` does, returning a `TrainResult`;
`dataset_from_arg` / `process_batch` feed a step the rows this process's devices hold (from the
embedded text, a token file, or through Grain a local Hugging Face dataset: `GrainDataset`);
`Checkpointer` saves and restores the whole train state into any mesh's shardings, with a CRC
manifest so a damaged step is an error, never a partial restore; `elastic_batch` decides how a
resumed run splits its batch on another device count; `reshard` rewrites a checkpoint for another
mesh and strategy ahead of time; `join_run` joins a `jax.distributed` run (`resolve_process_group`,
`initialize`) and `launch` runs a command as N local processes of one; `profile_steps` takes a
`jax.profiler` trace of chosen steps of a loop. Every input error is a `TrainingError`.
"""

from sharding.training._checkpoint import (
    Checkpointer,
    CheckpointMeta,
    CheckpointMismatchError,
    NoCheckpointError,
    check_compatible,
    flatten_state,
)
from sharding.training._config import (
    ConflictingSettingsError,
    InvalidSettingError,
    OutputPathError,
    SequenceTooLongError,
    TrainConfig,
    TrainConfigError,
    WouldOverwriteError,
)
from sharding.training._data import (
    BYTE_VOCAB,
    ArithmeticText,
    DataError,
    DataFileNotFoundError,
    TokenFile,
    TokenFileFormatError,
    TokenFileTooShortError,
    TokenOutOfRangeError,
    VocabTooSmallError,
    decode,
    encode,
    process_batch,
)
from sharding.training._distributed import (
    HEARTBEAT_TIMEOUT_S,
    DistributedConfigError,
    DistributedInitError,
    JoinedRun,
    ProcessGroup,
    devices_per_process,
    initialize,
    join_run,
    resolve_process_group,
)
from sharding.training._elastic import (
    ELASTIC_POLICIES,
    BatchPlan,
    ElasticPolicyError,
    checkpoint_shardings,
    elastic_batch,
    reshard_checkpoint,
)
from sharding.training._errors import TrainingError
from sharding.training._fit import NonFiniteLossError, fit
from sharding.training._grain import (
    DatasetMismatchError,
    DatasetTooSmallError,
    GrainDataset,
    dataset_from_arg,
)
from sharding.training._hfdata import DatasetFormatError, TextColumnError, TokenizerError
from sharding.training._launch import (
    LAUNCH_GRACE_S,
    LaunchError,
    free_port,
    launch,
    process_commands,
)
from sharding.training._manifest import CheckpointError, CorruptCheckpointError
from sharding.training._observe import ProfileError, StepProfile, profile_steps
from sharding.training._reshard import ReshardError, ReshardResult, reshard
from sharding.training._result import TrainResult

__all__ = [
    "BYTE_VOCAB",
    "ELASTIC_POLICIES",
    "HEARTBEAT_TIMEOUT_S",
    "LAUNCH_GRACE_S",
    "ArithmeticText",
    "BatchPlan",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointMismatchError",
    "Checkpointer",
    "ConflictingSettingsError",
    "CorruptCheckpointError",
    "DataError",
    "DataFileNotFoundError",
    "DatasetFormatError",
    "DatasetMismatchError",
    "DatasetTooSmallError",
    "DistributedConfigError",
    "DistributedInitError",
    "ElasticPolicyError",
    "GrainDataset",
    "InvalidSettingError",
    "JoinedRun",
    "LaunchError",
    "NoCheckpointError",
    "NonFiniteLossError",
    "OutputPathError",
    "ProcessGroup",
    "ProfileError",
    "ReshardError",
    "ReshardResult",
    "SequenceTooLongError",
    "StepProfile",
    "TextColumnError",
    "TokenFile",
    "TokenFileFormatError",
    "TokenFileTooShortError",
    "TokenOutOfRangeError",
    "TokenizerError",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "TrainingError",
    "VocabTooSmallError",
    "WouldOverwriteError",
    "check_compatible",
    "checkpoint_shardings",
    "dataset_from_arg",
    "decode",
    "devices_per_process",
    "elastic_batch",
    "encode",
    "fit",
    "flatten_state",
    "free_port",
    "initialize",
    "join_run",
    "launch",
    "process_batch",
    "process_commands",
    "profile_steps",
    "reshard",
    "reshard_checkpoint",
    "resolve_process_group",
]
