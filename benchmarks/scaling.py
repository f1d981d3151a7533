"""How memory per device and traffic per step move as the mesh grows: 1 -> 2 -> 4 -> 8 devices.

Each strategy gets a mesh over the first n devices with all n on its own axis (dp ``data=n``,
fsdp ``fsdp=n``, tp ``tensor=n``, pp ``stage=n`` as a gpipe pipeline of 2n micro-batches), and
its training step is compiled only, never run. Per device it records the train state its
shardings leave there (parameters + AdamW state), XLA's compiled memory and the collective bytes
of one step. At n=1 every strategy is the unsplit step (pp: no pipeline over one stage).

The model is llama tiny with 8 layers and 8 kv heads, so that tensor=8 and stage=8 divide it.

    python -m benchmarks.scaling                         # dp, fsdp, tp, pp on 1, 2, 4, 8
    python -m benchmarks.scaling --strategies fsdp,tp --batch 32
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._common import out_dir, parser, setup, write_json

STRATEGIES = ("dp", "fsdp", "tp", "pp")
AXIS = {"dp": "data", "fsdp": "fsdp", "tp": "tensor", "pp": "stage"}


class ScalingArgumentError(ValueError):
    """Benchmark arguments that cannot describe a scaling run."""


def device_counts(max_devices: int) -> list[int]:
    """1, 2, 4, ... up to ``max_devices`` (which must be a power of two).

    Example:
        >>> device_counts(8)
        [1, 2, 4, 8]
    """
    if max_devices < 1 or max_devices & (max_devices - 1):
        raise ScalingArgumentError(
            f"--devices {max_devices}: the mesh doubles 1 -> 2 -> 4 -> ..., so the device count "
            f"must be a power of two; use --devices 8 (or 2, 4, 16)"
        )
    return [2**k for k in range(max_devices.bit_length())]


def mesh_for(strategy: str, n: int) -> str:
    """The mesh spec of ``strategy`` on ``n`` devices: all of them on the strategy's axis.

    Example:
        >>> mesh_for("tp", 4), mesh_for("pp", 1)
        ('tensor=4', 'stage=1')
    """
    if strategy not in AXIS:
        raise ScalingArgumentError(
            f"unknown strategy {strategy!r} for the scaling benchmark; choose from "
            f"{', '.join(STRATEGIES)}"
        )
    return f"{AXIS[strategy]}={n}"


def measure(strategy: str, n: int, args: Any) -> dict[str, Any]:
    """Compile (only) ``strategy`` on the first ``n`` devices and read its per-device figures."""
    import jax

    import models
    from sharding import Workload, state_bytes
    from sharding.comparison import Settings, build
    from sharding.costmodel import Layout

    fam = models.get_family("llama")
    cfg = fam.config(args.size, n_layers=args.layers, n_kv_heads=args.kv_heads)
    spec = mesh_for(strategy, n)
    pipelined = strategy == "pp" and n > 1
    # pp on one device is the unpipelined step: the same program as dp there (one stage).
    unpiped = "dp" if strategy == "pp" and not pipelined else strategy
    cand = Layout(unpiped, spec, "gpipe" if pipelined else None, 2 * n if pipelined else None)
    start = time.perf_counter()
    program = build(cand, Workload.from_family(fam, cfg), Settings(args.batch, args.seq),
                    devices=jax.devices()[:n])  # fmt: skip
    pipeline = cand.pipeline()
    report = program.report()
    elapsed = time.perf_counter() - start
    m = report.memory
    return {
        "strategy": strategy,
        "devices": n,
        "mesh": spec,
        "microbatches": None if pipeline is None else pipeline.microbatches,
        "param_bytes": state_bytes(program.abstract_state["params"], program.param_shardings),
        "state_bytes": state_bytes(program.abstract_state, program.state_shardings),
        "peak_bytes": None if m is None else m.allocated,
        "temp_bytes": None if m is None else m.temp,
        "collective_bytes": report.collective_bytes(),
        "collectives": {
            k: {"count": s.count, "bytes": s.bytes} for k, s in report.summary().items()
        },
        "bubble_fraction": report.extra.get("bubble_fraction"),
        "compile_time_s": elapsed,
    }


def table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    from sharding import fmt_bytes

    t = Table(title="memory and traffic per device as the mesh grows (compiled, not run)")
    for col in ("strategy", "n", "mesh", "state/device", "vs n=1", "peak/device", "temp/device",
                "bytes/step", "collectives", "compile s"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("strategy", "mesh", "collectives") else "right")
    base = {r["strategy"]: r["state_bytes"] for r in rows if r["devices"] == 1}
    for r in rows:
        ratio = r["state_bytes"] / base[r["strategy"]] if r["strategy"] in base else None
        kinds = ", ".join(f"{k} x{v['count']}" for k, v in r["collectives"].items()) or "-"
        t.add_row(
            r["strategy"], str(r["devices"]), r["mesh"], fmt_bytes(r["state_bytes"]),
            "" if ratio is None else f"{ratio:.3f}", _opt_bytes(r["peak_bytes"]),
            _opt_bytes(r["temp_bytes"]), fmt_bytes(r["collective_bytes"]), kinds,
            f"{r['compile_time_s']:.1f}",
        )  # fmt: skip
    return t


def _opt_bytes(n: int | None) -> str:
    from sharding import fmt_bytes

    return "n/a" if n is None else fmt_bytes(n)


def plot(rows: list[dict[str, Any]], path: Any, title: str) -> Any:
    """Two panels over log2(devices): memory per device, collective bytes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, comm) = plt.subplots(1, 2, figsize=(11, 4.2))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        ns = [r["devices"] for r in mine]
        (line,) = mem.plot(ns, [r["state_bytes"] / 2**20 for r in mine], "o-",
                          label=f"{strategy} train state")  # fmt: skip
        if all(r["peak_bytes"] is not None for r in mine):
            mem.plot(ns, [r["peak_bytes"] / 2**20 for r in mine], "x--", color=line.get_color(),
                     alpha=0.6, label=f"{strategy} compiled peak")  # fmt: skip
        # log2 x and a symlog y: the n=1 step has no collectives at all.
        comm.plot(ns, [r["collective_bytes"] / 2**20 for r in mine], "o-", label=strategy)
    for ax, name in (
        (mem, "memory / device (MiB)"),
        (comm, "collective bytes / device / step (MiB)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("devices")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    mem.set_yscale("log")
    comm.set_yscale("symlog", linthresh=0.01)
    comm.set_ylim(bottom=0)
    mem.legend(fontsize=7)
    comm.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = parser("scaling", __doc__.split("\n\n")[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated subset of %(default)s")  # fmt: skip
    p.add_argument("--size", default="tiny", help="llama size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="n_layers override (default: 8)")
    p.add_argument("--kv-heads", type=int, default=8, help="n_kv_heads override (default: 8)")
    p.add_argument("--batch", type=int, default=16, help="global batch (default: %(default)s)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default: %(default)s)")
    args = p.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    counts = device_counts(args.devices)
    for s in strategies:
        mesh_for(s, 1)  # unknown names fail before any compile
    setup(args.devices)

    import jax
    from rich.console import Console

    console = Console(width=160)
    if jax.device_count() < counts[-1]:
        raise ScalingArgumentError(
            f"--devices {args.devices} but only {jax.device_count()} {jax.default_backend()} "
            f"devices exist; pass --devices {jax.device_count()} or fewer"
        )
    rows = []
    started = time.perf_counter()
    with console.status("compiling") as status:
        for s in strategies:
            for n in counts:
                status.update(f"compiling {s} on {mesh_for(s, n)}")
                rows.append(measure(s, n, args))
    elapsed = time.perf_counter() - started
    console.print(table(rows))
    model = f"llama {args.size} (n_layers={args.layers}, n_kv_heads={args.kv_heads})"
    console.print(f"{model}, global batch {args.batch} x {args.seq}, float32, AdamW; "
                  f"{len(rows)} compiles in {elapsed:.0f} s")  # fmt: skip
    out = out_dir(args.out)
    record = {
        "benchmark": "scaling",
        "model": {
            "family": "llama",
            "size": args.size,
            "n_layers": args.layers,
            "n_kv_heads": args.kv_heads,
        },
        "batch": args.batch,
        "seq": args.seq,
        "rows": rows,
        "elapsed_s": elapsed,
    }
    write_json(out / "scaling.json", record)
    plot(rows, out / "scaling.png", f"spmdkit scaling: {model}, batch {args.batch}x{args.seq}")
    console.print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
