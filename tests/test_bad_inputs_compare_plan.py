"""Bad input to `spmdkit compare` and `spmdkit plan`: refused up front, exit 2, no traceback, the
value and a flag that exists named, and nothing created or changed (compare's --out included).

Every row runs in a folder holding a file ``taken`` and a finished comparison ``done/``; rows
with another device count than this process's 8 run in a fresh interpreter.
"""

from __future__ import annotations

import pytest

ROWS = [
    # compare: step counts, sizes and numbers out of range
    ("compare --timed-steps 0", r"--timed-steps: 0 must be >= 1"),
    ("compare --timed-steps -3", r"--timed-steps: -3 must be >= 1"),
    ("compare --warmup-steps -1", r"--warmup-steps: -1 must be >= 0"),
    ("compare --steps 8", r"--steps: renamed: use --timed-steps 8"),
    ("compare --warmup 2", r"--warmup: renamed: use --warmup-steps 2"),
    ("compare --batch 0", r"--batch: 0 must be >= 1"),
    ("compare --seq 0", r"--seq: 0 must be >= 1"),
    (
        "compare --seq 8192",
        r"--seq 8192: llama tiny holds at most 4096 positions; use --seq 4096 or less, or a "
        r"--size that holds 8192: 1b, 8b, 8b-128k, 3-8b, 3-70b, 3.1-405b$",
    ),
    ("compare --memory 80i", r"--memory '80i': cannot read '80i' as a size.*'80GB'"),
    ("compare --memory 0", r"--memory '0': give the memory per device.*--memory 80GB"),
    ("compare --micro-batch 2 --accum 2", r"--micro-batch 2: .*not with --accum 2"),
    (
        "compare --peak-tflops 989",
        r"--peak-tflops: renamed: use --target with a TOML device "
        r"profile \(peak_tflops_bf16 = 989\)",
    ),
    (
        "compare --devices 16",
        r"--devices: renamed: use --target DEVICE:NODESxPER_NODE, e\.g\. "
        r"--target h100:1x16",
    ),
    (
        "compare --target h900",
        r"unknown target 'h900' \(did you mean 'h200'\?\); known devices: "
        r"h100, h200, b200, a100, h100-96gb-500w, v5e, v5p, v6e",
    ),
    ("compare --target h100:3x9", r"a h100 node holds at most 8 devices"),
    ("compare --dtype fp8", r"--dtype 'fp8': choose from float32, bfloat16"),
    ("compare --remat all", r"--remat 'all': choose from none, dots, full"),
    # compare: what to measure, and where the results go
    ("compare --strategies dp,zero3", r"--strategies 'dp,zero3': unknown strategies \['zero3'\]"),
    ("compare --model cnn --seq 32", r"--seq 32: cnn tiny has no sequence axis.*drop --seq"),
    ("compare --size 7x", r"--size '7x': unknown llama size; sizes: tiny, maxtext-tiny, 1b"),
    ("compare --out taken", r"--out 'taken' is a file; .* give a folder path, e.g. --out"),
    ("compare --out taken/sub", r"--out 'taken/sub': 'taken' is a file, not a folder"),
    (
        "compare --out done",
        r"--out 'done' already holds compare\.json and compare\.png; pass --overwrite",
    ),
    (
        "compare --strategies pp_tp --target h100:1x2",
        r"--strategies pp_tp: none of them has a "
        r"layout on 2 devices",
    ),
    # plan
    ("plan --layers 0", r"--layers: 0 must be >= 1"),
    ("plan --top 0", r"--top: 0 must be >= 1"),
    ("plan --devices 16", r"--devices: renamed: use --target h100:2x8"),
    ("plan --device-kind a100-80gb", r"--device-kind: renamed: use --target a100:1x8"),
    ("plan --target h100:3x9", r"target 'h100:3x9': a h100 node holds at most 8 devices"),
    ("plan --target tpu9", r"unknown target 'tpu9'.*known devices: h100"),
    ("plan --batch 0", r"--batch: 0 must be >= 1"),
    ("plan --seq 0", r"--seq: 0 must be >= 1"),
    ("plan --seq 99999", r"--seq 99999: llama 7b holds at most 4096 positions; use --seq 4096"),
    (
        "plan --size 70b --seq 8192",
        r"--seq 8192: llama 70b holds at most 4096 positions; use --seq 4096 or less, or --size "
        r"3-70b \(same layers and width; holds 8192\)$",
    ),
    (
        "plan --model gpt2 --size 124m --seq 4096",
        r"holds at most 1024 positions; use --seq 1024 "
        r"or less$",
    ),
    ("plan --aot -1", r"--aot: -1 must be >= 0"),
    ("plan --size 13b", r"--size '13b': unknown llama size; sizes: tiny, maxtext-tiny, 1b, 7b"),
    ("plan --model gpt2 --size 7b", r"--size '7b': unknown gpt2 size; sizes: tiny, 124m"),
    ("plan --model cnn --seq 32", r"--seq 32: cnn-tiny has no sequence axis; drop --seq"),
    ("plan --model cnn --aot 0", r"--aot 0: cnn-tiny has no closed-form costs.*leave --aot out"),
    (
        "plan --model cnn --target h100:16x8",
        r"cnn-tiny has no closed-form costs .* 128 devices, more than the 64 this host simulates",
    ),
    ("plan --dtype float16", r"--dtype: invalid choice: 'float16'"),
    ("plan --memory 80i", r"--memory '80i': cannot read '80i' as a size"),
    ("plan --memory 0", r"--memory '0': give the memory per device > 0, e.g. --memory 80GB"),
    (
        "plan --strategies dp,zero3",
        r"--strategies 'dp,zero3': unknown strategies \['zero3'\]; "
        r"known: dp, fsdp",
    ),
]


@pytest.mark.parametrize(
    ("args", "match"), ROWS, ids=[a.replace(" --", "-").replace(" ", "=") for a, _ in ROWS]
)
def test_refused(refused, tmp_path, args, match):
    (tmp_path / "taken").write_text("not a folder")
    (tmp_path / "done").mkdir()
    for name in ("compare.json", "compare.png"):
        (tmp_path / "done" / name).write_text("an earlier comparison")
    refused(args.split(), match, subprocess_="h100:1x2" in args)


def test_a_user_workload_too_short_for_seq_is_refused_by_its_own_name():
    """A Workload of the user's own (no family): its name, its limit, no size to suggest."""
    import dataclasses

    import models
    from sharding import Workload, compare
    from sharding.comparison import CompareArgumentError

    cfg = models.llama.config("tiny", n_layers=2)
    mine = dataclasses.replace(Workload.from_family(models.llama, cfg), family=None, name="mine")
    assert mine.seq_refusal(4096) is None
    with pytest.raises(CompareArgumentError,
                       match=r"^--seq 8192: mine holds at most 4096 positions; use --seq 4096 or "
                             r"less$"):  # fmt: skip
        compare(mine, seq=8192)
