"""Where a run starts: fresh, or from a checkpoint whose model, data and batch fit the new run.

`plan_start` only reads the checkpoint directory (and only if it exists): a run refused here
leaves the file system as it found it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sharding._mesh import MeshSpec, mesh_text
from sharding.training._checkpoint import (
    Checkpointer,
    CheckpointMeta,
    CheckpointMismatchError,
    NoCheckpointError,
)
from sharding.training._config import (
    DEFAULT_ACCUM,
    DEFAULT_BATCH,
    DEFAULT_SEQ,
    LATEST,
    TRAIN_SETTINGS,
    TrainConfig,
    WouldOverwriteError,
)
from sharding.training._elastic import elastic_batch


@dataclasses.dataclass(frozen=True)
class ModelId:
    """What a checkpoint records of the model, to refuse resuming another: its name (a shipped
    family or the workload's), size, and configuration as plain data."""

    name: str
    size: str
    config: dict


@dataclasses.dataclass(frozen=True)
class RunStart:
    """The batch of a run and the checkpoint it resumes (None: a fresh start at step 0)."""

    batch: int
    seq: int
    accum: int
    resume: CheckpointMeta | None = None

    @property
    def step(self) -> int:
        return 0 if self.resume is None else self.resume.step


def _fresh(config: TrainConfig) -> RunStart:
    return RunStart(
        DEFAULT_BATCH if config.batch is None else config.batch,
        DEFAULT_SEQ if config.seq is None else config.seq,
        DEFAULT_ACCUM if config.accum is None else config.accum,
    )


def _path(p: Any) -> str | None:
    return None if p is None else str(p)


def plan_start(
    model: ModelId, spec: MeshSpec, config: TrainConfig, note: Callable[[str], None]
) -> RunStart:
    """The `RunStart` of ``config`` on ``spec``: checks the checkpoint to resume against the run.

    Raises `WouldOverwriteError` where the run would replace saved steps (checkpoints in a
    directory given without ``resume``; steps after the resumed one, unless ``overwrite``),
    `NoCheckpointError` for a step that is not there, `CheckpointMismatchError` for a checkpoint
    of another model, size, sequence length, seed, data or batch split.
    """
    if config.checkpoint_dir is None:
        return _fresh(config)
    directory = Path(config.checkpoint_dir).absolute()
    if not directory.is_dir():
        if config.resume not in (None, LATEST):
            raise NoCheckpointError(
                f"--resume {config.resume}: checkpoint directory {directory} does not exist; "
                f"give the --checkpoint-dir the run saved to, or --resume alone to start fresh"
            )
        if config.resume == LATEST:
            note(f"no checkpoint in {directory} yet: starting at step 0")
        return _fresh(config)
    with Checkpointer(directory, keep=None, read_only=True) as reader:
        steps = reader.steps()
        if config.resume is None or (config.resume == LATEST and not steps):
            if steps:
                raise WouldOverwriteError(
                    f"{directory} already holds checkpoints (steps {steps}); pass --resume to "
                    f"continue that run, or give an empty --checkpoint-dir"
                )
            if config.resume is not None:
                note(f"no checkpoint in {directory} yet: starting at step 0")
            return _fresh(config)
        meta = reader.meta(None if config.resume == LATEST else config.resume)
    _check_same_run(model, config, meta, directory)
    later = [s for s in steps if s > meta.step]
    if later and not config.overwrite:
        raise WouldOverwriteError(
            f"resuming from step {meta.step} would replace the later checkpoint step(s) {later} "
            f"in {directory} with a new run; pass --overwrite to replace them, or --resume "
            f"{later[-1]} to continue from the latest"
        )
    plan = elastic_batch(meta, spec.sizes, config.elastic)
    for flag, given, value in (("batch", config.batch, plan.global_batch),
                               ("accum", config.accum, plan.accum_steps)):  # fmt: skip
        if given is not None and given != value:
            how = f"--elastic {config.elastic}" if config.elastic else "the checkpoint"
            raise CheckpointMismatchError(
                f"--{flag} {given} disagrees with {how}, which gives --{flag} {value} "
                f"(checkpoint step {meta.step}: global batch {meta.global_batch}, accumulation "
                f"{meta.accum_steps}, mesh {mesh_text(meta.mesh)}); drop --{flag}"
                + ("" if config.elastic else ", or choose --elastic keep-batch|shrink-batch")
            )
    if plan.note:
        note(plan.note)
    changed = [f"{k} {meta.train.get(k)} -> {getattr(config, k)}" for k in TRAIN_SETTINGS
               if k in meta.train and meta.train[k] != getattr(config, k)]  # fmt: skip
    if changed:
        note(f"resuming with changed settings: {', '.join(changed)}")
    if later:
        note(f"--overwrite: checkpoint steps {later} of the earlier run are replaced as reached")
    return RunStart(plan.global_batch, meta.seq_len, plan.accum_steps, meta)


def _check_same_run(
    model: ModelId, config: TrainConfig, meta: CheckpointMeta, directory: Path
) -> None:
    want = {"model": (meta.family, model.name), "size": (meta.size, model.size),
            "seq": (meta.seq_len, config.seq), "seed": (meta.data.get("seed"), config.seed)}  # fmt: skip
    bad = [f"--{k} {a} (given: {b})" for k, (a, b) in want.items() if b is not None and a != b]
    grain = "position" in meta.data and str(config.data).startswith(("hf:", "grain:"))
    if meta.data.get("path") != _path(config.data) and not grain:  # Grain: by fingerprint
        saved, now = meta.data.get("path") or "none", _path(config.data) or "none"
        bad.append(f"--data {saved} (given: {now}; 'none' is the embedded arithmetic text)")
    elif config.data is not None and meta.data.get("dtype", config.data_dtype) != config.data_dtype:
        bad.append(f"--data-dtype {meta.data['dtype']} (given: {config.data_dtype})")
    if meta.config != model.config and not bad:
        bad.append(f"the {meta.family} {meta.size} config {meta.config}")
    if bad:
        raise CheckpointMismatchError(
            f"checkpoint step {meta.step} in {directory} was trained with "
            f"{'; '.join(bad)}; resume with those settings (or drop the flags)"
        )


def run_meta(model: ModelId, spec: MeshSpec, config: TrainConfig, start: RunStart):
    """The `CheckpointMeta` this run saves (the step is filled in when saving)."""
    data: dict[str, Any] = {"path": _path(config.data), "seed": config.seed}
    if config.data is not None:
        data["dtype"] = config.data_dtype
    if config.tokenizer is not None:
        data["tokenizer"] = _path(config.tokenizer)
    return CheckpointMeta(
        family=model.name,
        size=model.size,
        config=model.config,
        strategy=config.strategy,
        mesh=spec.sizes,
        global_batch=start.batch,
        seq_len=start.seq,
        accum_steps=start.accum,
        seed=config.seed,
        data=data,
        train={
            **{k: getattr(config, k) for k in TRAIN_SETTINGS},
            "schedule": config.schedule,
            "microbatches": config.microbatches,
            "repeats": config.repeats,
        },
    )


def meta_at(meta: CheckpointMeta, dataset: Any, step: int) -> CheckpointMeta:
    """``meta`` with the data position after ``step`` steps of a dataset that has one (a Grain
    dataset: epoch, index within it, fingerprint of dataset + tokenizer + seq + seed)."""
    if not hasattr(dataset, "position"):
        return meta
    return dataclasses.replace(meta, data={**meta.data, **dataset.position(step)})
