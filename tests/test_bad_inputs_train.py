"""`spmdkit train` refuses every bad input up front: exit 2, one message naming the value and the
fix, no traceback, and no file created or changed (a metrics file already there stays as it was).
"""

from __future__ import annotations

import numpy as np
import pytest

BASE = ["train", "--mesh", "data=8", "--strategy", "dp", "--steps", "2", "--batch", "8",
        "--seq", "16"]  # fmt: skip

# (extra arguments, what stderr must say); files named here are made by `layout` below.
BAD = {
    "steps-0": (["--steps", "0"], r"--steps: 0 must be >= 1"),
    "steps-negative": (["--steps", "-5"], r"--steps: -5 must be >= 1"),
    "batch-0": (["--batch", "0"], r"--batch: 0 must be >= 1"),
    "seq-0": (["--seq", "0"], r"--seq: 0 must be >= 1"),
    "accum-0": (["--accum", "0"], r"--accum: 0 must be >= 1"),
    "lr-nan": (["--lr", "nan"], r"--lr nan: .*finite number > 0, e.g. --lr 3e-3"),
    "lr-inf": (["--lr", "inf"], r"--lr inf: .*finite number > 0"),
    "lr-negative": (["--lr", "-1"], r"--lr -1.0: .*> 0"),
    "lr-0": (["--lr", "0"], r"--lr 0.0: .*> 0"),
    "clip-negative": (["--clip", "-1"], r"--clip -1.0: .*>= 0.*--clip 0 turns clipping off"),
    "clip-nan": (["--clip", "nan"], r"--clip nan: .*--clip 0 turns clipping off"),
    "warmup-negative": (["--warmup", "-5"], r"--warmup: -5 must be >= 0"),
    "seed-negative": (["--seed", "-1"], r"--seed: -1 must be >= 0"),
    "devices-0": (["--devices", "0"], r"--devices: 0 must be >= 1"),
    "save-every-negative": (
        ["--checkpoint-dir", "ck", "--save-every", "-1"],
        r"--save-every: -1 must be >= 0",
    ),
    "keep-0": (["--checkpoint-dir", "ck", "--keep", "0"], r"--keep: 0 must be >= 1"),
    "resume-0": (["--checkpoint-dir", "ck", "--resume", "0"], r"--resume: 0 must be >= 1"),
    "elastic-without-resume": (
        ["--checkpoint-dir", "ck", "--elastic", "keep-batch"],
        r"--elastic keep-batch .*--resume is not given; add --resume",
    ),
    "resume-missing-folder": (
        ["--checkpoint-dir", "ck", "--resume", "5"],
        r"--resume 5: checkpoint directory .*ck does not exist",
    ),
    "checkpoint-dir-is-a-file": (
        ["--checkpoint-dir", "notes.txt"],
        r"--checkpoint-dir notes.txt is a file, not a folder",
    ),
    "checkpoint-dir-under-a-file": (
        ["--checkpoint-dir", "notes.txt/ck"],
        r"--checkpoint-dir notes.txt/ck is inside .*notes.txt, a file",
    ),
    "metrics-folder-missing": (
        ["--metrics", "no/such/dir/m.jsonl"],
        r"--metrics no/such/dir/m.jsonl: the folder .*no/such/dir does "
        r"not exist; create it first",
    ),
    "metrics-exists": (
        ["--metrics", "metrics.jsonl"],
        r"--metrics metrics.jsonl already exists .*pass --overwrite",
    ),
    "metrics-is-a-folder": (["--metrics", "runs"], r"--metrics runs is a folder; give a file"),
    # A folder no file system here can create (procfs): refused before compiling, not after.
    "tensorboard-cannot-be-created": (
        ["--tensorboard", "/proc/spmdkit-tb"],
        r"--tensorboard /proc/spmdkit-tb cannot be created: no folder can be made in /proc "
        r"\(.*\); give a folder where you can write, e.g. --tensorboard tb/run1",
    ),
    "profile-cannot-be-created": (
        ["--profile", "/proc/spmdkit-traces", "--profile-steps", "1:2"],
        r"--profile /proc/spmdkit-traces cannot be created: no folder can be made in /proc",
    ),
    "bin-without-dtype": (
        ["--data", "tokens.bin"],
        r"suffix '.bin' does not say .*--data-dtype uint16 or --data-dtype "
        r"uint32",
    ),
    "uint32-named-u16": (
        ["--data", "wide.u16"],
        r"0 at every odd position.*looks like a uint32 file; pass --data-dtype "
        r"uint32",
    ),
    "uint16-read-as-uint32": (
        ["--data", "tokens.bin", "--data-dtype", "uint32"],
        r"a uint16 file read as uint32 .*pass --data-dtype uint16",
    ),
    "size-not-a-multiple": (
        ["--data", "odd.u32"],
        r"7 bytes, not a multiple of 4 \(uint32\).*--data-dtype uint16 or "
        r"uint32",
    ),
    "ids-over-vocab": (
        ["--data", "big.u16"],
        r"token id 300 .*vocab_size=256.*another --model or --size.*check "
        r"--data-dtype.*llama sizes whose vocabulary covers 301 ids: "
        r"maxtext-tiny \(1024\)",
    ),
    "data-dtype-without-data": (
        ["--data-dtype", "uint16"],
        r"--data-dtype uint16 .*no --data FILE is given",
    ),
    "seq-over-max": (["--seq", "4097"], r"--seq 4097: .*max_seq_len=4096; use --seq 4096 or less"),
}


@pytest.fixture
def layout(tmp_path):
    """Files the rows point at, made before the snapshot, so a refusal may not touch them."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    (tmp_path / "notes.txt").write_text("not a folder\n")
    (tmp_path / "runs").mkdir()
    np.asarray(np.arange(1000) % 200, np.uint16).tofile(tmp_path / "tokens.bin")
    np.asarray(np.arange(1000) % 200, np.uint32).tofile(tmp_path / "wide.u16")
    (tmp_path / "odd.u32").write_bytes(b"\x01" * 7)
    big = np.arange(1000) % 200
    big[500] = 300
    np.asarray(big, np.uint16).tofile(tmp_path / "big.u16")
    return tmp_path


@pytest.mark.parametrize(("args", "match"), list(BAD.values()), ids=list(BAD))
def test_train_refuses(args, match, layout, refused):
    refused([*BASE, *args], match)
