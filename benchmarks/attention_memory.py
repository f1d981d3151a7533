"""Training-step memory against sequence length, for each attention kernel.

For each sequence length (default 1k .. 32k) and each kernel of `models.attention` that runs on
this host (blockwise: flash-style in pure JAX; xla: the materialising reference), the training
step of a llama with the widths of ``--size`` (default 8b: d_model 4096, 32 heads, 8 kv heads,
head 128, vocabulary 128256) and ``--layers`` layers (default 2) is compiled for one device,
one sequence per step, bfloat16 compute, remat none, AdamW. Nothing runs: the figure is the
compiled step's temporaries (`report().memory.temp`, XLA's buffer assignment): activations
saved for the backward, attention's intermediates and the logits.

The claim checked (exit 1 if it fails): blockwise's temporaries grow linearly in the sequence,
at most 4.5x from 2048 to 8192 tokens (4x the tokens); the reference's hold a float32
``[heads, S, S]`` score matrix per layer and grow with its square.

    python -m benchmarks.attention_memory                       # 1k..32k, 8b widths
    python -m benchmarks.attention_memory --seqs 2048,8192 --kernels blockwise
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._common import finish_claim, parser, setup

LINEAR_WITHIN = 4.5  # blockwise's temporaries at 8192 / at 2048 tokens, at most
CLAIM_SEQS = (2048, 8192)


def measure(seq: int, kernel: str, args: Any) -> dict[str, Any]:
    import jax

    import models
    from sharding import Workload, build_program, make_mesh

    cfg = models.llama.config(args.size, n_layers=args.layers, max_seq_len=max(args.seq_list))
    work = Workload.from_family(models.llama, cfg)
    start = time.perf_counter()
    prog = build_program(work, "dp", make_mesh("data=1", jax.devices()[:1]), batch=1, seq=seq,
                         compute_dtype="bfloat16", attention=kernel)  # fmt: skip
    mem = prog.report().memory
    return {"seq": seq, "kernel": kernel, "temp": mem.temp, "argument": mem.argument,
            "compile_s": time.perf_counter() - start}  # fmt: skip


def check_claim(rows: list[dict[str, Any]]) -> dict[str, Any]:
    at = {r["seq"]: r["temp"] for r in rows if r["kernel"] == "blockwise"}
    lo, hi = CLAIM_SEQS
    if lo not in at or hi not in at:
        return {"claim": "blockwise linear", "holds": None}
    ratio = at[hi] / at[lo]
    return {"claim": f"blockwise temporaries at seq {hi} within {LINEAR_WITHIN}x of seq {lo}",
            "ratio": ratio, "holds": ratio <= LINEAR_WITHIN}  # fmt: skip


def table(rows: list[dict[str, Any]], args: Any) -> Any:
    from rich.table import Table

    from sharding import fmt_bytes

    t = Table(title=f"temporaries of one training step on one device, llama {args.size} widths, "
                    f"{args.layers} layers, 1 sequence, bfloat16, remat none")  # fmt: skip
    t.add_column("seq", justify="right")
    for k in args.kernel_list:
        t.add_column(k, justify="right")
    if len(args.kernel_list) > 1:
        t.add_column(f"{args.kernel_list[-1]} / {args.kernel_list[0]}", justify="right")
    for seq in args.seq_list:
        mine = {r["kernel"]: r["temp"] for r in rows if r["seq"] == seq}
        cells = [fmt_bytes(mine[k]) for k in args.kernel_list]
        if len(args.kernel_list) > 1:
            cells.append(f"{mine[args.kernel_list[-1]] / mine[args.kernel_list[0]]:.1f}x")
        t.add_row(str(seq), *cells)
    return t


def plot(rows: list[dict[str, Any]], path: Any, args: Any) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for k in args.kernel_list:
        mine = sorted((r for r in rows if r["kernel"] == k), key=lambda r: r["seq"])
        ax.plot([r["seq"] for r in mine], [r["temp"] / 2**30 for r in mine], "o-", label=k)
        for r in mine:
            ax.annotate(f"{r['temp'] / 2**30:.1f}", (r["seq"], r["temp"] / 2**30), fontsize=7,
                        textcoords="offset points", xytext=(0, 5), ha="center")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length (tokens, one sequence)")
    ax.set_ylabel("temporaries per device (GiB)")
    ax.set_title(f"llama {args.size} widths, {args.layers} layers, bf16: memory by attention "
                 f"kernel", fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = parser("attention_memory", __doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768",
                   help="(default: %(default)s)")  # fmt: skip
    p.add_argument("--kernels", default="blockwise,xla", help="(default: %(default)s)")
    p.add_argument("--size", default="8b", help="llama size for the widths (default: 8b)")
    p.add_argument("--layers", type=int, default=2, help="n_layers (default: %(default)s)")
    args = p.parse_args(argv)
    args.seq_list = [int(s) for s in args.seqs.split(",") if s.strip()]
    args.kernel_list = [k for k in args.kernels.split(",") if k.strip()]
    setup(args.devices)  # compiled for one of them

    from rich.console import Console

    console = Console(width=150)
    started = time.perf_counter()
    rows = []
    with console.status("") as status:
        for seq in args.seq_list:
            for k in args.kernel_list:
                status.update(f"compiling seq={seq} attention={k}")
                rows.append(measure(seq, k, args))
    console.print(table(rows, args))
    return finish_claim("attention_memory", args, rows, check_claim(rows), started, console,
                        lambda path: plot(rows, path, args))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
