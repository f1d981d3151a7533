"""Activation memory per device against sequence length, with and without context parallelism.

For each sequence length (default 512 .. 4096) the context axis grows with it (context =
seq / --per-device, 512 tokens per device by default) and the training step of a small llama
(tiny widths, 2 layers, max_seq_len raised to the longest sequence) is compiled on that many
simulated devices, one sequence per step, under each context-parallel method
(`sharding.context`: ring, allgather, ulysses) and without context parallelism on one device
("none": the whole sequence on one device). Nothing runs: the figure is the compiled step's
temporary buffer per device (`compiled.memory_analysis().temp_size_in_bytes`, XLA's packed
buffer assignment), the activations and attention intermediates a step holds besides its
arguments.

What it shows: with the ring the per-device temporaries stay flat as context doubles with the
sequence (each device holds S/c queries and at most two S/c key blocks; the backward recomputes
probabilities block by block); the all-gather holds every key (and an S/c x S score matrix per
layer), so it grows linearly; Ulysses holds the whole sequence for heads / c heads (S x S scores
for its heads), also growing; without
CP one device holds every activation of the sequence (no score matrix: attention is the blockwise
flash kernel beyond 512 tokens). The claim checked (exit 1 if it fails): ring's temporaries at
the longest sequence within 1.25x of its at the shortest that uses context parallelism.

    python -m benchmarks.context_memory                    # seq 512..4096, 8 devices
    python -m benchmarks.context_memory --seqs 1024,2048 --per-device 512
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._common import finish_claim, parser, setup

METHODS = ("none", "ring", "allgather", "ulysses")
FLAT_WITHIN = 1.25  # the ring's temporaries at the longest / shortest CP sequence, at most


class GridError(ValueError):
    """Sequence lengths the devices or heads cannot take."""


def points(seqs: list[int], per_device: int, devices: int, kv_heads: int) -> list[tuple]:
    """(seq, context, method) to compile; the context = seq / per_device, at most ``devices``.

    Example:
        >>> points([512, 1024], 512, 8, 4)[:3]
        [(512, 1, 'none'), (1024, 1, 'none'), (1024, 2, 'ring')]
    """
    out = []
    for seq in seqs:
        c = seq // per_device
        if seq % per_device or c > devices or c < 1:
            raise GridError(
                f"seq={seq} needs context=seq/--per-device={seq / per_device:g} devices; pick "
                f"a multiple of {per_device} up to {devices * per_device} (--devices {devices})"
            )
        out.append((seq, 1, "none"))
        if c > 1:
            out += [(seq, c, m) for m in METHODS[1:] if m != "ulysses" or kv_heads % c == 0]
    return out


def measure(seq: int, context: int, method: str, args: Any) -> dict[str, Any]:
    import jax

    import models
    from sharding import Workload, build_program, make_mesh

    cfg = models.llama.config(args.size, n_layers=args.layers, max_seq_len=max(args.seq_list))
    work = Workload.from_family(models.llama, cfg)
    mesh = make_mesh(f"context={context}", jax.devices()[:context])
    start = time.perf_counter()
    prog = build_program(work, "dp" if method == "none" else "cp", mesh, batch=1, seq=seq,
                         context_method=None if method == "none" else method)  # fmt: skip
    mem = prog.report().memory
    return {"seq": seq, "context": context, "method": method, "temp": mem.temp,
            "argument": mem.argument, "compile_s": time.perf_counter() - start}  # fmt: skip


def check_claim(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ring = sorted((r for r in rows if r["method"] == "ring"), key=lambda r: r["seq"])
    if len(ring) < 2:
        return {"claim": "ring flat", "holds": None}
    ratio = ring[-1]["temp"] / ring[0]["temp"]
    return {"claim": f"ring's temporaries at seq {ring[-1]['seq']} within {FLAT_WITHIN}x of "
            f"seq {ring[0]['seq']}", "ratio": ratio, "holds": ratio <= FLAT_WITHIN}  # fmt: skip


def table(rows: list[dict[str, Any]], args: Any) -> Any:
    from rich.table import Table

    from sharding import fmt_bytes

    t = Table(title=f"temporaries per device of one training step, llama {args.size} widths, "
                    f"{args.layers} layers, 1 sequence, context = seq / {args.per_device}")  # fmt: skip
    for col in ("seq", "context", *METHODS):
        t.add_column(col, justify="right")
    for seq in args.seq_list:
        mine = {r["method"]: r for r in rows if r["seq"] == seq}
        c = max(r["context"] for r in mine.values())
        t.add_row(str(seq), str(c), *(fmt_bytes(mine[m]["temp"]) if m in mine else "-"
                                      for m in METHODS))  # fmt: skip
    return t


def plot(rows: list[dict[str, Any]], path: Any) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m in METHODS:
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["seq"])
        if mine:
            ax.plot([r["seq"] for r in mine], [r["temp"] / 2**20 for r in mine], "o-", label=m)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length (context = seq / per-device tokens)")
    ax.set_ylabel("temporaries per device (MiB)")
    ax.set_title("activation memory per device: context parallelism vs none", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = parser("context_memory", __doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="512,1024,2048,4096", help="(default: %(default)s)")
    p.add_argument("--per-device", type=int, default=512, help="tokens per device (default: "
                   "%(default)s): context = seq / this")  # fmt: skip
    p.add_argument("--size", default="tiny", help="llama size for the widths (default: tiny)")
    p.add_argument("--layers", type=int, default=2, help="n_layers (default: %(default)s)")
    args = p.parse_args(argv)
    args.seq_list = [int(s) for s in args.seqs.split(",") if s.strip()]
    import models

    kv = models.llama.config(args.size).n_kv_heads
    grid = points(args.seq_list, args.per_device, args.devices, kv)
    setup(args.devices)

    from rich.console import Console

    console = Console(width=150)
    started = time.perf_counter()
    rows = []
    with console.status("") as status:
        for seq, c, m in grid:
            status.update(f"compiling seq={seq} context={c} {m}")
            rows.append(measure(seq, c, m, args))
    console.print(table(rows, args))
    return finish_claim("context_memory", args, rows, check_claim(rows), started, console,
                        lambda path: plot(rows, path))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
