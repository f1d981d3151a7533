"""The training runtime: data, checkpoints (orbax), elastic restarts, multi-process runs.

`dataset_from_arg` / `process_batch` feed a step the rows this process's devices hold;
`Checkpointer` saves and restores the whole train state into any mesh's shardings, with a CRC
manifest so a damaged step is an error, never a partial restore; `elastic_batch` decides how a
resumed run splits its batch on another device count; `resolve_process_group` / `initialize` join
a `jax.distributed` run. Every input error is a `TrainingError`.
"""

from sharding.training._checkpoint import (
    Checkpointer,
    CheckpointMeta,
    CheckpointMismatchError,
    NoCheckpointError,
    check_compatible,
    flatten_state,
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
    dataset_from_arg,
    decode,
    encode,
    process_batch,
)
from sharding.training._distributed import (
    DistributedConfigError,
    DistributedInitError,
    ProcessGroup,
    devices_per_process,
    init_from_args,
    initialize,
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
from sharding.training._manifest import CheckpointError, CorruptCheckpointError

__all__ = [
    "BYTE_VOCAB",
    "ELASTIC_POLICIES",
    "ArithmeticText",
    "BatchPlan",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointMismatchError",
    "Checkpointer",
    "CorruptCheckpointError",
    "DataError",
    "DataFileNotFoundError",
    "DistributedConfigError",
    "DistributedInitError",
    "ElasticPolicyError",
    "NoCheckpointError",
    "ProcessGroup",
    "TokenFile",
    "TokenFileFormatError",
    "TokenFileTooShortError",
    "TokenOutOfRangeError",
    "TrainingError",
    "VocabTooSmallError",
    "check_compatible",
    "checkpoint_shardings",
    "dataset_from_arg",
    "decode",
    "devices_per_process",
    "elastic_batch",
    "encode",
    "flatten_state",
    "init_from_args",
    "initialize",
    "process_batch",
    "reshard_checkpoint",
    "resolve_process_group",
]
