"""`spmdkit explain`: which rule placed each parameter, and the memory per device it implies.

Runs on abstract shapes and an abstract mesh: no devices, no memory, any model size.
"""

from __future__ import annotations

import argparse

from flax import nnx

import models
from partition_rules import preset
from sharding._explain import Explanation, explain
from sharding._init import abstract_params
from sharding._mesh import MeshSpec
from sharding.cli._common import add_model_args, add_strategy_args, console


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show how a preset places every parameter on a mesh",
                       description=__doc__)  # fmt: skip
    add_model_args(p)
    add_strategy_args(p)
    p.add_argument("--devices", type=int,
                   help="device count, needed only when the mesh has a -1 axis")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(run=run)


def explain_preset(family: str, size: str, mesh: MeshSpec, strategy: str) -> Explanation:
    """The explain table of `family`/`size` under preset `strategy` on `mesh` (abstract)."""
    fam = models.get_family(family)
    cfg = fam.config(size)
    _, params = abstract_params(lambda: fam.Model(cfg, rngs=nnx.Rngs(0)))
    rules, axis_map = preset(family, strategy)
    return explain(rules, axis_map, params, mesh, title=f"{family} {size} / {strategy}")


def run(args: argparse.Namespace) -> int:
    spec = MeshSpec.of(args.mesh or "data=-1")
    if -1 in spec.sizes.values():
        if args.devices is None:
            raise ValueError(
                f"mesh {spec} has a -1 axis; give --devices N so explain can fill it "
                f"(explain needs no real devices)"
            )
        spec = spec.resolve(args.devices)
    elif args.devices is not None:
        spec = spec.resolve(args.devices)
    ex = explain_preset(args.model, args.size, spec, args.strategy)
    if args.json:
        print(ex.to_json())
    else:
        console().print(ex)
    return 0
