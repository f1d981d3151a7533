"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import shutil
import sys
from typing import NoReturn

from rich.console import Console

from models.attention import KINDS as ATTENTION_KINDS
from sharding import cpu_only, setup_devices  # noqa: F401  (re-exported for the commands)
from sharding.cli.argtypes import (  # noqa: F401  (re-exported for the commands)
    non_negative_int,
    positive_int,
    stage_layers_arg,
    strategy_arg,
)
from sharding.cli.model_args import (  # noqa: F401  (re-exported for the commands)
    add_model_args,
    sizes_text,
    workload_from_args,
)
from sharding.context import METHODS as CONTEXT_METHODS
from sharding.pipeline import SCHEDULES
from sharding.targets import CHOICES as COMPILERS


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is two lines, the error and where the help is, not the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            2,
            f"{self.prog}: error: {message}\n(flags, defaults and examples: {self.prog} --help)\n",
        )


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; every option's default shown (unless unset)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False
        if action.option_strings and "%(default)" not in text and not unset \
                and action.default != argparse.SUPPRESS:  # fmt: skip
            text += " (default: %(default)s)"
        return text


def add_command(
    sub: argparse._SubParsersAction, name: str, *, help: str, doc: str | None, examples: list[str]
) -> argparse.ArgumentParser:
    """A subcommand parser whose --help shows defaults and ends with runnable examples."""
    epilog = "examples:\n" + "\n".join(f"  spmdkit {name} {e}".rstrip() for e in examples)
    return sub.add_parser(name, help=help, description=doc, epilog=epilog,
                          formatter_class=HelpFormatter)  # fmt: skip


def add_strategy_args(
    p: argparse.ArgumentParser, *, default: str = "fsdp_tp", context: bool = False
) -> None:
    p.add_argument("--mesh", help="mesh spec, e.g. data=2,fsdp=2,tensor=2 (one axis may be -1)")
    p.add_argument("--strategy", default=default, type=strategy_arg, help=strategy_arg.__doc__)
    if context:  # the command runs what it builds: how attention runs over a context axis
        p.add_argument("--context-method", choices=CONTEXT_METHODS,
                       help="attention over a context mesh axis (cp, fsdp_cp): ring, allgather "
                       "or ulysses (when unset: ring)")  # fmt: skip
        add_attention_arg(p, "the step runs")


def add_attention_arg(p: argparse.ArgumentParser, what: str) -> None:
    """--attention: one meaning in every command, the kernel of `models.attention`."""
    p.add_argument("--attention", choices=ATTENTION_KINDS,
                   help=f"attention kernel {what}: auto (cuDNN flash on a GPU, splash on a TPU, "
                   "else blockwise beyond 512 tokens), blockwise (pure-JAX flash), xla (the "
                   "whole score matrix), cudnn, splash (when unset: the model's own)")  # fmt: skip


def add_compiler_arg(p: argparse.ArgumentParser) -> None:
    """--compiler: one meaning in compare and plan (`sharding.targets.compiler_for`)."""
    p.add_argument(
        "--compiler",
        choices=COMPILERS,
        default="auto",
        help="whose programs the figures come from: auto = the target's own compiler "
        "(XLA:GPU with spmdkit[gpu], libtpu with spmdkit[tpu]) on compile-only "
        "devices where installed, else XLA:CPU on simulated devices, saying so; "
        "target = the target's or an error; cpu = XLA:CPU (default: %(default)s)",
    )


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline (strategies pp, pp_tp, pp_fsdp)")
    g.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (when unset: gpipe)")
    g.add_argument("--microbatches", type=positive_int,
                   help="micro-batches per step (when unset: 2 x stages)")  # fmt: skip
    g.add_argument("--repeats", type=positive_int,
                   help="circular, interleaved: chunks of layers per stage (when unset: 2)")  # fmt: skip
    g.add_argument("--stage-layers", type=stage_layers_arg, metavar="N,N,...|auto",
                   help="balanced stages (1f1b, interleaved, zb-h1): layers per virtual stage in "
                   "pipeline order, e.g. 3,5, or 'auto' to even out measured FLOPs (when unset: "
                   "equal)")  # fmt: skip


def add_devices_arg(
    p: argparse.ArgumentParser,
    default: int | None = None,
    help: str = "number of devices the mesh spans (simulated on a CPU-only host; when unset: "
    "the mesh's size, or 8 with a -1 axis)",
) -> None:
    """--devices: one meaning in every command, the number of devices the run spans."""
    p.add_argument("--devices", type=positive_int, default=default, metavar="N", help=help)


def console(stderr: bool = False) -> Console:
    """A rich console; wide when output goes to a file or pipe so tables are not squeezed."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else max(160, shutil.get_terminal_size((160, 24)).columns)
    return Console(file=stream, width=width)
