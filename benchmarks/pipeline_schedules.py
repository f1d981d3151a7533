"""What each pipeline schedule costs on a target: its lock-step critical path against the theory.

Per schedule (gpipe, circular r=2, 1f1b, interleaved v=2, zb-h1), stages p and micro-batches m,
on llama (default tiny with 8 layers): the schedule's table priced in lock-step by
`Schedule.tick_costs` (each tick lasts as long as its slowest stage), from per-stage costs taken
from compiled programs, not constants. On one CPU device, per p:

- F: one stage's forward, the stack's first L/p layers, on one micro-batch, keeping every
  layer's residuals; the fused backward (1f1b's B) from them; zb-h1's B (input gradient) and W
  (weight gradient), which add up to the fused backward (`sharding.pipeline.stage_work`: the
  executor's own pieces, compiled);
- the head and loss (final norm, LM head, cross-entropy) forward and VJP on one micro-batch,
  added to the last stage: to its forward and backward under gpipe and circular (autodiff's
  order), all in its forward under 1f1b, interleaved and zb-h1 (their last forward runs the head
  and its VJP at once).

Matmul FLOPs are counted with `sharding.inspection.count_flops` and priced on ``--target`` by
`sharding.costmodel.step_time` (the target's matmul fraction of its dense peak). A schedule
whose backward is split (zb-h1) runs B and W; the others run the fused backward. The pipeline's
permutes are not priced: this is the compute critical path. `Schedule.tick_costs` takes one cost
per stage and charges a chunk of circular or interleaved 1/repeats of it, so the last stage's
head is spread over its chunks there (it runs after the last chunk only).

Outputs: a table, JSON and a PNG (bubble fraction against m, one panel per p, theory with F = B
= W dashed, priced solid). The issue's two claims are checked at p=4, m=8 (exit 1 if one fails):
zb-h1's priced bubble (`TickCosts.bubble`: the time the busiest stage waits) at most 1/2 of
1f1b's, interleaved v=2's at most 0.55 of it. With F = B = W they are 1/3 and 1/2.

    python -m benchmarks.pipeline_schedules                   # the default grid, h100:1x8
    python -m benchmarks.pipeline_schedules --stages 4 --microbatches 8 --target h200:1x8
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from benchmarks._common import out_dir, parser, setup, write_json

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zb-h1")
REPEATS = {"circular": 2, "interleaved": 2}  # chunks of layers per stage; the others 1
# The acceptance at p=4, m=8: (schedule, its priced bubble fraction / 1f1b's at most).
CLAIMS = (("zb-h1", 0.5), ("interleaved", 0.55))
CLAIM_POINT = (4, 8)


class GridError(ValueError):
    """Flags that name nothing runnable, or a target the stages do not divide."""


def label(schedule: str) -> str:
    """A schedule's name with its chunks: ``circular r=2``, ``interleaved v=2``.

    Example:
        >>> label("circular"), label("interleaved"), label("1f1b")
        ('circular r=2', 'interleaved v=2', '1f1b')
    """
    r = REPEATS.get(schedule, 1)
    return schedule if r == 1 else f"{schedule} {'v' if schedule == 'interleaved' else 'r'}={r}"


def grid(stages: list[int], microbatches: list[int], schedules: list[str],
         n_layers: int) -> tuple[list[tuple[int, int, str]], list[str]]:  # fmt: skip
    """The (p, m, schedule) points to price, and why the others are left out.

    A point is what `make_schedule` builds and ``n_layers`` splits into ``p * repeats`` equal
    chunks; a refusal is listed with the first sentence of the library's reason.

    Example:
        >>> points, skipped = grid([2, 4], [2], ["1f1b", "interleaved"], 8)
        >>> points
        [(2, 2, '1f1b'), (2, 2, 'interleaved')]
        >>> skipped[0]
        "p=4 m=2 1f1b: schedule='1f1b' needs microbatches >= stages, got microbatches=2 < stages=4"
    """
    from sharding.pipeline import ScheduleError, check_layers, make_schedule

    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise GridError(f"unknown schedules {unknown}; choose from {', '.join(SCHEDULES)}")
    points, skipped = [], []
    for p in stages:
        for m in microbatches:
            for s in schedules:
                r = REPEATS.get(s, 1)
                try:
                    make_schedule(p, m, s, r)
                    check_layers(n_layers, p, r)
                except ScheduleError as err:
                    skipped.append(f"p={p} m={m} {s}: {_first_clause(str(err))}")
                else:
                    points.append((p, m, s))
    if not points:
        raise GridError(f"no runnable point in the grid: {'; '.join(skipped)}")
    return points, skipped


def _first_clause(text: str) -> str:
    """A library message up to its explanation (``': '``) or its first sentence."""
    return text.split(": ")[0].split(". ")[0]


@dataclasses.dataclass(frozen=True)
class Costs:
    """Matmul FLOPs of one stage's pieces for one micro-batch, read from compiled programs.

    ``forward``, ``input_grad`` (B), ``weight_grad`` (W) and ``backward`` (the fused VJP) are of
    one stage of ``layers`` layers; ``head_forward`` and ``head_backward`` of the head and loss.
    ``compile_s``: seconds spent tracing and compiling them.
    """

    stages: int
    layers: int
    forward: int
    input_grad: int
    weight_grad: int
    backward: int
    head_forward: int
    head_backward: int
    head_input_grad: int
    head_weight_grad: int
    compile_s: float

    def per_stage(self, schedule: Any) -> tuple[list[float], list[float], list[float]]:
        """(F, B, W) per stage for `Schedule.tick_costs`, the head's work on the last stage.

        A split backward (zb-h1) runs B then W; a fused one costs ``backward + weight`` there,
        so it is given as (fused backward, 0). Explicit schedules run the head's forward and VJP
        inside the last stage's forward; gpipe and circular run its VJP in the backward.
        """
        p = self.stages
        if schedule.splits_backward:
            f, b, w = [self.forward] * p, [self.input_grad] * p, [self.weight_grad] * p
        else:
            f, b, w = [self.forward] * p, [self.backward] * p, [0] * p
        if schedule.splits_backward:  # zb-h1: the head's weight gradient waits for W too
            f[-1] += self.head_forward + self.head_input_grad
            w[-1] += self.head_weight_grad
        elif schedule.explicit:
            f[-1] += self.head_forward + self.head_backward
        else:
            f[-1] += self.head_forward
            b[-1] += self.head_backward
        return [float(x) for x in f], [float(x) for x in b], [float(x) for x in w]


def stage_costs(p: int, args: Any) -> Costs:
    """One stage's F, B, W and fused backward (and the head's forward and VJP), compiled on one
    CPU device from the pieces the explicit schedules run (`sharding.pipeline.stage_work`); a
    micro-batch is ``args.rows x args.seq`` tokens. Matmul FLOPs do not depend on the dtype."""
    from models import llama
    from sharding import Workload
    from sharding.pipeline import check_layers, stage_work

    started = time.perf_counter()
    cfg = dataclasses.replace(llama.config(args.size), n_layers=args.layers)
    n = check_layers(cfg.n_layers, p)
    w = stage_work(Workload.from_family(llama, cfg), n, args.rows, args.seq)
    return Costs(p, n, w["forward"], w["input_grad"], w["weight_grad"], w["backward"],
                 w["head_forward"], w["head_backward"], w["head_input_grad"],
                 w["head_weight_grad"], time.perf_counter() - started)  # fmt: skip


def price(p: int, m: int, schedule: str, costs: Costs, args: Any) -> dict[str, Any]:
    """One grid point: the schedule's lock-step critical path in FLOPs and on the target."""
    from sharding.costmodel import StepWork, step_time
    from sharding.pipeline import make_schedule
    from sharding.targets import target

    tgt = target(args.target)
    sched = make_schedule(p, m, schedule, REPEATS.get(schedule, 1))
    tc = sched.tick_costs(*costs.per_stage(sched))
    data = tgt.devices // p  # replicas of the pipeline, each running the same ticks
    work = StepWork(
        mesh={"stage": p, "data": data}, matmul_flops=tc.critical, collectives=[],
        tokens=data * m * args.rows * args.seq, dtype=args.dtype, bubble_flops=tc.bubble,
        bubble_fraction=tc.bubble_fraction, schedule=schedule, source="compiled stage programs",
    )  # fmt: skip
    st = step_time(work, tgt)
    return {
        "stages": p, "microbatches": m, "schedule": schedule, "label": label(schedule),
        "repeats": sched.repeats, "ticks": len(tc.ticks), "scan_ticks": sched.ticks,
        "bubble_theory": sched.bubble_fraction, "bubble_priced": tc.bubble_fraction,
        "critical_flops": tc.critical, "busiest_flops": tc.busiest, "bubble_flops": tc.bubble,
        "step_s": st.step_s, "bubble_s": st.bubble_s, "compute_s": st.compute_s,
        "tokens_per_s_per_device": st.throughput_per_device,
        "peak_activations": max(sched.peak_activations),
    }  # fmt: skip


def check_claims(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's claims at p=4, m=8: each schedule's priced bubble (`TickCosts.bubble`, the
    time the busiest stage waits) over 1f1b's, against its limit; the ratio of the bubble
    fractions is given beside it. ``holds`` is None where the grid lacks the point.

    Example:
        >>> rows = [{"stages": 4, "microbatches": 8, "schedule": s, "bubble_flops": b,
        ...          "bubble_priced": b / 10} for s, b in (("1f1b", 9), ("zb-h1", 3),
        ...                                                  ("interleaved", 5))]
        >>> [(c["schedule"], round(c["ratio"], 3), c["holds"]) for c in check_claims(rows)]
        [('zb-h1', 0.333, True), ('interleaved', 0.556, False)]
    """
    p, m = CLAIM_POINT
    at = {r["schedule"]: r for r in rows if (r["stages"], r["microbatches"]) == (p, m)}
    out = []
    for schedule, limit in CLAIMS:
        claim = {"claim": f"{label(schedule)} bubble <= {limit:g} x 1f1b's at p={p}, m={m}",
                 "schedule": schedule, "stages": p, "microbatches": m, "limit": limit,
                 "ratio": None, "fraction_ratio": None, "holds": None}  # fmt: skip
        one = at.get("1f1b")
        if schedule in at and one and one["bubble_flops"] > 0:
            mine = at[schedule]
            claim["ratio"] = mine["bubble_flops"] / one["bubble_flops"]
            claim["fraction_ratio"] = mine["bubble_priced"] / one["bubble_priced"]
            claim["holds"] = claim["ratio"] <= limit
        out.append(claim)
    return out


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f}"


def costs_table(costs: list[Costs], args: Any) -> Any:
    from rich.table import Table

    from sharding import fmt_count

    t = Table(title=f"one stage's pieces per micro-batch ({args.rows} x {args.seq} tokens), "
                    f"matmul FLOPs from the compiled programs")  # fmt: skip
    for col in ("p", "layers", "F", "B (input)", "W (weights)", "B + W", "fused backward",
                "head F", "head VJP", "compile s"):  # fmt: skip
        t.add_column(col, justify="right")
    for c in costs:
        t.add_row(str(c.stages), str(c.layers), fmt_count(c.forward), fmt_count(c.input_grad),
                  fmt_count(c.weight_grad), fmt_count(c.input_grad + c.weight_grad),
                  fmt_count(c.backward), fmt_count(c.head_forward), fmt_count(c.head_backward),
                  f"{c.compile_s:.1f}")  # fmt: skip
    return t


def table(rows: list[dict[str, Any]], args: Any) -> Any:
    from rich.table import Table

    from sharding import fmt_count

    t = Table(title=f"pipeline schedules on llama {args.size} ({args.layers} layers), priced on "
                    f"{args.target} ({args.dtype})")  # fmt: skip
    for col in ("p", "m", "schedule", "ticks", "bubble (theory)", "bubble (priced)",
                "critical FLOPs", "step us", "bubble us", "step / 1f1b"):  # fmt: skip
        t.add_column(col, justify="left" if col == "schedule" else "right")
    ref = {(r["stages"], r["microbatches"]): r for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        one = ref.get((r["stages"], r["microbatches"]))
        t.add_row(
            str(r["stages"]), str(r["microbatches"]), r["label"], str(r["ticks"]),
            f"{r['bubble_theory']:.1%}", f"{r['bubble_priced']:.1%}",
            fmt_count(r["critical_flops"]), _us(r["step_s"]), _us(r["bubble_s"]),
            "" if one is None else f"{r['step_s'] / one['step_s']:.3f}",
        )  # fmt: skip
    return t


def plot(rows: list[dict[str, Any]], path: Any) -> Any:
    """Bubble fraction against m, one panel per p: theory (F = B = W) dashed, priced solid.

    gpipe and 1f1b (circular and interleaved) price alike in lock-step, so gpipe and circular
    are drawn wide and pale under them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["stages"] for r in rows})
    fig, axes = plt.subplots(1, len(stages), figsize=(5.5 * len(stages), 4.2), squeeze=False,
                             sharey=True)  # fmt: skip
    colours = dict(zip(SCHEDULES, plt.rcParams["axes.prop_cycle"].by_key()["color"],
                       strict=False))  # fmt: skip
    for ax, p in zip(axes[0], stages, strict=True):
        for s in SCHEDULES:
            mine = sorted((r for r in rows if (r["stages"], r["schedule"]) == (p, s)),
                          key=lambda r: r["microbatches"])  # fmt: skip
            if not mine:
                continue
            ms = [r["microbatches"] for r in mine]
            under = s in ("gpipe", "circular")  # drawn wide and pale: others price alike
            style = {"color": colours[s], "lw": 5 if under else 1.5, "ms": 9 if under else 5,
                     "alpha": 0.35 if under else 0.9}  # fmt: skip
            ax.plot(ms, [r["bubble_priced"] for r in mine], "o-", label=f"{label(s)} priced",
                    **style)  # fmt: skip
            ax.plot(ms, [r["bubble_theory"] for r in mine], "x--", label=f"{label(s)} theory",
                    **style)  # fmt: skip
        ms = sorted({r["microbatches"] for r in rows if r["stages"] == p})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("micro-batches m")
        ax.set_title(f"p = {p} stages", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bubble fraction of the critical path")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle("lock-step bubble: theory (F = B = W, dashed) vs priced from compiled stages "
                 "(solid)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = parser("pipeline_schedules", __doc__.split("\n\n")[0])
    p.add_argument("--stages", default="2,4", help="p values (default: %(default)s)")
    p.add_argument("--microbatches", default="4,8,16,32", help="m values (default: %(default)s)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="(default: %(default)s)")
    p.add_argument("--size", default="tiny", help="llama size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="n_layers (default: %(default)s)")
    p.add_argument("--rows", type=int, default=1, help="rows per micro-batch (default: 1)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype, compiled and priced (default: %(default)s)")  # fmt: skip
    p.add_argument("--target", default="h100:1x8", help="target to price on (default: "
                   "%(default)s; see sharding.targets)")  # fmt: skip
    args = p.parse_args(argv)
    points, skipped = grid(_ints(args.stages), _ints(args.microbatches),
                           [s.strip() for s in args.schedules.split(",")], args.layers)  # fmt: skip
    from sharding.targets import target

    tgt = target(args.target)
    odd = sorted({pt[0] for pt in points if tgt.devices % pt[0]})
    if odd:
        raise GridError(f"target {tgt.name} has {tgt.devices} devices, which p={odd} do not "
                        f"divide; pick a target or stages that do")  # fmt: skip
    setup(args.devices)

    from rich.console import Console

    console = Console(width=170)
    started = time.perf_counter()
    costs: dict[int, Costs] = {}
    rows = []
    with console.status("") as status:
        for st in sorted({pt[0] for pt in points}):
            status.update(f"compiling one stage of p={st}: F, B, W, fused backward, head")
            costs[st] = stage_costs(st, args)
        for st, m, s in points:
            rows.append(price(st, m, s, costs[st], args))
    elapsed = time.perf_counter() - started
    console.print(costs_table(list(costs.values()), args))
    console.print(table(rows, args))
    for line in skipped:
        console.print(f"[yellow]skipped[/] {line}")
    claims = check_claims(rows)
    for c in claims:
        if c["holds"] is None:
            console.print(f"[yellow]not checked[/] {c['claim']}: the grid lacks the point")
        else:
            verdict = "[green]holds[/]" if c["holds"] else "[red]FAILS[/]"
            console.print(f"{verdict} {c['claim']}: bubble ratio {c['ratio']:.3f} (bubble "
                          f"fractions {c['fraction_ratio']:.3f})")  # fmt: skip
    console.print(f"{len(rows)} points in {elapsed:.1f} s ({args.rows} x {args.seq} tokens per "
                  f"micro-batch); {tgt.describe()}")  # fmt: skip
    out = out_dir(args.out)
    record = {"benchmark": "pipeline_schedules", "model": {"family": "llama", "size": args.size,
              "n_layers": args.layers}, "target": tgt.to_dict(),
              "args": {k: v for k, v in vars(args).items() if k != "out"},
              "stage_flops": [dataclasses.asdict(c) for c in costs.values()], "rows": rows,
              "claims": claims, "skipped": skipped, "elapsed_s": elapsed}  # fmt: skip
    write_json(out / "pipeline_schedules.json", record)
    plot(rows, out / "pipeline_schedules.png")
    console.print(f"wrote {out / 'pipeline_schedules.json'} and {out / 'pipeline_schedules.png'}")
    return 1 if any(c["holds"] is False for c in claims) else 0


if __name__ == "__main__":
    raise SystemExit(main())
