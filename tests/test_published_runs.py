"""The measuring stick of the step-time model: `benchmarks.published_runs` prices every published
run of its data file on the run's exact layout, and only the benchmark reads that file."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from benchmarks import published_runs
from sharding.costmodel import ACCURACY_FILE, expected_error, layout_kind

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def priced_runs(tmp_path_factory):
    """One run of the benchmark: (its output folder, its JSON, what it printed)."""
    out = tmp_path_factory.mktemp("published_runs")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert published_runs.main(["--out", str(out)]) == 0
    return out, json.loads((out / "published_runs.json").read_text()), printed.getvalue()


def test_every_published_run_is_priced_or_says_why(priced_runs):
    out, data, printed = priced_runs
    runs = published_runs.load()["run"]
    assert len(data["rows"]) == len(runs) == 26 and data["unpriced"] == []
    assert {r["device"] for r in data["rows"] if r["id"] in ("TT1", "TT3")} == {"h100-96gb-500w"}
    for row in data["rows"]:
        assert row["predicted"] > 0 and row["ratio"] == row["predicted"] / row["published"]
        assert row["dominant"] in ("compute", "exposed comm", "bubble")
    errors = sorted(abs(r["ratio"] - 1) for r in data["rows"])
    stats = data["summary"]
    assert stats["worst_abs_error"] == errors[-1] and stats["priced"] == 26
    assert stats["within_15"] == sum(e <= 0.15 for e in errors) / 26
    assert (out / "published_runs.png").stat().st_size > 10_000
    # runs held out of the model's derivation are priced apart, by the same public calls
    held = data["held_out"]
    assert [r["id"] for r in held["rows"]] == ["MX1", "PX1", "PX2", "PX3"]
    assert held["unpriced"] == [] and held["summary"]["priced"] == 4
    assert [r["kind"] for r in held["rows"]] == ["fsdp", "data", "fsdp", "fsdp"]
    assert held["summary"]["worst_abs_error"] == max(abs(r["ratio"] - 1) for r in held["rows"])
    assert "median |error|" in printed


def test_a_run_is_priced_on_its_own_layout():
    """NA6: data 32 x tensor 8 x 4 interleaved stages of 3 chunks, 28 micro-batches of 2 rows."""
    data = published_runs.load()
    run = next(r for r in data["run"] if r["id"] == "NA6")
    got = published_runs.price(run, data["models"][run["model"]])
    assert got["strategy"] == "tp+pp" and got["target"] == "a100:128x8"
    assert got["mesh"] == {"data": 32, "tensor": 8, "stage": 4}
    assert published_runs.layout_text(run["layout"]) == "DATA32 TENSOR8 STAGE4 interleaved v3"


def test_only_the_benchmark_reads_the_published_runs():
    library = [
        p for d in ("sharding", "models", "partition_rules") for p in (ROOT / d).rglob("*.py")
    ]
    assert library and not [p for p in library if "published_runs" in p.read_text()]


def test_the_shipped_accuracy_is_the_benchmarks_own(priced_runs):
    """compare quotes `sharding.costmodel.expected_error`, read from the table this benchmark
    writes; a model change that moves the errors must rewrite it (``--accuracy``)."""
    fresh = priced_runs[1]["accuracy"]
    shipped = json.loads(ACCURACY_FILE.read_text())
    assert shipped == fresh, "stale: run python -m benchmarks.published_runs --accuracy"
    assert set(shipped["kinds"]) == {"data", "fsdp", "tensor", "pipeline"}
    assert sum(k["runs"] for k in shipped["kinds"].values()) == shipped["all"]["runs"] == 26
    tp = expected_error({"data": 48, "tensor": 8})
    row = shipped["kinds"]["tensor"]
    assert (tp.kind, tp.runs, tp.median, tp.worst) == ("tensor", 6, row["median"], row["worst"])
    assert tp.sentence().startswith("Expected error: on 6 published tensor-parallel runs")
    assert f"off by {row['median']:.0%} (median), {row['worst']:.0%} at worst" in tp.sentence()
    # each kind names the sources of its own runs
    sources = {r["source"] for r in priced_runs[1]["rows"] if r["kind"] == "tensor"}
    assert tp.measured == row["measured"] == "; ".join(sorted(sources)) and len(sources) == 2


def test_a_layout_is_judged_by_its_most_telling_split():
    assert layout_kind({"stage": 2, "tensor": 8, "data": 4}) == "pipeline"
    assert layout_kind({"fsdp": 4, "tensor": 2}) == "tensor"
    assert [layout_kind({"fsdp": 8}), layout_kind({"data": 8}), layout_kind({})] == [
        "fsdp", "data", "data"]  # fmt: skip
    # no published run splits context or experts: no figure to quote
    assert layout_kind({"fsdp": 4, "context": 2}) is None
    assert expected_error({"data": 2, "expert": 4}) is None
