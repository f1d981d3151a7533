"""`spmdkit reshard`: rewrite a checkpoint for another mesh and strategy.

Reads step --step (default: the latest) of SRC, places every array straight into its sharding
under --strategy on --mesh (each device reads only its own shards), and writes it as the same step
of DST, whose metadata then names the new mesh and strategy. `spmdkit train --checkpoint-dir DST
--resume` continues from it; restoring onto another mesh also works without this step (train
reshards on resume), this makes the conversion once, ahead of time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sharding.cli.common import (
    add_command,
    add_devices_arg,
    console,
    non_negative_int,
    strategy_arg,
)

EXAMPLES = [
    "ck ck_tp --mesh fsdp=2,tensor=4 --strategy fsdp_tp",
    "ck ck_pp --mesh stage=2,data=4 --strategy pp --step 100",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "reshard", help="rewrite a checkpoint for another mesh and strategy",
                    doc=__doc__, examples=EXAMPLES)  # fmt: skip
    p.add_argument("src", type=Path, help="checkpoint directory to read (spmdkit train's)")
    p.add_argument("dst", type=Path, help="checkpoint directory to write (new or empty)")
    p.add_argument("--mesh", required=True, help="target mesh spec, e.g. fsdp=2,tensor=4")
    p.add_argument("--strategy", required=True, type=strategy_arg, metavar="STRATEGY",
                   help="target strategy: a name or parts joined by '+', e.g. fsdp+tp")  # fmt: skip
    p.add_argument("--model", metavar="MODULE:ATTR",
                   help="for a checkpoint of your own model: package.module:attribute or "
                   "path/to/file.py:attribute naming its sharding.Workload (shipped models are "
                   "found by the name the checkpoint records)")  # fmt: skip
    p.add_argument("--step", type=non_negative_int,
                   help="step to rewrite (when unset: the latest)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty DST, replacing the step if DST holds it")  # fmt: skip
    add_devices_arg(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sharding import setup_devices

    spec = setup_devices(args.mesh, args.devices)

    # Everything below imports JAX; the device count is fixed by now.
    import models
    from sharding import load_workload
    from sharding.training import reshard

    model = None if args.model is None else load_workload(args.model)
    result = reshard(args.src, args.dst, mesh=spec, strategy=args.strategy, model=model,
                     families=models.FAMILIES, step=args.step, overwrite=args.overwrite)  # fmt: skip
    console().print(result.summary(), highlight=False, soft_wrap=True)
    return 0
