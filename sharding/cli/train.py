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
from sharding.training._distributed import add_distributed_args, init_from_args

LM_FAMILIES = ("llama", "gpt2")
ELASTIC_POLICIES = ("keep-batch", "shrink-batch")
BATCH, SEQ, ACCUM = 16, 64, 1
LATEST = -1
# Settings that shape the numbers of a run beyond the model and the data; a resumed run that
# changes one still runs, and says so.
TRAIN_SETTINGS = ("lr", "warmup", "steps", "clip", "dtype", "remat")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model under a strategy", description=__doc__)
    add_model_args(p)
    add_strategy_args(p)
    add_pipeline_args(p)
    add_distributed_args(p)
    p.add_argument("--steps", type=int, default=300, help="train until this step")
    p.add_argument(
        "--batch",
        type=int,
        help=f"global batch, sequences per step (default {BATCH}, or the checkpoint's)",
    )
    p.add_argument("--seq", type=int, help=f"sequence length (default {SEQ}, or the checkpoint's)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    p.add_argument(
        "--accum",
        type=int,
        help="gradient accumulation micro-steps (default 1, or the checkpoint's)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    p.add_argument("--data", help="flat binary token file (uint16 .bin/.u16, uint32 .u32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics", type=Path, help="write one JSON object per step here (JSONL)")
    p.add_argument("--devices", type=int, help="simulated CPU devices (CPU hosts only)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", type=Path, help="save and resume checkpoints here")
    g.add_argument(
        "--save-every", type=int, default=0, help="save every N steps (and always at the last step)"
    )
    g.add_argument("--keep", type=int, default=3, help="keep the newest K checkpoints")
    g.add_argument(
        "--resume",
        nargs="?",
        const=LATEST,
        type=int,
        metavar="STEP",
        help="resume from STEP, or without STEP from the latest checkpoint (starting "
        "fresh when there is none yet)",
    )
    g.add_argument(
        "--elastic",
        choices=ELASTIC_POLICIES,
        help="resuming where another number of devices splits the batch: keep the "
        "global batch (more accumulation) or shrink it with the devices",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    init_from_args(args)  # joins a multi-process run (no-op for one process)
    spec = setup_devices(args.mesh, args.devices)

    # Everything below imports JAX; the device count is fixed by now.
    import models
    from sharding._mesh import make_mesh
    from sharding.cli._summary import program_summary
    from sharding.training import dataset_from_arg, process_batch

    if args.model not in LM_FAMILIES:
        raise ValueError(
            f"spmdkit train trains language models ({', '.join(LM_FAMILIES)}); "
            f"{args.model!r} is exercised through the Python API (sharding.compile_train_step)"
        )
    fam = models.get_family(args.model)
    cfg = fam.config(args.size)
    out = console()
    checkpoints, resume = open_checkpoints(args, cfg, spec, out)
    shapes = fam.batch_shapes(cfg, args.batch, args.seq)  # checks seq <= max_seq_len
    dataset = dataset_from_arg(args.data, cfg.vocab_size, args.seed, seq_len=args.seq)
    mesh = make_mesh(spec)
    program = build_program(args, fam, cfg, mesh, shapes)

    if resume is not None:
        state, meta = checkpoints.restore(program, resume.step)
        out.print(
            f"resumed from step {meta.step} of {checkpoints.directory} (saved under "
            f"{resume.strategy} on {_mesh_text(resume.mesh)}, restored under {args.strategy} on "
            f"{spec})"
        )
    else:
        state = program.init(args.seed)
    first = resume.step if resume is not None else 0
    with out.status(f"compiling {args.model} {args.size} / {args.strategy} on {spec} ..."):
        program.compiled  # noqa: B018  (compile once, ahead of the loop, and time it)
    metrics_file = args.metrics.open("w") if args.metrics else None
    save_meta = run_meta(args, cfg, spec) if checkpoints else None
    tokens_per_step = args.batch * args.seq
    history = []
    try:
        with _progress(out) as progress:
            task = progress.add_task(
                "train", total=args.steps, completed=first, loss=float("nan"), tps=0.0, ms=0.0
            )
            for step in range(first, args.steps):
                batch = process_batch(dataset, step, args.batch, args.seq, program.batch_shardings)
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
                if checkpoints and (checkpoints.should_save(step + 1) or step + 1 == args.steps):
                    # Asynchronous: returns once the arrays are copied; the next step may
                    # donate them. A resumed run replaces the steps it replays.
                    checkpoints.save(step + 1, state, save_meta, overwrite=resume is not None)
                progress.update(
                    task, advance=1, loss=loss, tps=record["tokens_per_s"], ms=elapsed * 1e3
                )
        if checkpoints:
            checkpoints.wait()
            out.print(f"checkpoints in {checkpoints.directory}: steps {checkpoints.steps()}")
    finally:
        if metrics_file:
            metrics_file.close()
        if checkpoints:
            checkpoints.close()  # waits for the save in flight
    if first >= args.steps:
        out.print(f"the checkpoint is at step {first} >= --steps {args.steps}: nothing to train")
    out.print(program_summary(args, spec, program, history))
    return 0


def run_meta(args, cfg, spec):
    """The `CheckpointMeta` of this run (the step is filled in when saving)."""
    import dataclasses

    from sharding.training import CheckpointMeta

    return CheckpointMeta(
        family=args.model,
        size=args.size,
        config=dataclasses.asdict(cfg),
        strategy=args.strategy,
        mesh=spec.sizes,
        global_batch=args.batch,
        seq_len=args.seq,
        accum_steps=args.accum,
        seed=args.seed,
        data={"path": str(args.data) if args.data else None, "seed": args.seed},
        train={
            **{k: getattr(args, k) for k in TRAIN_SETTINGS},
            "schedule": args.schedule,
            "microbatches": args.microbatches,
            "repeats": args.repeats,
        },
    )


def open_checkpoints(args, cfg, spec, out):
    """The run's `Checkpointer` (or None) and the metadata of the step to resume (or None).

    Fills ``args.batch``, ``args.seq`` and ``args.accum``: from the checkpoint when resuming
    (through the --elastic policy when the batch split changed), else from the defaults.
    """
    import dataclasses

    from sharding.training import Checkpointer, CheckpointMismatchError, elastic_batch

    given = [f"--{k.replace('_', '-')}" for k in ("resume", "elastic") if getattr(args, k)]
    if args.checkpoint_dir is None:
        if given or args.save_every:
            raise ValueError(f"{', '.join(given or ['--save-every'])} need(s) --checkpoint-dir DIR")
        _fill_defaults(args)
        return None, None
    ck = Checkpointer(args.checkpoint_dir, save_every=args.save_every, keep=args.keep)
    steps = ck.steps()
    if args.resume is None or (args.resume == LATEST and not steps):
        if steps:
            ck.close()
            raise ValueError(
                f"{ck.directory} already holds checkpoints (steps {steps}); pass --resume to "
                f"continue that run, or give an empty --checkpoint-dir"
            )
        if args.resume is not None:
            out.print(f"no checkpoint in {ck.directory} yet: starting at step 0")
        _fill_defaults(args)
        return ck, None
    meta = ck.meta(None if args.resume == LATEST else args.resume)
    want = {"model": (meta.family, args.model), "size": (meta.size, args.size),
            "seq": (meta.seq_len, args.seq), "seed": (meta.data.get("seed"), args.seed)}  # fmt: skip
    bad = [f"--{k} {a} (given: {b})" for k, (a, b) in want.items() if b is not None and a != b]
    if meta.data.get("path") != _path(args.data):
        saved, now = meta.data.get("path") or "none", _path(args.data) or "none"
        bad.append(f"--data {saved} (given: {now}; 'none' is the embedded arithmetic text)")
    if meta.config != dataclasses.asdict(cfg) and not bad:
        bad.append(f"the {meta.family} {meta.size} config {meta.config}")
    if bad:
        ck.close()
        raise CheckpointMismatchError(
            f"checkpoint step {meta.step} in {ck.directory} was trained with "
            f"{'; '.join(bad)}; resume with those settings (or drop the flags)"
        )
    plan = elastic_batch(meta, spec.sizes, args.elastic)
    for flag, given_value, value in (("batch", args.batch, plan.global_batch),
                                     ("accum", args.accum, plan.accum_steps)):  # fmt: skip
        if given_value is not None and given_value != value:
            ck.close()
            how = f"--elastic {args.elastic}" if args.elastic else "the checkpoint"
            raise CheckpointMismatchError(
                f"--{flag} {given_value} disagrees with {how}, which gives --{flag} {value} "
                f"(checkpoint step {meta.step}: global batch {meta.global_batch}, accumulation "
                f"{meta.accum_steps}, mesh {_mesh_text(meta.mesh)}); drop --{flag}"
                + ("" if args.elastic else ", or choose --elastic keep-batch|shrink-batch")
            )
    args.batch, args.accum, args.seq = plan.global_batch, plan.accum_steps, meta.seq_len
    if plan.note:
        out.print(plan.note)
    changed = [f"{k} {meta.train.get(k)} -> {getattr(args, k)}" for k in TRAIN_SETTINGS
               if k in meta.train and meta.train[k] != getattr(args, k)]  # fmt: skip
    if changed:
        out.print(f"resuming with changed settings: {', '.join(changed)}")
    return ck, meta


def _fill_defaults(args) -> None:
    args.batch = BATCH if args.batch is None else args.batch
    args.seq = SEQ if args.seq is None else args.seq
    args.accum = ACCUM if args.accum is None else args.accum


def _path(p) -> str | None:
    return str(p) if p is not None else None


def _mesh_text(sizes: dict) -> str:
    return ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "data=1"


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
