"""Predictions against published measurements: the measuring stick of the step-time model.

Prices every run of `benchmarks/data/published_runs.toml` (Megatron-LM's paper and README,
torchtitan; each row with its source and published unit) the way a user would: the row's exact
model, layout, global batch, micro-batch and recompute setting through
`sharding.costmodel.predict` and `step_time` on the row's hardware (`sharding.targets`), nothing
compiled and nothing fitted. Prints published vs predicted tokens/s per GPU with their ratio and
what dominates each prediction (compute, exposed communication, bubble), the summary figures
(median |error|, worst, share within 15%), writes JSON and a log-log PNG of predicted against
published coloured by layout kind; rows it cannot price are listed with the reason.

    python -m benchmarks.published_runs
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import tomllib
from pathlib import Path
from typing import Any

from benchmarks._common import out_dir, parser, write_json

DATA = Path(__file__).parent / "data" / "published_runs.toml"
ROOT = Path(__file__).parent.parent
ACCURACY = ROOT / "sharding" / "costmodel" / "accuracy.json"  # the library's copy of the errors
# Recompute as published -> spmdkit's remat policy (selective: Megatron's and torchtitan's keep
# the matmul outputs and recompute attention's core, as "dots" does).
REMAT = {"full": "full", "selective": "dots", "none": "none"}
WITHIN = 0.15


def load(path: Path = DATA) -> dict[str, Any]:
    """The data file: ``{"models": {...}, "run": [...], "conversions": {...}}``."""
    with path.open("rb") as f:
        return tomllib.load(f)


def config(arch: dict[str, Any], name: str, seq: int) -> tuple[Any, Any]:
    """(family module, Config) of an architecture row."""
    import models

    if arch["family"] == "llama":
        base = models.llama.config("3-8b")
        cfg = dataclasses.replace(
            base, name=name, n_layers=arch["layers"], d_model=arch["d_model"],
            n_heads=arch["heads"], n_kv_heads=arch["kv_heads"], head_dim=arch["d_model"] // arch["heads"],
            d_ff=arch["ffn"], vocab_size=arch["vocab"], max_seq_len=max(seq, base.max_seq_len),
        )  # fmt: skip
        return models.llama, cfg
    cfg = models.gpt2.Config(name=name, vocab_size=arch["vocab"], d_model=arch["d_model"],
                             n_layers=arch["layers"], n_heads=arch["heads"],
                             d_ff=arch.get("ffn", 4 * arch["d_model"]), max_seq_len=seq)  # fmt: skip
    return models.gpt2, cfg


def kind(layout: dict[str, Any]) -> str:
    """The layout's kind (`sharding.costmodel.layout_kind`: the key of compare's expected
    error): pipeline, tensor, fsdp or data parallel."""
    from sharding.costmodel import layout_kind

    return layout_kind({k: v for k, v in layout.items() if isinstance(v, int)})


def layout_text(layout: dict[str, Any]) -> str:
    parts = [f"{k.upper()}{layout[k]}" for k in ("data", "fsdp", "tensor", "stage") if k in layout]
    parts += ["SP"] if layout.get("sp") else []
    if "schedule" in layout:
        v = layout.get("virtual", 1)
        parts.append(layout["schedule"] + (f" v{v}" if v > 1 else ""))
    return " ".join(parts)


def price(run: dict[str, Any], arch: dict[str, Any]) -> dict[str, Any]:
    """One run priced on its layout, or ``{"reason": ...}`` where it cannot be."""
    from sharding.costmodel import predict, step_time, work_from_prediction
    from sharding.targets import PROFILES, target

    if run["device"] not in PROFILES:
        return {"reason": f"no device profile for {run['device']!r} (spmdkit has "
                          f"{', '.join(PROFILES)})"}  # fmt: skip
    lay = run["layout"]
    family, cfg = config(arch, run["model"], run["seq"])
    mesh = {k: lay[k] for k in ("data", "fsdp", "tensor", "stage") if k in lay}
    parts = [p for p, axis in (("fsdp", "fsdp"), ("tp", "tensor"), ("pp", "stage")) if axis in lay]
    if lay.get("sp"):
        parts.insert(parts.index("tp") + 1, "sp")
    strategy = "+".join(parts) or "dp"
    replicas = lay.get("data", 1) * lay.get("fsdp", 1)
    passes = run["gbs"] // (replicas * run["mbs"])  # micro-batches (pipelines) or micro-steps
    pipeline = (lay["schedule"], passes, lay.get("virtual", 1)) if "stage" in lay else None
    tgt = target(f"{run['device']}:{run['gpus'] // 8}x8")
    pred = predict(family, cfg, strategy, mesh, run["gbs"], run["seq"], pipeline=pipeline,
                   dtype="bfloat16", remat=REMAT[run["recompute"]],
                   accum=1 if pipeline else passes,
                   attention=run.get("attention", "auto"))  # fmt: skip
    useful = predict(family, cfg, "dp", {}, run["gbs"], run["seq"], dtype="bfloat16")
    work = work_from_prediction(pred, model_flops=useful.matmul_flops)
    work.tensor_overlap = run.get("tp_comm_overlap", False)
    work.reduction_overlap = run.get("grad_overlap", False)
    st = step_time(work, tgt)
    terms = {"compute": st.compute_s, "exposed comm": st.exposed_comm_s, "bubble": st.bubble_s}
    return {
        "strategy": strategy, "mesh": mesh, "target": tgt.name, "step_s": st.step_s,
        "predicted": st.throughput_per_device, "mfu": st.mfu, "terms": terms,
        "dominant": max(terms, key=terms.get),
        "memory_fits": pred.memory_bytes <= tgt.device.hbm_bytes,
    }  # fmt: skip


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["ratio"] - 1) for r in rows]
    return {"priced": len(rows), "median_abs_error": statistics.median(errors),
            "worst_abs_error": max(errors),
            "within_15": sum(e <= WITHIN for e in errors) / len(errors)}  # fmt: skip


def accuracy(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The table `sharding.costmodel.expected_error` ships: per layout kind (and over all), the
    runs priced, median and worst |error|, the share within 15%, to 0.1%, and their sources."""

    def of(subset: list[dict[str, Any]]) -> dict[str, Any]:
        s = summary(subset)
        return {"runs": s["priced"], "median": round(s["median_abs_error"], 3),
                "worst": round(s["worst_abs_error"], 3), "within_15": round(s["within_15"], 3),
                "measured": "; ".join(sorted({r["source"] for r in subset}))}  # fmt: skip

    kinds = sorted({r["kind"] for r in rows})
    return {"source": "python -m benchmarks.published_runs --accuracy", "all": of(rows), "kinds": {k: of([r for r in rows if r["kind"] == k]) for k in kinds}}  # fmt: skip


def plot(rows: list[dict[str, Any]], path: Path, held: list[dict[str, Any]] = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6), layout="constrained")
    colours = {"data": "tab:blue", "fsdp": "tab:green", "tensor": "tab:orange",
               "pipeline": "tab:red"}  # fmt: skip
    for k, colour in colours.items():
        pts = [r for r in rows if r["kind"] == k]
        if pts:
            ax.scatter([r["published"] for r in pts], [r["predicted"] for r in pts], c=colour,
                       label=k, s=36, zorder=3)  # fmt: skip
    if held:
        ax.scatter([r["published"] for r in held], [r["predicted"] for r in held], c="black",
                   marker="*", s=90, label="held out", zorder=4)  # fmt: skip
    for r in [*rows, *held]:
        ax.annotate(r["id"], (r["published"], r["predicted"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")  # fmt: skip
    every = [*rows, *held]
    lo = min(min(r["published"], r["predicted"]) for r in every) / 1.5
    hi = max(max(r["published"], r["predicted"]) for r in every) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
    ax.fill_between([lo, hi], [lo * (1 - WITHIN), hi * (1 - WITHIN)],
                    [lo * (1 + WITHIN), hi * (1 + WITHIN)], color="0.9", label="within 15%")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="published tokens/s per GPU", ylabel="predicted tokens/s per GPU",
           title="spmdkit's step-time model on published runs")  # fmt: skip
    ax.legend(loc="upper left")
    out_dir(path.parent)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def priced(data: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[list, list]:
    """(rows priced, each with its ratio and kind; [{"id", "reason"}] of those that cannot be)."""
    rows, unpriced = [], []
    for run in runs:
        got = price(run, data["models"][run["model"]])
        if "reason" in got:
            unpriced.append({"id": run["id"], "reason": got["reason"]})
            continue
        rows.append({"id": run["id"], "source": run["source"], "model": run["model"],
                     "gpus": run["gpus"], "device": run["device"],
                     "layout": layout_text(run["layout"]), "kind": kind(run["layout"]), "assumed": run.get("assumed", []),
                     "published": run["tokens_per_gpu"], **got,
                     "ratio": got["predicted"] / run["tokens_per_gpu"]})  # fmt: skip
    return rows, unpriced


def _table(title: str, rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in ("id", "model", "GPUs", "layout", "published", "predicted", "ratio", "dominates"):
        table.add_column(col, justify="left" if col in ("id", "model", "layout") else "right")
    for r in rows:
        off = abs(r["ratio"] - 1) > WITHIN
        table.add_row(r["id"], r["model"], f"{r['gpus']} {r['device']}", r["layout"],
                      f"{r['published']:.4g}", f"{r['predicted']:.4g}", f"{r['ratio']:.2f}",
                      r["dominant"], style="red" if off else None)  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    p = parser("published_runs", __doc__)
    p.add_argument("--data", type=Path, default=DATA, help="the runs (default: %(default)s)")
    p.add_argument("--accuracy", action="store_true",
                   help=f"write the by-kind errors to {ACCURACY.relative_to(ROOT)}, the table "
                        f"compare's recommendation quotes")  # fmt: skip
    args = p.parse_args(argv)

    from rich.console import Console

    start, data = time.perf_counter(), load(args.data)
    rows, unpriced = priced(data, data["run"])
    held, held_unpriced = priced(data, data.get("held_out", []))
    stats = summary(rows)
    console = Console(width=140)
    console.print(_table(f"published vs predicted tokens/s per GPU ({len(rows)} runs priced)",
                         rows))  # fmt: skip
    console.print(f"median |error| {stats['median_abs_error']:.1%}, worst "
                  f"{stats['worst_abs_error']:.1%}, within 15%: {stats['within_15']:.0%} of "
                  f"{stats['priced']}")  # fmt: skip
    for u in unpriced + held_unpriced:
        console.print(f"not priced: {u['id']}: {u['reason']}")
    if held:
        console.print(_table(f"held out: {len(held)} run(s) the model was not derived on", held))
        h = summary(held)
        console.print(f"held out: median |error| {h['median_abs_error']:.1%}, worst "
                      f"{h['worst_abs_error']:.1%} of {h['priced']}")  # fmt: skip
    table = accuracy(rows)
    for k, a in table["kinds"].items():
        console.print(f"{k}: {a['runs']} runs, median |error| {a['median']:.1%}, worst "
                      f"{a['worst']:.1%}, within 15%: {a['within_15']:.0%}")  # fmt: skip
    if args.accuracy:
        ACCURACY.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {ACCURACY.relative_to(ROOT)}")
    png = plot(rows, args.out / "published_runs.png", held)
    path = write_json(args.out / "published_runs.json",
                      {"summary": stats, "accuracy": table, "rows": rows, "unpriced": unpriced,
                       "held_out": {"summary": summary(held) if held else None, "rows": held,
                                    "unpriced": held_unpriced},
                       "seconds": time.perf_counter() - start})  # fmt: skip
    print(f"wrote {path} and {png} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
