"""`spmdkit train`: train a language model under any strategy, with a live display and metrics.

With no --data it trains on the embedded arithmetic text (no download). On a CPU-only host the
mesh's devices are simulated (8 when no mesh is given).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sharding.cli._common import (
    add_model_args,
    add_pipeline_args,
    add_strategy_args,
    console,
    pipeline_spec,
    setup_devices,
)

LM_FAMILIES = ("llama", "gpt2")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model under a strategy", description=__doc__)
    add_model_args(p)
    add_strategy_args(p)
    add_pipeline_args(p)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-steps")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    p.add_argument("--data", help="flat binary token file (uint16 .bin/.u16, uint32 .u32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", type=Path, help="write one JSON object per step here (JSONL)")
    p.add_argument("--devices", type=int, help="simulated CPU devices (CPU hosts only)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = setup_devices(args.mesh, args.devices)

    # Everything below imports JAX; the device count is fixed by now.
    import models
    from sharding._data import Batcher, dataset_from_arg, make_global_batch
    from sharding._mesh import make_mesh
    from sharding.cli._summary import program_summary

    if args.model not in LM_FAMILIES:
        raise ValueError(
            f"spmdkit train trains language models ({', '.join(LM_FAMILIES)}); "
            f"{args.model!r} is exercised through the Python API (sharding.compile_train_step)"
        )
    fam = models.get_family(args.model)
    cfg = fam.config(args.size)
    shapes = fam.batch_shapes(cfg, args.batch, args.seq)  # checks seq <= max_seq_len
    dataset = dataset_from_arg(args.data, cfg.vocab_size, args.seed, seq_len=args.seq)
    mesh = make_mesh(spec)
    program = build_program(args, fam, cfg, mesh, shapes)
    batcher = Batcher(dataset, args.batch, args.seq)

    out = console()
    state = program.init(args.seed)
    with out.status(f"compiling {args.model} {args.size} / {args.strategy} on {spec} ..."):
        program.compiled  # noqa: B018  (compile once, ahead of the loop, and time it)
    metrics_file = args.metrics.open("w") if args.metrics else None
    tokens_per_step = args.batch * args.seq
    history = []
    try:
        with _progress(out) as progress:
            task = progress.add_task("train", total=args.steps, loss=float("nan"), tps=0.0, ms=0.0)
            for step in range(args.steps):
                batch = make_global_batch(batcher(step), program.batch_shardings)
                start = time.perf_counter()
                state, metrics = program.step(state, batch)
                loss = float(metrics["loss"])  # blocks until the step is done
                elapsed = time.perf_counter() - start
                record = {
                    "step": step + 1,
                    "loss": loss,
                    "grad_norm": float(metrics["grad_norm"]),
                    "step_time_s": elapsed,
                    "tokens_per_s": tokens_per_step / elapsed,
                }
                history.append(record)
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                progress.update(
                    task, advance=1, loss=loss, tps=record["tokens_per_s"], ms=elapsed * 1e3
                )
    finally:
        if metrics_file:
            metrics_file.close()
    out.print(program_summary(args, spec, program, history))
    return 0


def build_program(args, fam, cfg, mesh, shapes):
    import optax

    from partition_rules import preset
    from sharding._step import compile_train_step

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, min(args.warmup, args.steps - 1)), max(args.steps, 2), args.lr * 0.1
    )
    return compile_train_step(
        lambda rngs: fam.Model(cfg, rngs=rngs),
        fam.loss,
        optax.adamw(schedule, b2=0.95, weight_decay=0.1),
        *preset(args.model, args.strategy),
        mesh,
        shapes,
        accum_steps=args.accum,
        compute_dtype=args.dtype,
        remat=args.remat,
        clip_norm=args.clip if args.clip > 0 else None,
        pipeline=pipeline_spec(args, fam, dict(mesh.shape).get("stage", 1)),
    )


def _progress(out):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TextColumn("{task.fields[ms]:.1f} ms/step"),
        TimeRemainingColumn(),
        console=out,
        transient=False,
    )
