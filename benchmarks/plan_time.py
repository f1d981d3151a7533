"""How fast `spmdkit plan` answers: the layout search for sizes that cannot run here.

Times `sharding.planning.plan`'s closed-form search (every mesh factorisation x strategy x
remat x schedule, predicted by the closed forms and priced on the target by `step_time`; no
devices, no compilation) for Llama 3.1 405B on 2048 nodes of 8 H100s (16,384 GPUs, batch 2048 x 8192, as Meta
trained it: pipelines with uneven stages, tensor, context and fsdp/data searched together), llama
70b on 64 nodes and 7b on one node, best of --repeats, against the target of under a minute.

    python -m benchmarks.plan_time
"""

from __future__ import annotations

import time

from benchmarks._common import parser, write_json

CASES = (("3.1-405b", "h100:2048x8", 2048, 8192), ("70b", "h100:64x8", 512, 4096),
         ("7b", "h100:1x8", 8, 1024))  # size, target, batch, seq  # fmt: skip
TARGET_S = 60.0


def main(argv: list[str] | None = None) -> int:
    p = parser("plan_time", __doc__)
    p.add_argument("--repeats", type=int, default=2, help="searches per case (best kept)")
    p.add_argument("--memory", help="memory a step may fill per device (default: 90%% of HBM)")
    args = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from models import llama
    from sharding import fmt_bytes, parse_bytes
    from sharding.planning import plan
    from sharding.targets import target

    memory = None if args.memory is None else parse_bytes(args.memory)
    published = _published(llama)  # first: nothing cached yet (the abstract models, placements)
    rows = []
    for size, where, batch, seq in CASES:
        tgt, best = target(where), float("inf")
        for _ in range(args.repeats):  # the closed-form search plan runs, nothing compiled
            result = plan(llama, size=size, target=tgt, memory=memory, batch=batch, seq=seq,
                          aot=0, top=1)  # fmt: skip
            best = min(best, result.search_s)
        ranked, searched = result.ranked, result.searched
        fits = [c for c in ranked if c.fits]
        top = fits[0] if fits else None
        rows.append({
            "size": size, "target": tgt.name, "devices": tgt.devices, "batch": batch, "seq": seq,
            "seconds": best, "searched": searched["layouts"], "rejected": len(searched["rejected"]),
            "layouts": len(ranked), "fit": len(fits),
            "within_target": best < TARGET_S,
            "top": None if top is None else {"label": top.label, "mesh": top.mesh_text,
                                             "remat": top.remat, "step_s": top.step_s,
                                             "memory_bytes": top.memory_bytes},
        })  # fmt: skip

    budget = args.memory or "90% of HBM"
    table = Table(title=f"spmdkit plan: layout search time (best of {args.repeats}), "
                  f"{budget} per device, target < {TARGET_S:.0f} s")  # fmt: skip
    for col in ("llama", "target", "batch x seq", "searched", "rejected", "estimates", "fit",
                "search", "top layout"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("llama", "top layout") else "right")
    for r in rows:
        top = r["top"]
        mesh = "-" if top is None else top["mesh"]
        table.add_row(r["size"], r["target"], f"{r['batch']} x {r['seq']}", str(r["searched"]),
                      str(r["rejected"]), str(r["layouts"]), str(r["fit"]),
                      f"{r['seconds']:.1f} s",
                      "-" if top is None else f"{top['label']} {mesh}",
                      style=None if r["within_target"] else "red")  # fmt: skip
    Console(width=140).print(table)
    table = Table(title="sharding.costmodel.predict on published layouts, first calls in the "
                  "process (target < 5 s each)")  # fmt: skip
    for col in ("layout", "seconds", "memory/device", "collectives/device"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in published:
        table.add_row(r["layout"], f"{r['seconds']:.2f} s", fmt_bytes(r["memory_bytes"]),
                      fmt_bytes(r["collective_bytes"]))  # fmt: skip
    Console(width=140).print(table)
    path = write_json(args.out / "plan_time.json",
                      {"args": vars(args), "results": rows, "published": published})  # fmt: skip
    print(f"wrote {path}")
    return 0


# Issue 36's published layouts: (name, size, strategy, mesh, batch, seq, pipeline, remat).
PUBLISHED = (
    ("405B tp8 x cp16 x pp16 x fsdp8, 128K tokens (Llama 3, 16,384 H100)", "3.1-405b",
     "fsdp+tp+sp+cp+pp", {"tensor": 8, "context": 16, "stage": 16, "fsdp": 8}, 128, 131072,
     ("1f1b", 16, 1, "auto"), "full"),
    ("70B tp4+SP x cp2 x interleaved pp4 v5 x data2", "70b", "tp+sp+cp+pp",
     {"tensor": 4, "context": 2, "stage": 4, "data": 2}, 32, 8192, ("interleaved", 16, 5), "none"),
    ("405B fsdp8 x tp8 x pp8 (torchtitan)", "3.1-405b", "fsdp+tp+pp",
     {"fsdp": 8, "tensor": 8, "stage": 8}, 128, 8192, ("1f1b", 16, 1, "auto"), "full"),
    ("70 layers on 12 uneven stages", 70, "pp", {"stage": 12, "data": 2}, 48, 4096,
     ("1f1b", 24, 1, "auto"), "none"),
    ("70B interleaved pp4 v2 x tp2, remat full", "70b", "pp_tp", {"stage": 4, "tensor": 2}, 16,
     4096, ("interleaved", 8, 2), "full"),
)  # fmt: skip


def _published(llama) -> list[dict]:
    import dataclasses

    from sharding.costmodel import predict

    out = []
    for name, size, strategy, mesh, batch, seq, pipeline, remat in PUBLISHED:
        cfg = (dataclasses.replace(llama.config("70b"), n_layers=size) if isinstance(size, int)
               else size)  # fmt: skip
        start = time.perf_counter()
        pred = predict(llama, cfg, strategy, mesh, batch, seq, pipeline=pipeline, remat=remat,
                       dtype="bfloat16")  # fmt: skip
        out.append({"layout": name, "seconds": time.perf_counter() - start,
                    "memory_bytes": pred.memory_bytes,
                    "collective_bytes": pred.collective_bytes()})  # fmt: skip
    return out


if __name__ == "__main__":
    raise SystemExit(main())
