"""The benchmarks' pure helpers, their input errors, and one tiny compile each of the measuring
functions (scaling, pipeline_schedules) and of MaxText's FLOP formula against a compiled step."""

from __future__ import annotations

import argparse

import jax
import optax
import pytest

from benchmarks import (
    attention_memory,
    compile_time,
    context_memory,
    mfu,
    overhead,
    peer,
    pipeline_schedules,
    plan_time,
    published_runs,
    scaling,
)
from models import llama
from partition_rules import preset
from sharding import compile_train_step, make_mesh

SAMPLE_LOG = """\
I0101 00:00:01.000 140 max_utils.py:42] Total memory size: 1.2 GB
I0101 00:00:09.000 140 metric_logger.py:196] completed step: 0, seconds: 7.900, TFLOP/s/device: \
0.004, Tokens/s/device: 64.800, total_weights: 4096, loss: 6.951
I0101 00:00:10.000 140 metric_logger.py:196] completed step: 1, seconds: 0.600, TFLOP/s/device: \
0.047, Tokens/s/device: 853.333, total_weights: 4096, loss: 6.903
I0101 00:00:11.000 140 metric_logger.py:196] completed step: 2, seconds: 0.500, TFLOP/s/device: \
0.056, Tokens/s/device: 1024.000, total_weights: 4096, loss: 6.850
I0101 00:00:11.500 140 metric_logger.py:196] completed step: 3, seconds: 0.400, TFLOP/s/device: \
0.070, Tokens/s/device: 1280.000, total_weights: 4096, loss: 6.801, lr: 1.000e-03
"""


def test_maxtext_log_parser_reads_every_step_line():
    records = peer.parse_maxtext_log(SAMPLE_LOG)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[1] == {"step": 1, "seconds": 0.6, "TFLOP/s/device": 0.047,
                          "Tokens/s/device": 853.333, "total_weights": 4096.0, "loss": 6.903}  # fmt: skip
    assert records[3]["lr"] == 1e-3  # extras MaxText appends are kept
    summary = peer.summarize_log(records, skip=2)
    assert summary == {"steps": 2, "loss": 6.801, "seconds": 0.45, "TFLOP/s/device": 0.063,
                       "Tokens/s/device": 1152.0, "loss_by_step": {0: 6.951, 1: 6.903,
                       2: 6.85, 3: 6.801}}  # fmt: skip


def test_side_by_side_compares_losses_at_the_same_step():
    ours = [{"label": "dp", "mesh": "data=8", "seconds": 0.9, "TFLOP/s/device": 0.02,
             "Tokens/s/device": 600.0, "loss": 6.85, "losses": [6.95, 6.9, 6.85]}]  # fmt: skip
    theirs = {"dp": peer.summarize_log(peer.parse_maxtext_log(SAMPLE_LOG), skip=2)}
    table = peer.side_by_side(ours, theirs)
    row = {c.header: next(iter(c.cells)) for c in table.columns}
    assert row["seconds\nMaxText"] == "0.45" and row["seconds\nratio"] == "2.00"
    assert row["loss\nMaxText"] == "6.85" and row["loss\nratio"] == "1.00"  # step 2, not 3


def test_maxtext_log_errors_name_the_file_and_the_format():
    with pytest.raises(peer.MaxTextLogError, match=r"run\.log: no MaxText step lines.*seconds"):
        peer.parse_maxtext_log("step 1 loss 3.0\n", "run.log")
    assert peer.parse_log_arg("stage=4,data=2=logs/pp.txt") == ("pp", peer.Path("logs/pp.txt"))
    assert peer.parse_log_arg("data=2,tensor=4=tp.log")[0] == "tp"  # canonical order too
    with pytest.raises(peer.MaxTextLogError, match=r"'data=4=x.log'.*data=8=FILE \(dp=FILE\)"):
        peer.parse_log_arg("data=4=x.log")


def test_maxtext_commands_match_each_mesh():
    pp = peer.maxtext_command("pp", "stage=4,data=2", 8, steps=20, config="base.yml")
    assert pp.startswith("python -m maxtext.trainers.pre_train.train base.yml")
    for flag in ("ici_pipeline_parallelism=4", "ici_data_parallelism=2", "ici_fsdp_parallelism=1",
                 "num_pipeline_microbatches=8", "num_layers_per_pipeline_stage=2",
                 "per_device_batch_size=2", "base_emb_dim=256", "vocab_size=1024"):  # fmt: skip
        assert flag in pp
    tp = peer.maxtext_command("tp", "tensor=4,data=2", None, steps=20, config="base.yml")
    assert "ici_tensor_parallelism=4" in tp and "num_pipeline" not in tp


def test_maxtext_flop_formula_matches_the_compiled_step():
    """MaxText's count halves causal attention; the compiled step computes the full score
    matrix, so it does the formula's work plus that other half."""
    cfg = llama.config("tiny")
    b, s = 2, 64
    program = compile_train_step(
        lambda r: llama.Model(cfg, rngs=r), llama.loss, optax.adamw(1e-3), *preset("llama", "dp"),
        make_mesh("data=1", jax.devices()[:1]), llama.batch_shapes(cfg, b, s),
    )  # fmt: skip
    compiled = program.report().matmul_flops
    other_half = 3 * cfg.n_layers * 4 * b * s * s * cfg.n_heads * cfg.head_dim / 2
    formula = peer.maxtext_train_flops_per_device(cfg, b, s)
    assert compiled == pytest.approx(formula + other_half, rel=0.01)


def test_scaling_helpers_and_errors():
    assert scaling.device_counts(8) == [1, 2, 4, 8]
    with pytest.raises(scaling.ScalingArgumentError, match=r"--devices 6: .*power of two"):
        scaling.device_counts(6)
    assert [scaling.mesh_for(s, 2) for s in scaling.STRATEGIES] == [
        "data=2", "fsdp=2", "tensor=2", "stage=2"]  # fmt: skip
    with pytest.raises(scaling.ScalingArgumentError, match=r"'dp_tp'.*dp, fsdp, tp, pp"):
        scaling.mesh_for("dp_tp", 2)


def test_scaling_measure_pipeline_on_two_devices():
    args = argparse.Namespace(size="tiny", layers=4, kv_heads=4, batch=8, seq=16)
    row = scaling.measure("pp", 2, args)
    assert row["mesh"] == "stage=2" and row["microbatches"] == 4
    assert row["collectives"]["collective-permute"]["bytes"] > 0
    full = scaling.measure("pp", 1, args)
    assert full["collective_bytes"] == 0  # one device: the unpipelined step
    assert row["param_bytes"] < full["param_bytes"]  # each stage holds its own layers


def test_mfu_helpers():
    assert mfu.sizes_largest_first(llama.SIZES, llama.param_count)[-1] == "tiny"
    assert mfu.train_flops_6nd(10, 3) == 180.0
    limit, source = mfu.memory_limit(jax.devices()[0], "2GB")
    assert (limit, source) == (2 * 10**9, "--memory")
    row = mfu.try_size(
        llama,
        "1b",
        argparse.Namespace(seq=64, batch=8, dtype="float32", remat="none"),
        jax.devices()[0],
        limit,
    )
    assert not row["fits"] and "train state alone exceeds" in row["reason"]


def test_pipeline_grid_and_errors():
    every = list(pipeline_schedules.SCHEDULES)
    points, skipped = pipeline_schedules.grid([2, 4], [2, 8], every, 8)
    assert len(points) == 16 and (4, 2, "gpipe") in points and (4, 2, "1f1b") not in points
    assert {s for p, m, s in points if (p, m) == (4, 8)} == set(every)
    assert "p=4 m=2 1f1b: schedule='1f1b' needs microbatches >= stages" in skipped[1]
    _, skipped = pipeline_schedules.grid([4], [6], ["interleaved", "gpipe"], 8)
    assert skipped == ["p=4 m=6 interleaved: schedule='interleaved' takes micro-batches in "
                       "groups of the stages"]  # fmt: skip
    with pytest.raises(pipeline_schedules.GridError, match=r"unknown schedules \['zb'\]"):
        pipeline_schedules.grid([2], [4], ["zb"], 8)
    with pytest.raises(pipeline_schedules.GridError, match=r"no runnable point.*n_layers=4 does "
                       r"not split into stages=4 x repeats=2"):  # fmt: skip
        pipeline_schedules.grid([4], [8], ["circular"], 4)
    assert pipeline_schedules.label("interleaved") == "interleaved v=2"


def test_pipeline_schedules_prices_every_schedule_and_checks_the_claims(tmp_path, capsys):
    """p=4, m=8 only: one stage's pieces compiled once, every schedule priced on h100:1x8."""
    import json

    from sharding.pipeline import make_schedule

    argv = ["--stages", "4", "--microbatches", "8", "--seq", "16", "--out", str(tmp_path)]
    rc = pipeline_schedules.main(argv)
    record = json.loads((tmp_path / "pipeline_schedules.json").read_text())
    assert (tmp_path / "pipeline_schedules.png").stat().st_size > 0
    rows = {r["schedule"]: r for r in record["rows"]}
    assert set(rows) == set(pipeline_schedules.SCHEDULES) and not record["skipped"]
    [stage] = record["stage_flops"]
    assert stage["layers"] == 2 and stage["forward"] > 0 and stage["head_forward"] > 0
    assert stage["input_grad"] < stage["backward"]  # B leaves out the weight gradients
    for name, r in rows.items():
        sched = make_schedule(4, 8, name, pipeline_schedules.REPEATS.get(name, 1))
        assert r["bubble_theory"] == pytest.approx(sched.bubble_fraction)
        assert r["ticks"] == len(sched.table + sched.backward_table)
        assert 0 < r["bubble_flops"] < r["critical_flops"] and r["step_s"] > r["bubble_s"] > 0
    assert rows["gpipe"]["ticks"] == 22 and rows["1f1b"]["ticks"] == 14
    claims = {c["schedule"]: c for c in record["claims"]}
    assert set(claims) == {"zb-h1", "interleaved"}
    assert all(c["ratio"] > 0 and c["holds"] == (c["ratio"] <= c["limit"]) for c in claims.values())
    assert claims["interleaved"]["holds"]  # v=2 halves 1f1b's bubble
    assert rc == (0 if all(c["holds"] for c in claims.values()) else 1)
    assert "zb-h1 bubble <= 0.5 x 1f1b's at p=4, m=8" in capsys.readouterr().out


def test_mfu_says_when_no_size_fits(tmp_path):
    argv = ["--size", "maxtext-tiny", "--memory", "1MB", "--out", str(tmp_path)]
    with pytest.raises(mfu.NoSizeFitsError, match=r"fits 977 KiB .*: the smallest needs 102 MiB"):
        mfu.main(argv)
    with pytest.raises(mfu.NoSizeFitsError, match=r"seq 5000 > max_seq_len 4096"):
        mfu.main(["--size", "tiny", "--seq", "5000", "--out", str(tmp_path)])


@pytest.mark.parametrize(
    "bench",
    [compile_time, mfu, overhead, peer, pipeline_schedules, plan_time, published_runs, scaling],
    ids=lambda m: m.__name__.split(".")[-1],
)
def test_every_benchmark_answers_help(bench, capsys):
    """`python -m benchmarks.NAME --help`: each imports and parses (nothing runs)."""
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0
    assert f"python -m {bench.__name__}" in capsys.readouterr().out


def test_calibrate_runs_tiny_on_cpu_and_writes_a_profile_plan_reads(tmp_path, capsys):
    """benchmarks/calibrate.py is written for a GPU; here it runs tiny, as a smoke test."""
    import json

    from benchmarks import calibrate
    from sharding.planning import plan
    from sharding.targets import PROFILES, load_profile

    argv = ["--devices", "8", "--target", "h100", "--matmul", "64", "--models", "tiny:2",
            "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)]  # fmt: skip
    assert calibrate.main(argv) == 0
    out = capsys.readouterr().out
    assert "smoke test, not a calibration" in out and "llama tiny (2 layers)" in out
    record = json.loads((tmp_path / "calibrate.json").read_text())
    [row] = record["steps"]
    assert row["fits"] and row["measured_s"] > 0 and row["predicted_s"] > 0
    assert row["calibrated_s"] > row["predicted_s"]  # a CPU is far below an H100's 60%
    # (c): (a)'s square and the CPU grid (64 tokens, width 64, tensor 1 and 2, column and row),
    # each timed, its FLOPs and intensity exact, its fractions of the peak and of the square
    shapes = [(g["m"], g["k"], g["n"], g["what"]) for g in record["gemms"]]
    assert shapes == [(64, 64, 64, "square n=64"), (64, 64, 256, "column d=64 tensor=1"),
                      (64, 256, 64, "row d=64 tensor=1"), (64, 64, 128, "column d=64 tensor=2"),
                      (64, 128, 64, "row d=64 tensor=2")]  # fmt: skip
    for g in record["gemms"]:
        m, k, n = g["m"], g["k"], g["n"]
        assert g["flops"] == 2 * m * k * n and g["intensity"] == g["flops"] / (
            2 * (m * k + k * n + m * n)
        )
        assert g["seconds"] > 0 and g["fraction"] == pytest.approx(g["flops_per_s"] / 989.4e12)
        assert g["of_square"] == pytest.approx(g["fraction"] / record["gemms"][0]["fraction"])
    assert (tmp_path / "calibrate_gemms.png").stat().st_size > 0 and "(c) bfloat16 GEMMs" in out
    for bad in ("64x32", "", "64x0x8"):
        with pytest.raises(calibrate.GemmArgumentError, match=rf"--gemms {bad!r}: write MxKxN"):
            calibrate.main([*argv, "--gemms", bad])
    spec = load_profile(tmp_path / "calibrate.toml")
    assert spec.name == "h100-calibrated" and 0 < spec.matmul_fraction < 0.01
    assert spec.peak_bf16 == PROFILES["h100"].peak_bf16
    slow = plan(llama, size="tiny", target=f"{tmp_path / 'calibrate.toml'}:1x8", seq=16, aot=0)
    fast = plan(llama, size="tiny", target="h100:1x8", seq=16, aot=0)
    assert slow.shown[0].predicted.compute_s > fast.shown[0].predicted.compute_s
    with pytest.raises(calibrate.CalibrateArgumentError, match=r"--models '9b'.*SIZE:LAYERS"):
        calibrate.parse_models("9b")
    with pytest.raises(SystemExit):
        calibrate.main(["--help"])
    assert "python -m benchmarks.calibrate" in capsys.readouterr().out


def test_context_memory_compiles_each_method_and_refuses_bad_lengths(tmp_path):
    """seq 64 and 128 at 64 tokens per device, one layer: the ring's temporaries below the
    all-gather's, both below one device's at the same length."""
    import json

    argv = ["--seqs", "64,128", "--per-device", "64", "--layers", "1", "--out", str(tmp_path)]
    assert context_memory.main(argv) == 0
    record = json.loads((tmp_path / "context_memory.json").read_text())
    assert (tmp_path / "context_memory.png").stat().st_size > 0
    at = {(r["seq"], r["method"]): r for r in record["rows"]}
    assert set(at) == {(64, "none"), (128, "none"), (128, "ring"), (128, "allgather"),
                       (128, "ulysses")}  # fmt: skip
    assert at[128, "ring"]["context"] == 2
    assert at[128, "ring"]["temp"] < at[128, "allgather"]["temp"] < at[128, "none"]["temp"]
    with pytest.raises(context_memory.GridError, match=r"seq=96 needs context=seq/--per-device"):
        context_memory.points([96], 64, 8, 4)


def test_attention_memory_compiles_each_kernel_and_writes_the_table(tmp_path):
    """Tiny widths, one layer, 64 and 128 tokens: a row per (seq, kernel), the JSON and PNG."""
    import json

    argv = ["--seqs", "64,128", "--size", "tiny", "--layers", "1", "--out", str(tmp_path)]
    assert attention_memory.main(argv) == 0
    record = json.loads((tmp_path / "attention_memory.json").read_text())
    assert (tmp_path / "attention_memory.png").stat().st_size > 0
    assert {(r["seq"], r["kernel"]) for r in record["rows"]} == {
        (64, "blockwise"), (64, "xla"), (128, "blockwise"), (128, "xla")}  # fmt: skip
    assert record["claim"]["holds"] is None  # 2048 and 8192 were not asked for
