"""`spmdkit compare`: what it enumerates, how it picks, and one real end-to-end run."""

from __future__ import annotations

import json

import pytest

from models import cnn, llama
from sharding.cli import main
from sharding.comparison import (
    CompareArgumentError,
    NoStrategyFitsError,
    OutputExistsError,
    Result,
    check_output,
    compare,
    recommend,
)
from sharding.costmodel import Layout, layouts
from sharding.inspection import Peak, UnknownDeviceKindError, device_peak, mfu


def labels(cands):
    return [(c.label, c.mesh) for c in cands if not c.fallback]


def test_every_strategy_and_schedule_on_8_devices():
    assert labels(layouts(8, 4)) == [
        ("dp", "data=8"),
        ("fsdp", "fsdp=8"),
        ("tp", "tensor=8"),
        ("dp_tp", "data=4,tensor=2"),
        ("fsdp_tp", "fsdp=4,tensor=2"),
        ("pp gpipe m=8", "stage=4,data=2"),
        ("pp 1f1b m=8", "stage=4,data=2"),
        ("pp circular m=4 r=2", "stage=2,data=4"),  # 4 layers: 2 stages x 2 repeats
        ("pp_tp gpipe m=4", "stage=2,data=2,tensor=2"),
        ("pp_fsdp gpipe m=4", "stage=2,fsdp=4"),
    ]
    tp_shapes = [c.mesh for c in layouts(8, 4, strategies=("tp",))]
    assert tp_shapes == ["tensor=8", "data=2,tensor=4", "data=4,tensor=2"]  # tried in order


def test_one_mesh_for_every_strategy():
    got = labels(layouts(8, 4, strategies=("dp", "pp"), mesh="stage=2,data=4"))
    assert got == [
        ("dp", "stage=2,data=4"),
        ("pp gpipe m=4", "stage=2,data=4"),
        ("pp 1f1b m=4", "stage=2,data=4"),
        ("pp circular m=4 r=2", "stage=2,data=4"),
    ]


def test_unknown_strategy_names_the_known():
    with pytest.raises(ValueError, match=r"unknown strategies \['zero3'\]; known: dp, fsdp"):
        layouts(8, 4, strategies=("zero3",))


def test_peaks_by_device_kind():
    assert device_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert device_peak("TPU v5 lite") == 197e12
    with pytest.raises(UnknownDeviceKindError, match=r"'Mystery X1'; known kinds: H200, .*TPU v4"):
        device_peak("Mystery X1")
    assert mfu(1e12, 0.5, Peak(4e12, 4, "cpu", "measured")) == 0.5


def result(label: str, step_s: float, state: int, peak: int, comm: int = 0) -> Result:
    strategy = label.split()[0]
    cand = Layout(strategy, "data=8", "gpipe" if strategy == "pp" else None, 8)
    return Result(cand, {"data": 8}, state // 3, state, peak, peak // 2, {}, comm, 1e9, 1.0,
                  [step_s], 4096, [5.5], bubble=0.2 if strategy == "pp" else None)  # fmt: skip


def test_recommends_the_fastest_that_fits_and_names_the_leanest():
    results = [result("dp", 0.10, 3000, 3000, 10), result("fsdp", 0.12, 400, 500, 30),
               result("pp", 0.11, 900, 1000, 20)]  # fmt: skip
    free = recommend(results, 3000)
    assert free.best.candidate.strategy == "dp"
    assert any("fsdp needs the least" in line for line in free.lines)
    tight = recommend(results, 3000, memory_budget=1000)
    assert tight.best.candidate.strategy == "pp"
    assert any("data parallelism alone cannot hold this model" in line for line in tight.lines)


def test_nothing_fits_says_the_smallest_memory_needed():
    results = [result("dp", 0.10, 3000, 3000), result("fsdp", 0.12, 400, 500)]
    with pytest.raises(
        NoStrategyFitsError, match=r"no strategy fits 100 B per device; the least, fsdp .* 500 B"
    ):
        recommend(results, 3000, memory_budget=100)


def test_compare_end_to_end(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--strategies", "dp,fsdp_tp,pp", "--batch", "16", "--seq", "32",
            "--timed-steps", "2", "--warmup-steps", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Recommendation" in text and "strategies measured" in text
    record = json.loads((out / "compare.json").read_text())
    got = [r["candidate"]["label"] for r in record["results"]]
    assert got == ["dp", "fsdp_tp", "pp gpipe m=8", "pp 1f1b m=8", "pp circular m=4 r=2"]
    first = [r["losses"][0] for r in record["results"]]
    assert max(first) - min(first) < 1e-5  # every strategy computes the same step
    dp, fsdp_tp = record["results"][:2]
    assert dp["state_bytes"] == record["unsplit_state_bytes"]
    assert fsdp_tp["state_bytes"] < dp["state_bytes"] / 7  # weights and moments over 8 devices
    assert all(r["mfu"] > 0 and len(r["step_times_s"]) == 2 for r in record["results"])
    assert record["results"][2]["bubble"] == pytest.approx(
        3 / 11, abs=1e-4
    )  # (p-1)/(m+p-1), p=4, m=8
    assert record["recommendation"]["strategy"] in got
    assert (out / "compare.png").stat().st_size > 10_000


def test_compare_unknown_peak_device_kind_message():
    with pytest.raises(UnknownDeviceKindError, match="known kinds"):
        device_peak("cpu")


def test_compare_memory_budget_picks_what_fits(tmp_path, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "compare.json").write_text("{}")  # an earlier run's, replaced under --overwrite
    argv = ["compare", "--strategies", "dp,fsdp", "--batch", "16", "--seq", "32",
            "--timed-steps", "1", "--warmup-steps", "0", "--memory", "4MiB", "--peak-tflops", "1",
            "--out", str(out), "--overwrite"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "data parallelism alone cannot hold this model" in text
    record = json.loads((out / "compare.json").read_text())
    assert record["recommendation"]["strategy"] == "fsdp"  # dp needs 5.3 MiB, fsdp 2.9 MiB
    assert record["peak"]["source"] == "given" and record["peak"]["per_device"] == 1e12


def test_compare_api_refuses_before_anything_compiles(tmp_path, unchanged):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "compare.png").write_text("an earlier chart")
    with unchanged():
        for kwargs, match in [
            ({"batch": 0}, r"--batch 0: give a whole number >= 1"),
            ({"timed_steps": 0}, r"--timed-steps 0: give a whole number >= 1"),
            ({"warmup_steps": -1}, r"--warmup-steps -1: give a whole number >= 0"),
            ({"size": "13b"}, r"--size '13b': unknown llama size; sizes: tiny"),
            ({"dtype": "float16"}, r"--dtype 'float16': choose one of float32, bfloat16"),
            ({"memory_budget": -5}, r"--memory -5: give the memory per device"),
            ({"peak_tflops": float("inf")}, r"--peak-tflops inf: give the peak TFLOP/s"),
        ]:
            with pytest.raises(CompareArgumentError, match=match):
                compare(llama, **kwargs)
        with pytest.raises(CompareArgumentError, match=r"--seq 32: cnn tiny has no sequence axis"):
            compare(cnn, seq=32)
        with pytest.raises(
            OutputExistsError, match=r"already holds compare\.png; pass --overwrite"
        ):
            check_output(tmp_path / "old")
    assert check_output(tmp_path / "old", overwrite=True) == tmp_path / "old"


def test_compare_measures_the_cnn_hybrid_beside_pure_dp(tmp_path):
    """The guides' hybrid: convolutions data-parallel, the wide classifier split over tensor
    (dp_tp on the CNN), measured beside pure dp: less traffic and less train state per device."""
    out = tmp_path / "cnn"
    argv = ["compare", "--model", "cnn", "--strategies", "dp,dp_tp", "--batch", "16",
            "--timed-steps", "1", "--warmup-steps", "0", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads((out / "compare.json").read_text())
    rows = {r["candidate"]["strategy"]: r for r in record["results"]}
    assert set(rows) == {"dp", "dp_tp"} and record["config"]["seq"] is None
    hybrid, dp = rows["dp_tp"], rows["dp"]
    assert hybrid["mesh_sizes"]["tensor"] == 2 and hybrid["unit"] == "samples"
    assert hybrid["collective_bytes"] < dp["collective_bytes"]
    assert hybrid["state_bytes"] < dp["state_bytes"]
    assert hybrid["losses"][0] == pytest.approx(dp["losses"][0], rel=1e-6)
