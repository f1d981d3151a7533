"""`spmdkit compare`: measure every strategy that fits on your model and devices, and choose.

With no arguments: llama tiny on 8 devices (simulated on a CPU-only host), every strategy and
pipeline schedule, a few timed steps each after warm-up; prints one table and a recommendation,
writes JSON and a PNG chart.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sharding.cli.common import (
    add_command,
    add_devices_arg,
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
        raise argparse.ArgumentError(self, f"renamed: use {self.new} {values}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "compare", help="measure and compare strategies (the main job)",
                    doc=__doc__, examples=["", "--strategies dp,fsdp --timed-steps 2",
                                           "--model gpt2 --memory 80GB --out gpt2-compare"])  # fmt: skip
    add_model_args(p)
    add_devices_arg(p)
    p.add_argument("--mesh", help="run every strategy on this one mesh instead of its own shape")
    p.add_argument("--strategies", help="comma-separated subset, e.g. dp,fsdp,pp (default: all)")
    p.add_argument("--batch", type=positive_int, default=32, help="global batch in sequences")
    p.add_argument("--seq", type=positive_int,
                   help="sequence length of a language model (when unset: 128; cnn and mlp "
                   "batches have no sequence axis)")  # fmt: skip
    p.add_argument("--timed-steps", type=positive_int, default=8,
                   help="timed steps per layout (the median is reported)")  # fmt: skip
    p.add_argument("--warmup-steps", type=non_negative_int, default=2,
                   help="untimed steps per layout before the timed ones")  # fmt: skip
    p.add_argument("--steps", action=_Renamed, new="--timed-steps")
    p.add_argument("--warmup", action=_Renamed, new="--warmup-steps")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype")  # fmt: skip
    p.add_argument("--memory", help="memory per device, e.g. 80GB: adds a fits column")
    p.add_argument("--peak-tflops", type=float,
                   help="peak TFLOP/s per device for MFU (when unset: the datasheet, or "
                   "measured on CPU)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("compare-out"),
                   help="folder for compare.json and compare.png")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="replace compare.json / compare.png already in --out")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sharding.comparison import CompareError, check_output, compare

    check_output(args.out, overwrite=args.overwrite)  # before anything is measured
    setup_devices(args.mesh, args.devices)  # before the user's module can touch jax's backend
    work = workload_from_args(args)
    out = console()
    with _progress(out) as bars:
        try:
            result = compare(
                work,
                batch=args.batch,
                seq=args.seq,
                dtype=args.dtype,
                timed_steps=args.timed_steps,
                warmup_steps=args.warmup_steps,
                strategies=args.strategies,
                mesh=args.mesh,
                memory_budget=args.memory,
                peak_tflops=args.peak_tflops,
                on_progress=_Bars(bars),
            )
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
