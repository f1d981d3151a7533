"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import shutil
import sys

from rich.console import Console

import models
from partition_rules import STRATEGIES


def add_model_args(p: argparse.ArgumentParser, *, size: str = "tiny") -> None:
    p.add_argument("--model", default="llama", choices=sorted(models.FAMILIES),
                   help="model family (default: %(default)s)")  # fmt: skip
    p.add_argument("--size", default=size, help="named size of the family (default: %(default)s)")


def add_strategy_args(p: argparse.ArgumentParser, *, default: str = "fsdp_tp") -> None:
    p.add_argument("--mesh", help="mesh spec, e.g. data=2,fsdp=2,tensor=2 (one axis may be -1)")
    p.add_argument("--strategy", default=default, choices=list(STRATEGIES),
                   help="partition preset (default: %(default)s)")  # fmt: skip


def console(stderr: bool = False) -> Console:
    """A rich console; wide when output goes to a file or pipe so tables are not squeezed."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else max(160, shutil.get_terminal_size((160, 24)).columns)
    return Console(file=stream, width=width)
