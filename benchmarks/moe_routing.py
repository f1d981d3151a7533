"""Where a mixture of experts' tokens go: tokens per expert and the dropped fraction against the
capacity factor, for a random router and one trained a few steps.

On llama-moe (default tiny: 4 experts, top-2, 2 layers), one batch of ``--batch`` x ``--seq``
tokens, per capacity factor (default 1.0, 1.25, 2.0 and dropless): each layer's assignments per
expert (before capacity), those kept, the dropped fraction of all assignments and the
load-balancing loss (`models.llama_moe.routing_report`). "random" is the router at
initialisation; "trained" after ``--steps`` optimizer steps of the expert-parallel program
(strategy ep on ``--mesh``, capacity factor ``--train-capacity``) on synthetic batches. Capacity
is counted per sequence (``ceil(k * S / E * capacity_factor)``), so the figures are the same on
any mesh.

Outputs: a table, JSON and a PNG (dropped fraction against the capacity factor; tokens per
expert of the first layer, random and trained).

    python -m benchmarks.moe_routing
    python -m benchmarks.moe_routing --steps 50 --seq 128 --capacity-factors 1.0,1.5,none
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._common import out_dir, parser, setup, write_json


def capacity_factors(text: str) -> list[float | None]:
    """``"1.0,1.25,none"`` -> ``[1.0, 1.25, None]`` (none: dropless).

    Example:
        >>> capacity_factors("1, 2.5, none")
        [1.0, 2.5, None]
    """
    return [
        None if t.strip().lower() in ("none", "dropless") else float(t) for t in text.split(",")
    ]


def label(cf: float | None) -> str:
    return "dropless" if cf is None else f"{cf:g}"


def reports(params: Any, args, factors: list[float | None], router: str) -> list[dict]:
    """One row per capacity factor: the routing report of ``params`` on the benchmark batch."""
    import jax
    import numpy as np
    from flax import nnx

    from models import llama_moe

    rows = []
    for cf in factors:
        cfg = llama_moe.config(args.size, capacity_factor=cf)
        model = nnx.eval_shape(lambda cfg=cfg: llama_moe.Model(cfg, rngs=nnx.Rngs(0)))
        nnx.update(model, jax.tree.map(np.asarray, params))
        batch = llama_moe.make_batch(cfg, args.batch, args.seq, key=jax.random.key(123))
        layers = llama_moe.routing_report(model, batch["inputs"])
        per_expert = np.asarray([r["tokens_per_expert"] for r in layers])
        rows.append({
            "router": router, "capacity_factor": cf, "capacity": layers[0]["capacity"],
            "dropped_fraction": float(np.mean([r["dropped_fraction"] for r in layers])),
            "max_over_mean_load": float((per_expert.max(1) / per_expert.mean(1)).mean()),
            "aux_loss": float(np.mean([r["aux_loss"] for r in layers])), "layers": layers,
        })  # fmt: skip
    return rows


def train(args) -> tuple[Any, Any, list[float]]:
    """(initial params, params after ``args.steps`` steps of ep training, the losses)."""
    import jax

    from models import llama_moe
    from sharding import Workload, build_program

    cfg = llama_moe.config(args.size, capacity_factor=args.train_capacity)
    work = Workload.from_family(llama_moe, cfg)
    prog = build_program(work, "ep", args.mesh, batch=args.batch, seq=args.seq)
    state = prog.init(0)
    initial = jax.tree.map(lambda a: jax.device_get(a), state["params"])
    losses = []
    for step in range(args.steps):
        batch = llama_moe.make_batch(cfg, args.batch, args.seq, key=jax.random.key(step % 4))
        state, metrics = prog.step(state, batch)
        losses.append(float(metrics["loss"]))
    return initial, state["params"], losses


def table(rows: list[dict], args) -> Any:
    from rich.table import Table

    t = Table(title=f"llama-moe {args.size}: routing of {args.batch} x {args.seq} tokens "
              f"(mean over layers; tokens per expert of layer 0)")  # fmt: skip
    for col in ("router", "capacity factor", "capacity / seq", "tokens per expert",
                "kept per expert", "dropped", "max / mean load", "aux loss"):  # fmt: skip
        t.add_column(col, justify="left" if col == "router" else "right")
    for r in rows:
        first = r["layers"][0]
        t.add_row(r["router"], label(r["capacity_factor"]),
                  str(r["capacity"] if r["capacity"] is not None else args.seq),
                  " ".join(map(str, first["tokens_per_expert"])),
                  " ".join(map(str, first["kept_per_expert"])), f"{r['dropped_fraction']:.1%}",
                  f"{r['max_over_mean_load']:.2f}", f"{r['aux_loss']:.3f}")  # fmt: skip
    return t


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for router in ("random", "trained"):
        mine = [r for r in rows if r["router"] == router and r["capacity_factor"] is not None]
        left.plot([r["capacity_factor"] for r in mine], [r["dropped_fraction"] for r in mine],
                  marker="o", label=router)  # fmt: skip
    left.set(xlabel="capacity factor", ylabel="dropped fraction of assignments",
             title="drops (dropless: 0)")  # fmt: skip
    left.legend()
    dropless = {r["router"]: r for r in rows if r["capacity_factor"] is None} or {
        r["router"]: r for r in rows}  # fmt: skip
    width = 0.4
    for i, (router, r) in enumerate(sorted(dropless.items())):
        counts = r["layers"][0]["tokens_per_expert"]
        right.bar([e + (i - 0.5) * width for e in range(len(counts))], counts, width, label=router)
    right.set(xlabel="expert", ylabel="assignments (layer 0)", title="tokens per expert")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = parser("moe_routing", __doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", help="llama-moe size (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="sequences (default: %(default)s)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default: %(default)s)")
    p.add_argument("--capacity-factors", default="1.0,1.25,2.0,none",
                   help="factors to report, 'none' = dropless (default: %(default)s)")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="training steps (default: %(default)s)")
    p.add_argument("--train-capacity", type=float, default=1.25,
                   help="capacity factor while training (default: %(default)s)")  # fmt: skip
    p.add_argument("--mesh", default="expert=4,data=2", help="training mesh (default: %(default)s)")
    args = p.parse_args(argv)
    factors = capacity_factors(args.capacity_factors)
    setup(args.devices)

    from rich.console import Console

    console = Console(width=150)
    started = time.perf_counter()
    initial, trained, losses = train(args)
    rows = reports(initial, args, factors, "random") + reports(trained, args, factors, "trained")
    elapsed = time.perf_counter() - started
    console.print(table(rows, args))
    console.print(f"trained {args.steps} steps of ep on {args.mesh}: loss {losses[0]:.3f} -> "
                  f"{losses[-1]:.3f}; {elapsed:.1f} s")  # fmt: skip
    out = out_dir(args.out)
    record = {"benchmark": "moe_routing", "model": {"family": "llama-moe", "size": args.size},
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "losses": losses,
              "rows": rows, "elapsed_s": elapsed}  # fmt: skip
    write_json(out / "moe_routing.json", record)
    plot(rows, out / "moe_routing.png")
    console.print(f"wrote {out / 'moe_routing.json'} and {out / 'moe_routing.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
