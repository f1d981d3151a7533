"""Seeing inside a run: `train --profile DIR --profile-steps A:B` traces exactly steps A..B, and
`--tensorboard DIR` holds the JSON Lines numbers as scalars; bad flags write nothing.

One 3-step run (llama tiny, fsdp_tp on data=2,fsdp=2,tensor=2) is shared by the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import types
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import models
from sharding.cli import main
from sharding.training import (
    ArithmeticText,
    ConflictingSettingsError,
    InvalidSettingError,
    NonFiniteLossError,
    OutputPathError,
    TrainConfig,
    fit,
    profile_steps,
)

SMALL = TrainConfig(size="tiny", strategy="dp", mesh="data=8", batch=8, seq=16, warmup=2, steps=3)


def scalars(folder) -> dict[str, dict[int, float]]:
    """TensorBoard scalars read back with tbparse: tag -> {step: value}."""
    from tbparse import SummaryReader

    with warnings.catch_warnings():  # tbparse sorts with pandas' deprecated inplace=True
        warnings.simplefilter("ignore", DeprecationWarning)
        frame = SummaryReader(str(folder)).scalars
        texts = SummaryReader(str(folder)).text
    out: dict[str, dict[int, float]] = {}
    for step, tag, value in frame[["step", "tag", "value"]].itertuples(index=False):
        assert step not in out.setdefault(tag, {}), f"{tag} written twice at step {step}"
        out[tag][int(step)] = float(value)
    return out | {"text": dict(zip(texts["tag"], texts["value"], strict=True))}


def events(trace_file) -> list[dict]:
    """The events of the Perfetto JSON the trace wrote beside its ``.xplane.pb``."""
    return json.loads(gzip.decompress((trace_file.parent / "perfetto_trace.json.gz").read_bytes()))[
        "traceEvents"
    ]


def traced_steps(trace_file) -> list[int]:
    """The step numbers of the ``train`` step annotations in the trace."""
    return sorted(
        int(e["args"]["step_num"]) for e in events(trace_file) if e.get("name") == "train"
    )


def op_names(trace_file) -> set[str]:
    """The names of the ops in the trace, without their numbers (``all-gather.35``)."""
    return {e.get("name", "").split(".")[0] for e in events(trace_file) if e.get("ph") == "X"}


@pytest.fixture(scope="module")
def run3(tmp_path_factory):
    root = tmp_path_factory.mktemp("observe")
    args = ["train", "--model", "llama", "--size", "tiny", "--strategy", "fsdp_tp",
            "--mesh", "data=2,fsdp=2,tensor=2", "--batch", "8", "--seq", "16", "--steps", "3",
            "--metrics", str(root / "m.jsonl"), "--profile", str(root / "traces"),
            "--profile-steps", "2:3", "--tensorboard", str(root / "tb")]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(args) == 0
    rows = [json.loads(line) for line in (root / "m.jsonl").read_text().splitlines()]
    return root, rows, " ".join(printed.getvalue().split())


def test_the_trace_holds_steps_2_and_3_with_their_collectives(run3):
    root, _, printed = run3
    files = sorted((root / "traces").glob("plugins/profile/*/*.xplane.pb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert traced_steps(files[0]) == [2, 3]  # started before step 2, stopped after step 3
    assert {"all-gather", "all-reduce"} <= op_names(files[0])  # fsdp gathers, grads reduce
    assert "8 simulated CPU devices: the trace's device timelines are simulated too" in printed
    assert f"trace of steps 2..3: {files[0]}" in printed


def test_tensorboard_scalars_equal_the_json_lines(run3):
    root, rows, _ = run3
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) == {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"}
    read = scalars(root / "tb")
    text = read.pop("text")
    assert set(read) == {f"train/{k}" for k in rows[0] if k != "step"}
    for key in rows[0].keys() - {"step"}:  # event files hold float32
        assert read[f"train/{key}"] == {r["step"]: float(np.float32(r[key])) for r in rows}, key
    assert "| mesh | data=2,fsdp=2,tensor=2 |" in text["settings"]
    assert "| profile_steps | 2:3 |" in text["settings"] and "| batch | 8 |" in text["settings"]


def test_a_library_loop_is_traced_only_inside_its_window(tmp_path):
    notes = []
    with profile_steps(tmp_path / "t", 2, 3, on_note=notes.append) as prof:
        for n in range(1, 6):
            with prof.step(n):
                float((jnp.arange(64.0) * n).sum())
    assert len(prof.files) == 1 and traced_steps(prof.files[0]) == [2, 3]
    assert "simulated CPU devices" in notes[0] and str(prof.files[0]) in notes[1]


def test_a_diverged_run_closes_its_trace_and_scalars(tmp_path):
    window = ArithmeticText(seed=0).batch(2, SMALL.batch, SMALL.seq)
    bad = jnp.asarray(window[:, :-1])

    def loss(model, batch, *, remat=None):  # NaN on exactly the batch of step 3
        value = models.llama.loss(model, batch, remat=remat)
        return jnp.where(jnp.all(batch["inputs"] == bad), jnp.nan, value)

    nan_llama = types.SimpleNamespace(**{**vars(models.llama), "loss": loss})
    config = dataclasses.replace(SMALL, steps=5, profile=tmp_path / "t", profile_steps="2:4",
                                 tensorboard=tmp_path / "tb")  # fmt: skip
    with pytest.raises(NonFiniteLossError, match="step 3: loss nan"):
        fit(nan_llama, config)
    [trace] = (tmp_path / "t").glob("plugins/profile/*/*.xplane.pb")
    assert traced_steps(trace) == [2, 3]  # stopped at the error, so the next trace can start
    read = scalars(tmp_path / "tb")
    assert read["train/loss"].keys() == {1, 2}


@pytest.mark.slow
def test_a_resumed_run_traces_only_the_steps_it_trains(tmp_path, unchanged):
    first = dataclasses.replace(SMALL, steps=2, checkpoint_dir=tmp_path / "ck")
    fit(models.llama, first)
    more = dataclasses.replace(first, steps=4, resume="latest", profile=tmp_path / "t",
                               tensorboard=tmp_path / "tb")  # fmt: skip
    with unchanged(), pytest.raises(InvalidSettingError, match=r"1:2: the run resumes after "
                                    r"step 2, so it trains steps 3..4 only.* 3:4"):  # fmt: skip
        fit(models.llama, dataclasses.replace(more, profile_steps="1:2"))
    assert not (tmp_path / "t").exists() and not (tmp_path / "tb").exists()
    result = fit(models.llama, dataclasses.replace(more, profile_steps="2:3"))
    [trace] = (tmp_path / "t").glob("plugins/profile/*/*.xplane.pb")
    assert traced_steps(trace) == [3] and result.resumed_from == 2
    assert scalars(tmp_path / "tb")["train/loss"].keys() == {3, 4}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"profile_steps": "2-3"}, InvalidSettingError, r"--profile-steps 2-3: give the first"),
        ({"profile_steps": "0:2"}, InvalidSettingError, r"--profile-steps 0:2: steps count from 1"),
        ({"profile_steps": "3:2"}, InvalidSettingError, r"1 <= A <= B\), e.g. --profile-steps 3:3"),
        ({"profile_steps": "2:9"}, InvalidSettingError, r"2:9: the run ends at --steps 3;.* 2:3"),
        ({"profile_steps": None}, ConflictingSettingsError, r"needs --profile-steps A:B"),
        ({"profile": None}, ConflictingSettingsError, r"no --profile DIR is given"),
        ({"profile": "file.txt"}, OutputPathError, r"--profile file.txt is a file, not a folder"),
        ({"tensorboard": "file.txt/tb"}, OutputPathError, r"--tensorboard .* is inside .*file"),
    ],
)
def test_bad_settings_are_refused_before_any_file(tmp_path, unchanged, change, error, match):
    (tmp_path / "file.txt").write_text("not a folder")
    given = {"profile": "traces", "profile_steps": "2:3", "tensorboard": "tb"} | change
    config = dataclasses.replace(SMALL, **given)
    with unchanged() as here, pytest.raises(error, match=match):
        fit(models.llama, config)
    assert not (here / "traces").exists() and not (here / "tb").exists()


def test_bad_flags_exit_2_and_write_nothing(refused):
    refused(["train", "--steps", "3", "--profile", "traces", "--profile-steps", "3:x"],
            r"--profile-steps 3:x: give the first and last step")  # fmt: skip


def test_the_library_call_names_its_arguments(tmp_path):
    with pytest.raises(InvalidSettingError, match=r"profile_steps\(directory, 4, 2\): steps"):
        profile_steps(tmp_path / "t", 4, 2)
    assert not (tmp_path / "t").exists()
