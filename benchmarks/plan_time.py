"""How fast `spmdkit plan` answers: the layout search for sizes that cannot run here.

Times `sharding.costmodel.candidates` (every mesh factorisation x strategy x remat x
schedule, predicted by the cost model; no devices, no compilation) for llama 70b on 512 x 80 GB
and 7b on 8 x 80 GB, best of --repeats, against issue 5's target of under a minute.

    python -m benchmarks.plan_time
"""

from __future__ import annotations

import time

from benchmarks._common import parser, write_json

CASES = (("70b", 512, 512, 4096), ("7b", 8, 8, 1024))  # size, devices, global batch, seq
TARGET_S = 60.0


def main(argv: list[str] | None = None) -> int:
    p = parser("plan_time", __doc__)
    p.add_argument("--repeats", type=int, default=2, help="searches per case (best kept)")
    p.add_argument("--memory", default="80GB", help="memory per device (default: %(default)s)")
    args = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from models import llama
    from sharding import mesh_text, parse_bytes
    from sharding.costmodel import PROFILES, candidates

    memory = parse_bytes(args.memory)
    profile = PROFILES["h100-80gb"]
    rows = []
    for size, devices, batch, seq in CASES:
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            ranked = candidates(llama, size, devices, batch, seq, memory_bytes=memory,
                                profile=profile)  # fmt: skip
            best = min(best, time.perf_counter() - start)
        fits = [c for c in ranked if c.fits]
        top = fits[0].prediction if fits else None
        rows.append({
            "size": size, "devices": devices, "batch": batch, "seq": seq, "seconds": best,
            "layouts": len(ranked), "fit": len(fits), "within_target": best < TARGET_S,
            "top": None if top is None else {"strategy": top.strategy, "mesh": top.mesh,
                                             "memory_bytes": top.memory_bytes},
        })  # fmt: skip

    table = Table(title=f"spmdkit plan: layout search time (best of {args.repeats}), "
                  f"{args.memory} per device, target < {TARGET_S:.0f} s")  # fmt: skip
    for col in ("llama", "devices", "batch x seq", "layouts", "fit", "search", "top layout"):
        table.add_column(col, justify="left" if col in ("llama", "top layout") else "right")
    for r in rows:
        top = r["top"]
        mesh = "-" if top is None else mesh_text(top["mesh"])
        table.add_row(r["size"], str(r["devices"]), f"{r['batch']} x {r['seq']}",
                      str(r["layouts"]), str(r["fit"]), f"{r['seconds']:.1f} s",
                      "-" if top is None else f"{top['strategy']} {mesh}",
                      style=None if r["within_target"] else "red")  # fmt: skip
    Console(width=140).print(table)
    path = write_json(args.out / "plan_time.json", {"args": vars(args), "results": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
