"""`spmdkit reshard`: rewrite a checkpoint for another mesh and strategy.

Reads step STEP (default: the latest) of SRC, places every array straight into its sharding under
--strategy on --mesh (each device reads only its own shards), and writes it as the same step of
DST, whose metadata then names the new mesh and strategy. `spmdkit train --checkpoint-dir DST
--resume` continues from it; restoring onto another mesh also works without this step (train
reshards on resume), this makes the conversion once, ahead of time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from partition_rules import STRATEGIES
from sharding.cli._common import console, setup_devices


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reshard", help="rewrite a checkpoint for another mesh and strategy",
                       description=__doc__)  # fmt: skip
    p.add_argument("src", type=Path, help="checkpoint directory to read (spmdkit train's)")
    p.add_argument("dst", type=Path, help="checkpoint directory to write")
    p.add_argument("--mesh", required=True, help="target mesh spec, e.g. fsdp=2,tensor=4")
    p.add_argument("--strategy", required=True, choices=list(STRATEGIES),
                   help="target partition preset")  # fmt: skip
    p.add_argument("--step", type=int, help="step to rewrite (default: the latest)")
    p.add_argument("--devices", type=int, help="simulated CPU devices (CPU hosts only)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = setup_devices(args.mesh, args.devices)

    # Everything below imports JAX; the device count is fixed by now.
    from flax import nnx

    import models
    from partition_rules import preset
    from sharding._init import abstract_params
    from sharding._mesh import make_mesh
    from sharding._resolve import resolve
    from sharding._units import fmt_bytes
    from sharding.training import Checkpointer, reshard_checkpoint

    if args.src.absolute() == args.dst.absolute():
        raise ValueError(f"reshard: SRC and DST are both {args.src}; give a new directory as DST")
    with Checkpointer(args.src, keep=None, read_only=True) as source:
        meta = source.meta(args.step)
        saved = source.array_metadata(meta.step)
    fam = models.get_family(meta.family)
    cfg = fam.config(meta.size, **meta.config)
    mesh = make_mesh(spec)
    _, params = abstract_params(lambda: fam.Model(cfg, rngs=nnx.Rngs(0)))
    shardings = resolve(*preset(meta.family, args.strategy), params, mesh)
    new = reshard_checkpoint(
        args.src, args.dst, params, shardings, mesh, args.strategy, step=meta.step
    )
    total = sum(v.size * v.dtype.itemsize for v in saved.values())
    console().print(
        f"step {meta.step}: {meta.family} {meta.size}, {meta.strategy} on "
        f"{_mesh_text(meta.mesh)} -> {new.strategy} on {spec}; {len(saved)} arrays, "
        f"{fmt_bytes(total)}; wrote {Path(args.dst).absolute() / str(meta.step)}"
    )
    return 0


def _mesh_text(sizes: dict) -> str:
    return ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "data=1"
