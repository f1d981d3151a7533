"""Programs from the target's own compiler: XLA:GPU compiling for compile-only H100s on this
CPU-only host (`sharding.targets.compiler_for`), the facts compare reads from them, and the
fallback to XLA:CPU that says so.

The exact figures were measured with jax 0.10.2 and jax-cuda12-plugin 0.10.2 (the `gpu` extra,
which the README's test command installs); another XLA may schedule otherwise, so they are
asserted there and the structure elsewhere."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from functools import cache

import jax
import pytest

from models import llama
from sharding import AttentionChoiceError, Workload, build_program
from sharding.comparison import (
    CompareArgumentError,
    NoStrategyFitsError,
    NothingMeasuredError,
    Settings,
    compare,
    evaluate,
)
from sharding.costmodel import Layout
from sharding.planning import PlanError, plan
from sharding.targets import (
    CHIPS,
    PROFILES,
    CompilerError,
    compiler_for,
    gpu_target_config,
    load_profile,
    target,
)

GPU = importlib.util.find_spec("jax_cuda12_plugin") is not None
TPU = importlib.util.find_spec("libtpu") is not None
needs_gpu = pytest.mark.skipif(not GPU, reason="XLA:GPU is not installed (pip install -e '.[gpu]')")
MEASURED = jax.__version__ == "0.10.2"  # the exact figures below
TINY = Workload.from_family(llama, llama.config("tiny"))


@cache
def _fsdp(platform: str):
    """llama tiny, fsdp=8, bfloat16, 32 x 128: compiled for H100s or for the simulated CPUs."""
    devices = compiler_for(target("h100:1x8"), "auto" if platform == "gpu" else "cpu")
    program = build_program(
        TINY,
        "fsdp",
        "fsdp=8",
        batch=32,
        seq=128,
        compute_dtype="bfloat16",
        devices=devices.device_list(),
    )
    return program, program.report()


def test_every_shipped_profile_names_a_chip_its_compiler_knows():
    assert {name: spec.chip for name, spec in PROFILES.items()} == {
        "h100": "h100",
        "h200": "h200",
        "b200": "b200",
        "a100": "a100",
        "h100-96gb-500w": "h100",
        "v5e": "v5e",
        "v5p": "v5p",
        "v6e": "v6e",
    }
    text = gpu_target_config(CHIPS["h100"], PROFILES["h100"].hbm_bytes, PROFILES["h100"].hbm_bw)
    for line in (
        "core_count: 132",
        "l2_cache_size: 52428800",
        "clock_rate_ghz: 1.98",
        f"device_memory_size: {80 * 2**30}",
        "memory_bandwidth: 3350000000000",
        'platform_version: "Compute Capability 9.0a"',
        'device_description_str: "NVIDIA H100 80GB HBM3"',
    ):
        assert line in text
    assert "collective_memory_granularity" not in text  # jaxlib 0.10.2's proto has no such field


@needs_gpu
@pytest.mark.parametrize(
    ("name", "count", "kind"),
    [
        ("h100:1x8", 8, "NVIDIA H100 80GB HBM3"),
        ("h100:2x8", 16, "NVIDIA H100 80GB HBM3"),
        ("a100", 8, "NVIDIA A100-SXM4-80GB"),
        ("h200", 8, "NVIDIA H200 141GB HBM3e"),
        ("b200", 8, "NVIDIA B200"),
    ],
)
def test_gpu_targets_get_compile_only_devices_of_their_chip(name, count, kind):
    c = compiler_for(target(name))
    assert (c.name, c.platform, c.count, c.device_kind, c.note) == (
        "XLA:GPU",
        "gpu",
        count,
        kind,
        None,
    )
    assert [d.platform for d in c.device_list()] == ["gpu"] * count
    assert jax.devices()[0].platform == "cpu"  # this process's own devices are untouched


def test_without_its_compiler_a_target_falls_back_to_xla_cpu_saying_so(tmp_path):
    if not TPU:
        c = compiler_for(target("v5e:2x4"))
        assert (c.name, c.count) == ("XLA:CPU", 8)
        assert "pip install 'spmdkit[tpu]'" in c.note
        with pytest.raises(CompilerError, match=r"XLA:TPU .* not installed.*spmdkit\[tpu\]"):
            compiler_for(target("v5e:2x4"), "target")
    profile = tmp_path / "mine.toml"
    profile.write_text(PROFILES["h100"].to_toml().replace('chip = "h100"\n', ""))
    c = compiler_for(target(str(profile)))
    assert c.name == "XLA:CPU" and "names no chip" in c.note and "chip = one of" in c.note
    assert compiler_for(target("h100"), "cpu").name == "XLA:CPU"
    with pytest.raises(CompilerError, match="--compiler 'gpu': choose auto"):
        compiler_for(target("h100"), "gpu")


@needs_gpu
def test_a_profile_naming_a_chip_compiles_as_it_with_its_own_memory(tmp_path):
    profile = tmp_path / "h100-96.toml"
    profile.write_text(PROFILES["h100"].to_toml().replace("hbm_gib = 80.0", "hbm_gib = 96"))
    assert load_profile(profile).chip == "h100"
    c = compiler_for(target(str(profile)))
    assert (c.name, c.device_kind) == ("XLA:GPU", "NVIDIA H100 80GB HBM3")


@needs_gpu
def test_the_h100_program_has_the_gpu_compilers_collectives_and_buffers():
    """XLA:GPU makes the fsdp gradient reductions reduce-scatters (XLA:CPU runs all-reduces and
    slices), runs them async, and its peak is the memory per device (no float32 copies)."""
    (gpu_program, gpu), (_, cpu) = _fsdp("gpu"), _fsdp("cpu")
    assert (gpu.platform, gpu.memory.platform, cpu.platform) == ("gpu", "gpu", "cpu")
    assert gpu.memory.widened == 0 and gpu.memory.needed == gpu.memory.peak
    assert "reduce-scatter" not in cpu.summary() and cpu.count("all-reduce") > 1
    # The H100 program runs cuDNN's flash attention (auto, bf16), whose causal mask skips the
    # tiles above the diagonal: per layer 7 matmuls of 2 B N S T H over (T + 1) / 2T of the
    # scores, where XLA:CPU's plain attention computes 6 over all of them (B 4, N 8, S T 128, H 8).
    full, causal = 2 * 4 * 8 * 128 * 128 * 8, 129 / 256
    assert gpu.matmul_flops == cpu.matmul_flops - 4 * (6 * full - round(7 * full * causal))
    assert "__cudnn$fmhaSoftmaxBackward" in gpu_program.compiled.as_text()
    text = gpu_program.compiled.as_text()
    assert "all-gather-start" in text and "reduce-scatter-start" in text
    if MEASURED:
        assert {k: (s.count, s.bytes) for k, s in gpu.summary().items()} == {
            "all-reduce": (1, 8),
            "all-gather": (9, 657536),
            "reduce-scatter": (4, 361600),
        }
        assert gpu.memory.peak == 14293860


@needs_gpu
def test_compare_prices_the_h100_program_and_says_which_compiler():
    result = compare(
        llama,
        strategies="fsdp",
        mesh="fsdp=8",
        dtype="bfloat16",
        batch=32,
        seq=128,
        remat="none",
        measure=False,
    )
    [cand] = result.candidates
    _, report = _fsdp("gpu")
    assert result.compiler.name == cand.compiler == "XLA:GPU"
    assert cand.allocated == report.memory.peak  # the same program's buffer assignment
    assert {c["kind"] for c in cand.collectives} == {"all-gather", "reduce-scatter", "all-reduce"}
    record = result.to_dict()
    assert record["compiler"]["name"] == "XLA:GPU" and record["compiler"]["note"] is None
    assert "compiled by XLA:GPU for 8 x NVIDIA H100 80GB HBM3" in str(result.table().renderables[0])
    assert any("as XLA for gpu compiled them" in a for a in result.assumptions)
    on_cpu = compare(
        llama,
        strategies="fsdp",
        mesh="fsdp=8",
        dtype="bfloat16",
        batch=32,
        seq=128,
        remat="none",
        measure=False,
        compiler="cpu",
    )
    assert on_cpu.compiler.name == on_cpu.candidates[0].compiler == "XLA:CPU"
    assert "reduce-scatter" not in {c["kind"] for c in on_cpu.candidates[0].collectives}


@needs_gpu
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_an_explicit_schedule_is_priced_from_the_h100_program_at_bfloat16(schedule):
    """XLA:GPU writes two-way conditionals on a predicate (the lanes are read from them) and
    would unroll the tick loop by two (a pipeline compiles without it); inside the stages'
    shard_map auto attention keeps blockwise (jax's cuDNN partitioning fails there)."""
    settings = Settings(32, 128, compiler=compiler_for(target("h100")))
    layout = Layout(
        "pp", "stage=2,data=4", schedule, 4, repeats=2 if schedule == "interleaved" else 1
    )
    cand, program = evaluate(layout, TINY, settings, target("h100"), dtype="bfloat16")
    assert cand.compiler == "XLA:GPU" and 0 < cand.bubble < 1
    assert cand.predicted_work.pipeline["busiest_device_flops"] > 0
    assert "__cudnn$fmha" not in program.compiled.as_text()


@needs_gpu
def test_cudnn_attention_is_checked_against_the_target_not_this_host():
    with pytest.raises(AttentionChoiceError, match=r"compiled for 'cpu'.*spmdkit\[gpu\]"):
        compare(llama, strategies="dp", attention="cudnn", compiler="cpu", measure=False)
    with pytest.raises(
        CompareArgumentError, match=r"--compiler 'gpu': choose auto \(the target's compiler"
    ):
        compare(llama, strategies="dp", compiler="gpu")
    devices = compiler_for(target("h100")).device_list()
    program = build_program(
        TINY,
        "dp",
        "data=8",
        batch=16,
        seq=128,
        compute_dtype="bfloat16",
        attention="cudnn",
        devices=devices,
    )
    assert "__cudnn$fmha" in program.compiled.as_text()


@needs_gpu
def test_a_layout_whose_h100_peak_exceeds_the_memory_is_refused_with_both_figures(tmp_path):
    """XLA:GPU compiles a program larger than the device without complaint: compare checks
    its peak against the budget (90% of the profile's HBM) and names both."""
    profile = tmp_path / "small.toml"
    profile.write_text(PROFILES["h100"].to_toml().replace("hbm_gib = 80.0", "hbm_gib = 0.01"))
    with pytest.raises(
        NoStrategyFitsError,
        match=r"no candidate fits 9.\d+ MiB per device on .*"
        r"small.toml:1x8; the least, .* needs \d+\.\d+ MiB",
    ):
        compare(
            llama,
            target=str(profile),
            strategies="dp",
            dtype="bfloat16",
            remat="none",
            batch=32,
            seq=128,
            measure=False,
        )


@needs_gpu
def test_plan_checks_its_top_layout_against_the_h100_program_at_bfloat16():
    """XLA:CPU checks a bfloat16 plan at float32; the target's compiler checks it as asked."""
    result = plan(llama, size="tiny", target="h100:1x8", batch=32, seq=128, aot=1, top=3)
    [checked] = [c for c in result.ranked if c.check is not None]
    assert (checked.check.dtype, checked.check.compiled.compiler) == ("bfloat16", "XLA:GPU")
    assert not any("checked at float32" in n for n in result.notes)
    on_cpu = plan(
        llama, size="tiny", target="h100:1x8", batch=32, seq=128, aot=1, top=3, compiler="cpu"
    )
    [checked] = [c for c in on_cpu.ranked if c.check is not None]
    assert (checked.check.dtype, checked.check.compiled.compiler) == ("float32", "XLA:CPU")
    with pytest.raises(PlanError, match=r"--compiler 'gpu': choose auto \(.*\) or cpu \(XLA:CPU\)"):
        plan(llama, size="tiny", compiler="gpu")


@needs_gpu
def test_the_benchmark_tables_every_strategy_from_both_compilers_and_the_closed_form(tmp_path):
    from benchmarks import target_compile

    assert (
        target_compile.main(
            [
                "--size",
                "tiny",
                "--layers",
                "2",
                "--seq",
                "32",
                "--batch",
                "16",
                "--strategies",
                "fsdp",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "target_compile.json").read_text())
    rows = {r["strategy"]: r for r in record["rows"]}
    assert set(rows) == {"fsdp"}
    assert "reduce-scatter" in rows["fsdp"]["gpu"]["collectives"]
    assert "reduce-scatter" not in rows["fsdp"]["cpu"]["collectives"]
    assert "reduce-scatter" in rows["fsdp"]["closed"]["collectives"]
    assert all(r[k]["memory"] > 0 for r in rows.values() for k in ("gpu", "cpu", "closed"))


needs_tpu = pytest.mark.skipif(not TPU, reason="libtpu is not installed (pip install -e '.[tpu]')")


@needs_tpu
@pytest.mark.parametrize(
    ("name", "kind"), [("v5e:2x4", "TPU v5 lite"), ("v5p:8", "TPU v5"), ("v6e:2x4", "TPU v6 lite")]
)
def test_tpu_targets_compile_with_libtpu(name, kind):
    c = compiler_for(target(name), "target")
    assert (c.name, c.platform, c.device_kind, c.count) == ("XLA:TPU", "tpu", kind, 8)
    program = build_program(
        TINY, "fsdp", "fsdp=8", batch=32, seq=128, compute_dtype="bfloat16", devices=c.device_list()
    )
    report = program.report()
    assert report.platform == "tpu" and report.memory.needed == report.memory.peak > 0
    assert report.count("all-gather") > 0


@needs_tpu
def test_libtpu_refuses_a_program_larger_than_hbm_and_compare_says_so():
    """Unlike XLA:GPU, libtpu refuses a program that does not fit the chip (16 GiB on a v5e):
    Llama-3-8B's width at 4 layers replicated (1.4B parameters, 22 GB of float32 state) is
    skipped with the compiler's own words, at every remat policy asked."""
    wide = Workload.from_family(llama, dataclasses.replace(llama.config("8b"), n_layers=4))
    with pytest.raises(NothingMeasuredError, match="every layout was skipped") as refused:
        compare(
            wide,
            target="v5e:8",
            strategies="dp",
            dtype="bfloat16",
            batch=8,
            seq=1024,
            remat="none",
            measure=False,
            memory_budget="1TB",
        )
    [skipped] = refused.value.comparison.skipped
    assert skipped.reason.startswith("CompilerRefusedError: XLA:TPU refused it at every remat")
    assert "RESOURCE_EXHAUSTED" in skipped.reason


@needs_gpu
def test_the_gpu_program_keeps_dp_reductions_in_the_accumulation_loop_and_is_priced_so():
    """step_time assumed, for a CPU program priced on a GPU, that XLA:GPU moves dp's gradient
    all-reduces out of the accumulation loop (WhileLoopAllReduceCodeMotion) and divided them
    by the micro-steps. The H100 program of spmdkit's step shows it does not: its all-reduces
    run every micro-step (more of them than XLA:CPU's, which combines otherwise), and a target
    program is priced as it shows, with no such correction."""
    counts = {}
    for choice in ("auto", "cpu"):
        devices = compiler_for(target("h100"), choice).device_list()
        program = build_program(
            TINY,
            "dp",
            "data=8",
            batch=32,
            seq=128,
            accum_steps=4,
            compute_dtype="bfloat16",
            devices=devices,
        )
        counts[choice] = program.report().count("all-reduce", "data")
    assert counts["auto"] >= 4 and counts["cpu"] % 4 == 0
    if MEASURED:
        assert (counts["auto"], counts["cpu"]) == (25, 20)
    settings = Settings(32, 128, compiler=compiler_for(target("h100")))
    cand, _ = evaluate(
        Layout("dp", "data=8"), TINY, settings, target("h100"), dtype="bfloat16", accum=4
    )
    [reduce] = [c for c in cand.predicted.collectives if c.kind == "all-reduce"]
    assert reduce.count == counts["auto"]  # as compiled: not divided by the micro-steps
