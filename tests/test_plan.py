"""`spmdkit plan` on targets: the closed-form search priced by the one step-time model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
from rich.console import Console

from models import gpt2, llama
from sharding import Workload, costmodel, planning
from sharding.cli import plan
from sharding.costmodel import (
    DEFAULT,
    CostModelError,
    NoFittingStrategyError,
    candidates,
    expected_error,
    meshes,
    predict,
    step_time,
    work_from_prediction,
)
from sharding.planning import DEFAULT_SIZES, check_candidate
from sharding.targets import PROFILES, target

GB = 10**9


def test_meshes_are_every_factorisation_over_the_four_axes():
    found = meshes(8)
    assert len(found) == 20  # 3 factors of 2 over 4 axes: C(3 + 3, 3)
    assert all(math.prod(m.values()) == 8 for m in found)
    assert len({tuple(m.values()) for m in found}) == 20


def test_70b_on_64_nodes_of_8_h100s_names_fitting_strategies():
    # How long the search takes is measured by benchmarks/plan_time.py, not asserted here.
    ranked = candidates(llama, "70b", "h100:64x8", 512, 4096)
    fitting = [c for c in ranked if c.fits]
    assert fitting and ranked[: len(fitting)] == fitting
    budget = costmodel.MEMORY_FRACTION * PROFILES["h100"].hbm_bytes  # as step_time counts a fit
    assert all(c.memory_bytes <= budget and c.predicted.fits for c in fitting)
    assert [c.step_s for c in fitting] == sorted(c.step_s for c in fitting)
    assert all(c.predicted.devices == 512 and c.predicted.target == "h100:64x8" for c in ranked)
    # Replicating 70B parameters with Adam state cannot fit on one device: dp never fits.
    assert not any(c.layout.strategy == "dp" for c in fitting)
    assert {c.layout.strategy for c in fitting} & {"fsdp_tp", "pp_tp", "pp_fsdp", "fsdp"}
    # An fsdp group across nodes carries the guides' cross-switch warning.
    wide = next(c for c in ranked if c.layout.sizes["fsdp"] == 512)
    assert any(w.startswith("fsdp=512 spans 64 nodes") for w in wide.predicted.warnings)


def test_every_estimate_is_step_time_of_its_prediction():
    """One model for compare and plan: the search's figure is `step_time` of the prediction."""
    ranked = candidates(gpt2, "tiny", "a100:2x4", 16, 64, strategies="fsdp,tp,pp")
    useful = predict(gpt2, gpt2.config("tiny"), "dp", {}, 16, 64, dtype="bfloat16").matmul_flops
    for c in ranked:
        again = step_time(work_from_prediction(c.prediction, model_flops=useful), "a100:2x4")
        assert again.step_s == c.step_s and again.mfu == c.predicted.mfu
        assert c.collective_bytes == c.prediction.collective_bytes()
    assert {c.remat for c in ranked} == {"none", "dots", "full"}  # every policy searched
    assert {c.layout.schedule for c in ranked if c.layout.strategy == "pp"} == {
        "gpipe", "1f1b", "interleaved", "zb-h1"}  # fmt: skip


def test_memory_fits_against_the_targets_hbm_or_the_given_budget():
    on_h100 = candidates(llama, "7b", "h100:1x8", 8, 1024, strategies="dp,fsdp")
    on_a100_40 = candidates(llama, "7b", "a100:1x8", 8, 1024, strategies="dp,fsdp",
                            memory_bytes=40 * GB)  # fmt: skip
    assert sum(c.fits for c in on_a100_40) < sum(c.fits for c in on_h100)
    assert all(c.memory_bytes <= 40 * GB for c in on_a100_40 if c.fits)


def test_a_model_that_fits_nowhere_says_the_memory_it_needs():
    with pytest.raises(
        NoFittingStrategyError,
        match=r"fits no strategy on h100:1x8 at 9.31 GiB per device: the smallest per-device "
        r"memory any layout needs is [\d.]+ GiB .*--target, --memory",
    ):
        candidates(llama, "70b", "h100:1x8", 8, 4096, memory_bytes=10 * GB)


def test_unknown_strategy_names_the_known_ones():
    with pytest.raises(CostModelError, match=r"unknown strategies \['zero'\]; known: dp"):
        candidates(llama, "tiny", "h100:1x8", 8, 32, strategies=("zero",))


def test_7b_memory_prediction_is_within_10_percent_of_an_aot_compile():
    # A 2-layer 7b keeps the per-layer shapes (d_model 4096, 32 heads, d_ff 11008, vocab 32000)
    # and compiles in seconds from abstract shapes; nothing is allocated.
    cfg = dataclasses.replace(llama.config("7b"), n_layers=2)
    work = Workload.from_family(llama, cfg)
    ranked = candidates(llama, cfg, "h100:1x8", 8, 1024, strategies="fsdp,fsdp_tp",
                        dtype="float32")  # fmt: skip
    for c in ranked[:2]:
        check = check_candidate(c, work, "h100:1x8")
        assert check.compiled.allocated is not None
        assert check.errors()["memory_bytes"] == pytest.approx(0, abs=0.10), (c.label, c.mesh_text)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="spmdkit")
    plan.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def test_cli_json_shows_the_compiled_program_beside_the_formula(capsys):
    rc = _cli(
        [
            "--model",
            "gpt2",
            "--size",
            "tiny",
            "--seq",
            "64",
            "--strategies",
            "dp,fsdp,tp",
            "--aot",
            "1",
            "--json",
            "--compiler",
            "cpu",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target"]["name"] == "h100:1x8" and out["devices"] == 8 and out["batch"] == 8
    assert out["dtype"] == "bfloat16" and out["source"] == "formula"
    best = out["candidates"][0]
    assert best["fits"] and best["check"] is not None and best["check"]["dtype"] == "float32"
    assert {c["strategy"] for c in out["candidates"]} <= {"dp", "fsdp", "tp", "dp_tp"}
    [checked] = out["checked"]
    assert checked["rank"] == 1 and checked["compiled"]["memory_bytes"] > 0
    for key in ("collective_bytes", "matmul_flops"):
        assert abs(checked["error"][key]) <= 0.10, (key, checked)
    assert any("checked at float32 on this CPU host" in line for line in out["assumptions"])
    assert any(line.startswith("Matmuls run at 60% of the dense bfloat16 peak")
               for line in out["assumptions"])  # fmt: skip


def test_cli_table_for_a_target_that_cannot_run_here(capsys):
    assert _cli(["--size", "70b", "--target", "h100:64x8", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "llama 70b (80 layers) on h100:64x8 (512 devices" in text and "yes" in text
    assert "formula vs compiled" not in text  # 512 devices: nothing compiled
    assert "Target h100:64x8: 512 x h100 on 64 nodes of 8" in text


def test_cli_gpt2_without_size_takes_the_family_default(capsys):
    assert _cli(["--model", "gpt2", "--aot", "0", "--top", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "gpt2" and out["size"] == DEFAULT_SIZES["gpt2"] == "1.5b"
    assert len(out["candidates"]) == 2 and out["candidates"][0]["fits"]
    assert out["checked"] == []


def test_plan_api_overrides_layers_and_notes_a_skipped_aot():
    # This process holds 8 devices, so an AOT compile for 16 is skipped, and says so.
    result = planning.plan(llama, size="tiny", target="h100:2x8", seq=32, layers=2,
                            strategies="dp,fsdp,pp", aot=1, top=3)  # fmt: skip
    assert result.layers == 2 and result.batch == 16 and len(result.shown) == 3
    assert result.devices == 16 and result.target.nodes == 2
    assert {c.layout.strategy for c in result.ranked} == {"dp", "fsdp", "pp"}
    assert "AOT skipped: 8 devices here, not 16" in result.to_dict()["assumptions"]
    assert json.loads(result.to_json())["layers"] == 2
    # the error to expect, from the published runs of the top layout's kind
    top = result.ranked[0]
    said = [a for a in result.assumptions if a.startswith("Expected error")]
    assert said == [expected_error(top.layout.sizes).sentence()]
    console = Console(width=200, record=True)
    console.print(result.table())
    text = console.export_text()
    assert "llama tiny (2 layers) on h100:2x8 (16 devices" in text and "AOT skipped" in text


def test_plan_takes_a_shipped_workload_and_a_toml_target(tmp_path):
    spec = dataclasses.replace(PROFILES["h100"], name="half-h100", peak_bf16=494.7e12)
    (tmp_path / "half.toml").write_text(spec.to_toml())
    work = Workload.from_family(gpt2, gpt2.config("tiny"))
    slow = planning.plan(work, target=f"{tmp_path / 'half.toml'}:1x8", seq=64, aot=0, top=1)
    fast = planning.plan(work, target=target("h100:1x8"), seq=64, aot=0, top=1)
    assert slow.model == fast.model == "gpt2" and slow.target.device.name == "half-h100"
    assert slow.shown[0].predicted.compute_s > fast.shown[0].predicted.compute_s


# --- the global batch as micro-steps -----------------------------------------------------------


def test_nvidias_llama3_8b_batch_plans_as_micro_steps(capsys):
    """NVIDIA's recipe trains Llama 3 8B at 128 x 8192 on 8 H100s with micro-batch 1 and 16 x
    accumulation over 8 data shards; the whole batch at once fits nowhere (215 GiB at best)."""
    assert _cli(["--size", "3-8b", "--batch", "128", "--seq", "8192", "--aot", "0",
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    best = out["candidates"][0]
    assert best["fits"] and best["global_batch"] == 128
    assert best["accum"] > 1 and best["micro_batch"] >= 1
    shards = math.prod(best["mesh"][a] for a in ("data", "fsdp", "expert"))
    m = best["pipeline"]["microbatches"] if best["pipeline"] else 1
    assert best["micro_batch"] * best["accum"] * shards * m == 128
    assert f"--accum {best['accum']}" in out["train_command"]
    assert out["train_command"].startswith(f"spmdkit train --model llama --size 3-8b "
                                           f"--strategy {best['strategy']} --mesh ")  # fmt: skip


def test_llama3_70b_on_8_nodes_plans_at_its_published_batch():
    ranked = candidates(llama, "3-70b", "h100:8x8", 128, 8192)
    assert ranked[0].fits and ranked[0].prediction.batch == 128


def test_llama31_405b_on_576_gpus_fits_as_fsdp_tensor_and_pipeline():
    """Llama 3.1 405B at 252 x 8192 on 72 nodes of 8 H100 fits no named strategy (the best,
    pp_tp, its optimizer state split over stage and tensor only, needs just over 72 GiB); the
    compositions plan searches beside them (fsdp+tp+pp, and at 8K tokens fsdp+tp+sp+cp+pp)
    split it over fsdp as well."""
    ranked = candidates(llama, "3.1-405b", "h100:72x8", 252, 8192)
    best = ranked[0]
    assert best.fits and best.layout.strategy in ("fsdp+tp+pp", "fsdp+tp+sp+cp+pp")
    assert best.prediction.batch == 252
    three = candidates(llama, "3.1-405b", "h100:72x8", 252, 8192, strategies=("fsdp+tp+pp",))
    assert three[0].fits and three[0].layout.sizes["tensor"] == 8
    # the nearest named one: pp_tp on 72 uneven stages of 1 or 2 layers, just over the budget
    with pytest.raises(NoFittingStrategyError, match=r"needs is 72.01 GiB \(pp_tp 1f1b m=84 "
                       r"uneven on stage=72,tensor=8"):  # fmt: skip
        candidates(llama, "3.1-405b", "h100:72x8", 252, 8192, strategies=DEFAULT)


def test_accumulation_and_micro_batch_can_be_pinned():
    pinned = candidates(llama, "tiny", "h100:1x8", 64, 128, accum=4)
    assert {c.accum for c in pinned} == {4}
    rows = candidates(llama, "tiny", "h100:1x8", 64, 128, micro_batch=2)
    assert {c.micro_batch for c in rows} == {2}
    with pytest.raises(
        CostModelError,
        match=r"--accum 0: give a whole number >= 1 \(or leave it out to search it\)",
    ):
        planning.plan(llama, size="tiny", accum=0)
    with pytest.raises(CostModelError, match=r"accum=3: .*divides the global batch 64"):
        predict(llama, "tiny", "fsdp", {"fsdp": 8}, 64, 128, accum=3)


def test_the_printed_train_command_trains(capsys, tmp_path, monkeypatch):
    """plan's first row, run by `spmdkit train` with exactly the flags plan printed."""
    from sharding.cli import main

    monkeypatch.chdir(tmp_path)
    assert _cli(["--model", "llama", "--size", "tiny", "--batch", "16", "--seq", "32", "--accum",
                 "2", "--aot", "0", "--top", "1", "--json"]) == 0  # fmt: skip
    flags = json.loads(capsys.readouterr().out)["train_command"].removeprefix("spmdkit ").split()
    assert flags[0] == "train" and "--accum" in flags and "2" in flags
    assert main([*flags, "--steps", "1", "--dtype", "float32"]) == 0
