"""`spmdkit compare`: what it enumerates, how it prices and picks, and end-to-end runs.

Times are predicted for a target from each compiled program, so they and the recommendation are
the same on every run; every sentence of the recommendation is checked against the table."""

from __future__ import annotations

import json
from functools import cache

import pytest

from models import cnn, llama
from sharding.cli import main
from sharding.comparison import (
    CompareArgumentError,
    NoStrategyFitsError,
    OutputExistsError,
    Settings,
    check_output,
    compare,
    evaluate,
    rank,
    recommend,
)
from sharding.costmodel import Layout, expected_error, layouts, predict
from sharding.inspection import Peak, UnknownDeviceKindError, device_peak, mfu
from sharding.targets import target


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
        ("pp interleaved m=4 r=2", "stage=2,data=4"),  # 4 layers: 2 stages x 2 repeats
        ("pp zb-h1 m=8", "stage=4,data=2"),
        ("pp circular m=4 r=2", "stage=2,data=4"),
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
        ("pp interleaved m=4 r=2", "stage=2,data=4"),
        ("pp zb-h1 m=4", "stage=2,data=4"),
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


MiB = 2**20


@cache
def tiny(strategies: str, **kwargs):
    """compare() on llama tiny, float32, h100:1x8, once per argument set for the module."""
    return compare(llama, target="h100:1x8", strategies=strategies, dtype="float32", batch=16,
                   seq=32, **dict(kwargs))  # fmt: skip


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


@pytest.mark.slow
def test_llama_tiny_on_one_h100_node_is_data_parallel_and_says_why():
    result = tiny("dp,fsdp,tp,pp")
    ranked = result.ranked
    best = result.recommendation.best
    assert best is ranked[0] and best.label == "dp" and best.mesh == "data=8"
    assert [c.step_s for c in ranked] == sorted(c.step_s for c in ranked)
    lines = result.recommendation.lines
    assert lines[0].startswith(f"dp on data=8: the fastest predicted step on h100:1x8 of the "
                               f"{len(ranked)} candidates that fit")  # fmt: skip
    assert ms(best.step_s) in lines[0]
    assert any("it fits, so the guides' first choice is data parallelism" in x for x in lines)
    assert "And dp is the fastest here too." in lines
    nxt = next(x for x in lines if x.startswith("Next: "))
    assert nxt.startswith(f"Next: {ranked[1].label} on {ranked[1].mesh} ({ms(ranked[1].step_s)}")
    quiet = min(ranked, key=lambda c: c.collective_bytes)
    loud = max(ranked, key=lambda c: c.collective_bytes)
    traffic = next(x for x in lines if x.startswith("Traffic: "))
    assert traffic.startswith(f"Traffic: {quiet.label} moves the least")
    assert f"{loud.label} the most" in traffic
    moved = next(x for x in lines if x.startswith("What it communicates"))
    assert "all-reduce" in moved and "over data (8 devices, NVLink, inside a node)" in moved
    assert any(x.startswith("Scaling, by the same model: on 16 devices (h100:2x8") for x in lines)
    assert [(s.label, s.mesh) for s in result.skipped] == [("tp", "tensor=8")]  # kv_heads=4
    # every candidate from the default target's own compiler where the gpu extra is installed
    assert {c.compiler for c in ranked} == {result.compiler.name}
    # the error to expect: the published data-parallel runs' (sharding.costmodel.accuracy.json)
    assert lines[1] == expected_error({"data": 8}).sentence()
    assert lines[1].startswith("Expected error: on ") and "data-parallel runs" in lines[1]


def test_the_prediction_is_deterministic_and_the_json_carries_its_assumptions():
    result = tiny("dp,fsdp,tp,pp")
    settings, tgt = Settings(16, 32), target("h100:1x8")
    again = evaluate(Layout("dp", "data=8"), _workload(), settings, tgt, dtype="float32")[0]
    dp = next(c for c in result.candidates if c.label == "dp")
    assert again.step_s == dp.step_s and again.collectives == dp.collectives
    record = json.loads(result.to_json())
    assert record["ranked_by"] == "predicted" and record["target"]["name"] == "h100:1x8"
    assert any("Matmuls run at 60%" in a for a in record["assumptions"])
    steps = [c["predicted"]["step_s"] for c in record["candidates"]]
    assert steps == sorted(steps)
    gpipe = next(c for c in record["candidates"] if c["label"] == "pp gpipe m=8")
    assert gpipe["bubble"] == pytest.approx(3 / 11, abs=1e-4)  # (p-1)/(m+p-1), p=4, m=8
    assert gpipe["predicted"]["bubble_s"] > 0


def _workload():
    from sharding import Workload

    return Workload.from_family(llama, llama.config("tiny"))


def test_a_memory_budget_recommends_the_fastest_that_fits_without_contradiction():
    free = tiny("dp,fsdp", remat="none")
    dp, fsdp = (next(c for c in free.candidates if c.label == s) for s in ("dp", "fsdp"))
    budget = (dp.memory_bytes + fsdp.memory_bytes) // 2  # between the two
    assert fsdp.memory_bytes < budget < dp.memory_bytes
    rec = recommend(free.candidates, free.unsplit_state, budget, free.target)
    assert rec.best is fsdp
    assert rec.lines[0].startswith("fsdp on fsdp=8: the fastest predicted step on h100:1x8 of "
                                   "the 1 candidates that fit")  # fmt: skip
    assert not any(x.startswith("Next: ") or x.startswith("Traffic: ") for x in rec.lines)
    assert rank(free.candidates, budget) == [fsdp, dp]  # what fits first, then by memory
    with pytest.raises(NoStrategyFitsError, match=r"no candidate fits 100 B per device on "
                       r"h100:1x8; the least, fsdp on fsdp=8, needs"):  # fmt: skip
        recommend(free.candidates, free.unsplit_state, 100, free.target)


def test_one_mesh_says_which_strategies_it_cannot_hold():
    """--mesh data=8 --strategies dp,fsdp,pp: pp is listed as skipped, and fsdp on fsdp=1
    splits nothing but the batch (from its compiled shardings)."""
    result = tiny("dp,fsdp,pp", mesh="data=8")
    assert [(s.label, s.reason) for s in result.skipped] == [
        ("pp", "--mesh data=8 has no stage axis; a pipeline needs stage >= 2")]  # fmt: skip
    fsdp = next(c for c in result.candidates if c.layout.strategy == "fsdp")
    assert fsdp.split == "batch data(8)\nweights whole" and fsdp.state_bytes == result.unsplit_state


def test_remat_policies_are_candidates_when_asked():
    result = tiny("dp", remat="none,full")
    plain, full = sorted(result.candidates, key=lambda c: c.remat != "none")
    assert (plain.label, full.label) == ("dp", "dp remat=full")
    assert full.matmul_flops > plain.matmul_flops  # the forward again in the backward
    assert full.predicted.compute_s > plain.predicted.compute_s


@pytest.mark.slow
def test_compare_cli_writes_json_and_a_png_with_the_recommendation(tmp_path, capsys):
    out = tmp_path / "cmp"
    # Two strategies: the CLI's parsing, printing and files are the subject here; every
    # strategy and schedule is compared in test_llama_tiny_on_one_h100_node_... above.
    argv = ["compare", "--strategies", "dp,fsdp_tp", "--dtype", "float32", "--batch", "16",
            "--seq", "32", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Recommendation" in text and "ranked by step time predicted on h100:1x8" in text
    record = json.loads((out / "compare.json").read_text())
    assert record["recommendation"]["candidate"] == "dp"
    assert {c["label"] for c in record["candidates"]} == {"dp", "fsdp_tp"}
    assert (out / "compare.png").stat().st_size > 10_000
    assert main(argv) == 2  # the folder holds a comparison now
    assert "pass --overwrite" in capsys.readouterr().err


def test_compare_api_refuses_before_anything_compiles(tmp_path, unchanged):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "compare.png").write_text("an earlier chart")
    with unchanged():
        for kwargs, match in [
            ({"batch": 0}, r"--batch 0: give a whole number >= 1"),
            ({"timed_steps": 0}, r"--timed-steps 0: give a whole number >= 1"),
            ({"warmup_steps": -1}, r"--warmup-steps -1: give a whole number >= 0"),
            ({"size": "13b"}, r"--size '13b': unknown llama size; sizes: tiny"),
            ({"dtype": "float16"}, r"--dtype 'float16': choose from float32, bfloat16"),
            ({"remat": "some"}, r"--remat 'some': choose from none, dots, full"),
            ({"memory_budget": -5}, r"--memory -5: give the memory per device"),
            ({"target": "h100:2x8"}, r"--target h100:2x8 has 16 devices but this process has 8"),
        ]:
            with pytest.raises(CompareArgumentError, match=match):
                compare(llama, **kwargs)
        with pytest.raises(CompareArgumentError, match=r"--seq 32: cnn tiny has no sequence axis"):
            compare(cnn, seq=32)
        with pytest.raises(ValueError, match=r"unknown target 'h900' \(did you mean 'h200'\?\)"):
            compare(llama, target="h900")
        with pytest.raises(
            OutputExistsError, match=r"already holds compare\.png; pass --overwrite"
        ):
            check_output(tmp_path / "old")
    assert check_output(tmp_path / "old", overwrite=True) == tmp_path / "old"


def test_compare_finds_the_cnn_hybrid_beside_pure_dp():
    """The guides' hybrid: convolutions data-parallel, the wide classifier split over tensor
    (dp_tp on the CNN), compiled beside pure dp: less traffic and less train state per device."""
    result = compare(cnn, strategies="dp,dp_tp", dtype="float32", batch=16, compiler="cpu")
    rows = {c.layout.strategy: c for c in result.candidates}
    hybrid, dp = rows["dp_tp"], rows["dp"]
    assert hybrid.mesh_sizes["tensor"] == 2 and hybrid.unit == "samples"
    assert result.settings.seq is None
    assert hybrid.collective_bytes < dp.collective_bytes
    assert hybrid.state_bytes < dp.state_bytes
    assert "weights tensor(2)" in hybrid.split
    # no closed form for the CNN: its memory-bound work is the optimizer update, and it says so
    assert dp.predicted_work.elementwise_bytes == 0
    assert any("charged at the matmul rate" in n for n in dp.predicted_work.notes)


def test_a_compiled_candidate_moves_the_closed_forms_elementwise_bytes():
    """compare prices the compiled program's FLOPs and collectives, and the non-matmul work by
    the closed form's count (the HLO of a CPU compile fuses otherwise than a GPU's)."""
    settings, tgt = Settings(16, 32), target("h100:1x8")
    cand, program = evaluate(Layout("fsdp", "fsdp=8"), _workload(), settings, tgt,
                             dtype="float32")  # fmt: skip
    pred = predict(llama, "tiny", "fsdp", {"fsdp": 8}, 16, 32, dtype="float32")
    work = cand.predicted_work
    assert work.elementwise_bytes == pred.elementwise_bytes > 0
    args = program.report().memory.argument
    assert work.memory_bound_bytes == 2 * args + pred.elementwise_bytes
    assert cand.predicted.memory_bound_s == pytest.approx(work.memory_bound_bytes / (3.35e12 * 0.8))
    assert any("the closed form's count" in n for n in work.notes)


@pytest.mark.slow
def test_profile_traces_each_measured_candidates_timed_steps(tmp_path):
    """--profile DIR: every measured candidate's timed steps in a jax.profiler trace of its own;
    asking for a trace with measuring off is refused before anything compiles or is written."""
    traces = tmp_path / "traces"
    result = compare(
        llama, strategies="dp", dtype="float32", profile=traces, timed_steps=2, compiler="cpu"
    )
    labels = [c.label for c in result.candidates]
    found = sorted(p.relative_to(traces).parts[0] for p in traces.rglob("*.xplane.pb"))
    assert len(found) == len(labels) == 1 and found[0].startswith("dp")
    assert all(c.measured_s for c in result.candidates)
    with pytest.raises(CompareArgumentError, match=r"--profile .* traces the measured steps, but "
                                                   r"--no-measure turns measuring off"):  # fmt: skip
        compare(llama, strategies="dp", profile=tmp_path / "other", measure=False)
    assert not (tmp_path / "other").exists()
    (tmp_path / "taken").write_text("")
    with pytest.raises(
        CompareArgumentError, match=r"--profile .*: .*taken is a file; give a folder"
    ):
        compare(llama, strategies="dp", profile=tmp_path / "taken" / "sub")


def test_a_pinned_accumulation_gathers_fsdp_weights_once_per_micro_step():
    """compare --accum 4: the fsdp candidate carries its 4 micro-steps, its compiled step
    gathers the layers' weights once per micro-step, and the closed form says the same bytes."""
    result = compare(
        llama,
        size="tiny",
        strategies="fsdp",
        mesh="fsdp=8",
        batch=32,
        seq=32,
        dtype="float32",
        remat="none",
        accum=4,
        measure=False,
        compiler="cpu",
    )
    [cand] = result.candidates
    assert cand.accum == 4 and "accum=4" in cand.label and cand.micro_batch == 1
    record = cand.to_dict()
    assert (record["global_batch"], record["micro_batch"], record["accum"]) == (32, 1, 4)
    gathered = sum(c["bytes"] for c in cand.collectives
                   if c["kind"] == "all-gather" and tuple(c["axes"]) == ("fsdp",))  # fmt: skip
    pred = predict(llama, "tiny", "fsdp", {"fsdp": 8}, 32, 32, accum=4)
    assert gathered == pred.collective_bytes("all-gather", "fsdp")
    once = predict(llama, "tiny", "fsdp", {"fsdp": 8}, 32, 32)
    layer = sum(t.bytes for t in once.traffic if t.what.startswith("layer weights"))
    assert gathered - once.collective_bytes("all-gather", "fsdp") == 3 * layer
    with pytest.raises(CompareArgumentError, match=r"--accum 3: give a whole number >= 1 that "
                                                   r"divides --batch 32"):  # fmt: skip
        compare(llama, size="tiny", strategies="fsdp", batch=32, accum=3, measure=False)


def test_a_pinned_micro_batch_sets_each_candidates_accumulation():
    """compare --micro-batch 2: every candidate runs 2 rows per device per forward pass, its
    accumulation following from its batch shards (dp over 8: 2 micro-steps of 16 rows;
    pp_fsdp on stage=2,fsdp=4 with 4 micro-batches of 2 rows per shard: 1 micro-step)."""
    result = compare(
        llama,
        size="tiny",
        strategies="dp,pp_fsdp",
        batch=32,
        seq=32,
        dtype="float32",
        remat="none",
        micro_batch=2,
        measure=False,
        compiler="cpu",
    )
    assert {c.micro_batch for c in result.candidates} == {2}
    accum = {c.layout.strategy: (c.accum, c.layout.mesh) for c in result.candidates}
    assert accum == {"dp": (2, "data=8"), "pp_fsdp": (1, "stage=2,fsdp=4")}
    for c in result.candidates:
        shards = c.layout.sizes["data"] * c.layout.sizes["fsdp"]
        assert c.micro_batch * c.accum * shards * (c.layout.microbatches or 1) == 32
    with pytest.raises(CompareArgumentError, match=r"--micro-batch 2: .*not with --accum 2"):
        compare(llama, size="tiny", strategies="dp", batch=32, micro_batch=2, accum=2)
