"""The `spmdkit` command line: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import sys

from sharding.cli import compare, explain, launch, plan, reshard, train

COMMANDS = {
    "compare": compare,
    "explain": explain,
    "launch": launch,
    "plan": plan,
    "reshard": reshard,
    "train": train,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="spmdkit",
        description="Data, FSDP, tensor and pipeline parallelism for JAX: declare a mesh, "
        "partition rules and a schedule; measure and compare.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except ValueError as e:  # every user-input error is a typed ValueError with its remedy
        print(f"spmdkit {args.command}: error: {e}", file=sys.stderr)
        return 2


__all__ = ["main"]
