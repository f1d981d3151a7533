"""The manifest that makes a checkpoint step verifiable: size and CRC-32 of every file.

Written inside orbax's temporary directory of the step, just before the rename that commits it
(so a committed step always has one), and checked before anything is read back: a truncated,
altered or missing file is a `CorruptCheckpointError` naming the step and the file.
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
    files = {}
    for item in ITEMS:
        for path in sorted((step_dir / item).rglob("*")):
            if path.is_file():
                files[str(path.relative_to(step_dir))] = [path.stat().st_size, _crc32(path)]
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, "files": files}))
    os.replace(tmp, step_dir / MANIFEST)


def verify_manifest(step_dir: Path, step: int) -> None:
    """Raise `CorruptCheckpointError` naming the first file that differs from the manifest."""
    manifest = step_dir / MANIFEST
    remedy = (
        f"restore an earlier step (--resume STEP) or delete {step_dir} so the previous "
        f"checkpoint becomes the latest"
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
