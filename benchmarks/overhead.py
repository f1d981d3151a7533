"""What spmdkit costs: its compiled step against a hand-written `jax.jit` step.

The hand-written step is what a user would write without spmdkit: `value_and_grad` of the
family's loss on `nnx.merge`d parameters, an optax update, `jax.jit` with the very shardings the
rules resolved to. Both run in the same process, interleaved step by step so that machine noise
falls on both alike; the ratio of their medians is spmdkit's overhead, and their collective
bytes per step must be identical (same program, same communication).

    python -m benchmarks.overhead                      # dp, fsdp, dp_tp, fsdp_tp on 8 devices
    python -m benchmarks.overhead --steps 50 --strategies fsdp
"""

from __future__ import annotations

import os
import statistics
import time

from benchmarks._common import parser, setup, write_json


def hand_written_step(fam, graphdef, optimizer, state_shardings, batch_shardings, mesh, *,
                      pin: bool):  # fmt: skip
    """A plain jitted train step over the same shardings: no spmdkit code on the hot path.

    With ``pin`` the layer stack's activations are constrained to the batch sharding at every
    layer, as a careful user (and MaxText) writes; without it XLA chooses, and for FSDP it often
    chooses to all-reduce activations instead of gathering weights.
    """
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def pinned(body):
        def layer(h, params):
            out, ys = body(jax.lax.with_sharding_constraint(h, rows), params)
            return jax.lax.with_sharding_constraint(out, rows), ys

        return layer

    def loss_fn(params, batch):
        return fam.loss(nnx.merge(graphdef, params), batch, remat=pinned if pin else None)

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        return new, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def measure(strategy: str, mesh_spec: str, args) -> dict:
    import jax
    import optax

    import models
    from sharding import Workload
    from sharding.comparison import Settings, build
    from sharding.costmodel import Layout
    from sharding.inspection import compile_and_inspect

    fam = models.get_family("llama")
    cfg = fam.config(args.size)
    settings = Settings(args.batch, args.seq)
    program = build(Layout(strategy, mesh_spec), Workload.from_family(fam, cfg), settings)
    mesh, shapes = program.mesh, program.batch_shapes
    optimizer = optax.adamw(settings.lr)  # the same update, for the hand-written step
    ours = program.report()
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        (program.abstract_state, shapes),
        (program.state_shardings, program.batch_shardings),
    )
    compiled = {}
    for pin in (True, False):
        hand = hand_written_step(fam, program.graphdef, optimizer, program.state_shardings,
                                 program.batch_shardings, mesh, pin=pin)  # fmt: skip
        compiled[pin] = compile_and_inspect(hand, *abstract, mesh=mesh)
    (hand_compiled, theirs), (naive_compiled, naive) = compiled[True], compiled[False]

    batch = program.shard_batch(fam.make_batch(cfg, args.batch, args.seq))
    runs = {"spmdkit": program.compiled, "hand": hand_compiled, "naive": naive_compiled}
    states = {who: program.init(0) for who in runs}
    times = {who: [] for who in runs}
    losses = {who: [] for who in runs}

    def timed(i: int, who: str) -> None:
        start = time.perf_counter()
        states[who], m = runs[who](states[who], batch)
        loss = float(m["loss"])  # waits for the step
        if i >= args.warmup:
            times[who].append(time.perf_counter() - start)
            losses[who].append(loss)

    # The compared pair runs interleaved, ABBA, so drift and cache effects fall on both alike;
    # the naive program (slower, other traffic) runs on its own afterwards.
    for i in range(args.warmup + args.steps):
        for who in ("spmdkit", "hand") if i % 2 == 0 else ("hand", "spmdkit"):
            timed(i, who)
    for i in range(args.warmup + args.steps):
        timed(i, "naive")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "strategy": strategy,
        "mesh": mesh_spec,
        "median_s": med,
        "ratio": med["spmdkit"] / med["hand"],
        "naive_ratio": med["spmdkit"] / med["naive"],
        "collective_bytes": {
            "spmdkit": ours.collective_bytes(),
            "hand": theirs.collective_bytes(),
            "naive": naive.collective_bytes(),
        },
        "collectives_by_kind": {
            who: {k: s.bytes for k, s in rep.summary().items()}
            for who, rep in (("spmdkit", ours), ("hand", theirs), ("naive", naive))
        },
        "max_loss_gap": max(
            abs(a - b) for a, b in zip(losses["spmdkit"], losses["hand"], strict=True)
        ),
        "steps": args.steps,
        "times_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's remat warnings for the naive jit
    p = parser("overhead", __doc__)
    p.add_argument("--strategies", default="dp,fsdp,dp_tp,fsdp_tp")
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="timed steps each (median)")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    setup(args.devices)

    from rich.console import Console
    from rich.table import Table

    from partition_rules.strategies import EXAMPLE_MESHES_8
    from sharding import fmt_bytes

    rows = [measure(s, EXAMPLE_MESHES_8[s], args) for s in args.strategies.split(",")]
    table = Table(title=f"spmdkit step vs hand-written jax.jit step (llama {args.size}, "
                  f"batch {args.batch}x{args.seq}, median of {args.steps} interleaved steps)")  # fmt: skip
    for col in ("strategy", "mesh", "spmdkit", "hand-written", "ratio", "bytes/step (both)",
                "loss gap", "naive jit", "naive bytes"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("strategy", "mesh") else "right")
    for r in rows:
        b = r["collective_bytes"]
        same = fmt_bytes(b["spmdkit"]) if b["spmdkit"] == b["hand"] else (
            f"{fmt_bytes(b['spmdkit'])} != {fmt_bytes(b['hand'])}")  # fmt: skip
        table.add_row(r["strategy"], r["mesh"], f"{r['median_s']['spmdkit'] * 1e3:.2f} ms",
                      f"{r['median_s']['hand'] * 1e3:.2f} ms", f"{r['ratio']:.3f}", same,
                      f"{r['max_loss_gap']:.1e}", f"{r['median_s']['naive'] * 1e3:.2f} ms",
                      fmt_bytes(b["naive"]))  # fmt: skip
    Console(width=160).print(table)
    print(
        "hand-written: plain jax.jit over the same parameter shardings, activations pinned to "
        "the batch sharding per layer by hand; naive jit: the same without the pin"
    )
    path = write_json(args.out / "overhead.json", {"args": vars(args), "results": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
