"""The manifest that makes a checkpoint step verifiable: size and CRC-32 of every file.

Written inside orbax's temporary directory of the step, just before the rename that commits it
(so a committed step always has one), and checked before anything is read back: a truncated,
altered or missing file is a `CorruptCheckpointError` naming the step and the file, and so is a
file the manifest does not list (written after it, e.g. by another process of a multi-process
run), so a manifest that does not cover the whole step never passes for a complete one.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from sharding.training._errors import TrainingError

MANIFEST = "spmdkit_manifest.json"
ITEMS = ("state", "meta")
MANIFEST_FORMAT = 1


class CheckpointError(TrainingError):
    """A checkpoint that cannot be saved or restored as asked."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files do not match what was written (truncated, altered)."""


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(step_dir: Path, step: int) -> None:
    """Record size and CRC-32 of every file of the step's items (atomic: write, then rename)."""
    files = {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)] for p in _files(step_dir)}
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, "files": files}))
    os.replace(tmp, step_dir / MANIFEST)


def _files(step_dir: Path) -> list[Path]:
    return [p for item in ITEMS for p in sorted((step_dir / item).rglob("*")) if p.is_file()]


def missing_processes(step_dir: Path, process_count: int) -> list[int]:
    """The processes of the run that left no part in the step: orbax writes one array-metadata
    file per process (``state/array_metadatas/process_I``) together with that process's shards.
    Empty for a layout without that folder (nothing to tell)."""
    parts = step_dir / "state" / "array_metadatas"
    if not parts.is_dir():
        return []
    return [i for i in range(process_count) if not (parts / f"process_{i}").is_file()]


def verify_manifest(step_dir: Path, step: int) -> None:
    """Raise `CorruptCheckpointError` naming the first file that differs from the manifest."""
    manifest = step_dir / MANIFEST
    remedy = (
        f"use an earlier step (train --resume STEP, reshard --step STEP) or delete {step_dir} "
        f"so the previous checkpoint becomes the latest"
    )
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"checkpoint step {step}: {manifest} is missing, so its files cannot be checked "
            f"(not written by spmdkit, or altered after the save); {remedy}"
        ) from None
    except (ValueError, KeyError) as e:
        raise CorruptCheckpointError(
            f"checkpoint step {step}: manifest {manifest} is unreadable ({e}); {remedy}"
        ) from None
    for rel, (size, crc) in files.items():
        path = step_dir / rel
        if not path.is_file():
            raise CorruptCheckpointError(
                f"checkpoint step {step}: file {path} is missing; {remedy}"
            )
        actual = path.stat().st_size
        if actual != size:
            what = "truncated" if actual < size else "grown"
            raise CorruptCheckpointError(
                f"checkpoint step {step}: file {path} is {what}: {actual} bytes, but {size} were "
                f"written; {remedy}"
            )
        if _crc32(path) != crc:
            raise CorruptCheckpointError(
                f"checkpoint step {step}: file {path} is corrupted: its CRC-32 differs from the "
                f"one recorded at save time ({size} bytes); {remedy}"
            )
    unlisted = [p for p in _files(step_dir) if str(p.relative_to(step_dir)) not in files]
    if unlisted:
        raise CorruptCheckpointError(
            f"checkpoint step {step}: file {unlisted[0]} is not in the manifest {manifest}"
            f"{f' (nor {len(unlisted) - 1} more)' if len(unlisted) > 1 else ''}: written after "
            f"the manifest (e.g. by another process of a multi-process run) or added later, so "
            f"the step may be incomplete; {remedy}"
        )
