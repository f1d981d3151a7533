"""`spmdkit launch`: run one command as N local processes of a `jax.distributed` run.

Starts `spmdkit COMMAND ...` once per process with a coordinator on a local port (CPU devices,
gloo collectives: a multi-host run on one machine, for tests and demos). Each output line is
prefixed with its process id. When a process fails the others are stopped, and launch exits with
the failed process's status. On real clusters start the processes with srun, torchrun-style
environment variables or --coordinator/--num-processes/--process-id instead.
"""

from __future__ import annotations

import argparse

from sharding.cli.common import add_command, positive_int
from sharding.training import LAUNCH_GRACE_S, launch

EXAMPLES = [
    "--local-processes 2 -- train --mesh data=2,fsdp=2,tensor=2 --steps 20",
    "--local-processes 2 --devices-per-process 4 -- train --mesh fsdp=8 --strategy fsdp "
    "--steps 20 --metrics m.jsonl",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "launch", help="run a command as N local processes (jax.distributed)",
                    doc=__doc__, examples=EXAMPLES)  # fmt: skip
    p.add_argument("--local-processes", type=positive_int, required=True, metavar="N",
                   help="processes to start on this host")  # fmt: skip
    p.add_argument("--devices-per-process", type=positive_int, metavar="K",
                   help="simulated CPU devices per process (when unset: the mesh size / N)")  # fmt: skip
    p.add_argument("--port", type=int,
                   help="coordinator port on 127.0.0.1 (when unset: a free one)")  # fmt: skip
    p.add_argument("--grace", type=float, default=LAUNCH_GRACE_S, metavar="S",
                   help="seconds the other processes get to stop after one fails")  # fmt: skip
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the spmdkit command each process runs, after --, e.g. -- train --steps 20")  # fmt: skip
    p.set_defaults(run=run)


def check_command(argv: list[str]) -> None:
    """Parse the launched command as its processes will, so a bad flag stops the launch before
    any process starts (argparse prints the error and exits 2)."""
    from sharding.cli import COMMANDS

    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command or command[0] not in COMMANDS:
        return  # launch itself says what it can run
    parser = argparse.ArgumentParser(prog="spmdkit launch --")
    sub = parser.add_subparsers(dest="command")
    COMMANDS[command[0]].add_parser(sub)
    parser.parse_args(command)


def run(args: argparse.Namespace) -> int:
    check_command(args.argv)
    return launch(args.argv, args.local_processes, devices_per_process=args.devices_per_process,
                  port=args.port, grace_s=args.grace)  # fmt: skip
