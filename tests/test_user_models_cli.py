"""Every command on a user model file in a temporary directory: `--model file.py:attribute`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from sharding.cli import main

HERE = Path(__file__).parent


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    """tests/user_models.py copied under another name into an empty folder, run from there."""
    shutil.copy(HERE / "user_models.py", tmp_path / "my_models.py")
    monkeypatch.chdir(tmp_path)
    return "my_models.py"


@pytest.mark.slow
def test_train_explain_and_reshard_a_user_model(model_file, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--model", f"{model_file}:transformer", "--strategy", "pp",
                 "--mesh", "stage=2,data=4", "--schedule", "1f1b", "--batch", "16",
                 "--steps", "3", "--metrics", str(metrics), "--checkpoint-dir", "ck"]) == 0  # fmt: skip
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    out = capsys.readouterr().out
    assert "tiny-decoder-stacked" in out and "1f1b" in out
    assert main(["reshard", "ck", "ck_tp", "--model", f"{model_file}:transformer",
                 "--mesh", "data=2,fsdp=2,tensor=2", "--strategy", "fsdp_tp"]) == 0  # fmt: skip
    assert main(["train", "--model", f"{model_file}:transformer", "--strategy", "fsdp_tp",
                 "--mesh", "data=2,fsdp=2,tensor=2", "--batch", "16", "--steps", "4",
                 "--checkpoint-dir", "ck_tp", "--resume"]) == 0  # fmt: skip
    assert "resumed from step 3" in capsys.readouterr().out
    assert main(["explain", "--model", f"{model_file}:cnn", "--strategy", "dp_tp",
                 "--mesh", "data=4,tensor=2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "fc1" in out and "P(-, tensor)" in out


@pytest.mark.parametrize(
    ("model", "match"),
    [
        ("nowhere.py:transformer", r"--model 'nowhere.py:transformer': no file 'nowhere.py'"),
        ("my_models.py:missing", r"my_models.py has no attribute 'missing'; it defines .*cnn"),
        (
            "my_models.py:cross_entropy",
            r"cross_entropy is a function of \(logits, targets\).*"
            r"sharding.Workload or a function returning one",
        ),
        ("my_models.py:VOCAB", r"gave a int; it must be a sharding.Workload"),
        ("no_such_pkg.mod:work", r"cannot import 'no_such_pkg.mod'.*path/to/mod.py:attribute"),
        ("resnet", r"not a shipped model .*llama.*'package.module:attribute'"),
    ],
)
def test_bad_model_names_are_refused(model_file, model, match, capsys):
    assert main(["explain", "--model", model, "--strategy", "dp", "--mesh", "data=8"]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err, re.S), err


def test_size_for_a_model_without_one_is_refused(model_file, capsys):
    assert main(["explain", "--model", f"{model_file}:cnn", "--size", "big", "--strategy", "dp",
                 "--mesh", "data=8"]) == 2  # fmt: skip
    assert "--size big: my_models.py:cnn takes no size= argument" in capsys.readouterr().err


def test_compare_puts_the_user_cnn_hybrid_beside_pure_dp(model_file, tmp_path):
    """The guides' hybrid on a CNN written by the user: convolutions data-parallel, the wide
    classifier split over tensor (dp_tp), compiled beside pure dp for one H100 node."""
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "compare",
                "--model",
                f"{model_file}:cnn",
                "--strategies",
                "dp,dp_tp",
                "--dtype",
                "float32",
                "--batch",
                "16",
                "--out",
                str(out),
                "--compiler",
                "cpu",
            ]
        )
        == 0
    )
    record = json.loads((out / "compare.json").read_text())
    rows = {c["layout"]["strategy"]: c for c in record["candidates"]}
    hybrid, dp = rows["dp_tp"], rows["dp"]
    assert record["model"]["name"] == "tiny-cnn" and hybrid["unit"] == "samples"
    assert hybrid["collective_bytes"] < dp["collective_bytes"]
    assert hybrid["state_bytes"] < dp["state_bytes"]
    assert hybrid["split"] == "batch data(4)\nweights tensor(2)"
