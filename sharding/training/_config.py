"""The settings of a training run (`TrainConfig`) and the errors for settings it cannot take.

Field names follow `spmdkit train`'s flags (``save_every`` is ``--save-every``), and so do the
messages: each names the flag, the value and what to write instead. `TrainConfig.validate` checks
everything that needs neither the model nor the checkpoint, reading the file system but writing
nothing; `sharding.training.fit` calls it first.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from partition_rules import CompositionError, composition
from sharding._attention import KINDS as ATTENTION_KINDS
from sharding.context import METHODS as CONTEXT_METHODS
from sharding.pipeline import SCHEDULES
from sharding.training._elastic import ELASTIC_POLICIES
from sharding.training._errors import TrainingError

# Defaults of the settings a resumed run takes from its checkpoint instead.
DEFAULT_BATCH, DEFAULT_SEQ, DEFAULT_ACCUM = 16, 64, 1
LATEST = "latest"
DTYPES = ("float32", "bfloat16")
REMATS = ("none", "full", "dots")
DATA_DTYPES = ("uint16", "uint32")
# Settings that shape the numbers of a run beyond the model and the data; a resumed run that
# changes one still runs, and says so.
TRAIN_SETTINGS = ("lr", "warmup", "steps", "clip", "dtype", "remat")


class TrainConfigError(TrainingError):
    """A training setting that cannot be taken (the base of the errors below)."""


class InvalidSettingError(TrainConfigError):
    """A setting out of its range (``--steps 0``, ``--lr nan``) or not one of its choices."""


class ConflictingSettingsError(TrainConfigError):
    """A setting that needs another one (``--elastic`` without ``--resume``)."""


class OutputPathError(TrainConfigError):
    """A ``--metrics`` or ``--checkpoint-dir`` path that cannot be written where asked."""


class SequenceTooLongError(TrainConfigError):
    """``--seq`` longer than the model's ``max_seq_len``."""


class WouldOverwriteError(TrainingError):
    """The run would replace a file or checkpoint; ``--overwrite`` (``overwrite=True``) allows it."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `spmdkit train` is told, as one value (see ``spmdkit train --help``).

    ``batch``, ``seq`` and ``accum`` left as None take the checkpoint's values when resuming, else
    16, 64 and 1. ``resume`` is a step, ``"latest"`` (the newest checkpoint, or a fresh start when
    there is none yet), or None. ``clip=0`` turns gradient clipping off. ``mesh`` is a mesh spec
    (None: every device along ``data``). ``profile`` is a folder for a `jax.profiler` trace of
    steps ``profile_steps`` (``"A:B"`` or ``(A, B)``, inclusive); ``tensorboard`` a folder for
    TensorBoard scalars of every step. ``data`` is a token file, ``"hf:PATH"`` (a local Hugging
    Face dataset, tokenized with ``tokenizer`` from column ``text_column``, default ``text``) or
    ``"grain:FILE"``; None is the embedded arithmetic text.

    Example:
        >>> TrainConfig(steps=10, lr=1e-3).validate()
        >>> TrainConfig(steps=0).validate()  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        InvalidSettingError: --steps 0: train until a step >= 1, e.g. --steps 300
    """

    size: str = "tiny"
    strategy: str = "fsdp_tp"
    mesh: Any = None
    steps: int = 300
    batch: int | None = None
    seq: int | None = None
    lr: float = 3e-3
    warmup: int = 20
    dtype: str = "float32"
    remat: str = "none"
    accum: int | None = None
    clip: float = 1.0
    data: str | os.PathLike | None = None
    data_dtype: str | None = None
    tokenizer: str | os.PathLike | None = None
    text_column: str | None = None
    seed: int = 0
    metrics: str | os.PathLike | None = None
    checkpoint_dir: str | os.PathLike | None = None
    save_every: int = 0
    keep: int = 3
    resume: int | str | None = None
    elastic: str | None = None
    schedule: str | None = None
    microbatches: int | None = None
    repeats: int | None = None
    stage_layers: tuple[int, ...] | str | None = None
    context_method: str | None = None
    attention: str | None = None
    overwrite: bool = False
    profile: str | os.PathLike | None = None
    profile_steps: tuple[int, int] | str | None = None
    tensorboard: str | os.PathLike | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (paths as strings) for JSON."""
        out = dataclasses.asdict(self)
        return {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in out.items()}

    def validate(self) -> None:
        """Raise a `TrainConfigError` (or `WouldOverwriteError`) for the first bad setting.

        Checks ranges and choices, settings that need each other, and the output paths
        (``metrics``' folder exists and the file does not unless ``overwrite``;
        ``checkpoint_dir``, ``profile`` and ``tensorboard`` are not files, and can be created
        where missing). Leaves nothing behind (the probe's empty folder is removed at once).
        """
        self._check_numbers()
        self._check_choices()
        self._check_combinations()
        self._check_paths()
        self.profile_window()

    def profile_window(self) -> tuple[int, int] | None:
        """The steps to trace, ``(first, last)`` inclusive, or None without ``profile``.

        Example:
            >>> TrainConfig(steps=5, profile="traces", profile_steps="2:3").profile_window()
            (2, 3)
        """
        if self.profile is None:
            if self.profile_steps is not None:
                raise ConflictingSettingsError(
                    f"--profile-steps {_window_text(self.profile_steps)} says which steps to "
                    f"trace, but no --profile DIR is given; add --profile DIR (e.g. --profile "
                    f"traces) or drop --profile-steps"
                )
            return None
        if self.profile_steps is None:
            raise ConflictingSettingsError(
                f"--profile {self.profile} needs --profile-steps A:B, the first and last step to "
                f"trace, e.g. --profile-steps {min(2, self.steps)}:{min(4, self.steps)}"
            )
        first, last = parse_window(self.profile_steps)
        if last > self.steps:
            raise InvalidSettingError(
                f"--profile-steps {first}:{last}: the run ends at --steps {self.steps}; trace "
                f"steps within 1..{self.steps}, e.g. --profile-steps {min(first, self.steps)}:"
                f"{self.steps}"
            )
        return first, last

    def _check_numbers(self) -> None:
        wholes = {
            "steps": (1, "train until a step >= 1, e.g. --steps 300"),
            "batch": (1, "the global batch (sequences per step) must be >= 1, e.g. --batch 16"),
            "seq": (1, "the sequence length must be >= 1, e.g. --seq 64"),
            "accum": (1, "gradient accumulation micro-steps must be >= 1 (1: none)"),
            "warmup": (0, "learning-rate warm-up steps must be >= 0, e.g. --warmup 20"),
            "seed": (0, "the seed must be a whole number >= 0, e.g. --seed 0"),
            "save_every": (0, "save every N >= 0 steps (0: only at the last step)"),
            "keep": (1, "keep >= 1 checkpoints, e.g. --keep 3"),
            "microbatches": (1, "micro-batches per step must be >= 1"),
            "repeats": (1, "circular repeats must be >= 1"),
        }
        optional = {"batch", "seq", "accum", "microbatches", "repeats"}
        for name, (least, fix) in wholes.items():
            v = getattr(self, name)
            if v is None and name in optional:
                continue
            if not _whole(v) or v < least:
                raise InvalidSettingError(f"{_flag(name)} {v!r}: {fix}")
        if not _real(self.lr) or not math.isfinite(self.lr) or self.lr <= 0:
            raise InvalidSettingError(
                f"--lr {self.lr!r}: the peak learning rate must be a finite number > 0, "
                f"e.g. --lr 3e-3"
            )
        if not _real(self.clip) or not math.isfinite(self.clip) or self.clip < 0:
            raise InvalidSettingError(
                f"--clip {self.clip!r}: the gradient-clipping norm must be a finite number >= 0, "
                f"e.g. --clip 1.0; --clip 0 turns clipping off"
            )
        r = self.resume
        if r is not None and r != LATEST and (not _whole(r) or r < 1):
            raise InvalidSettingError(
                f"--resume {r!r}: give a saved step >= 1, or --resume alone for the latest"
            )

    def _check_choices(self) -> None:
        choices = {
            "dtype": DTYPES,
            "remat": REMATS,
            "data_dtype": (None, *DATA_DTYPES),
            "elastic": (None, *ELASTIC_POLICIES),
            "schedule": (None, *SCHEDULES),
            "context_method": (None, *CONTEXT_METHODS),
            "attention": (None, *ATTENTION_KINDS),
        }
        try:
            composition(self.strategy)
        except CompositionError as e:
            raise InvalidSettingError(f"--strategy {self.strategy!r}: {e}") from None
        for name, known in choices.items():
            v = getattr(self, name)
            if v not in known:
                shown = ", ".join(str(k) for k in known if k is not None)
                raise InvalidSettingError(f"{_flag(name)} {v!r}: choose one of {shown}")
        sl = self.stage_layers
        if (
            sl is not None
            and sl != "auto"
            and not (isinstance(sl, tuple | list) and sl and all(_whole(n) and n >= 1 for n in sl))
        ):
            raise InvalidSettingError(
                f"--stage-layers {sl!r}: give the layers of each virtual stage as whole numbers "
                f">= 1, e.g. --stage-layers 3,5, or --stage-layers auto"
            )
        if not isinstance(self.size, str) or not self.size:
            raise InvalidSettingError(f"--size {self.size!r}: give a named size, e.g. --size tiny")

    def _check_combinations(self) -> None:
        if self.checkpoint_dir is None:
            given = [_flag(k) for k in ("resume", "elastic") if getattr(self, k) is not None]
            if given or self.save_every:
                raise ConflictingSettingsError(
                    f"{', '.join(given or ['--save-every'])} need(s) --checkpoint-dir DIR"
                )
        if self.elastic is not None and self.resume is None:
            raise ConflictingSettingsError(
                f"--elastic {self.elastic} decides how a resumed run splits its batch, but "
                f"--resume is not given; add --resume [STEP], or drop --elastic"
            )
        hf = str(self.data).startswith("hf:")
        if hf and self.tokenizer is None:
            raise ConflictingSettingsError(
                f"--data {self.data} holds text, which needs --tokenizer PATH (a tokenizer.json "
                f"or its folder, whose vocabulary fits the model)"
            )
        given = [_flag(k) for k in ("tokenizer", "text_column") if getattr(self, k) is not None]
        if given and not hf:
            raise ConflictingSettingsError(
                f"{' and '.join(given)} tokenize a Hugging Face dataset, but --data is "
                f"{self.data or 'not given'}; pass --data hf:PATH, or drop {' and '.join(given)}"
            )
        if self.data_dtype is not None and hf:
            raise ConflictingSettingsError(
                f"--data-dtype {self.data_dtype} says how a token file is stored, but --data "
                f"{self.data} is text tokenized by --tokenizer; drop --data-dtype"
            )
        if self.data_dtype is not None and self.data is None:
            raise ConflictingSettingsError(
                f"--data-dtype {self.data_dtype} says how a --data token file is stored, but no "
                f"--data FILE is given (the embedded arithmetic text needs none); add --data FILE "
                f"or drop --data-dtype"
            )

    def _check_paths(self) -> None:
        if self.metrics is not None:
            path = Path(self.metrics)
            if path.is_dir():
                raise OutputPathError(
                    f"--metrics {path} is a folder; give a file in it, e.g. "
                    f"--metrics {path / 'metrics.jsonl'}"
                )
            folder = path.absolute().parent
            if not folder.is_dir():
                raise OutputPathError(
                    f"--metrics {path}: the folder {folder} does not exist; create it first "
                    f"(mkdir -p {folder}) or give a file in an existing folder"
                )
            if path.exists() and not self.overwrite:
                raise WouldOverwriteError(
                    f"--metrics {path} already exists ({path.stat().st_size} bytes); pass "
                    f"--overwrite to replace it, or give another file"
                )
        folders = {"checkpoint_dir": "checkpoints/run1", "profile": "traces/run1",
                   "tensorboard": "tb/run1"}  # fmt: skip
        for name, example in folders.items():
            if getattr(self, name) is not None:
                check_folder(getattr(self, name), _flag(name), example)


def check_folder(folder: str | os.PathLike, shown: str, example: str) -> None:
    """Raise `OutputPathError` when ``folder`` is, or lies inside, an existing file, or is
    missing and cannot be created where its nearest existing folder is (a read-only or virtual
    file system: ``/proc/x``). The probe makes an empty folder there and removes it at once."""
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        what = "is a file" if existing == path else f"is inside {existing}, a file"
        raise OutputPathError(
            f"{shown} {os.fspath(folder)} {what}, not a folder; give a folder (created if "
            f"missing), e.g. {shown} {example}"
        )
    if existing != path:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".spmdkit-probe-", dir=existing))
        except OSError as e:
            raise OutputPathError(
                f"{shown} {os.fspath(folder)} cannot be created: no folder can be made in "
                f"{existing} ({e.strerror}); give a folder where you can write, e.g. {shown} "
                f"{example}"
            ) from None


def parse_window(window: Any, call: bool = False) -> tuple[int, int]:
    """``"A:B"``, ``"A"`` or ``(A, B)`` as ``(A, B)`` with ``1 <= A <= B``, else
    `InvalidSettingError` naming ``--profile-steps`` (``call``: ``profile_steps(...)``)."""

    def shown(a: Any, b: Any) -> str:
        return f"profile_steps(directory, {a}, {b})" if call else f"--profile-steps {a}:{b}"

    if isinstance(window, str):
        parts = window.split(":")
        try:
            nums = tuple(int(x) for x in parts) if len(parts) <= 2 else ()
        except ValueError:
            nums = ()
    else:
        nums = tuple(window) if isinstance(window, tuple | list) else ()
    if len(nums) == 1:
        nums = (nums[0], nums[0])
    if len(nums) != 2 or not all(_whole(n) for n in nums):
        given = f"--profile-steps {_window_text(window)}" if not call else shown(*map(repr, window))
        raise InvalidSettingError(
            f"{given}: give the first and last step to trace as whole numbers, e.g. "
            f"{shown(2, 4)} (steps 2, 3 and 4)"
        )
    first, last = nums
    if first < 1 or last < first:
        raise InvalidSettingError(
            f"{shown(first, last)}: steps count from 1 and the last comes no earlier than the "
            f"first (1 <= A <= B), e.g. {shown(max(first, 1), max(first, last, 1))}"
        )
    return first, last


def _window_text(window: Any) -> str:
    if isinstance(window, tuple | list) and len(window) == 2:
        return f"{window[0]}:{window[1]}"
    return window if isinstance(window, str) else repr(window)


def _real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
