"""`spmdkit plan`: ranking layouts from the cost model, checked against AOT compiles."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
from rich.console import Console

from models import llama
from sharding import costmodel
from sharding.cli import plan
from sharding.costmodel import (
    DEFAULT_SIZES,
    PROFILES,
    CostModelError,
    NoFittingStrategyError,
    candidates,
    compile_candidate,
    meshes,
)

H100 = PROFILES["h100-80gb"]
GB = 10**9


def test_meshes_are_every_factorisation_over_the_four_axes():
    found = meshes(8)
    assert len(found) == 20  # 3 factors of 2 over 4 axes: C(3 + 3, 3)
    assert all(math.prod(m.values()) == 8 for m in found)
    assert len({tuple(m.values()) for m in found}) == 20


def test_70b_on_512_h100s_names_fitting_strategies():
    # How long the search takes is measured by benchmarks/plan_time.py, not asserted here.
    ranked = candidates(llama, "70b", 512, 512, 4096, memory_bytes=80 * GB, profile=H100)
    fitting = [c for c in ranked if c.fits]
    assert fitting and ranked[: len(fitting)] == fitting
    assert all(c.prediction.memory_bytes <= 80 * GB for c in fitting)
    assert [c.step_s for c in fitting] == sorted(c.step_s for c in fitting)
    # Replicating 70B parameters with Adam state cannot fit on one device: dp never fits.
    assert not any(c.prediction.strategy == "dp" for c in fitting)
    assert {c.prediction.strategy for c in fitting} & {"fsdp_tp", "pp_tp", "pp_fsdp", "fsdp"}


def test_7b_prediction_is_within_10_percent_of_an_aot_compile():
    # A 2-layer 7b keeps the per-layer shapes (d_model 4096, 32 heads, d_ff 11008, vocab 32000)
    # and compiles in seconds from abstract shapes; nothing is allocated.
    cfg = dataclasses.replace(llama.config("7b"), n_layers=2)
    ranked = candidates(llama, cfg, 8, 8, 1024, memory_bytes=80 * GB, profile=H100)
    for c in ranked[:2]:
        compile_candidate(c, llama, cfg)
        assert c.compiled_memory is not None
        assert c.prediction.memory_bytes == pytest.approx(c.compiled_memory, rel=0.10), (
            c.prediction.strategy,
            c.mesh_text,
        )


def test_a_model_that_fits_nowhere_says_the_memory_it_needs():
    with pytest.raises(
        NoFittingStrategyError, match=r"smallest per-device memory any layout needs is [\d.]+ GiB"
    ):
        candidates(llama, "70b", 8, 8, 4096, memory_bytes=10 * GB, profile=H100)


def test_unknown_strategy_names_the_known_ones():
    with pytest.raises(CostModelError, match=r"unknown strategies \['zero'\]; known: dp"):
        candidates(llama, "tiny", 8, 8, 32, strategies=("zero",), memory_bytes=GB,
                   profile=H100)  # fmt: skip


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="spmdkit")
    plan.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def test_cli_prints_json_with_compiled_memory_beside_predicted(capsys):
    rc = _cli(["--model", "gpt2", "--size", "tiny", "--devices", "8", "--seq", "64",
               "--strategies", "dp,fsdp,tp", "--aot", "1", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    best = out["candidates"][0]
    assert best["fits"] and best["compiled_memory_bytes"] > 0
    assert {c["strategy"] for c in out["candidates"]} <= {"dp", "fsdp", "tp", "dp_tp"}
    assert any("step time" in line for line in out["assumptions"])


def test_cli_table_for_sizes_that_cannot_run_here(capsys):
    assert _cli(["--size", "70b", "--devices", "512", "--memory", "80GB", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "on 512 devices" in text and "yes" in text and "h100-80gb" in text


def test_cli_gpt2_without_size_takes_the_family_default(capsys):
    assert _cli(["--model", "gpt2", "--aot", "0", "--top", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "gpt2" and out["size"] == DEFAULT_SIZES["gpt2"] == "1.5b"
    assert len(out["candidates"]) == 2 and out["candidates"][0]["fits"]


def test_plan_api_overrides_layers_and_notes_a_skipped_aot():
    # This process holds 8 devices, so an AOT compile for 16 is skipped, and says so.
    result = costmodel.plan(llama, size="tiny", devices=16, seq=32, layers=2, strategies="dp,fsdp,pp",
                  aot=1, top=3)  # fmt: skip
    assert result.layers == 2 and result.batch == 16 and len(result.shown) == 3
    assert all(c.layout.mesh == c.mesh_text for c in result.ranked)
    assert {c.prediction.strategy for c in result.ranked} == {"dp", "fsdp", "pp"}
    assert "AOT skipped: 8 devices here, not 16" in result.to_dict()["assumptions"]
    assert json.loads(result.to_json())["layers"] == 2
    console = Console(width=200, record=True)
    console.print(result.table())
    text = console.export_text()
    assert "llama tiny (2 layers) on 16 devices" in text and "AOT skipped" in text
