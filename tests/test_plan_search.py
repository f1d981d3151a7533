"""`spmdkit plan`'s search over compositions: every factorisation of the devices over the axes a
strategy uses, pipelines with uneven stages where the layers do not divide, the every-split
composition at long sequences, and a record of each layout searched and not priced, with why."""

from __future__ import annotations

import dataclasses
import json

import pytest
from rich.console import Console

import models
from sharding.cli import main
from sharding.costmodel import candidates, layouts, strategy_names
from sharding.planning import plan

STRATEGIES = ("fsdp_tp", "fsdp+tp+sp+cp+pp")


@pytest.fixture(scope="module")
def planned():
    """Llama 3.1 405B on 32 nodes of 8 H100s at 8K tokens: 126 layers, no power of 2 divides."""
    return plan(models.llama, size="3.1-405b", target="h100:32x8", batch=256, seq=8192, aot=0,
                strategies=STRATEGIES)  # fmt: skip


def test_pipelines_with_uneven_stages_are_searched(planned):
    uneven = [c for c in planned.ranked if c.layout.stage_layers == "auto"]
    assert uneven and all(126 % c.layout.sizes["stage"] for c in uneven)
    assert all(c.prediction.pipeline["stage_layers"] for c in uneven)
    stages = uneven[0].prediction.pipeline["stage_layers"]
    assert sum(stages) == 126 and max(stages) - min(stages) == 1


def test_every_rejected_layout_says_why(planned):
    searched = planned.to_dict()["searched"]
    assert searched["rejected"] and all(r["reason"] for r in searched["rejected"])
    reasons = {r["mesh"]: r["reason"] for r in searched["rejected"]}
    assert reasons["fsdp=16,tensor=16"] == ("tensor=16 spans nodes of 8: its per-layer "
                                            "reductions would cross the inter-node links")  # fmt: skip


def test_tensor_groups_that_straddle_nodes_are_pruned_by_the_topology(tmp_path):
    """Nodes of 6: tensor=4 fits under the node size, but its second group holds devices 4-7,
    two on each node; the search asks the topology, not the sizes, and leaves tensor=2 in."""
    profile = tmp_path / "six.toml"
    profile.write_text(
        "peak_tflops_bf16 = 100\npeak_tflops_f32 = 50\nhbm_gib = 80\nhbm_gb_per_s = 1000\n"
        "devices_per_node = 6\nintra_node_gb_per_s = 100\nintra_node_latency_us = 1\n"
        "inter_node_gb_per_s = 10\ninter_node_latency_us = 5\n"
    )
    rejected = []
    ranked = candidates(models.llama, "tiny", f"{profile}:2x6", 24, 64, strategies="tp",
                        rejected=rejected)  # fmt: skip
    reasons = {r["mesh"]: r["reason"] for r in rejected}
    assert reasons["data=3,tensor=4"] == ("tensor=4 spans nodes of 6: its per-layer reductions "
                                          "would cross the inter-node links")  # fmt: skip
    assert {c.layout.mesh for c in ranked} == {"data=6,tensor=2"}


def test_layouts_the_rules_or_layers_cannot_take_are_listed_with_the_error():
    rejected = []
    candidates(models.llama, "tiny", "h100:2x8", 32, 128, strategies=("dp_tp", "pp"),
               rejected=rejected)  # fmt: skip
    reasons = {(r["layout"], r["mesh"]): r["reason"] for r in rejected}
    assert reasons[("pp (pipelined)", "stage=8,data=2")] == (
        "4 layers on stage=8: every stage needs a layer")  # fmt: skip
    assert reasons[("dp_tp", "data=2,tensor=8")].startswith(
        "cannot place 2 of 12 parameters on mesh stage=1,data=2,fsdp=1,expert=1,context=1,"
        "tensor=8: IndivisibleDimensionError")  # fmt: skip


def test_the_train_command_runs_the_best_layout_with_even_stages(planned):
    # here the best layout has even stages (none): both commands run it
    best = planned.ranked[0]
    data = planned.to_dict()
    assert best.layout.stage_layers is None
    assert data["train_command"] == data["train_command_even_stages"] == planned.train_command(1)
    assert data["train_command"].startswith(
        f"spmdkit train --model llama --size 3.1-405b --strategy {best.layout.strategy} "
        f"--mesh {best.layout.mesh} --batch 256 --seq 8192 --accum {best.accum}")  # fmt: skip
    # with an uneven layout ranked first, train cannot run it: the best even one's command
    rank, uneven = next((i, c) for i, c in enumerate(planned.ranked, 1) if c.layout.stage_layers)
    assert planned.train_command(rank) is None
    first = dataclasses.replace(planned, ranked=[uneven, *planned.ranked])
    assert first.to_dict()["train_command"] is None
    assert first.to_dict()["train_command_even_stages"] == planned.train_command(1)


def test_the_every_split_composition_is_searched_at_long_sequences():
    at_long = candidates(models.llama, "tiny", "h100:2x8", 32, 4096)
    assert any(c.layout.strategy == "fsdp+tp+sp+cp+pp" for c in at_long)
    short = candidates(models.llama, "tiny", "h100:2x8", 32, 1024)
    assert not any(c.layout.strategy == "fsdp+tp+sp+cp+pp" for c in short)


def test_pipeline_meshes_the_batch_cannot_fill_are_listed():
    rejected = []
    layouts(16, 4, strategies="pp", search=True, batch=12, rejected=rejected)
    reasons = {r["mesh"]: r["reason"] for r in rejected}
    assert reasons["stage=2,data=8"] == (
        "the global batch 12 does not split over data x fsdp x expert = 8")  # fmt: skip
    assert reasons["stage=4,data=4"] == ("the batch's 3 rows per data x fsdp x expert shard do "
                                         "not split into at least stage=4 micro-batches")  # fmt: skip


def test_any_composition_can_be_named():
    assert strategy_names("dp,cp+pp,fsdp+tp+sp+cp+pp") == ["dp", "pp_cp", "fsdp+tp+sp+cp+pp"]
    # compare's shape for a composition without a table entry: 2 on every axis it splits
    assert [x.mesh for x in layouts(32, 4, strategies="fsdp+tp+sp+cp+pp")] == [
        "stage=2,data=2,fsdp=2,context=2,tensor=2"]  # fmt: skip


def test_plan_json_lists_the_search(planned, capsys):
    assert main(["plan", "--model", "llama", "--size", "3.1-405b", "--target", "h100:32x8",
                 "--batch", "256", "--seq", "8192", "--aot", "0", "--strategies",
                 ",".join(STRATEGIES), "--json"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["searched"] == planned.to_dict()["searched"]
    assert data["searched"]["priced"] > 0 and data["searched"]["rejected"]
    console = Console(width=200, record=True)
    console.print(planned.table())
    assert "rejected, each with its reason in --json" in " ".join(console.export_text().split())
