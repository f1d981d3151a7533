"""`spmdkit explain`: which rule placed each parameter, and the memory per device it implies.

Runs on abstract shapes and a mesh spec: no devices, no memory, any model size. Without --mesh,
the strategy's example mesh on 8 devices (dp: data=8, fsdp_tp: data=2,fsdp=2,tensor=2, ...).
"""

from __future__ import annotations

import argparse

from flax import nnx

from partition_rules import composition
from partition_rules.strategies import EXAMPLE_MESHES_8
from sharding import MeshSpec, MeshSpecError, explain
from sharding.cli.common import (
    add_command,
    add_devices_arg,
    add_model_args,
    add_strategy_args,
    console,
    workload_from_args,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub, "explain", help="show how a preset places every parameter on a mesh", doc=__doc__,
        examples=["", "--model llama --size 70b --mesh fsdp=64,tensor=8 --strategy fsdp_tp",
                  "--model my_models.py:workload --strategy fsdp --mesh fsdp=8",
                  "--model gpt2 --size 124m --mesh data=-1,tensor=4 --devices 16 --json"],
    )  # fmt: skip
    add_model_args(p)
    add_strategy_args(p)
    add_devices_arg(p)
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    parts = composition(args.strategy)
    example = EXAMPLE_MESHES_8.get(parts.alias or "")
    if args.mesh is None and example is None:
        sizes = ",".join(f"{a}=2" for a in parts.axes if a != "data" or "zero1" in parts.parts)
        raise MeshSpecError(
            f"--strategy {args.strategy} has no example mesh; give --mesh, e.g. --mesh {sizes}"
        )
    spec = MeshSpec.of(args.mesh or example)
    if -1 in spec.sizes.values() and args.devices is None:
        raise MeshSpecError(
            f"--mesh {spec} has a -1 axis; give --devices N so explain can fill it "
            f"(explain needs no real devices)"
        )
    spec = spec.resolve(args.devices if args.devices is not None else spec.size)
    work = workload_from_args(args)
    ex = explain(
        work.rules,
        work.axis_map(args.strategy),
        lambda: work.model(nnx.Rngs(0)),
        spec,
        title=f"{work.name} / {args.strategy}",
    )
    if args.json:
        print(ex.to_json())
    else:
        console().print(ex.table())
    return 0
