"""The multi-host flags of a command, and how a process of a multi-process run ends on an error.

`add_distributed_args` adds ``--coordinator/--num-processes/--process-id/--heartbeat-timeout``;
`join_from_args` joins the run they (or the environment) describe through
`sharding.training.join_run`, then installs the exit policy: an uncaught error prints its
traceback and one line saying why the process stopped, and the process exits with status 1 at
once, skipping the `jax.distributed` shutdown barrier (which can only wait for peers that are gone).
"""

from __future__ import annotations

import argparse
import os
import sys

from sharding.cli.common import non_negative_int, positive_int
from sharding.training import HEARTBEAT_TIMEOUT_S, JoinedRun, join_run

# Fragments of the runtime's errors when a peer vanished mid-collective or from the service.
_PEER_LOST = ("gloo", "connection closed", "connection reset", "heartbeat", "unavailable",
              "coordination service", "socket closed", "broken pipe")  # fmt: skip


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Add the ``multi-host (jax.distributed)`` argument group to a subcommand's parser."""
    g = p.add_argument_group(
        "multi-host (jax.distributed)",
        "Omit for one process. Also read from SPMDKIT_COORDINATOR/SPMDKIT_NUM_PROCESSES/"
        "SPMDKIT_PROCESS_ID, torchrun's MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK, or SLURM. "
        "On CPU hosts --devices counts the simulated devices of each process.",
    )
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="address of process 0's coordination service")  # fmt: skip
    g.add_argument("--num-processes", type=positive_int, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=non_negative_int, metavar="I",
                   help="this process's id, 0..N-1")  # fmt: skip
    g.add_argument("--heartbeat-timeout", type=positive_int, default=HEARTBEAT_TIMEOUT_S,
                   metavar="S", help="seconds without a heartbeat before a peer counts as dead")  # fmt: skip


def join_from_args(args: argparse.Namespace) -> JoinedRun | None:
    """Join the multi-process run the flags or environment describe; None (a no-op) for one.

    Call before anything initialises JAX. For a multi-process run on a CPU-only host it sets
    ``args.devices`` to this process's simulated devices; on processes other than 0 it drops
    ``args.metrics``, so only process 0 writes the metrics file.
    """
    joined = join_run(
        mesh=getattr(args, "mesh", None),
        devices=getattr(args, "devices", None),
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )
    if joined is None:
        return None
    if joined.devices is not None:
        args.devices = joined.devices
    if not joined.writes_metrics and getattr(args, "metrics", None) is not None:
        args.metrics = None
    _exit_on_error(joined)
    return joined


_HOOKED = False


def _exit_on_error(joined: JoinedRun) -> None:
    """On an uncaught error: the traceback, then one line saying why, then exit status 1."""
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    previous, group = sys.excepthook, joined.group

    def hook(kind, value, tb):
        previous(kind, value, tb)
        first = (str(value).strip().splitlines() or [kind.__name__])[0]
        if any(s in first.lower() for s in _PEER_LOST):
            why = (f"a peer process is gone ({first}); a multi-process run cannot continue "
                   f"without all its processes")  # fmt: skip
        else:
            why = (f"{kind.__name__}: {first}; the other processes stop within about "
                   f"{joined.heartbeat_timeout_s} s once they miss this one")  # fmt: skip
        print(
            f"spmdkit: {group} stopped: {why}. Restart all {group.num_processes} processes "
            f"(with --checkpoint-dir and --resume to continue from the last checkpoint)",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook
