"""The `spmdkit` command line: explain and train, and their errors before anything compiles."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from sharding.cli import main

MESH = "data=2,fsdp=2,tensor=2"


def train(tmp_path, *extra: str) -> int:
    return main(
        ["train", "--model", "llama", "--size", "tiny", "--strategy", "fsdp_tp", "--mesh", MESH,
         "--batch", "8", "--seq", "32", *extra]
    )  # fmt: skip


def test_explain_json_reports_bytes_per_device(capsys):
    assert main(["explain", "--model", "llama", "--size", "70b", "--mesh", "fsdp=64,tensor=8",
                 "--strategy", "fsdp_tp", "--json"]) == 0  # fmt: skip
    table = json.loads(capsys.readouterr().out)
    assert table["mesh"] == {
        "stage": 1,
        "data": 1,
        "fsdp": 64,
        "expert": 1,
        "context": 1,
        "tensor": 8,
    }
    assert table["totals"]["parameters"] == 68_976_648_192
    per_device = table["totals"]["param_bytes_per_device"]
    assert per_device == pytest.approx(68_976_648_192 * 4 / 512, rel=0.01)


def test_explain_prints_a_table(capsys):
    assert main(["explain", "--model", "cnn", "--size", "tiny", "--mesh", "data=4,tensor=2",
                 "--strategy", "dp_tp"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "head/fc1/kernel" in out and "P(-, tensor)" in out and "train state / device" in out


def test_explain_refuses_a_placement_with_the_reason(capsys):
    assert main(["explain", "--model", "llama", "--size", "tiny", "--mesh", "tensor=8",
                 "--strategy", "tp"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "IndivisibleDimensionError" in err and "kv_heads" in err and "tensor=8" in err


def test_train_writes_metrics_and_a_summary(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert train(tmp_path, "--steps", "3", "--metrics", str(metrics)) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"loss", "step_time_s", "tokens_per_s", "grad_norm"} <= set(rows[0])
    out = capsys.readouterr().out
    assert "fsdp_tp" in out and "collectives per device per step" in out
    # One memory figure, what the step allocates, with its parts named; one FLOP count, per
    # device and summed (XLA's "peak" and loop-blind FLOP estimate contradicted them).
    assert "step allocates / device" in out and "temporaries" in out and "peak" not in out
    assert "per device" in out and "summed over 8 devices" in out and "FLOPs/device:" not in out


def test_train_missing_data_file(tmp_path, capsys):
    assert train(tmp_path, "--steps", "1", "--data", str(tmp_path / "nope.bin")) == 2
    assert "nope.bin" in capsys.readouterr().err


def test_train_token_ids_beyond_the_vocabulary(tmp_path, capsys):
    path = tmp_path / "tokens.bin"
    np.array([1, 2, 300, 4] * 100, np.uint16).tofile(path)
    assert train(tmp_path, "--steps", "1", "--data", str(path), "--data-dtype", "uint16") == 2
    err = capsys.readouterr().err
    assert "300" in err and "256" in err


def test_train_sequence_longer_than_the_model(tmp_path, capsys):
    assert train(tmp_path, "--steps", "1", "--seq", "4097") == 2
    assert "seq_len=4097 > max_seq_len=4096" in capsys.readouterr().err


def test_train_batch_not_divisible(tmp_path, capsys):
    assert train(tmp_path, "--steps", "1", "--batch", "6") == 2
    assert "global batch 6 is not divisible by data=2xfsdp=2" in capsys.readouterr().err


def test_train_accumulation_not_dividing(tmp_path, capsys):
    assert train(tmp_path, "--steps", "1", "--accum", "3") == 2
    assert "not divisible by 3 accumulation steps" in capsys.readouterr().err


def test_train_unknown_strategy_lists_the_known(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--strategy", "zero3"])
    err = capsys.readouterr().err
    assert "unknown strategy 'zero3'" in err and "fsdp_tp" in err and "pp_fsdp" in err


def test_train_pipeline_flags_need_a_pipeline_strategy(tmp_path, capsys):
    assert train(tmp_path, "--steps", "1", "--schedule", "1f1b") == 2
    err = capsys.readouterr().err
    assert "--schedule configure a pipeline" in err and "'fsdp_tp' does not pipeline" in err


def test_train_pipeline_without_a_stage_axis(tmp_path, capsys):
    assert train(tmp_path, "--steps", "1", "--strategy", "pp") == 2
    assert "has stage=1; add stage=N with N >= 2" in capsys.readouterr().err


def test_train_1f1b_pipeline_runs(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert train(tmp_path, "--steps", "2", "--strategy", "pp_tp", "--mesh", "stage=2,data=2,tensor=2",
                 "--schedule", "1f1b", "--microbatches", "4", "--metrics", str(metrics)) == 0  # fmt: skip
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    assert "collective-permute" in capsys.readouterr().out


def strict_json(line: str) -> dict:
    """`json.loads` that refuses the bare NaN / Infinity Python's json writes by default."""
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_train_stops_at_a_non_finite_loss_with_exit_1(tmp_path, capsys):
    """A learning rate of 1e30 blows up at step 3 (the gradient norm): stop, keep step 2."""
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    assert train(tmp_path, "--steps", "8", "--lr", "1e30", "--metrics", str(metrics),
                 "--checkpoint-dir", str(ck), "--save-every", "1", "--keep", "10") == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"step 3: loss .*gradient norm nan: the run diverged", err), err
    assert "last finite loss" in err and "the last checkpoint is step 2" in err
    assert "--resume 2" in err and "Lower --lr" in err
    rows = [strict_json(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == [1, 2]


def test_train_context_parallel_with_a_chosen_method(tmp_path, capsys):
    """--context-method picks how attention runs over context; asking for one on a mesh without
    a context axis is refused, not ignored."""
    assert train(tmp_path, "--strategy", "cp", "--mesh", "data=2,context=4", "--context-method",
                 "allgather", "--steps", "2") == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "reduce-scatter" in out and "context" in out  # the all-gather's dK, dV transpose
    assert train(tmp_path, "--context-method", "ring", "--steps", "1") == 2
    assert "context" in capsys.readouterr().err
