"""`spmdkit compare`: which strategy for your model on your cluster.

Every strategy and schedule is compiled ahead of time by the target's own compiler where
installed (XLA:GPU for compile-only H100s on a CPU host, spmdkit[gpu]; else XLA:CPU, saying so)
and its step priced on the target: compute, exposed communication, bubble, memory per device.
No arguments: llama tiny on one node of 8 H100s, both dtypes; a ranked table, JSON and a PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sharding.cli.common import (
    add_attention_arg,
    add_command,
    add_compiler_arg,
    add_model_args,
    console,
    non_negative_int,
    positive_int,
    setup_devices,
    workload_from_args,
)


class _Renamed(argparse.Action):
    """A flag that was renamed: refuse it, naming the new one (one meaning per flag name)."""

    def __init__(self, option_strings, dest, *, new: str, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"renamed: use {self.new.format(values)}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "compare", help="which strategy for your model on your cluster (the main job)",
                    doc=__doc__, examples=[
                        "", "--target h100:4x8 --model llama --size 8b --batch 32 --seq 8192 "
                        "--dtype bfloat16", "--strategies dp,fsdp --target a100:2x8",
                        "--model cnn --strategies dp,dp_tp --out cnn-compare",
                        "--model my_models.py:workload --target my_cluster.toml:2x8"])  # fmt: skip
    add_model_args(p)
    p.add_argument("--target", default="h100:1x8",
                   help="the cluster to answer for: DEVICE[:NODESxPER_NODE] (h100, h200, b200, "
                   "a100, h100-96gb-500w, v5e, v5p, v6e; e.g. h100:4x8) or a TOML device "
                   "profile")  # fmt: skip
    p.add_argument("--devices", action=_Renamed,
                   new="--target DEVICE:NODESxPER_NODE, e.g. --target h100:1x{}")  # fmt: skip
    p.add_argument("--mesh", help="run every strategy on this one mesh instead of its own shape")
    p.add_argument("--strategies", help="comma-separated subset, e.g. dp,fsdp,pp (default: all)")
    p.add_argument("--batch", type=positive_int, default=32, help="global batch in sequences")
    p.add_argument("--seq", type=positive_int,
                   help="sequence length of a language model (when unset: 128; cnn and mlp "
                   "batches have no sequence axis)")  # fmt: skip
    p.add_argument("--measure", action=argparse.BooleanOptionalAction,
                   help="also time steps on this host's devices (when unset: on real devices, "
                   "or for a model under 256 MiB of train state)")  # fmt: skip
    p.add_argument("--timed-steps", type=positive_int, default=3,
                   help="timed steps per candidate where measured (the median is shown)")  # fmt: skip
    p.add_argument("--warmup-steps", type=non_negative_int, default=1,
                   help="untimed steps per candidate before the timed ones")  # fmt: skip
    p.add_argument("--profile", metavar="DIR", help="trace the timed steps into DIR/<candidate>")
    p.add_argument("--steps", action=_Renamed, new="--timed-steps {}")
    p.add_argument("--warmup", action=_Renamed, new="--warmup-steps {}")
    p.add_argument("--dtype", help="compute dtypes to compare, a comma list of float32, "
                   "bfloat16 (when unset: both)")  # fmt: skip
    p.add_argument("--remat", help="remat policies to compare, a comma list of none, dots, full "
                   "(when unset: none, and dots / full / accumulation only where memory needs "
                   "them)")  # fmt: skip
    p.add_argument("--accum", type=positive_int, help="run every candidate at this many "
                   "accumulation micro-steps (when unset: only where memory needs them)")  # fmt: skip
    p.add_argument("--micro-batch", type=positive_int, help="rows per device per forward pass "
                   "in every candidate; each one's --accum follows (not with --accum)")  # fmt: skip
    add_attention_arg(p, "every candidate compiles with (on this host)")
    p.add_argument("--memory", help="memory per device a step may allocate, e.g. 40GB (when "
                   "unset: 90%% of the target's HBM)")  # fmt: skip
    p.add_argument(
        "--peak-tflops",
        action=_Renamed,
        new="--target with a TOML device profile (peak_tflops_bf16 = {})",
    )
    add_compiler_arg(p)
    p.add_argument("--out", type=Path, default=Path("compare-out"),
                   help="folder for compare.json and compare.png")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="replace compare.json / compare.png already in --out")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sharding.comparison import CompareError, check_output, compare
    from sharding.targets import target

    check_output(args.out, overwrite=args.overwrite)  # before anything is compiled
    tgt = target(args.target)
    setup_devices(args.mesh, tgt.devices)  # before the user's module can touch jax's backend
    work = workload_from_args(args)
    out = console()
    with _progress(out) as bars:
        try:
            result = compare(
                work, target=tgt, batch=args.batch, seq=args.seq, dtype=args.dtype,
                remat=args.remat, measure=args.measure, profile=args.profile,
                timed_steps=args.timed_steps, warmup_steps=args.warmup_steps,
                strategies=args.strategies, mesh=args.mesh, memory_budget=args.memory,
                on_progress=_Bars(bars), attention=args.attention, accum=args.accum,
                micro_batch=args.micro_batch, compiler=args.compiler,
            )  # fmt: skip
        except CompareError as e:  # show what was measured before the message
            if getattr(e, "comparison", None) is not None:
                bars.stop()
                out.print(e.comparison.table())
            raise
    out.print(result.table())
    json_path, png_path = result.save(args.out, overwrite=args.overwrite)
    out.print(f"wrote {json_path} and {png_path}")
    return 0


class _Bars:
    """`compare`'s on_progress as rich progress bars: one per task, dimmed when skipped."""

    def __init__(self, progress) -> None:
        self.progress, self.tasks = progress, {}

    def __call__(self, task: str, done: int, total: int, note: str | None) -> None:
        if task not in self.tasks:
            self.tasks[task] = self.progress.add_task(task, total=total)
        tid = self.tasks[task]
        self.progress.update(tid, completed=done)
        if note:
            self.progress.update(tid, description=f"[dim]{task}: {note}")
            self.progress.stop_task(tid)


def _progress(out):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=False,
    )
