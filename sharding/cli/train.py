"""`spmdkit train`: train a language model under any strategy, with a live display and metrics.

With no --data it trains on the embedded arithmetic text (no download); --data hf:PATH
--tokenizer PATH reads a Hugging Face dataset on local disk through Grain. On a CPU-only host the
mesh's devices are simulated (8 when no mesh is given). Exit status 1 when the run diverges (a
NaN or infinite loss stops it; the last good checkpoint is kept). The loop is
`sharding.training.fit`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from sharding.cli.argtypes import data_arg, resume_step
from sharding.cli.common import (
    add_command,
    add_devices_arg,
    add_model_args,
    add_pipeline_args,
    add_strategy_args,
    console,
    non_negative_int,
    positive_int,
    setup_devices,
    workload_from_args,
)
from sharding.cli.multihost import add_distributed_args, join_from_args
from sharding.training import ELASTIC_POLICIES, NonFiniteLossError, TrainConfig, fit

_FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "train", help="train a model under a strategy", doc=__doc__, examples=[
        "--steps 50 --metrics metrics.jsonl",
        "--mesh data=2,fsdp=2,tensor=2 --strategy fsdp_tp --checkpoint-dir ck --save-every 25",
        "--mesh fsdp=8 --strategy fsdp --checkpoint-dir ck --resume --steps 100",
        "--model my_models.py:workload --strategy pp --mesh stage=2,data=4 --schedule 1f1b",
        "--steps 20 --profile traces --profile-steps 5:7 --tensorboard tb",
        "--data hf:corpus --tokenizer tokenizer.json --seq 128 --checkpoint-dir ck --save-every 50",
        "--strategy cp --mesh data=2,context=4 --seq 1024 --context-method ring",
    ])  # fmt: skip
    add_model_args(p)
    add_strategy_args(p, context=True)  # and --attention
    add_pipeline_args(p)
    add_distributed_args(p)
    add_devices_arg(p)
    p.add_argument("--steps", type=positive_int, default=300, help="train until this step")
    p.add_argument("--batch", type=positive_int,
                   help="global batch, sequences per step (when unset: 16, or the checkpoint's)")  # fmt: skip
    p.add_argument("--seq", type=positive_int,
                   help="sequence length (when unset: 64, or the checkpoint's)")  # fmt: skip
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=non_negative_int, default=20,
                   help="learning-rate warm-up steps")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype (float32 master weights either way)")  # fmt: skip
    p.add_argument("--remat", default="none", choices=("none", "full", "dots"),
                   help="recompute activations in the backward pass")  # fmt: skip
    p.add_argument("--accum", type=positive_int,
                   help="gradient accumulation micro-steps (when unset: 1, or the checkpoint's)")  # fmt: skip
    p.add_argument("--clip", type=float, default=1.0,
                   help="clip gradients to this global norm; 0 turns clipping off")  # fmt: skip
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="initialisation and data seed (default: %(default)s)")  # fmt: skip
    d = p.add_argument_group("data (default: the embedded arithmetic text)")
    d.add_argument("--data", type=data_arg, metavar="FILE|hf:PATH|grain:FILE",
                   help="a flat token file (raw little-endian ids, no header; random windows), "
                   "hf:PATH a Hugging Face dataset on local disk (saved, or a folder of "
                   "parquet/json/txt files), grain:FILE a token file read in rows through Grain")  # fmt: skip
    d.add_argument("--data-dtype", choices=("uint16", "uint32"),
                   help="how a token file stores its ids; required unless it is named .u16/.u32")  # fmt: skip
    d.add_argument("--tokenizer", type=Path, metavar="PATH",
                   help="tokenizer.json (or its folder) that tokenizes --data hf:PATH")  # fmt: skip
    d.add_argument("--text-column", metavar="NAME", help="the column of documents (default: text)")
    p.add_argument("--metrics", type=Path, help="write one JSON object per step here (JSONL)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --metrics file, or the checkpoints after the "
                   "--resume step")  # fmt: skip
    o = p.add_argument_group("seeing inside a run")
    o.add_argument("--profile", type=Path, metavar="DIR",
                   help="write a jax.profiler trace of --profile-steps here (TensorBoard, Perfetto)")  # fmt: skip
    o.add_argument("--profile-steps", metavar="A:B", help="first and last step to trace, e.g. 5:7")
    o.add_argument("--tensorboard", type=Path, metavar="DIR",
                   help="write each step's metrics as TensorBoard scalars here")  # fmt: skip
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", type=Path, help="save and resume checkpoints here")
    g.add_argument("--save-every", type=non_negative_int, default=0,
                   help="save every N steps, and always at the last step (default: %(default)s)")  # fmt: skip
    g.add_argument("--keep", type=positive_int, default=3, help="keep the newest K checkpoints")
    g.add_argument("--resume", nargs="?", const="latest", type=resume_step, metavar="STEP",
                   help="resume from STEP, or without STEP (or 'latest') from the latest "
                   "checkpoint, starting fresh when there is none yet")  # fmt: skip
    g.add_argument("--elastic", choices=ELASTIC_POLICIES,
                   help="resuming where another number of devices splits the batch: keep the "
                   "global batch (more accumulation) or shrink it with the devices")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    join_from_args(args)  # joins a multi-process run (no-op for one process)
    spec = setup_devices(args.mesh, args.devices)

    import models

    shipped = args.model in models.FAMILIES
    model = models.get_family(args.model) if shipped else workload_from_args(args)
    fields = {k: getattr(args, k) for k in _FIELDS if k not in ("size", "mesh")}
    config = TrainConfig(**fields, size=args.size or "tiny", mesh=str(spec))
    out = console()
    with _progress(out) as progress:
        task = None

        def on_step(record: dict) -> None:
            nonlocal task
            shown = {"loss": record["loss"], "tps": record["tokens_per_s"],
                     "ms": record["step_time_s"] * 1e3}  # fmt: skip
            if task is None:  # the first step trained: after a resume, not step 1
                task = progress.add_task("train", total=config.steps,
                                         completed=record["step"] - 1, **shown)  # fmt: skip
            progress.update(task, advance=1, **shown)

        try:
            result = fit(model, config, on_step=on_step, on_note=out.print)
        except NonFiniteLossError as e:  # the input was fine; the run diverged
            progress.stop()
            print(f"spmdkit train: stopped: {e}", file=sys.stderr)
            return 1
    out.print(result.table())
    return 0


def _progress(out):
    import rich.progress as rp

    return rp.Progress(
        rp.TextColumn("[bold]train"), rp.BarColumn(), rp.MofNCompleteColumn(),
        rp.TextColumn("loss {task.fields[loss]:.4f}"),
        rp.TextColumn("{task.fields[tps]:,.0f} tok/s"),
        rp.TextColumn("{task.fields[ms]:.1f} ms/step"),
        rp.TimeRemainingColumn(), console=out, transient=False,
    )  # fmt: skip
