"""Checkpoints of the whole train state, verified on restore and restorable onto any mesh.

A checkpoint directory is an orbax `CheckpointManager` directory: one sub-directory per step
holding two items, ``state`` (every array of the train state, saved from its shards) and
``meta`` (JSON: mesh, strategy, model, batch; `CheckpointMeta`), plus ``spmdkit_manifest.json``:
the size and CRC-32 of every file of both items. The manifest is written while the step is still
orbax's temporary directory, just before the atomic rename that commits it, so a committed step
always has one; a save killed at any point leaves only a ``*.orbax-checkpoint-tmp`` directory,
which is ignored, and the previous step stays what `latest_step` returns. Restore checks every
file against the manifest first: a truncated or corrupted file is a `CorruptCheckpointError`
naming the step and the file, never a partial restore.

Arrays are stored under their "/"-joined state paths (``params/layers/attn/q/kernel``,
``opt_state/0/mu/...``), independent of the pytree node types, and restored straight into the
shardings of the target (`TrainProgram.state_shardings` for any mesh and strategy): each device
reads only its own shards. The data position follows from the step: `sharding.process_batch` is
addressed by ``(seed, step, row)``, so a restored step resumes the exact data order; a Grain
dataset also saves its epoch, index and fingerprint in the metadata, checked on resume.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from sharding._resolve import path_str
from sharding.training._manifest import (
    CheckpointError,
    CorruptCheckpointError,
    verify_manifest,
    write_manifest,
)

FORMAT = 1


class NoCheckpointError(CheckpointError):
    """The directory holds no committed checkpoint, or not the step asked for."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's arrays do not fit the target state (other model, optimizer or config)."""


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint was trained with, stored as JSON beside the arrays.

    ``train`` holds the remaining run settings (optimizer, schedule, dtype, pipeline) free-form;
    ``data`` identifies the dataset (its position is ``step``).
    """

    family: str
    size: str
    config: dict
    strategy: str
    mesh: dict
    global_batch: int
    seq_len: int | None
    accum_steps: int
    seed: int = 0
    data: dict = dataclasses.field(default_factory=dict)
    train: dict = dataclasses.field(default_factory=dict)
    step: int = 0
    devices: int = 0
    process_count: int = 1
    format: int = FORMAT

    @property
    def batch_split(self) -> int:
        """Devices the batch is split over when saved (``data * fsdp``)."""
        return self.mesh.get("data", 1) * self.mesh.get("fsdp", 1)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str = "checkpoint") -> CheckpointMeta:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in d
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        if missing or d.get("format", FORMAT) > FORMAT:
            raise CheckpointError(
                f"{where}: metadata is not spmdkit checkpoint format {FORMAT} (missing fields "
                f"{missing}, format={d.get('format')!r}); was it written by another tool or a "
                f"newer spmdkit?"
            )
        return cls(**{k: v for k, v in d.items() if k in names})


def flatten_state(tree: Any) -> dict[str, Any]:
    """``{"/"-joined path: leaf}`` of a state tree (nnx Variables see through to their value).

    Example:
        >>> flatten_state({"params": {"w": 1}, "opt_state": (2, {"mu": 3})})
        {'opt_state/0': 2, 'opt_state/1/mu': 3, 'params/w': 1}
    """
    flat: dict[str, Any] = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        key = path_str(key_path)
        if key in flat:
            raise CheckpointError(f"two leaves of the state share the path {key!r}")
        flat[key] = leaf
    return flat


def nest(flat: dict[str, Any]) -> dict:
    """Nested dicts from "/"-joined paths (the layout orbax stores).

    Example:
        >>> nest({"params/w": 1, "params/b": 2, "step": 3})
        {'params': {'w': 1, 'b': 2}, 'step': 3}
    """
    out: dict = {}
    for key, leaf in flat.items():
        *parents, last = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


class Checkpointer:
    """Asynchronous, verified checkpoints of a train state in ``directory``.

    Args:
        directory: the checkpoint directory (created if missing).
        save_every: `should_save(step)` is true every this many steps (0: never by interval).
        keep: keep only the newest ``keep`` steps (None keeps all).
        async_save: write in a background thread; `save` returns once the arrays are copied, so
            the next (donating) step may run at once. False: `save` returns once committed.
        read_only: only read (the directory must exist; interrupted saves are left alone).

    Example:
        >>> ck = Checkpointer("/tmp/run1", save_every=100, keep=3)  # doctest: +SKIP
        >>> ck.save(step, state, meta)  # doctest: +SKIP
        >>> state, meta = ck.restore(program)  # latest step, in program's shardings  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int = 0,
        keep: int | None = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if save_every < 0 or (keep is not None and keep < 1):
            raise CheckpointError(
                f"save_every={save_every} must be >= 0 and keep={keep} >= 1 (or None to keep all)"
            )
        self.directory = Path(directory).absolute()
        if read_only and not self.directory.is_dir():
            raise NoCheckpointError(
                f"checkpoint directory {self.directory} does not exist; give the --checkpoint-dir "
                f"a run was trained with"
            )
        self.save_every = save_every
        self.read_only = read_only
        self._pending: int | None = None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            # A reader must not delete the temporary directory of another process's save.
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            # Always orbax's async path, for its pre-commit hook; a synchronous save waits.
            async_options=ocp.AsyncOptions(post_finalization_callback=self._finalize),
        )
        self._sync = not async_save
        self._mgr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    # -- bookkeeping ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first (interrupted saves are not listed)."""
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return self.save_every > 0 and step % self.save_every == 0

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def pre_commit(self, step: int) -> None:
        """Hook: runs once every file of ``step`` is written, before its manifest and the rename
        that commits it. Does nothing; override (or patch) it to observe commits or to test a
        save that dies at that moment (the step then stays an ignored temporary directory).

        Runs in orbax's background thread for an asynchronous save.
        """

    def _finalize(self) -> None:
        self.pre_commit(self._pending)
        self._before_commit()

    def _before_commit(self) -> None:
        # Runs in orbax's background thread after every item is written and before the rename
        # that commits the step: the manifest is committed atomically with the arrays. In a
        # multi-process run every process writes its own shards into the same step directory;
        # orbax calls this on the primary process (0) only, after the barrier each process
        # reaches once its own writes are done and after the per-process parts are merged, so
        # process 0's manifest covers every process's files. That order is orbax's, not ours:
        # a step lacking a process's part is refused here (never committed), and a file the
        # manifest does not list fails verification on restore.
        from sharding.training._manifest import missing_processes

        if jax.process_index() != 0:
            return
        step = self._pending
        tmps = glob.glob(str(self.directory / f"{step}.orbax-checkpoint-tmp*"))
        if tmps:
            step_dir = Path(max(tmps, key=os.path.getmtime))
        elif self.step_dir(step).is_dir():  # a temporary-path scheme that writes in place
            step_dir = self.step_dir(step)
        else:
            raise CheckpointError(f"checkpoint step {step}: no directory to write the manifest in")
        missing = missing_processes(step_dir, jax.process_count())
        if missing:
            raise CheckpointError(
                f"checkpoint step {step}: process(es) {', '.join(map(str, missing))} of "
                f"{jax.process_count()} left no shards in {step_dir} by the time it was to be "
                f"committed; the step is not committed and the previous one stays the latest"
            )
        write_manifest(step_dir, step)

    # -- save ----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: CheckpointMeta, *, overwrite: bool = False) -> None:
        """Start saving ``state`` as ``step`` (waits for the previous save first).

        ``overwrite`` replaces an existing step (a resumed run replaying steps past its start).

        Example:
            >>> ck.save(10, state, meta)  # doctest: +SKIP
            >>> ck.wait(); ck.steps()  # doctest: +SKIP
            [10]
        """
        if self.read_only:
            raise CheckpointError(f"{self.directory} is opened read-only; cannot save step {step}")
        self._mgr.wait_until_finished()
        if step in self.steps():
            if not overwrite:
                raise CheckpointError(
                    f"checkpoint step {step} already exists in {self.directory}; pass "
                    f"overwrite=True (spmdkit train: --overwrite) to replace it, or save to "
                    f"another directory"
                )
            self._mgr.delete(step)
        meta = dataclasses.replace(
            meta, step=int(step), devices=jax.device_count(), process_count=jax.process_count()
        )
        self._pending = step
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(nest(flatten_state(state))),
            meta=ocp.args.JsonSave(meta.to_json()),
        )
        self._mgr.save(step, args=args, force=True)
        if self._sync:
            self._mgr.wait_until_finished()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restore -------------------------------------------------------------------------------

    def _pick(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            tmps = sorted(p.name for p in self.directory.glob("*.orbax-checkpoint-tmp*"))
            extra = f" (only interrupted saves: {', '.join(tmps)})" if tmps else ""
            raise NoCheckpointError(
                f"no committed checkpoint in {self.directory}{extra}; train without --resume "
                f"first, or point --checkpoint-dir at a directory written by spmdkit train"
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise NoCheckpointError(
                f"checkpoint step {step} is not in {self.directory}; committed steps: {steps}"
            )
        return step

    def meta(self, step: int | None = None, *, verify: bool = True) -> CheckpointMeta:
        """The metadata of ``step`` (default: the latest), after checking its files."""
        step = self._pick(step)
        if verify:
            verify_manifest(self.step_dir(step), step)
        raw = self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        return CheckpointMeta.from_json(raw, f"checkpoint step {step} in {self.directory}")

    def array_metadata(self, step: int) -> dict[str, jax.ShapeDtypeStruct]:
        """``{path: ShapeDtypeStruct}`` of every saved array (no sharding; nothing is read)."""
        tree = self._mgr.item_metadata(step)["state"]
        return {k: jax.ShapeDtypeStruct(m.shape, m.dtype) for k, m in flatten_state(tree).items()}

    def _read(self, step: int, args: Any) -> Any:
        try:
            return self._mgr.restore(step, args=args)
        except (OSError, ValueError, RuntimeError) as e:
            raise CorruptCheckpointError(
                f"checkpoint step {step} in {self.directory} could not be read: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e

    def restore(
        self, target: Any, step: int | None = None, *, verify: bool = True
    ) -> tuple[Any, CheckpointMeta]:
        """Restore ``step`` (default: the latest) into ``target``'s structure and shardings.

        ``target`` is a `TrainProgram` (its ``abstract_state`` in its ``state_shardings``, for
        any mesh and strategy) or a pytree of `jax.ShapeDtypeStruct` with ``sharding`` set.
        Every array is read straight into its target sharding. Returns ``(state, meta)``.
        """
        if hasattr(target, "abstract_state") and hasattr(target, "state_shardings"):
            target = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                target.abstract_state,
                target.state_shardings,
            )
        meta = self.meta(step, verify=verify)
        step = meta.step
        treedef = jax.tree_util.tree_structure(target)
        flat = flatten_state(target)
        check_compatible(self.array_metadata(step), flat, f"checkpoint step {step}")
        restored = self._read(step, ocp.args.Composite(state=ocp.args.StandardRestore(nest(flat))))[
            "state"
        ]
        arrays = flatten_state(restored)
        state = jax.tree_util.tree_unflatten(treedef, [arrays[k] for k in flat])
        return state, meta


def check_compatible(
    saved: dict[str, jax.ShapeDtypeStruct], target: dict[str, Any], where: str
) -> None:
    """Raise `CheckpointMismatchError` listing every path whose presence, shape or dtype differ."""
    lines = [f"  - {k}: in the target, not in the checkpoint" for k in target if k not in saved]
    lines += [f"  - {k}: in the checkpoint, not in the target" for k in saved if k not in target]
    for k in target.keys() & saved.keys():
        a, b = saved[k], target[k]
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            lines.append(
                f"  - {k}: saved {a.dtype}{list(a.shape)}, target {b.dtype}{list(b.shape)}"
            )
    if lines:
        shown = sorted(lines)[:20] + ([f"  ... {len(lines) - 20} more"] if len(lines) > 20 else [])
        raise CheckpointMismatchError(
            f"{where} does not fit the target state ({len(lines)} differences):\n"
            + "\n".join(shown)
            + "\nrestore with the model config and optimizer the checkpoint was saved with "
            "(its metadata names them: Checkpointer.meta())"
        )
