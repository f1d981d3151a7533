"""Checkpoints: exact resume, restore onto other meshes and strategies, faults, elastic restart.

One 10-step reference run (llama tiny, fsdp on fsdp=8, saves at steps 5 and 10) is shared by the
module; every other run resumes from a copy of its checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from closeness import assert_close
from jax import sharding as jshard

import models
from sharding.cli import main
from sharding.cli import reshard as reshard_cmd
from sharding.cli import train as train_cmd
from sharding.training import (
    ELASTIC_POLICIES,
    Checkpointer,
    CheckpointMeta,
    CheckpointMismatchError,
    CorruptCheckpointError,
    ElasticPolicyError,
    NoCheckpointError,
    TrainConfig,
    WouldOverwriteError,
    elastic_batch,
    fit,
)

BASE = ["--model", "llama", "--size", "tiny", "--batch", "16", "--seq", "32", "--steps", "10"]
FSDP8 = ["--mesh", "fsdp=8", "--strategy", "fsdp"]


def train(*args: str) -> int:
    return main(["train", *BASE, *args])


def losses(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def load(directory, step: int) -> tuple[dict[str, np.ndarray], CheckpointMeta]:
    """Every saved array of ``step`` as numpy (replicated: the test model is small)."""
    replicated = jshard.NamedSharding(jax.make_mesh((1,), ("x",)), jshard.PartitionSpec())
    with Checkpointer(directory, keep=None, read_only=True) as ck:
        saved = ck.array_metadata(step)
        targets = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in saved.items()
        }
        state, meta = ck.restore(targets, step)
    return {k: np.asarray(v) for k, v in state.items()}, meta


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Checkpoint dir (steps 5 and 10) and per-step losses of the uninterrupted 10-step run."""
    root = tmp_path_factory.mktemp("reference")
    metrics = root / "m.jsonl"
    assert train(*FSDP8, "--checkpoint-dir", str(root / "ck"), "--save-every", "5",
                 "--metrics", str(metrics)) == 0  # fmt: skip
    return root / "ck", losses(metrics)


def copy_of(reference, tmp_path):
    return shutil.copytree(reference[0], tmp_path / "ck")


def test_saves_every_n_steps_with_metadata(reference):
    ck_dir, _ = reference
    with Checkpointer(ck_dir, read_only=True) as ck:
        assert ck.steps() == [5, 10]
        meta = ck.meta(5)
    assert (meta.family, meta.size, meta.strategy, meta.step) == ("llama", "tiny", "fsdp", 5)
    assert meta.mesh == {"stage": 1, "data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}
    assert (meta.global_batch, meta.seq_len, meta.accum_steps, meta.devices) == (16, 32, 1, 8)
    assert meta.config["d_model"] == 64 and meta.data == {"path": None, "seed": 0}
    for step in (5, 10):
        assert (ck_dir / str(step) / "spmdkit_manifest.json").is_file()


def test_exact_resume_is_bit_identical(reference, tmp_path):
    ck_dir = copy_of(reference, tmp_path)
    metrics = tmp_path / "m.jsonl"
    assert train(*FSDP8, "--checkpoint-dir", str(ck_dir), "--resume", "5", "--overwrite",
                 "--metrics", str(metrics)) == 0  # fmt: skip
    resumed = losses(metrics)
    assert list(resumed) == [6, 7, 8, 9, 10]
    assert resumed == {s: reference[1][s] for s in resumed}  # exact float equality
    want, _ = load(reference[0], 10)
    got, _ = load(ck_dir, 10)
    assert want.keys() == got.keys() and len(want) > 30
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def reshard_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    reshard_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["reshard", *argv])
    return args.run(args)


def test_reshard_to_fsdp_tp_keeps_values_and_loss(reference, tmp_path, capsys):
    dst = tmp_path / "fsdp_tp"
    assert reshard_cli(str(reference[0]), str(dst), "--mesh", "fsdp=2,tensor=4",
                       "--strategy", "fsdp_tp", "--step", "5") == 0  # fmt: skip
    assert "fsdp on fsdp=8 -> fsdp_tp on fsdp=2,tensor=4" in capsys.readouterr().out
    want, _ = load(reference[0], 5)
    got, meta = load(dst, 5)
    assert meta.strategy == "fsdp_tp" and meta.mesh["tensor"] == 4 and meta.step == 5
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    metrics = tmp_path / "m.jsonl"
    assert train("--mesh", "fsdp=2,tensor=4", "--strategy", "fsdp_tp",
                 "--checkpoint-dir", str(dst), "--resume", "--metrics", str(metrics)) == 0  # fmt: skip
    resumed = losses(metrics)
    assert list(resumed) == [6, 7, 8, 9, 10]
    np.testing.assert_allclose(list(resumed.values()), [reference[1][s] for s in resumed],
                               rtol=1e-5)  # fmt: skip


def test_resume_under_zero1_splits_the_restored_optimizer_state(reference, tmp_path, capsys):
    """fsdp on fsdp=8 -> zero1 on data=8: the weights restored whole, the moments over data."""
    ck_dir, metrics = copy_of(reference, tmp_path), tmp_path / "m.jsonl"
    assert train("--mesh", "data=8", "--strategy", "zero1", "--checkpoint-dir", str(ck_dir),
                 "--resume", "5", "--overwrite", "--metrics", str(metrics)) == 0  # fmt: skip
    assert "resumed from step 5" in capsys.readouterr().out
    resumed = losses(metrics)
    assert list(resumed) == [6, 7, 8, 9, 10]
    np.testing.assert_allclose(list(resumed.values()), [reference[1][s] for s in resumed],
                               rtol=1e-5)  # fmt: skip
    # Step 10's weights and Adam moments, saved from their zero1 layout, are fsdp's own.
    want, _ = load(reference[0], 10)
    got, meta = load(ck_dir, 10)
    assert meta.strategy == "zero1" and got.keys() == want.keys() and len(want) > 30
    assert_close(got, want)


def test_resume_under_pipeline_on_another_split(reference, tmp_path, capsys):
    """fsdp on fsdp=8 -> pp on stage=2,data=4: the batch split 8 -> 4 takes an elastic policy."""
    ck_dir = copy_of(reference, tmp_path)
    pp = ["--mesh", "stage=2,data=4", "--strategy", "pp", "--microbatches", "2"]
    assert train(*pp, "--checkpoint-dir", str(ck_dir), "--resume", "5", "--overwrite") == 2
    assert "choose --elastic keep-batch" in capsys.readouterr().err
    metrics = tmp_path / "m.jsonl"
    assert train(*pp, "--checkpoint-dir", str(ck_dir), "--resume", "5", "--elastic", "keep-batch",
                 "--overwrite", "--metrics", str(metrics)) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "resumed from step 5" in out and "gradient accumulation 1 -> 2" in out
    resumed = losses(metrics)
    assert list(resumed) == [6, 7, 8, 9, 10]
    np.testing.assert_allclose(list(resumed.values()), [reference[1][s] for s in resumed],
                               rtol=1e-5)  # fmt: skip


def _program(strategy: str, mesh: str, family: str = "llama"):
    import optax

    from partition_rules import preset
    from sharding import compile_train_step, make_mesh
    from sharding.pipeline import PipelineSpec

    fam = models.get_family(family)
    cfg = fam.config("tiny")
    pipe = PipelineSpec("gpipe", 2, 1) if "stage" in mesh else None
    return compile_train_step(
        lambda rngs: fam.Model(cfg, rngs=rngs), fam.loss, optax.adamw(lambda count: 1e-3),
        *preset(family, strategy), make_mesh(mesh), fam.batch_shapes(cfg, 16, 32), pipeline=pipe, stack="layers",
        clip_norm=1.0,  # spmdkit train: chain(clip, adamw(schedule)) shapes the state so
    )  # fmt: skip


def test_restore_into_a_pipeline_program_places_every_array(reference):
    """Python API: restore straight into a program's shardings; nothing compiles."""
    program = _program("pp", "stage=2,data=4")
    with Checkpointer(reference[0], read_only=True) as ck:
        state, meta = ck.restore(program, step=5)
    assert meta.step == 5 and int(state["step"]) == 5
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(program.state_shardings),
                         strict=True):  # fmt: skip
        assert got.sharding == want
    layers = state["params"]["layers"]["attn"]["q"]["kernel"]
    assert layers.sharding.spec[0] == "stage"
    saved, _ = load(reference[0], 5)
    np.testing.assert_array_equal(np.asarray(layers), saved["params/layers/attn/q/kernel"])


def test_restore_into_another_model_lists_the_differences(reference):
    with (
        Checkpointer(reference[0], read_only=True) as ck,
        pytest.raises(
            CheckpointMismatchError,
            match=r"(?s)step 10 does not fit the target state.*in the target, not in the checkpoint",
        ),
    ):
        ck.restore(_program("fsdp", "fsdp=8", family="gpt2"))


def test_elastic_restart_on_four_devices_continues_the_loss_curve(reference, tmp_path):
    ck_dir = copy_of(reference, tmp_path)
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-c", "import sys; from sharding.cli import main; sys.exit(main())",
           "train", *BASE, "--devices", "4", "--mesh", "fsdp=4", "--strategy",
           "fsdp", "--checkpoint-dir", str(ck_dir), "--resume", "5", "--elastic", "keep-batch",
           "--overwrite", "--metrics", str(metrics)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global batch 16 kept; gradient accumulation 1 -> 2" in done.stdout
    resumed = losses(metrics)
    assert list(resumed) == [6, 7, 8, 9, 10]
    np.testing.assert_allclose(list(resumed.values()), [reference[1][s] for s in resumed],
                               rtol=1e-5)  # fmt: skip
    with Checkpointer(ck_dir, read_only=True) as ck:
        assert ck.meta(10).devices == 4 and ck.meta(10).accum_steps == 2


KILLED_CHILD = """
import os, signal, sys
from sharding.training import Checkpointer
where = sys.argv.pop(1)
save = Checkpointer.save
def pre_commit(self, step):
    if where == "before-commit" and step == 10:  # all of step 10 written, not yet committed
        os.kill(os.getpid(), signal.SIGKILL)
def start_save(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if where == "save-started" and step == 10:  # the async write of step 10 has just begun
        os.kill(os.getpid(), signal.SIGKILL)
Checkpointer.pre_commit, Checkpointer.save = pre_commit, start_save
from sharding.cli import main
sys.exit(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before-commit", "save-started"])
def test_killed_save_leaves_the_previous_checkpoint(reference, tmp_path, where):
    ck_dir = tmp_path / "ck"
    cmd = [sys.executable, "-c", KILLED_CHILD, where, "train", *BASE, *FSDP8,
           "--checkpoint-dir", str(ck_dir), "--save-every", "5"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-3000:]
    with Checkpointer(ck_dir, read_only=True) as ck:
        if where == "before-commit":
            assert sorted(os.listdir(ck_dir)) == ["10.orbax-checkpoint-tmp", "5"]
            assert ck.steps() == [5]
        # A kill right after the save started almost always lands before the commit; if the
        # write won the race, step 10 is complete and verified. Never a half-written step.
        assert ck.steps() in ([5], [5, 10])
        for step in ck.steps():
            ck.meta(step)  # verifies every file against the manifest
        if ck.steps() == [5, 10]:
            ck.restore(_program("fsdp", "fsdp=8"))
            return
    metrics = tmp_path / "m.jsonl"
    assert train(*FSDP8, "--checkpoint-dir", str(ck_dir), "--resume",
                 "--metrics", str(metrics)) == 0  # fmt: skip
    resumed = losses(metrics)
    assert resumed == {s: reference[1][s] for s in range(6, 11)}


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_checkpoint_names_the_step_and_file(reference, tmp_path, capsys, damage):
    ck_dir = copy_of(reference, tmp_path)
    victim = max((p for p in (ck_dir / "10" / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)  # fmt: skip
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:
        victim.unlink()
    what = {"truncate": "is truncated", "flip": "is corrupted", "delete": "is missing"}[damage]
    with Checkpointer(ck_dir, read_only=True) as ck:
        with pytest.raises(CorruptCheckpointError, match=f"step 10: file .*{victim.name} {what}"):
            ck.restore(_program("fsdp", "fsdp=8"))
        ck.restore(_program("fsdp", "fsdp=8"), step=5)  # the earlier step is intact
    assert train(*FSDP8, "--checkpoint-dir", str(ck_dir), "--resume") == 2
    err = capsys.readouterr().err
    assert "checkpoint step 10: file" in err and f"{victim.name} {what}" in err


def test_missing_manifest_is_not_restored(reference, tmp_path):
    ck_dir = copy_of(reference, tmp_path)
    (ck_dir / "5" / "spmdkit_manifest.json").unlink()
    missing = r"step 5: .*manifest.json is missing"
    with (
        Checkpointer(ck_dir, read_only=True) as ck,
        pytest.raises(CorruptCheckpointError, match=missing),
    ):
        ck.meta(5)


def test_cli_refuses_unsafe_starts(reference, tmp_path, capsys, unchanged):
    ck_dir = copy_of(reference, tmp_path)
    assert train(*FSDP8, "--checkpoint-dir", str(ck_dir)) == 2
    assert "already holds checkpoints (steps [5, 10]); pass --resume" in capsys.readouterr().err
    assert train(*FSDP8, "--checkpoint-dir", str(ck_dir), "--resume", "--seq", "16") == 2
    assert "--seq 32 (given: 16)" in capsys.readouterr().err
    assert train(*FSDP8, "--checkpoint-dir", str(ck_dir), "--resume", "7") == 2
    assert "step 7 is not in" in capsys.readouterr().err
    assert train(*FSDP8, "--resume") == 2
    assert "--resume need(s) --checkpoint-dir" in capsys.readouterr().err
    # Resuming an earlier step would replace the later ones: refused, naming both ways on.
    before = sorted(p.name for p in ck_dir.iterdir())
    assert train(*FSDP8, "--checkpoint-dir", str(ck_dir), "--resume", "5") == 2
    err = capsys.readouterr().err
    assert "would replace the later checkpoint step(s) [10]" in err
    assert "--overwrite" in err and "--resume 10" in err
    assert sorted(p.name for p in ck_dir.iterdir()) == before
    with unchanged(), pytest.raises(WouldOverwriteError, match=r"step\(s\) \[10\]"):
        fit(models.llama, TrainConfig(size="tiny", strategy="fsdp", mesh="fsdp=8", batch=16,
                                      seq=32, steps=10, checkpoint_dir=ck_dir, resume=5))  # fmt: skip
    # A failed --resume STEP on a missing folder does not create it.
    assert train(*FSDP8, "--checkpoint-dir", str(tmp_path / "none"), "--resume", "5") == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "none").exists()
    with pytest.raises(NoCheckpointError, match="does not exist"):
        Checkpointer(tmp_path / "nothing", read_only=True)
    with pytest.raises(ValueError, match="SRC and DST are both"):
        reshard_cli(str(ck_dir), str(ck_dir), "--mesh", "tensor=8", "--strategy", "tp")


def test_doc_examples(doctests):
    import sharding.training

    assert doctests(sharding.training) > 0


def _meta(batch: int, accum: int, **mesh: int) -> CheckpointMeta:
    return CheckpointMeta("llama", "tiny", {}, "fsdp", mesh, batch, 32, accum)


@pytest.mark.parametrize(
    ("saved", "new", "policy", "want"),
    [
        (_meta(16, 1, fsdp=8), {"fsdp": 4}, "keep-batch", (16, 2)),
        (_meta(16, 2, data=2, fsdp=4), {"data": 2}, "keep-batch", (16, 8)),
        (_meta(16, 1, fsdp=8), {"fsdp": 4}, "shrink-batch", (8, 1)),
        (_meta(16, 2, fsdp=4), {"fsdp": 8}, "shrink-batch", (32, 2)),
        (_meta(16, 1, fsdp=8), {"data": 4, "fsdp": 2}, None, (16, 1)),
        (_meta(24, 1, data=8), {"data": 6}, "keep-batch", (24, 2)),
    ],
)
def test_elastic_batch_policies(saved, new, policy, want):
    plan = elastic_batch(saved, new, policy)
    assert (plan.global_batch, plan.accum_steps) == want
    assert bool(plan.note) == (want != (saved.global_batch, saved.accum_steps))


def test_elastic_batch_errors_name_the_fix():
    with pytest.raises(ElasticPolicyError, match=r"splits it over 4; choose --elastic"):
        elastic_batch(_meta(16, 1, fsdp=8), {"fsdp": 4}, None)
    with pytest.raises(ElasticPolicyError, match=r"keep-batch: .*does not split.*over 5 devices"):
        elastic_batch(_meta(8, 1, data=8), {"data": 5}, "keep-batch")
    with pytest.raises(ElasticPolicyError, match=r"unknown elastic policy 'grow'"):
        elastic_batch(_meta(16, 1, data=8), {"data": 4}, "grow")
    assert tuple(train_cmd.ELASTIC_POLICIES) == ("keep-batch", "shrink-batch")
    assert train_cmd.ELASTIC_POLICIES is ELASTIC_POLICIES  # one definition, the library's


def test_keep_k_and_synchronous_saves(tmp_path):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jshard.AxisType.Auto,))
    x = jax.device_put(np.arange(64.0).reshape(8, 8), jshard.NamedSharding(mesh, jshard.PartitionSpec("data")))  # fmt: skip
    meta = _meta(8, 1, data=8)
    for async_save in (True, False):
        d = tmp_path / f"async_{async_save}"
        with Checkpointer(d, save_every=2, keep=2, async_save=async_save) as ck:
            for step in range(1, 7):
                if ck.should_save(step):
                    ck.save(step, {"w": x * step, "step": np.int32(step)}, meta)
            ck.wait()
            assert ck.steps() == [4, 6]
            with pytest.raises(Exception, match="step 6 already exists"):
                ck.save(6, {"w": x, "step": np.int32(6)}, meta)
            replicated = jshard.NamedSharding(mesh, jshard.PartitionSpec())
            target = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      "step": jax.ShapeDtypeStruct((), np.int32, sharding=replicated)}  # fmt: skip
            state, got = ck.restore(target)
        assert got.step == 6 and int(state["step"]) == 6
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(x) * 6)
        assert (d / "4" / "spmdkit_manifest.json").is_file()
