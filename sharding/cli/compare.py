"""`spmdkit compare`: measure every strategy that fits on your model and devices, and choose.

With no arguments: llama tiny on 8 devices (simulated on a CPU-only host), every strategy and
pipeline schedule, a few timed steps each after warm-up; prints one table and a recommendation,
writes JSON and a PNG chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from sharding.cli._common import add_model_args, console, setup_devices
from sharding.cli.train import LM_FAMILIES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="measure and compare strategies (the main job)",
                       description=__doc__)  # fmt: skip
    add_model_args(p)
    p.add_argument("--devices", type=int, help="simulated CPU devices (CPU hosts; default 8)")
    p.add_argument("--mesh", help="run every strategy on this one mesh instead of its own shape")
    p.add_argument("--strategies", help="comma-separated subset, e.g. dp,fsdp,pp")
    p.add_argument("--batch", type=int, default=32, help="global batch (default: %(default)s)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="timed steps each (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--memory", help="memory per device, e.g. 80GB: adds a fits column")
    p.add_argument("--peak-tflops", type=float,
                   help="peak TFLOP/s per device for MFU (default: datasheet, or measured on CPU)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("compare-out"),
                   help="folder for compare.json and compare.png (default: %(default)s)")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sharding._units import parse_bytes

    budget = parse_bytes(args.memory) if args.memory else None
    if args.model not in LM_FAMILIES:
        raise ValueError(
            f"spmdkit compare measures language models ({', '.join(LM_FAMILIES)}); "
            f"{args.model!r} is compared through the Python API (sharding.comparison._measure.measure)"
        )
    setup_devices(args.mesh, args.devices)

    import jax

    import models
    from sharding.comparison import (
        CompareConfig,
        Skipped,
        candidates,
        comparison_table,
        measure,
        recommend,
        reference,
    )
    from sharding.inspection import host_peak

    out = console()
    fam = models.get_family(args.model)
    cfg = fam.config(args.size)
    conf = CompareConfig(args.model, args.size, args.batch, args.seq, args.dtype, args.steps,
                         args.warmup)  # fmt: skip
    fam.batch_shapes(cfg, conf.batch, conf.seq)  # checks seq against the model first
    strategies = tuple(args.strategies.split(",")) if args.strategies else None
    todo = candidates(cfg.n_layers, jax.device_count(), strategies=strategies, mesh=args.mesh)
    devices = jax.devices()
    simulated = devices[0].platform == "cpu"
    peak = host_peak(devices, dtype=args.dtype, tflops=args.peak_tflops)
    started = time.perf_counter()
    results, skipped = [], []
    with _progress(out) as progress:
        flops_task = progress.add_task("unsplit step (1 device)", total=1)
        useful, unsplit = reference(fam, cfg, conf)
        progress.update(flops_task, advance=1)
        placed: set[str] = set()
        for cand in todo:
            if cand.fallback and cand.strategy in placed:
                continue
            task = progress.add_task(f"{cand.label} on {cand.mesh}", total=conf.warmup + conf.steps)
            try:
                results.append(measure(cand, fam, cfg, conf, useful_flops=useful, peak=peak,
                                       on_step=lambda t=task: progress.advance(t)))  # fmt: skip
                placed.add(cand.strategy)
            except ValueError as e:  # a strategy the model or mesh cannot take: say why
                skipped.append(Skipped(cand, f"{type(e).__name__}: {e}"))
                progress.update(task, description=f"[dim]{cand.label} on {cand.mesh}: skipped")
                progress.stop_task(task)
    elapsed = time.perf_counter() - started

    out.print(
        f"[bold]{args.model} {args.size}[/]: {fam.param_count(cfg):,} parameters, global batch "
        f"{conf.batch} x {conf.seq} tokens, {conf.dtype}, {len(devices)} "
        f"{devices[0].platform} devices ({devices[0].device_kind}); MFU against "
        f"{peak.flops_per_s / 1e12:.3g} TFLOP/s ({peak.source}), useful matmul FLOPs/step "
        f"{useful:.4g}"
    )
    if results:
        out.print(comparison_table(results, unsplit, budget))
    shaped = {c.strategy for c in todo if c.fallback}  # strategies offered several shapes
    for s in skipped:
        if s.candidate.strategy in shaped and s.candidate.strategy in placed:
            continue  # a later shape of the same strategy ran
        first = s.reason.splitlines()[0]
        out.print(f"[yellow]skipped[/] {s.candidate.label} on {s.candidate.mesh}: {first}")
    verdict = recommend(results, unsplit, memory_budget=budget, simulated=simulated)
    out.print("[bold]Recommendation[/]")
    for i, line in enumerate(verdict.lines):
        out.print(("  -> " if i == 0 else "     ") + line)
    out.print(f"measured {len(results)} candidates in {elapsed:.0f} s")

    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "model": {"family": args.model, "size": args.size, "parameters": fam.param_count(cfg)},
        "config": dataclasses.asdict(conf),
        "devices": {
            "count": len(devices),
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
        },
        "peak": peak.to_dict(),
        "useful_flops_per_step": useful,
        "unsplit_state_bytes": unsplit,
        "memory_budget": budget,
        "results": [r.to_dict() for r in results],
        "skipped": [
            {"label": s.candidate.label, "mesh": s.candidate.mesh, "reason": s.reason}
            for s in skipped
        ],
        "recommendation": verdict.to_dict(),
        "elapsed_s": elapsed,
    }
    (args.out / "compare.json").write_text(json.dumps(record, indent=2))
    from sharding.comparison import plot

    plot(results, args.out / "compare.png", title=f"{args.model} {args.size}")
    out.print(f"wrote {args.out / 'compare.json'} and {args.out / 'compare.png'}")
    return 0


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
