"""Compile time against depth and micro-batches: scanned programs should stay flat.

spmdkit scans the layer stack (one layer body, whatever the depth) and runs pipelines as a
`lax.scan` over ticks (one tick body, whatever the number of micro-batches), so the compiled
program, and the time to build it, should not grow with either. This measures the wall time of
trace + lower + XLA compile of the full train step (best of --repeats fresh compiles) for
layers 4 -> 32 and micro-batches 4 -> 32, and the ratio of the largest to the smallest.

    python -m benchmarks.compile_time
"""

from __future__ import annotations

from benchmarks._common import out_dir, parser, setup, write_json


def compile_seconds(strategy: str, mesh_spec: str, *, layers: int, batch: int, seq: int,
                    schedule: str | None = None, microbatches: int = 0, repeats: int = 2) -> float:  # fmt: skip
    """Best wall time over ``repeats`` fresh compiles of the train step."""
    import models
    from sharding.comparison import Settings, build
    from sharding.costmodel import Layout

    fam = models.get_family("llama")
    cfg = fam.config("tiny", n_layers=layers)
    cand = Layout(strategy, mesh_spec, schedule, microbatches or None)
    best = float("inf")
    for _ in range(repeats):
        from sharding import Workload

        # A new program (new closures) every time: no in-memory cache hit.
        program = build(cand, Workload.from_family(fam, cfg), Settings(batch, seq))
        program.compiled  # noqa: B018 - compiles and records compile_time_s
        best = min(best, program.compile_time_s)
    return best


def main(argv: list[str] | None = None) -> int:
    p = parser("compile_time", __doc__)
    p.add_argument("--layers", default="4,8,16,32")
    p.add_argument("--microbatches", default="4,8,16,32")
    p.add_argument("--repeats", type=int, default=2, help="fresh compiles per point (best kept)")
    args = p.parse_args(argv)
    setup(args.devices)

    from rich.console import Console
    from rich.table import Table

    layers = [int(x) for x in args.layers.split(",")]
    micro = [int(x) for x in args.microbatches.split(",")]
    sweeps = {
        "layers (fsdp_tp, data=2,fsdp=2,tensor=2)": [
            (
                n,
                compile_seconds(
                    "fsdp_tp",
                    "data=2,fsdp=2,tensor=2",
                    layers=n,
                    batch=16,
                    seq=64,
                    repeats=args.repeats,
                ),
            )
            for n in layers
        ],
    }
    for schedule in ("gpipe", "1f1b"):
        sweeps[f"micro-batches (pp {schedule}, stage=4,data=2)"] = [
            (m, compile_seconds("pp", "stage=4,data=2", layers=4, batch=2 * max(micro), seq=64,
                                schedule=schedule, microbatches=m, repeats=args.repeats))
            for m in micro
        ]  # fmt: skip

    table = Table(title="compile time of one train step (trace + lower + XLA), best of "
                  f"{args.repeats}, llama tiny on {args.devices} devices")  # fmt: skip
    table.add_column("sweep")
    for i in range(max(len(layers), len(micro))):
        table.add_column(f"#{i + 1}", justify="right")
    table.add_column("largest / smallest", justify="right")
    record = {}
    for name, points in sweeps.items():
        ratio = points[-1][1] / points[0][1]
        record[name] = {"points": points, "ratio": ratio}
        cells = [f"{x}: {t:.2f} s" for x, t in points]
        table.add_row(name, *cells, f"{ratio:.2f}", style="green" if ratio <= 1.5 else "red")
    Console(width=150).print(table)
    path = write_json(args.out / "compile_time.json", {"args": vars(args), "sweeps": record})
    _plot(record, out_dir(args.out) / "compile_time.png")
    print(f"wrote {path} and {args.out / 'compile_time.png'}")
    return 0


def _plot(record: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, data in record.items():
        ax = axes[0] if name.startswith("layers") else axes[1]
        xs, ts = zip(*data["points"], strict=True)
        ax.plot(xs, ts, marker="o", label=f"{name.split('(')[1].rstrip(')')}")
    for ax, xlabel in zip(axes, ("layers", "micro-batches"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("compile time (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("scanned programs: compile time stays flat")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
