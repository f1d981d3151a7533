"""`fit`: the training loop behind `spmdkit train`, as one library call.

Order matters here: every check that can refuse the run (settings, model size, checkpoint to
resume, data file, mesh, batch split, pipeline) runs before anything compiles or any file is
created; only then are the checkpoint directory and the metrics file opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from sharding._init import state_bytes
from sharding._mesh import MeshSpec, make_mesh, mesh_text
from sharding._recipe import build_program
from sharding._workload import Workload, sizes_with
from sharding.training._checkpoint import Checkpointer
from sharding.training._config import (
    InvalidSettingError,
    SequenceTooLongError,
    TrainConfig,
)
from sharding.training._data import TokenOutOfRangeError, process_batch
from sharding.training._errors import TrainingError
from sharding.training._grain import dataset_from_arg
from sharding.training._observe import ScalarLog, StepProfile, profile_steps, step_extras
from sharding.training._result import TrainResult
from sharding.training._resume import ModelId, meta_at, plan_start, run_meta


class NonFiniteLossError(TrainingError):
    """The loss or gradient norm became NaN or infinite: the run diverged and was stopped.

    ``step`` is the step that diverged (not saved), ``last_loss`` the last finite loss (None if
    none in this run), ``history`` the records of the steps before it.
    """

    def __init__(self, message: str, step: int, last_loss: float | None, history: list[dict]):
        super().__init__(message)
        self.step, self.last_loss, self.history = step, last_loss, history


def model_config(family: Any, size: str) -> Any:
    """``family.config(size)``, for a shipped family module and one of its named sizes."""
    name = getattr(family, "NAME", repr(family))
    sizes = getattr(family, "SIZES", {})
    if not sizes or not all(hasattr(family, a) for a in ("Model", "loss", "config")):
        raise InvalidSettingError(
            f"fit trains a sharding.Workload (your model) or a shipped family module (e.g. "
            f"models.llama); {name!r} is neither"
        )
    if size not in sizes:
        raise InvalidSettingError(
            f"--size {size!r}: {name} has no such size; choose one of {', '.join(sizes)}"
        )
    return family.config(size)


def _sizes_with(family: Any, field: str, least: int) -> str:
    fits = sizes_with(family, field, least)
    return ", ".join(f"{n} ({getattr(family.SIZES[n], field)})" for n in fits) or "none"


def _check_seq(family: Any, cfg: Any, seq: int) -> None:
    if seq > cfg.max_seq_len:
        raise SequenceTooLongError(
            f"--seq {seq}: sequence longer than {family.NAME} {cfg.name!r} supports: "
            f"seq_len={seq} > max_seq_len={cfg.max_seq_len}; use --seq {cfg.max_seq_len} or "
            f"less, or a --size whose context fits (max_seq_len: "
            f"{_sizes_with(family, 'max_seq_len', seq)})"
        )


def _dataset(family: Any, cfg: Any, config: TrainConfig, start) -> Any:
    """The run's dataset; a Grain dataset continues at the checkpoint's position."""
    try:
        data = dataset_from_arg(config.data, cfg.vocab_size, config.seed, seq_len=start.seq,
                                dtype=config.data_dtype, tokenizer=config.tokenizer,
                                text_column=config.text_column, global_batch=start.batch)  # fmt: skip
    except TokenOutOfRangeError as e:
        need = e.token_id + 1
        raise TokenOutOfRangeError(
            f"{e}; {family.NAME} sizes whose vocabulary covers {need} ids: "
            f"{_sizes_with(family, 'vocab_size', need)} (--size NAME)",
            token_id=e.token_id,
        ) from None
    if start.resume is not None and hasattr(data, "resumed"):
        data = data.resumed(start.resume.step, start.resume.data)
    return data


class _SyntheticData:
    """A user workload's batches: its ``make_batch`` at a key folded from the seed and the step,
    so a resumed run sees the batches the uninterrupted one would have."""

    def __init__(self, work: Workload, seed: int):
        self.work, self.seed = work, seed

    def batch(self, step: int, batch: int, seq: int) -> dict:
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        return jax.device_get(self.work.make_batch(batch, seq if self.work.seq else None, key))


def _workload(model: Any, config: TrainConfig) -> tuple[Workload, ModelId]:
    """The workload to train and what its checkpoints record of it."""
    if not isinstance(model, Workload):  # a shipped family module, at config.size
        model = Workload.from_family(model, model_config(model, config.size))
    if _language_model(model):
        cfg = model.config
        return model, ModelId(model.family.NAME, cfg.name, dataclasses.asdict(cfg))
    if config.data is not None:
        raise InvalidSettingError(
            f"--data {config.data}: token files feed the shipped language models; "
            f"{model.name!r} trains on its own make_batch data, so drop --data"
        )
    if model.make_batch is None:
        raise InvalidSettingError(
            f"workload {model.name!r} has no make_batch: give it one (batch, seq, key) -> batch "
            f"so fit has data to train on"
        )
    if model.family is not None:
        cfg = dataclasses.asdict(model.config)
        return model, ModelId(model.family.NAME, model.config.name, cfg)
    return model, ModelId(model.name, "-", {"workload": model.name})


def _language_model(work: Workload) -> bool:
    """A shipped family trained on token data (vocabulary and context length known)."""
    return work.family is not None and hasattr(work.config, "vocab_size")


def lr_schedule(config: TrainConfig) -> Callable[[int], Any]:
    """The learning rate of the update after ``n`` updates: warm-up, then cosine to 10%."""
    import optax

    return optax.warmup_cosine_decay_schedule(
        0.0,
        config.lr,
        max(1, min(config.warmup, config.steps - 1)),
        max(config.steps, 2),
        config.lr * 0.1,
    )


def build_train_program(work: Workload, config: TrainConfig, spec: MeshSpec, start):
    """The run's `TrainProgram` (`sharding.build_program`): AdamW (b2 0.95, weight decay 0.1) on
    a warm-up + cosine schedule (to 10% of ``lr`` at ``steps``), global-norm clipping unless
    ``clip`` is 0. Compiles nothing.
    """
    import optax

    schedule = lr_schedule(config)
    return build_program(
        work,
        config.strategy,
        make_mesh(spec),
        batch=start.batch,
        seq=start.seq,
        optimizer=optax.adamw(schedule, b2=0.95, weight_decay=0.1),
        accum_steps=start.accum,
        compute_dtype=config.dtype,
        remat=config.remat,
        clip_norm=config.clip if config.clip > 0 else None,
        schedule=config.schedule,
        microbatches=config.microbatches,
        repeats=config.repeats,
        stage_layers=config.stage_layers,
        context_method=config.context_method,
        attention=config.attention,
    )


def fit(
    model: Any,
    config: TrainConfig | None = None,
    *,
    on_step: Callable[[dict], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train ``model`` as ``config`` says: a shipped language-model family (``models.llama``,
    at ``config.size``) on token data, or any `sharding.Workload` (yours) on its
    ``make_batch`` data.

    Everything `spmdkit train` does: checks the settings, resumes or refuses the checkpoint,
    splits the batch (``elastic``), compiles the step, trains to ``config.steps`` writing one JSON
    line per step to ``metrics``, checkpoints to ``checkpoint_dir``, the same numbers as
    TensorBoard scalars to ``tensorboard`` and a `jax.profiler` trace of ``profile_steps`` to
    ``profile`` (`profile_steps`). ``on_step`` receives each step's record (step, loss,
    grad_norm, lr, step_time_s, tokens_per_s, and mfu on an accelerator whose peak is known);
    ``on_note`` each message about the run (resumed from, batch changed, compiling, traced).
    Runs on the devices JAX has (fix the count first: `sharding.setup_devices`).

    Raises a `TrainingError` (or another `SpmdkitError`) before anything compiles or any file is
    written for settings it cannot take, and `NonFiniteLossError` at the first NaN or infinite
    loss or gradient norm: that step is neither saved nor written to ``metrics``.

    Example (with ``models`` the package of shipped model families):
        >>> from sharding.training import TrainConfig, fit
        >>> result = fit(models.llama, TrainConfig(steps=3, mesh="data=8", batch=8, seq=16))  # doctest: +SKIP
        >>> [r["step"] for r in result.history]  # doctest: +SKIP
        [1, 2, 3]
    """
    config = TrainConfig() if config is None else config
    config.validate()
    notes: list[str] = []

    def note(message: str) -> None:
        notes.append(message)
        if on_note is not None:
            on_note(message)

    work, ident = _workload(model, config)
    if config.seq is None and work.seq and not _language_model(work):
        config = dataclasses.replace(config, seq=work.seq)  # the workload's own length
    spec = MeshSpec.of(config.mesh or "data=-1").resolve(jax.device_count())
    start = plan_start(ident, spec, config, note)
    if _language_model(work):
        _check_seq(work.family, work.config, start.seq)
        dataset = _dataset(work.family, work.config, config, start)
    else:
        dataset = _SyntheticData(work, config.seed)
    program = build_train_program(work, config, spec, start)
    window = _trace_window(config, start.step)
    # Everything is checked: from here on the run writes files.
    ck, saved, board = None, [], None
    if config.checkpoint_dir is not None:
        ck = Checkpointer(config.checkpoint_dir, save_every=config.save_every, keep=config.keep)
    try:
        if start.resume is not None:
            state, meta = ck.restore(program, start.step)
            note(
                f"resumed from step {meta.step} of {ck.directory} (saved under {meta.strategy} "
                f"on {mesh_text(meta.mesh)}, restored under {config.strategy} on {spec})"
            )
        else:
            state = program.init(config.seed)
        note(f"compiling {ident.name} {ident.size} / {config.strategy} on {spec} ...")
        program.compiled  # noqa: B018  (compile once, ahead of the loop, and time it)
        report = program.report()
        save_meta = run_meta(ident, spec, config, start) if ck else None
        if config.tensorboard is not None:
            board = ScalarLog(config.tensorboard, _settings(ident, spec, config, start), start.step)
        prof = contextlib.nullcontext() if window is None else profile_steps(
            config.profile, *window, on_note=note)  # fmt: skip
        extras = step_extras(config, lr_schedule(config), report, program)
        with prof:
            state, history = _loop(program, dataset, state, config, start, ck, save_meta,
                                   on_step, work, extras, prof, board)  # fmt: skip
        if ck is not None:
            ck.wait()
            saved = ck.steps()
            note(f"checkpoints in {ck.directory}: steps {saved}")
    finally:
        if board is not None:
            board.close()  # flushed on error too: the curves up to the failing step stay
        if ck is not None:
            ck.close()  # waits for the save in flight
    if start.step >= config.steps:
        note(f"the checkpoint is at step {start.step} >= --steps {config.steps}: nothing to train")
    params = program.abstract_state["params"]
    return TrainResult(
        family=ident.name,
        size=ident.size,
        strategy=config.strategy,
        mesh=spec.sizes,
        devices=spec.size,
        platform=jax.devices()[0].platform,
        config=config,
        batch=start.batch,
        seq=start.seq,
        accum=start.accum,
        history=history,
        resumed_from=None if start.resume is None else start.step,
        checkpoint_steps=saved,
        notes=notes,
        parameters=sum(x.size for x in jax.tree.leaves(params)),
        param_bytes=state_bytes(params, program.param_shardings),
        state_bytes=state_bytes(program.abstract_state, program.state_shardings),
        report=report,
        program=program,
        state=state,
    )


def _trace_window(config: TrainConfig, done: int) -> tuple[int, int] | None:
    """The steps to trace of those this run trains (after ``done``), checked before any file."""
    window = config.profile_window()
    if window is None or done >= config.steps:
        return None
    first, last = window
    if last <= done:
        raise InvalidSettingError(
            f"--profile-steps {first}:{last}: the run resumes after step {done}, so it trains "
            f"steps {done + 1}..{config.steps} only; trace steps among those, e.g. "
            f"--profile-steps {done + 1}:{min(done + 3, config.steps)}"
        )
    return max(first, done + 1), last


def _settings(ident: ModelId, spec: MeshSpec, config: TrainConfig, start) -> dict[str, Any]:
    """What the run was told and what it resolved (mesh, batch split), for TensorBoard's text."""
    resolved = {"model": ident.name, "size": ident.size, "mesh": str(spec), "devices": spec.size,
                "processes": jax.process_count(), "platform": jax.devices()[0].platform,
                "batch": start.batch, "seq": start.seq, "accum": start.accum,
                "jax": jax.__version__}  # fmt: skip
    return {**resolved, **{k: v for k, v in config.to_dict().items() if k not in resolved}}


def _loop(program, dataset, state, config, start, ck, save_meta, on_step, work, extras, prof,
          board):  # fmt: skip
    """Train from ``start.step`` to ``config.steps``; stop at the first non-finite number."""
    history: list[dict] = []
    metrics = None if config.metrics is None else open(config.metrics, "w")  # noqa: SIM115
    traced = prof.step if isinstance(prof, StepProfile) else lambda n: contextlib.nullcontext()
    try:
        for step in range(start.step, config.steps):
            if isinstance(dataset, _SyntheticData):
                batch = program.shard_batch(dataset.batch(step, start.batch, start.seq))
            else:
                batch = process_batch(dataset, step, start.batch, start.seq,
                                      program.batch_shardings)  # fmt: skip
            with traced(step + 1):
                began = time.perf_counter()
                state, out = program.step(state, batch)
                loss = float(out["loss"])  # blocks until the step is done
                elapsed = time.perf_counter() - began
            grad_norm = float(out["grad_norm"])
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise _diverged(step + 1, loss, grad_norm, history, config, ck)
            record = {
                "step": step + 1,
                "loss": loss,
                "grad_norm": grad_norm,
                "step_time_s": elapsed,
                "tokens_per_s": start.batch * (start.seq if work.seq else 1) / elapsed,
                **extras(step, elapsed),
            }
            history.append(record)
            if metrics is not None:
                metrics.write(json.dumps(record, allow_nan=False) + "\n")
                metrics.flush()
            if board is not None:
                board.write(record)
            if ck is not None and (ck.should_save(step + 1) or step + 1 == config.steps):
                # Asynchronous: returns once the arrays are copied; the next step may donate them.
                meta = meta_at(save_meta, dataset, step + 1)  # with a Grain dataset's position
                ck.save(step + 1, state, meta, overwrite=config.overwrite)
            if on_step is not None:
                on_step(record)
    finally:
        if metrics is not None:
            metrics.close()
    return state, history


def _diverged(step, loss, grad_norm, history, config, ck) -> NonFiniteLossError:
    last = history[-1]["loss"] if history else None
    where = "no finite loss in this run" if last is None else (
        f"last finite loss {last:.4f} at step {history[-1]['step']}")  # fmt: skip
    saved = ""
    if ck is not None:
        ck.wait()  # the save of an earlier step in flight is good: let it commit
        steps = ck.steps()
        saved = (f"; nothing saved for step {step}, the last checkpoint is step {steps[-1]} in "
                 f"{ck.directory} (--resume {steps[-1]})" if steps else
                 f"; nothing saved for step {step}")  # fmt: skip
    clip = "" if config.clip > 0 else ", turn clipping on (--clip 1.0)"
    return NonFiniteLossError(
        f"step {step}: loss {loss}, gradient norm {grad_norm}: the run diverged and was stopped "
        f"({where}){saved}. Lower --lr (now {config.lr:g}){clip} or raise --warmup "
        f"(now {config.warmup})",
        step,
        last,
        list(history),
    )
