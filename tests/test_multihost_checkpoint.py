"""Checkpoints of multi-process runs: 2 processes x 4 CPU devices save, lose a process in the
middle of a save, and resume through `spmdkit launch`, bit-exact against one process.

In a multi-process run every process writes its own shards into the step directory and process 0
writes the CRC manifest; these tests check that the manifest covers every process's files, that a
process killed while step 10 is being written leaves step 5 the latest (and verified), and that a
launched resume from step 5 reproduces the single-process losses and train state exactly.

The single-process reference runs with the collectives a multi-process CPU run uses (gloo, one
`jax.distributed` process): summation order is the collectives', so only then are the float bits
comparable. Against the in-process collectives the curves agree to 1e-5 (test_multihost.py).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax import sharding as jshard

from sharding.training import Checkpointer, CorruptCheckpointError, launch

SPMDKIT = [sys.executable, "-c", "import sys; from sharding.cli import main; sys.exit(main())"]
RUN = ["train", "--model", "llama", "--size", "tiny", "--mesh", "data=2,fsdp=2,tensor=2",
       "--strategy", "fsdp_tp", "--batch", "16", "--seq", "32", "--steps", "10",
       "--save-every", "5"]  # fmt: skip
# One process, 8 simulated CPU devices, gloo collectives (see the module docstring).
SINGLE = [sys.executable, "-c", """
import sys
from sharding.training import ProcessGroup, free_port, initialize
initialize(ProcessGroup(f"127.0.0.1:{free_port()}", 1, 0, "reference"), cpu_devices=8)
from sharding.cli import main
sys.exit(main())
"""]  # fmt: skip
# A launched process that is SIGKILLed as process 1 the moment it has started saving step 10:
# its shards are being written, process 0 waits for them to commit the step.
KILLED_AT_SAVE = """
import os, signal, sys
from sharding.training import Checkpointer
save = Checkpointer.save
def save_then_die(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if step == 10 and sys.argv[-1] == "1":  # the last argument is --process-id's value
        os.kill(os.getpid(), signal.SIGKILL)
Checkpointer.save = save_then_die
from sharding.cli import main
sys.exit(main())
"""


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def load(directory, step: int) -> dict[str, np.ndarray]:
    """Every saved array of ``step`` as numpy (replicated: the test model is small)."""
    replicated = jshard.NamedSharding(jax.make_mesh((1,), ("x",)), jshard.PartitionSpec())
    with Checkpointer(directory, keep=None, read_only=True) as ck:
        targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated)
                   for k, v in ck.array_metadata(step).items()}  # fmt: skip
        state, _ = ck.restore(targets, step)
    return {k: np.asarray(v) for k, v in state.items()}


def step_files(step_dir) -> set[str]:
    """Every file of a step's items (what its manifest must cover)."""
    return {str(p.relative_to(step_dir)) for item in ("state", "meta")
            for p in (step_dir / item).rglob("*") if p.is_file()}  # fmt: skip


def manifest(step_dir) -> set[str]:
    return set(json.loads((step_dir / "spmdkit_manifest.json").read_text())["files"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference (checkpoints at 5 and 10) and, meanwhile, a 2-process run
    whose process 1 is killed while saving step 10."""
    root = tmp_path_factory.mktemp("multihost_ck")
    reference = subprocess.Popen(
        [*SINGLE, *RUN, "--checkpoint-dir", str(root / "ref"), "--metrics", str(root / "ref.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out = io.StringIO()
    rc = launch([*RUN, "--checkpoint-dir", str(root / "ck"), "--metrics", str(root / "m.jsonl")],
                2, out=out, executable=[sys.executable, "-c", KILLED_AT_SAVE])  # fmt: skip
    ref_out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_out[-3000:]
    return SimpleNamespace(root=root, ref=root / "ref", ref_losses=losses(root / "ref.jsonl"),
                           ck=root / "ck", rc=rc, out=out.getvalue(),
                           losses=losses(root / "m.jsonl"))  # fmt: skip


@pytest.mark.slow
def test_a_process_killed_during_a_save_leaves_the_previous_step(runs, tmp_path):
    assert runs.rc == 128 + 9, runs.out[-3000:]
    assert "process 1 failed (signal SIGKILL)" in runs.out
    # Up to the kill, the two processes trained the reference's losses, bit for bit.
    assert len(runs.losses) >= 5
    assert runs.losses == {s: runs.ref_losses[s] for s in runs.losses}
    with Checkpointer(runs.ck, read_only=True) as ck:
        # Process 0 cannot commit step 10 without process 1's shards: it stays a temporary
        # directory, ignored. (Had process 1 finished writing before the kill landed, step 10
        # would be complete, and verified below.)
        assert ck.steps() in ([5], [5, 10])
        if ck.steps() == [5]:
            assert list(runs.ck.glob("10.orbax-checkpoint-tmp*"))
        for step in ck.steps():
            meta = ck.meta(step)  # checks every file against the manifest
            assert (meta.process_count, meta.devices) == (2, 8)
    # Process 0's manifest covers the shards of both processes, and nothing is left out.
    files = manifest(runs.ck / "5")
    assert files == step_files(runs.ck / "5")
    for i in (0, 1):
        assert any(f.startswith(f"state/ocdbt.process_{i}/") for f in files), sorted(files)
    # A file the manifest does not list (written after it, say) fails verification.
    copy = shutil.copytree(runs.ck, tmp_path / "ck")
    (copy / "5" / "state" / "ocdbt.process_1" / "d" / "late").write_bytes(b"shard")
    with (
        Checkpointer(copy, read_only=True) as ck,
        pytest.raises(CorruptCheckpointError, match=r"step 5: file .*late is not in the manifest"),
    ):
        ck.meta(5)


@pytest.mark.slow
def test_launched_resume_from_step_5_is_bit_exact(runs, tmp_path):
    ck_dir = shutil.copytree(runs.ck, tmp_path / "ck")
    shutil.rmtree(ck_dir / "10", ignore_errors=True)  # resume from step 5 as the latest
    metrics = tmp_path / "m.jsonl"
    done = subprocess.run(
        [*SPMDKIT, "launch", "--local-processes", "2", "--", *RUN,
         "--checkpoint-dir", str(ck_dir), "--resume", "5", "--metrics", str(metrics)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "[p0] resumed from step 5" in done.stdout
    assert losses(metrics) == {s: runs.ref_losses[s] for s in range(6, 11)}  # exact
    with Checkpointer(ck_dir, read_only=True) as ck:
        assert ck.steps() == [5, 10]
    assert manifest(ck_dir / "10") == step_files(ck_dir / "10")
    want, got = load(runs.ref, 10), load(ck_dir, 10)
    assert want.keys() == got.keys() and len(want) > 30
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
