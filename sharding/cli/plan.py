"""`spmdkit plan`: rank strategies and meshes for a model on N devices before owning them.

The ranking comes from the cost model (no devices, any size). For meshes small enough to
simulate here (and sizes whose compile fits the host), the top layouts are also compiled ahead of
time on simulated CPU devices from abstract shapes, and their compiled memory shown beside the
prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from sharding._units import fmt_bytes, fmt_count, parse_bytes
from sharding.cli._common import add_model_args, console, cpu_only

# Simulating more CPU devices than this makes an AOT compile too slow to be worth waiting for.
MAX_AOT_DEVICES = 64


def add_parser(sub: argparse._SubParsersAction) -> None:
    from partition_rules import STRATEGIES
    from sharding.costmodel import PROFILES

    p = sub.add_parser("plan", help="rank strategies and meshes for N devices from the cost model",
                       description=__doc__)  # fmt: skip
    add_model_args(p, size="7b")
    p.add_argument("--devices", type=int, default=8, help="device count (default: %(default)s)")
    p.add_argument("--memory", help="memory per device, e.g. 80GB (default: the device kind's)")
    p.add_argument("--device-kind", default="h100-80gb", choices=sorted(PROFILES),
                   help="peak FLOP/s and link bandwidths (default: %(default)s)")  # fmt: skip
    p.add_argument("--batch", type=int, help="global batch in sequences (default: --devices)")
    p.add_argument("--seq", type=int, help="sequence length (default: min(4096, model max))")
    p.add_argument("--layers", type=int, help="override the model's layer count")
    p.add_argument("--strategies", help=f"comma list (default: all of {','.join(STRATEGIES)})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"))
    p.add_argument("--top", type=int, default=12, help="rows to show (default: %(default)s)")
    p.add_argument("--aot", type=int,
                   help=f"AOT-compile this many top layouts (default: 2 when --devices <= "
                        f"{MAX_AOT_DEVICES} on a CPU host, else 0)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    aot = args.aot if args.aot is not None else (2 if args.devices <= MAX_AOT_DEVICES else 0)
    notes = []
    if aot and cpu_only():  # before anything initialises JAX
        from sharding._mesh import simulate_cpu_devices

        simulate_cpu_devices(args.devices)
    import models
    from sharding.costmodel import PROFILES, candidates, compile_candidate

    fam = models.get_family(args.model)
    cfg = fam.config(args.size)
    if args.layers:
        cfg = dataclasses.replace(cfg, n_layers=args.layers)
    profile = PROFILES[args.device_kind]
    memory = parse_bytes(args.memory) if args.memory else profile.memory_bytes
    batch = args.batch or args.devices
    seq = args.seq or min(4096, cfg.max_seq_len)
    strategies = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else None
    start = time.perf_counter()
    ranked = candidates(fam, cfg, args.devices, batch, seq, strategies=strategies,
                        dtype=args.dtype, optimizer=args.optimizer, memory_bytes=memory,
                        profile=profile)  # fmt: skip
    elapsed = time.perf_counter() - start
    if aot:
        import jax

        if jax.device_count() != args.devices:
            notes.append(f"AOT skipped: {jax.device_count()} devices here, not {args.devices}")
        else:
            for c in [c for c in ranked if c.fits][:aot]:
                compile_candidate(c, fam, cfg)
    assumptions = [
        f"device: {profile.describe()}; memory budget {fmt_bytes(memory)} per device",
        "step time = critical-path matmul FLOPs / peak + ring collective time at the bandwidth "
        "of the links each group spans, no overlap (an upper bound); axes laid out stage, data, "
        "fsdp, tensor with tensor innermost",
        "memory = params + gradients + optimizer state + batch + saved activations + one "
        "layer's backward transients + gathered layer weights + float32 logits; no runtime "
        "reserve",
        f"float32 master weights; {args.dtype} compute; {args.optimizer}",
    ]
    if args.json:
        print(json.dumps({
            "model": args.model, "size": args.size, "layers": cfg.n_layers,
            "devices": args.devices, "memory_bytes": memory, "batch": batch, "seq": seq,
            "dtype": args.dtype, "search_s": elapsed, "assumptions": assumptions + notes,
            "candidates": [c.to_dict() for c in ranked[: args.top]],
        }, indent=1))  # fmt: skip
        return 0
    out = console()
    out.print(_table(args, cfg, ranked[: args.top], memory, batch, seq, elapsed))
    for line in assumptions + notes:
        out.print(f"[dim]- {line}[/dim]")
    return 0


def _table(args, cfg, ranked, memory, batch, seq, elapsed):
    from rich.table import Table

    n_fit = sum(c.fits for c in ranked)
    table = Table(
        title=f"{args.model} {args.size} ({cfg.n_layers} layers) on {args.devices} devices of "
        f"{fmt_bytes(memory)}: batch {batch} x seq {seq}; {n_fit} of the top {len(ranked)} fit "
        f"(searched in {elapsed:.1f} s)",
        title_justify="left",
    )
    for col in ("#", "strategy", "mesh", "pipeline", "remat", "memory/device", "fits",
                "compiled", "comm/step", "step (compute+comm)", "tokens/s"):  # fmt: skip
        table.add_column(
            col, justify="left" if col in ("strategy", "mesh", "pipeline") else "right"
        )
    for i, c in enumerate(ranked, 1):
        p = c.prediction
        pipe = f"{p.pipeline['name']} m={p.pipeline['microbatches']}" if p.pipeline else "-"
        compiled = "-"
        if c.compiled_memory is not None:
            err = (p.memory_bytes - c.compiled_memory) / c.compiled_memory
            compiled = f"{fmt_bytes(c.compiled_memory)} ({err:+.0%})"
        table.add_row(
            str(i), p.strategy, c.mesh_text, pipe, p.remat, fmt_bytes(p.memory_bytes),
            "[green]yes[/green]" if c.fits else "[red]no[/red]", compiled,
            fmt_bytes(p.collective_bytes()),
            f"{c.step_s * 1e3:,.0f} ms ({c.compute_s * 1e3:,.0f}+{c.comm_s * 1e3:,.0f})",
            fmt_count(p.batch * p.seq / c.step_s),
        )  # fmt: skip
    return table
