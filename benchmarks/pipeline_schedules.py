"""What each pipeline schedule costs: bubble, FLOP overhead, memory, traffic, compile and step time.

A grid over stages p, micro-batches m and schedule (gpipe, 1f1b, circular with r=2 where the
layers divide into p*r blocks), on llama tiny with 8 layers and a mesh of the first p devices
(``stage=p``, or ``stage=p,data=d`` with --data). Per point:

- bubble: the schedule's idle stage-ticks (`Schedule.bubble_fraction`), theory;
- FLOP overhead: matmul FLOPs of the pipelined layer stack over the unpipelined one, measured
  from compiled programs (`sharding.pipeline.stack_flop_overhead`; n/a for 1f1b, whose ticks
  branch between forward and backward so a static count charges every branch);
- temp memory per device and collective-permute bytes per step, from the compiled step;
- compile time, and the median wall time of a few steps.

    python -m benchmarks.pipeline_schedules                   # the full default grid
    python -m benchmarks.pipeline_schedules --stages 4 --microbatches 16 --schedules gpipe,1f1b
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._common import median_time, out_dir, parser, setup, write_json

SCHEDULES = ("gpipe", "1f1b", "circular")
REPEATS = {"gpipe": 1, "1f1b": 1, "circular": 2}


class GridError(ValueError):
    """Grid flags that name nothing runnable."""


def grid(stages: list[int], microbatches: list[int], schedules: list[str],
         n_layers: int) -> tuple[list[tuple[int, int, str]], list[str]]:  # fmt: skip
    """The (p, m, schedule) points to run, and why the others are left out.

    A point needs ``n_layers % (p * r) == 0`` and, for 1f1b and circular, ``m >= p``.

    Example:
        >>> points, skipped = grid([2, 4], [4], ["gpipe", "circular"], 4)
        >>> points, skipped
        ([(2, 4, 'gpipe'), (2, 4, 'circular'), (4, 4, 'gpipe')], ['p=4 m=4 circular: 4 layers do not split into 4 stages x 2 repeats'])
    """
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise GridError(f"unknown schedules {unknown}; choose from {', '.join(SCHEDULES)}")
    points, skipped = [], []
    for p in stages:
        for m in microbatches:
            for s in schedules:
                r = REPEATS[s]
                if n_layers % (p * r):
                    skipped.append(f"p={p} m={m} {s}: {n_layers} layers do not split into "
                                   f"{p} stages x {r} repeats")  # fmt: skip
                elif s != "gpipe" and m < p:
                    skipped.append(f"p={p} m={m} {s}: needs micro-batches >= stages")
                else:
                    points.append((p, m, s))
    if not points:
        raise GridError(f"no runnable point in the grid: {'; '.join(skipped)}")
    return points, skipped


def implied_bubble(overhead: float | None) -> float | None:
    """The bubble fraction a FLOP overhead implies: (m+p-1)/m -> (p-1)/(m+p-1).

    Example:
        >>> round(implied_bubble(11 / 8), 4)
        0.2727
    """
    return None if overhead is None else 1.0 - 1.0 / overhead


def measure(p: int, m: int, schedule: str, args: Any) -> dict[str, Any]:
    """Compile, inspect and time one grid point."""
    import jax
    from flax import nnx

    import models
    from sharding import MeshSpec, Workload
    from sharding.comparison import Settings, build
    from sharding.costmodel import Layout
    from sharding.pipeline import stack_flop_overhead

    fam = models.get_family("llama")
    cfg = fam.config("tiny", n_layers=args.layers)
    n = p * args.data
    batch = args.batch or m * args.data
    cand = Layout("pp", str(MeshSpec(stage=p, data=args.data)), schedule, m, REPEATS[schedule])
    program = build(
        cand,
        Workload.from_family(fam, cfg),
        Settings(batch, args.seq),
        devices=jax.devices()[:n],
    )
    spec, mesh = cand.pipeline(), program.mesh
    report = program.report()  # compiles; program.compile_time_s is tracing + XLA
    overhead = None
    if schedule != "1f1b" and not args.no_overhead:
        model = nnx.eval_shape(lambda: fam.Model(cfg, rngs=nnx.Rngs(0)))
        overhead = stack_flop_overhead(model, spec, mesh, batch, args.seq)
    state = {"s": program.init(0)}
    data = program.shard_batch(fam.make_batch(cfg, batch, args.seq))
    losses = []

    def one() -> None:
        state["s"], metrics = program.step(state["s"], data)
        losses.append(float(metrics["loss"]))

    for _ in range(args.warmup):
        one()
    step_s, times = median_time(one, args.steps)
    sched = program.schedule
    return {
        "stages": p, "microbatches": m, "schedule": schedule, "repeats": REPEATS[schedule],
        "mesh": str(MeshSpec(stage=p, data=args.data)), "batch": batch, "ticks": sched.ticks,
        "bubble": sched.bubble_fraction, "peak_activations": max(sched.peak_activations),
        "flop_overhead": None if overhead is None else overhead["overhead"],
        "flop_overhead_theory": None if overhead is None else overhead["theory"],
        "temp_bytes": report.memory.temp if report.memory else None,
        "permute_bytes": report.collective_bytes("collective-permute"),
        "permute_count": report.count("collective-permute"),
        "collective_bytes": report.collective_bytes(),
        "compile_time_s": program.compile_time_s, "step_time_s": step_s, "step_times_s": times,
        "losses": losses,
    }  # fmt: skip


def table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    from sharding import fmt_bytes

    t = Table(title="pipeline schedules on llama tiny (8 layers)")
    for col in ("p", "m", "schedule", "ticks", "bubble (theory)", "FLOP overhead",
                "(theory)", "peak act.", "temp/device", "permute bytes/step", "compile s",
                "step ms"):  # fmt: skip
        t.add_column(col, justify="left" if col == "schedule" else "right")
    for r in rows:
        name = r["schedule"] + (f" r={r['repeats']}" if r["repeats"] > 1 else "")
        over, theory = r["flop_overhead"], r["flop_overhead_theory"]
        t.add_row(
            str(r["stages"]), str(r["microbatches"]), name, str(r["ticks"]), f"{r['bubble']:.1%}",
            "n/a" if over is None else f"{over:.3f}", "" if theory is None else f"{theory:.3f}",
            str(r["peak_activations"]),
            "n/a" if r["temp_bytes"] is None else fmt_bytes(r["temp_bytes"]),
            f"{fmt_bytes(r['permute_bytes'])} ({r['permute_count']})",
            f"{r['compile_time_s']:.1f}", f"{r['step_time_s'] * 1e3:.1f}",
        )  # fmt: skip
    return t


def plot(rows: list[dict[str, Any]], path: Any) -> Any:
    """Left: bubble in theory against the bubble the measured FLOP overhead implies, by m.
    Right: compiled temp memory per device of gpipe and 1f1b, by m."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = dict.fromkeys((r["stages"], r["schedule"]) for r in rows)
    for p, s in keys:
        mine = sorted((r for r in rows if (r["stages"], r["schedule"]) == (p, s)),
                      key=lambda r: r["microbatches"])  # fmt: skip
        ms = [r["microbatches"] for r in mine]
        (line,) = left.plot(ms, [r["bubble"] for r in mine], "o-", label=f"p={p} {s} theory")
        measured = [(r["microbatches"], implied_bubble(r["flop_overhead"])) for r in mine
                    if r["flop_overhead"] is not None]  # fmt: skip
        if measured:
            left.plot(*zip(*measured, strict=True), "x--", color=line.get_color(), markersize=9,
                      label=f"p={p} {s} from FLOPs")  # fmt: skip
        if s in ("gpipe", "1f1b") and all(r["temp_bytes"] is not None for r in mine):
            right.plot(ms, [r["temp_bytes"] / 2**20 for r in mine], "o-" if s == "gpipe" else "s--",
                       label=f"p={p} {s}")  # fmt: skip
    left.set_title("bubble: schedule theory vs implied by measured FLOP overhead", fontsize=9)
    left.set_ylabel("bubble fraction")
    right.set_title("compiled temp memory per device", fontsize=9)
    right.set_ylabel("MiB")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ms = sorted({r["microbatches"] for r in rows})
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches m")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = parser("pipeline_schedules", __doc__.split("\n\n")[0])
    p.add_argument("--stages", default="2,4", help="p values (default: %(default)s)")
    p.add_argument("--microbatches", default="4,8,16", help="m values (default: %(default)s)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="llama tiny n_layers (default: 8)")
    p.add_argument("--data", type=int, default=1, help="data-parallel size beside stage")
    p.add_argument("--batch", type=int, help="global batch (default: m x data, 1 row/micro)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the FLOP-overhead compiles (2 more per gpipe/circular point)")  # fmt: skip
    args = p.parse_args(argv)
    points, skipped = grid(_ints(args.stages), _ints(args.microbatches),
                           [s.strip() for s in args.schedules.split(",")], args.layers)  # fmt: skip
    need = max(pt[0] for pt in points) * args.data
    if need > args.devices:
        raise GridError(f"p={need // args.data} x data={args.data} needs {need} devices; "
                        f"--devices is {args.devices}")  # fmt: skip
    setup(args.devices)

    from rich.console import Console

    console = Console(width=170)
    rows = []
    started = time.perf_counter()
    with console.status("") as status:
        for i, (st, m, s) in enumerate(points):
            status.update(f"[{i + 1}/{len(points)}] p={st} m={m} {s}")
            rows.append(measure(st, m, s, args))
    elapsed = time.perf_counter() - started
    console.print(table(rows))
    for line in skipped:
        console.print(f"[yellow]skipped[/] {line}")
    pairs = {(r["stages"], r["microbatches"], r["schedule"]): r for r in rows}
    for (st, m, s), r in pairs.items():
        g = pairs.get((st, m, "gpipe"))
        if s == "1f1b" and g and g["temp_bytes"] and r["temp_bytes"] is not None:
            console.print(f"p={st} m={m}: 1f1b temp / gpipe temp = "
                          f"{r['temp_bytes'] / g['temp_bytes']:.2f}")  # fmt: skip
    console.print(f"{len(rows)} points in {elapsed:.0f} s (seq {args.seq}, data={args.data})")
    out = out_dir(args.out)
    record = {"benchmark": "pipeline_schedules", "model": {"family": "llama", "size": "tiny",
              "n_layers": args.layers}, "args": {k: v for k, v in vars(args).items()
              if k != "out"}, "rows": rows, "skipped": skipped, "elapsed_s": elapsed}  # fmt: skip
    write_json(out / "pipeline_schedules.json", record)
    plot(rows, out / "pipeline_schedules.png")
    console.print(f"wrote {out / 'pipeline_schedules.json'} and {out / 'pipeline_schedules.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
