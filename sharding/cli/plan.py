"""`spmdkit plan`: rank strategies and meshes for a model on N devices before owning them.

The ranking comes from the cost model (no devices, any size). For meshes small enough to
simulate here (and sizes whose compile fits the host), the top layouts are also compiled ahead of
time on simulated CPU devices from abstract shapes, and their compiled memory shown beside the
prediction.
"""

from __future__ import annotations

import argparse

from partition_rules import STRATEGIES
from sharding.cli.common import (
    add_command,
    add_devices_arg,
    add_model_args,
    console,
    non_negative_int,
    positive_int,
)
from sharding.costmodel import DEFAULT_SIZES, LM_FAMILIES, PROFILES
from sharding.costmodel import plan as plan_layouts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "plan", help="rank strategies and meshes for N devices from the cost model",
                    doc=__doc__, examples=["", "--model gpt2 --devices 64 --aot 0 --json",
                                           "--size 70b --devices 512 --memory 80GB --top 5"])  # fmt: skip
    defaults = ", ".join(f"{s} for {f}" for f, s in DEFAULT_SIZES.items())
    add_model_args(p, size=None, families=LM_FAMILIES,
                   size_help=f" (default: {defaults}, the largest that fits 8 devices)")  # fmt: skip
    add_devices_arg(p, default=8, help="number of devices the mesh spans (none need exist here)")
    p.add_argument("--memory", help="memory per device, e.g. 80GB (when unset: the device kind's)")
    p.add_argument("--device-kind", default="h100-80gb", choices=sorted(PROFILES),
                   help="peak FLOP/s and link bandwidths")  # fmt: skip
    p.add_argument("--batch", type=positive_int,
                   help="global batch in sequences (when unset: --devices)")  # fmt: skip
    p.add_argument("--seq", type=positive_int,
                   help="sequence length (when unset: min(4096, the model's maximum))")  # fmt: skip
    p.add_argument("--layers", type=positive_int, help="override the model's layer count")
    p.add_argument("--strategies", help=f"comma list (when unset: all of {','.join(STRATEGIES)})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype")  # fmt: skip
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"),
                   help="optimizer whose state is counted")  # fmt: skip
    p.add_argument("--top", type=positive_int, default=12, help="rows to show")
    p.add_argument("--aot", type=non_negative_int,
                   help="AOT-compile this many top layouts (when unset: 2 when --devices <= 64 "
                   "on a CPU host, else 0)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import models

    result = plan_layouts(
        models.get_family(args.model),
        size=args.size,
        devices=args.devices,
        memory=args.memory,
        device_kind=args.device_kind,
        batch=args.batch,
        seq=args.seq,
        layers=args.layers,
        strategies=args.strategies,
        dtype=args.dtype,
        optimizer=args.optimizer,
        top=args.top,
        aot=args.aot,
    )
    if args.json:
        print(result.to_json())
    else:
        console().print(result.table())
    return 0
