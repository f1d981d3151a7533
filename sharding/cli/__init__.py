"""The `spmdkit` command line: one subcommand per module in this package.

Each module only parses its arguments, calls one public library function, prints the result and
maps typed errors to exit codes: 0 done, 1 a run that failed (e.g. a non-finite loss), 2 input
spmdkit cannot take (argparse's own code for bad flags), with a message naming the value and the
fix and never a traceback.
"""

from __future__ import annotations

import sys
from importlib import metadata

from sharding.cli import compare, explain, launch, plan, reshard, train
from sharding.cli.common import HelpFormatter, Parser

COMMANDS = {
    "compare": compare,
    "explain": explain,
    "launch": launch,
    "plan": plan,
    "reshard": reshard,
    "train": train,
}


def version() -> str:
    try:
        return metadata.version("spmdkit")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="spmdkit",
        description="Data, FSDP, tensor and pipeline parallelism for JAX: declare a mesh, "
        "partition rules and a schedule; measure and compare.",
        epilog="examples:\n  spmdkit compare\n  spmdkit explain --model llama --size 70b "
        "--mesh fsdp=64,tensor=8\n  spmdkit COMMAND --help",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"spmdkit {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except ValueError as e:  # every user-input error is a typed ValueError with its remedy
        print(f"spmdkit {args.command}: error: {e}", file=sys.stderr)
        return 2


__all__ = ["COMMANDS", "main"]
