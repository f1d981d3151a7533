"""`sharding.training.fit`: the training loop through the Python API.

One 4-step run (llama tiny, dp on data=8, checkpoints at 2 and 4) is shared by the module.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import types

import jax.numpy as jnp
import pytest
from rich.console import Console

import models
from sharding.training import (
    ArithmeticText,
    Checkpointer,
    ConflictingSettingsError,
    InvalidSettingError,
    NonFiniteLossError,
    OutputPathError,
    TrainConfig,
    TrainingError,
    TrainResult,
    WouldOverwriteError,
    fit,
)

SMALL = TrainConfig(size="tiny", strategy="dp", mesh="data=8", batch=8, seq=16, warmup=2, steps=4)


def strict_json(line: str) -> dict:
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    config = dataclasses.replace(
        SMALL, checkpoint_dir=root / "ck", save_every=2, metrics=root / "m.jsonl"
    )
    seen, notes = [], []
    result = fit(models.llama, config, on_step=seen.append, on_note=notes.append)
    return root, result, seen, notes


def test_fit_returns_the_run(run4):
    root, result, seen, notes = run4
    assert isinstance(result, TrainResult)
    assert [r["step"] for r in result.history] == [1, 2, 3, 4] and seen == result.history
    assert [strict_json(line) for line in (root / "m.jsonl").read_text().splitlines()] == seen
    assert result.final_loss < result.history[0]["loss"]
    assert (result.family, result.size, result.strategy, result.devices) == (
        "llama",
        "tiny",
        "dp",
        8,
    )
    assert (result.batch, result.seq, result.accum, result.resumed_from) == (8, 16, 1, None)
    assert result.checkpoint_steps == [2, 4] and result.notes == notes
    assert any(n.startswith("compiling llama tiny / dp on data=8") for n in notes)
    assert result.parameters > 0 and result.state_bytes > result.param_bytes > 0
    assert int(result.state["step"]) == 4 and result.program.accum_steps == 1
    data = json.loads(result.to_json())
    assert data["history"] == seen and data["config"]["checkpoint_dir"] == str(root / "ck")
    assert data["memory_per_device"]["allocated"] == result.report.memory.allocated
    console = Console(record=True, width=200)
    console.print(result.table())
    text = console.export_text()
    assert "step allocates / device" in text and "dp: batch split over data" in text
    png = result.plot(root / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fit_resumes_through_the_api(run4, tmp_path):
    root, first, _, _ = run4
    ck = shutil.copytree(root / "ck", tmp_path / "ck")
    more = fit(
        models.llama, dataclasses.replace(SMALL, steps=6, checkpoint_dir=ck, resume="latest")
    )
    assert more.resumed_from == 4 and [r["step"] for r in more.history] == [5, 6]
    assert more.checkpoint_steps == [2, 4, 6]
    assert any(n.startswith("resumed from step 4") for n in more.notes)
    # From step 2 again (replacing 4 and 6): steps 3 and 4 repeat the first run bit for bit.
    again = fit(models.llama, dataclasses.replace(SMALL, checkpoint_dir=ck, resume=2,
                                                  overwrite=True))  # fmt: skip
    assert again.history[0]["step"] == 3
    assert [r["loss"] for r in again.history] == [r["loss"] for r in first.history[2:]]


def test_resuming_an_earlier_step_needs_overwrite(run4, tmp_path, unchanged):
    ck = shutil.copytree(run4[0] / "ck", tmp_path / "ck")
    config = dataclasses.replace(SMALL, checkpoint_dir=ck, resume=2)
    with unchanged(), pytest.raises(WouldOverwriteError, match=r"step\(s\) \[4\].*--resume 4"):
        fit(models.llama, config)
    with unchanged(), pytest.raises(WouldOverwriteError, match=r"already holds checkpoints"):
        fit(models.llama, dataclasses.replace(config, resume=None))


def _nan_at_step_3() -> types.SimpleNamespace:
    """llama whose loss is NaN on exactly the batch of the third step (index 2)."""
    window = ArithmeticText(seed=0).batch(2, SMALL.batch, SMALL.seq)
    bad = jnp.asarray(window[:, :-1])

    def loss(model, batch, *, remat=None):
        value = models.llama.loss(model, batch, remat=remat)
        return jnp.where(jnp.all(batch["inputs"] == bad), jnp.nan, value)

    return types.SimpleNamespace(**{**vars(models.llama), "loss": loss})


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_step(tmp_path):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    config = dataclasses.replace(SMALL, steps=6, metrics=metrics, checkpoint_dir=ck, save_every=1)
    with pytest.raises(NonFiniteLossError, match=r"step 3: loss nan.*last finite loss") as e:
        fit(_nan_at_step_3(), config)
    assert e.value.step == 3 and [r["step"] for r in e.value.history] == [1, 2]
    assert e.value.last_loss == e.value.history[-1]["loss"]
    assert "the last checkpoint is step 2" in str(e.value) and "--resume 2" in str(e.value)
    assert [strict_json(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    with Checkpointer(ck, read_only=True) as saved:
        assert saved.steps() == [1, 2]


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"steps": 0}, InvalidSettingError, r"--steps 0: train until a step >= 1"),
        ({"lr": float("nan")}, InvalidSettingError, r"--lr nan: .*finite number > 0"),
        ({"clip": -1.0}, InvalidSettingError, r"--clip -1.0: .*--clip 0 turns clipping off"),
        ({"batch": True}, InvalidSettingError, r"--batch True"),
        ({"resume": "newest"}, InvalidSettingError, r"--resume 'newest'"),
        ({"size": "huge"}, InvalidSettingError, r"--size 'huge': llama has no such size; .*tiny"),
        ({"seq": 4097}, TrainingError, r"--seq 4097: .*max_seq_len=4096; use --seq 4096 or less"),
        ({"elastic": "keep-batch", "checkpoint_dir": "ck"}, ConflictingSettingsError, r"--resume"),
        ({"data_dtype": "uint16"}, ConflictingSettingsError, r"no --data FILE"),
        ({"metrics": "nowhere/m.jsonl"}, OutputPathError, r"nowhere does not exist"),
        ({"metrics": "kept.jsonl"}, WouldOverwriteError, r"kept.jsonl already exists.*--overwrite"),
        ({"checkpoint_dir": "kept.jsonl"}, OutputPathError, r"is a file, not a folder"),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else None,
)
def test_fit_refuses_bad_settings_before_any_work(changes, error, match, tmp_path, unchanged):
    (tmp_path / "kept.jsonl").write_text("{}\n")
    with unchanged(), pytest.raises(error, match=match):
        fit(models.llama, dataclasses.replace(SMALL, **changes))


def test_fit_takes_a_workload_or_a_family(unchanged):
    with unchanged(), pytest.raises(InvalidSettingError, match=r"trains a sharding.Workload"):
        fit(models.layers, SMALL)
