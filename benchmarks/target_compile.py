"""Every strategy of one model compiled by the target's own compiler and by XLA:CPU, side by side
with the closed form: memory per device, collectives by kind, compile time.

The same step (`sharding.comparison.build`: AdamW, the asked dtype, remat and attention) is
compiled twice per strategy, ahead of time from abstract shapes: by XLA:GPU for compile-only
devices of ``--target`` (`sharding.targets.compiler_for`; needs ``pip install -e '.[gpu]'``)
and by XLA:CPU on simulated devices. Memory is each program's figure `compare` reads
(`MemoryStats.needed`: the GPU's peak; XLA:CPU's allocation less its float32 copies of
bfloat16 arrays); the closed form is `sharding.costmodel.predict` of the same layout. Default:
Llama-3-8B's width at 2 layers, batch 8 x 4096, bfloat16, remat full, blockwise attention (the
same kernel on both compilers), on h100:1x8.

Outputs: a table, and ``target_compile.json`` with every figure (collective counts and bytes by
kind for the three sources).

    python -m benchmarks.target_compile
    python -m benchmarks.target_compile --size 1b --layers 4 --seq 2048 --strategies dp,fsdp
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from benchmarks._common import out_dir, parser, setup, write_json


def _kinds(summary: dict) -> dict[str, list[int]]:
    return {kind: [s.count, s.bytes] for kind, s in sorted(summary.items())}


def _closed(pred: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for t in pred.traffic:
        count, nbytes = out.get(t.kind, [0, 0])
        out[t.kind] = [count + t.count, nbytes + round(t.bytes)]
    return dict(sorted(out.items()))


def run(args: Any) -> list[dict]:
    from models import llama
    from sharding import Workload
    from sharding.comparison import Settings, build
    from sharding.costmodel import CostModelError, layouts, predict
    from sharding.targets import compiler_for, target

    tgt = target(args.target)
    gpu, cpu = compiler_for(tgt, "target"), compiler_for(tgt, "cpu")
    cfg = dataclasses.replace(llama.config(args.size), n_layers=args.layers)
    work = Workload.from_family(llama, cfg)
    rows = []
    chosen: dict[str, Any] = {}
    for layout in layouts(tgt.devices, args.layers, strategies=args.strategies, batch=args.batch):
        chosen.setdefault(layout.strategy, layout)
    for layout in chosen.values():
        row: dict[str, Any] = {"strategy": layout.label, "mesh": layout.mesh}
        # context parallelism runs its own attention over the split sequence
        kernel = None if layout.sizes["context"] > 1 else args.attention
        row["attention"] = kernel or "the context method's"
        for name, compiler in (("gpu", gpu), ("cpu", cpu)):
            settings = Settings(args.batch, args.seq, attention=kernel, compiler=compiler)
            start = time.perf_counter()
            try:
                report = build(layout, work, settings, dtype=args.dtype, remat=args.remat).report()
            except Exception as e:  # a layout one compiler refuses: say which and why
                row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                continue
            row[name] = {
                "memory": report.memory.needed,
                "collectives": _kinds(report.summary()),
                "compile_s": round(time.perf_counter() - start, 1),
            }
        try:
            pred = predict(
                llama,
                cfg,
                layout.strategy,
                layout.sizes,
                args.batch,
                args.seq,
                pipeline=layout.pipeline(),
                dtype=args.dtype,
                remat=args.remat,
                attention=kernel or "auto",
            )
            row["closed"] = {"memory": pred.memory_bytes, "collectives": _closed(pred)}
        except CostModelError as e:
            row["closed"] = {"error": str(e).splitlines()[0]}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> Any:
    from rich.table import Table

    from sharding import fmt_bytes

    t = Table(title="one step per device: the target's compiler, XLA:CPU and the closed form")
    for col in (
        "strategy",
        "mesh",
        "GPU GiB",
        "CPU GiB",
        "closed GiB",
        "closed / GPU",
        "GPU collectives (count)",
        "CPU collectives (count)",
        "compile GPU / CPU s",
    ):
        t.add_column(col)

    def mem(r: dict) -> str:
        return "error" if "error" in r else f"{r['memory'] / 2**30:.2f}"

    def colls(r: dict) -> str:
        if "error" in r:
            return r["error"][:60]
        return ", ".join(f"{k} {c} ({fmt_bytes(b)})" for k, (c, b) in r["collectives"].items())

    for row in rows:
        g, c, f = row["gpu"], row["cpu"], row["closed"]
        ratio = (
            f"{f['memory'] / g['memory']:.2f}x" if "error" not in f and "error" not in g else "-"
        )
        times = "/".join(str(r.get("compile_s", "-")) for r in (g, c))
        t.add_row(
            row["strategy"], row["mesh"], mem(g), mem(c), mem(f), ratio, colls(g), colls(c), times
        )
    return t


def main(argv: list[str] | None = None) -> int:
    p = parser("target_compile", __doc__)
    p.add_argument("--target", default="h100:1x8")
    p.add_argument("--size", default="8b", help="a llama size whose width is used")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--remat", default="full")
    p.add_argument("--attention", default="blockwise")
    p.add_argument("--strategies", default="dp,fsdp,tp,fsdp_tp,tp_sp,fsdp_tp_sp,cp,pp_tp")
    args = p.parse_args(argv)
    setup(args.devices)
    from rich.console import Console

    console, started = Console(width=200), time.perf_counter()
    rows = run(args)
    console.print(table(rows))
    elapsed = time.perf_counter() - started
    console.print(f"{2 * len(rows)} programs compiled in {elapsed:.0f} s")
    out = out_dir(args.out)
    record = {
        "benchmark": "target_compile",
        "elapsed_s": elapsed,
        "rows": rows,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    console.print(f"wrote {write_json(out / 'target_compile.json', record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
