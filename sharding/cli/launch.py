"""`spmdkit launch`: run one command as N local processes of a `jax.distributed` run.

    spmdkit launch --local-processes 2 --devices-per-process 4 -- \\
        train --mesh data=2,fsdp=2,tensor=2 --steps 20 --metrics m.jsonl

starts `spmdkit train ...` once per process with a coordinator on a free local port (CPU devices,
gloo collectives: a multi-host run on one machine, for tests and demos). Each output line is
prefixed with its process id. When a process fails the others are stopped, and launch exits with
the failed process's status. On real clusters start the processes with srun, torchrun-style
environment variables or --coordinator/--num-processes/--process-id instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

LAUNCHABLE = ("train",)
RESERVED = ("--coordinator", "--num-processes", "--process-id")
GRACE_S = 10.0


class LaunchError(ValueError):
    """The launch command line cannot start a multi-process run."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a command as N local processes (jax.distributed)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--local-processes", type=int, required=True, metavar="N",
                   help="processes to start on this host")  # fmt: skip
    p.add_argument("--devices-per-process", type=int, metavar="K",
                   help="simulated CPU devices per process (default: the mesh size / N)")  # fmt: skip
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--grace", type=float, default=GRACE_S, metavar="S",
                   help="seconds the other processes get to stop after one fails "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the spmdkit command each process runs, after --, e.g. -- train --steps 20")  # fmt: skip
    p.set_defaults(run=run)


def spmdkit_executable() -> list[str]:
    """How to run `spmdkit`: the console script beside this Python, else `python -c` its main."""
    script = Path(sys.executable).with_name("spmdkit")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "import sys; from sharding.cli import main; sys.exit(main())"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_commands(
    command: list[str], n: int, port: int, devices_per_process: int | None = None
) -> list[list[str]]:
    """The argument lists (after the executable) of the ``n`` processes of ``command``.

    Example:
        >>> process_commands(["train", "--steps", "3"], 2, 1234)[1]
        ['train', '--steps', '3', '--coordinator', '127.0.0.1:1234', '--num-processes', '2', '--process-id', '1']
    """
    command = command[1:] if command[:1] == ["--"] else list(command)
    if not command or command[0] not in LAUNCHABLE:
        got = f"{command[0]!r}" if command else "nothing"
        raise LaunchError(
            f"the command after -- must be one of: {', '.join(LAUNCHABLE)}; got {got}. Write e.g. "
            f"'spmdkit launch --local-processes 2 -- train --mesh data=2,tensor=4 --steps 20'"
        )
    if n < 1:
        raise LaunchError(f"--local-processes {n} must be >= 1")
    taken = [a for a in command if a.split("=", 1)[0] in RESERVED]
    if taken:
        raise LaunchError(
            f"{', '.join(taken)} in the launched command: launch sets "
            f"{', '.join(RESERVED)} itself for each process; drop them"
        )
    if devices_per_process is not None:
        if devices_per_process < 1:
            raise LaunchError(f"--devices-per-process {devices_per_process} must be >= 1")
        if any(a.split("=", 1)[0] == "--devices" for a in command):
            raise LaunchError(
                "both --devices-per-process and --devices in the launched command; give one "
                "(each counts the simulated CPU devices of one process)"
            )
        command += ["--devices", str(devices_per_process)]
    address = f"127.0.0.1:{port}"
    return [
        [*command, "--coordinator", address, "--num-processes", str(n), "--process-id", str(i)]
        for i in range(n)
    ]


def _status(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"


# Gloo announces every connection of every collective group, one line each: noise, not news.
_QUIET = ("[Gloo] Rank ",)


def _pump(i: int, stream: TextIO, out: TextIO, lock: threading.Lock) -> None:
    for line in stream:
        if line.startswith(_QUIET):
            continue
        with lock:
            out.write(f"[p{i}] {line}" if line.endswith("\n") else f"[p{i}] {line}\n")
            out.flush()


def launch(
    argvs: list[list[str]],
    *,
    grace_s: float = GRACE_S,
    out: TextIO | None = None,
    env: dict[str, str] | None = None,
    executable: list[str] | None = None,
) -> int:
    """Run one process per argument list, stream their prefixed output, stop all if one fails.

    Returns 0 when every process succeeds, else the first failure's status (128 + N for a
    process ended by signal N), or 130 when interrupted. ``executable`` defaults to `spmdkit`.
    """
    out = out or sys.stdout
    lock = threading.Lock()
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    exe = executable or spmdkit_executable()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for i, argv in enumerate(argvs):
            p = subprocess.Popen([*exe, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, bufsize=1, env=env)  # fmt: skip
            procs.append(p)
            with lock:
                out.write(f"[launch] process {i}: pid {p.pid}\n")
                out.flush()
            t = threading.Thread(target=_pump, args=(i, p.stdout, out, lock), daemon=True)
            t.start()
            pumps.append(t)
        failed = _watch(procs)
    except KeyboardInterrupt:
        _stop(procs, grace_s)
        for p in procs:
            p.stdout.close()
        out.write("[launch] interrupted: stopped all processes\n")
        return 130
    if failed:
        rest = [j for j, p in enumerate(procs) if p.poll() is None]
        with lock:
            out.write(
                "[launch] "
                + ", ".join(f"process {i} failed ({_status(rc)})" for i, rc in failed)
                + (f"; stopping process(es) {', '.join(map(str, rest))}" if rest else "")
                + "\n"
            )
            out.flush()
    _stop(procs, grace_s)
    for t, p in zip(pumps, procs, strict=True):
        t.join(timeout=5)
        p.stdout.close()
    if not failed:
        return 0
    rc = failed[0][1]
    return 128 - rc if rc < 0 else rc


def _watch(procs: list[subprocess.Popen]) -> list[tuple[int, int]]:
    """Wait until all processes succeed ([]) or some fail: [(index, return code)], those ended
    by a signal first (a killed process usually takes its peers down with it)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
        if failed:
            return sorted(failed, key=lambda f: f[1] >= 0)
        if None not in codes:
            return []
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the processes still running, SIGKILL those still there after ``grace_s``."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(args: argparse.Namespace) -> int:
    argvs = process_commands(
        args.argv, args.local_processes, args.port or free_port(), args.devices_per_process
    )
    return launch(argvs, grace_s=args.grace)
