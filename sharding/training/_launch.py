"""Run one spmdkit command as N local processes of a `jax.distributed` run (`spmdkit launch`).

Each process gets the command plus ``--coordinator 127.0.0.1:PORT --num-processes N --process-id
I`` (CPU devices, gloo collectives: a multi-host run on one machine, for tests and demos). Every
output line is prefixed with its process id. When a process fails the others are stopped, and the
launch returns the failed process's status. On real clusters start the processes with srun,
torchrun-style environment variables or --coordinator/--num-processes/--process-id instead.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from sharding.training._errors import TrainingError

LAUNCHABLE = ("train",)
RESERVED = ("--coordinator", "--num-processes", "--process-id")
LAUNCH_GRACE_S = 10.0


class LaunchError(TrainingError):
    """The launch cannot start a multi-process run as asked (processes, command, port, grace)."""


def spmdkit_executable() -> list[str]:
    """How to run `spmdkit`: the console script beside this Python, else `python -c` its main."""
    script = Path(sys.executable).with_name("spmdkit")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "import sys; from sharding.cli import main; sys.exit(main())"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _whole(value: object, flag: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise LaunchError(f"{flag} {value!r} must be >= {least} (a whole number)")


def process_commands(
    command: Sequence[str], processes: int, port: int, devices_per_process: int | None = None
) -> list[list[str]]:
    """The argument lists (after the executable) of the ``processes`` processes of ``command``.

    Example:
        >>> process_commands(["train", "--steps", "3"], 2, 1234)[1][3:]
        ['--coordinator', '127.0.0.1:1234', '--num-processes', '2', '--process-id', '1']
    """
    command = list(command[1:] if command[:1] == ["--"] else command)
    if not command or command[0] not in LAUNCHABLE:
        got = f"{command[0]!r}" if command else "nothing"
        raise LaunchError(
            f"the command after -- must be one of: {', '.join(LAUNCHABLE)}; got {got}. Write e.g. "
            f"'spmdkit launch --local-processes 2 -- train --mesh data=2,tensor=4 --steps 20'"
        )
    _whole(processes, "--local-processes", 1)
    taken = [a for a in command if a.split("=", 1)[0] in RESERVED]
    if taken:
        raise LaunchError(
            f"{', '.join(taken)} in the launched command: launch sets "
            f"{', '.join(RESERVED)} itself for each process; drop them"
        )
    if devices_per_process is not None:
        _whole(devices_per_process, "--devices-per-process", 1)
        if any(a.split("=", 1)[0] == "--devices" for a in command):
            raise LaunchError(
                "both --devices-per-process and --devices in the launched command; give one "
                "(each counts the simulated CPU devices of one process)"
            )
        command += ["--devices", str(devices_per_process)]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise LaunchError(f"--port {port} is not a TCP port; give one in 1..65535, or drop --port")
    address = f"127.0.0.1:{port}"
    return [
        [*command, "--coordinator", address, "--num-processes", str(processes),
         "--process-id", str(i)]
        for i in range(processes)
    ]  # fmt: skip


def launch(
    command: Sequence[str],
    processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace_s: float = LAUNCH_GRACE_S,
    out: TextIO | None = None,
    env: Mapping[str, str] | None = None,
    executable: Sequence[str] | None = None,
) -> int:
    """Run ``command`` (``["train", ...]``) as ``processes`` local processes; their exit status.

    Streams every process's output prefixed ``[pI]`` to ``out`` (default: stdout) and stops the
    others (SIGTERM, SIGKILL after ``grace_s``) as soon as one fails. Returns 0 when every process
    succeeds, else the first failure's status (128 + N for a process ended by signal N), or 130
    when interrupted. ``port`` is the coordinator's on 127.0.0.1 (default: a free one);
    ``executable`` runs each process (default: `spmdkit`). Every argument is checked before any
    process starts.

    Example:
        >>> launch(["train", "--mesh", "data=2,tensor=4", "--steps", "20"], 2)  # doctest: +SKIP
        0
    """
    if (
        isinstance(grace_s, bool)
        or not isinstance(grace_s, int | float)
        or not (math.isfinite(grace_s) and grace_s >= 0)
    ):
        raise LaunchError(
            f"--grace {grace_s} must be a number of seconds >= 0 (how long the other processes "
            f"get to stop after one fails), e.g. --grace {LAUNCH_GRACE_S:g}"
        )
    argvs = process_commands(
        command, processes, free_port() if port is None else port, devices_per_process
    )
    return _run(argvs, grace_s, out or sys.stdout, env, list(executable or spmdkit_executable()))


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


def _run(
    argvs: list[list[str]],
    grace_s: float,
    out: TextIO,
    env: Mapping[str, str] | None,
    exe: list[str],
) -> int:
    """Run one process per argument list, stream their prefixed output, stop all if one fails."""
    lock = threading.Lock()
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
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
