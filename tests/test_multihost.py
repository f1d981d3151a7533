"""Multi-process runs on jax.distributed: settings from flags and environment, the local launcher,
the per-process batch, and the end-to-end acceptance (2 processes x 4 CPU devices = the 8-device
single-process loss curve; a dead peer stops the survivor with a clear message)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sharding.cli import main
from sharding.training import (
    DistributedConfigError,
    LaunchError,
    ProcessGroup,
    devices_per_process,
    free_port,
    join_run,
    launch,
    process_commands,
    resolve_process_group,
)

MESH = "data=2,fsdp=2,tensor=2"
TRAIN = ["train", "--model", "llama", "--size", "tiny", "--strategy", "fsdp_tp",
         "--batch", "8", "--seq", "32"]  # fmt: skip
# `spmdkit launch` in a child process.
LAUNCHER = [sys.executable, "-c",
            "import sys; from sharding.cli import main; sys.exit(main(['launch', *sys.argv[1:]]))"]  # fmt: skip
DIST_ENV = ("SPMDKIT_COORDINATOR", "SPMDKIT_NUM_PROCESSES", "SPMDKIT_PROCESS_ID",
            "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
            "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")  # fmt: skip


# ---------------------------------------------------------------- settings: flags and environment


def test_flags_win_over_environment():
    env = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    g = resolve_process_group("10.0.0.1:1234", 2, 1, env=env)
    assert g == ProcessGroup("10.0.0.1:1234", 2, 1, "flags")


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"SPMDKIT_COORDINATOR": "c:9", "SPMDKIT_NUM_PROCESSES": "4", "SPMDKIT_PROCESS_ID": "2"},
         ProcessGroup("c:9", 4, 2, "SPMDKIT_* environment")),
        ({"SPMDKIT_COORDINATOR": "job-0.svc:9", "SPMDKIT_NUM_PROCESSES": "4",
          "JOB_COMPLETION_INDEX": "3"},
         ProcessGroup("job-0.svc:9", 4, 3, "SPMDKIT_* environment")),
        ({"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5"},
         ProcessGroup("10.1.1.1:29500", 8, 5, "torchrun environment")),
        ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_PROCID": "9"},
         ProcessGroup(None, 16, 9, "SLURM")),
    ],
)  # fmt: skip
def test_environment_sources(env, want):
    assert resolve_process_group(env=env) == want


@pytest.mark.parametrize(
    "env",
    [{}, {"WORLD_SIZE": "1", "RANK": "0"}, {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}],
)
def test_one_process_is_no_distributed_run(env):
    assert resolve_process_group(env=env) is None


@pytest.mark.parametrize(
    ("flags", "env", "match"),
    [
        ((None, 2, 0), {}, r"from flags are incomplete: --num-processes=2, --process-id=0 given, "
                           r"but --coordinator missing"),
        ((None, None, None), {"WORLD_SIZE": "2", "RANK": "1"},
         r"torchrun environment are incomplete.*MASTER_ADDR:MASTER_PORT missing"),
        (("h:1", 2, 2), {}, r"--process-id=2 is outside 0\.\.1 \(--num-processes=2"),
        (("h:1", 0, 0), {}, r"--num-processes=0 \(from flags\) must be >= 1"),
        (("h", 2, 0), {}, r"coordinator address 'h' \(from flags\) is not HOST:PORT"),
        ((None, None, None), {"SPMDKIT_COORDINATOR": "h:1", "SPMDKIT_NUM_PROCESSES": "two",
                              "SPMDKIT_PROCESS_ID": "0"},
         r"SPMDKIT_NUM_PROCESSES='two' \(from SPMDKIT_\* environment\) is not an integer"),
    ],
)  # fmt: skip
def test_bad_settings_say_what_to_fix(flags, env, match):
    with pytest.raises(DistributedConfigError, match=match):
        resolve_process_group(*flags, env=env)


def test_devices_per_process():
    g = ProcessGroup("h:1", 2, 0, "flags")
    assert devices_per_process(g, None, 8) == 4
    assert devices_per_process(g, 3, 8) == 3  # as given: the mesh check comes later
    assert devices_per_process(g, None, None) == 4  # 8 devices in all by default
    with pytest.raises(DistributedConfigError, match=r"needs 6 devices in all.*over 4 processes"):
        devices_per_process(ProcessGroup("h:1", 4, 0, "flags"), None, 6)


def test_join_run_is_a_no_op_for_one_process(monkeypatch, capsys):
    for k in DIST_ENV:
        monkeypatch.delenv(k, raising=False)
    assert join_run(mesh=MESH) is None
    assert join_run(mesh=MESH, devices=8, env={"WORLD_SIZE": "1", "RANK": "0"}) is None
    with pytest.raises(SystemExit):  # the CLI's default heartbeat is the library's, 10 s
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "--heartbeat-timeout S seconds without a heartbeat before a peer counts as dead "
        "(default: 10)" in help_text
    )


def test_heartbeat_timeout_must_be_positive():
    with pytest.raises(DistributedConfigError, match=r"--heartbeat-timeout 0 must be >= 1"):
        join_run(coordinator="127.0.0.1:1", num_processes=2, process_id=0, mesh=MESH,
                 heartbeat_timeout_s=0)  # fmt: skip


# ---------------------------------------------------------------- the launcher


def test_process_commands_and_their_errors():
    argvs = process_commands(["--", "train", "--steps", "3"], 2, 4321, devices_per_process=4)
    assert argvs[1] == ["train", "--steps", "3", "--devices", "4", "--coordinator",
                        "127.0.0.1:4321", "--num-processes", "2", "--process-id", "1"]  # fmt: skip
    with pytest.raises(LaunchError, match=r"after -- must be one of: train; got 'explain'"):
        process_commands(["explain"], 2, 1)
    with pytest.raises(LaunchError, match=r"--process-id=1 in the launched command"):
        process_commands(["train", "--process-id=1"], 2, 1)
    with pytest.raises(LaunchError, match=r"both --devices-per-process and --devices"):
        process_commands(["train", "--devices", "2"], 2, 1, devices_per_process=4)
    with pytest.raises(LaunchError, match=r"--local-processes 0 must be >= 1"):
        process_commands(["train"], 0, 1)


def test_launch_stops_the_others_when_one_fails():
    # Each process reads its id (the last argument): process 0 sleeps, process 1 fails soon.
    code = ("import sys, time; print('up', flush=True); i = int(sys.argv[-1]); "
            "time.sleep([60, 0.2][i]); sys.exit([0, 3][i])")  # fmt: skip
    out = io.StringIO()
    start = time.monotonic()
    rc = launch(["train"], 2, out=out, grace_s=5, executable=[sys.executable, "-c", code])
    assert rc == 3 and time.monotonic() - start < 20
    text = out.getvalue()
    assert "[p0] up" in text and "[p1] up" in text
    assert "[launch] process 1 failed (status 3); stopping process(es) 0" in text


def test_launch_succeeds_when_all_succeed():
    out = io.StringIO()
    assert launch(["train"], 2, out=out, executable=[sys.executable, "-c", "print('ok')"]) == 0
    assert out.getvalue().count("] ok") == 2


# ---------------------------------------------------------------- end to end (subprocesses)


def _losses(path) -> list[float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["loss"] for r in rows]


@pytest.mark.slow
def test_two_processes_match_the_single_process_loss_curve(tmp_path):
    multi, single = tmp_path / "multi.jsonl", tmp_path / "single.jsonl"
    cmd = [*LAUNCHER, "--local-processes", "2", "--devices-per-process", "4", "--", *TRAIN,
           "--mesh", MESH, "--steps", "20", "--metrics", str(multi)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The reference runs here, on this process's 8 simulated devices, meanwhile.
    assert main([*TRAIN, "--mesh", MESH, "--steps", "20", "--metrics", str(single)]) == 0
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    assert "[p1] " in out and "data=2,fsdp=2,tensor=2 (8 cpu devices)" in out
    # Only process 0 writes --metrics: one well-formed line per step.
    np.testing.assert_allclose(_losses(multi), _losses(single), rtol=1e-5)
    assert len(_losses(multi)) == 20


def _wait_for_metrics(path, procs, timeout=180.0):
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, f"no step logged; exited: {dead}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_dead_peer_stops_the_survivor_with_a_clear_message(tmp_path):
    # Processes split along tensor: the batch is replicated, each process loads all of it.
    port, metrics = free_port(), tmp_path / "m.jsonl"
    argvs = process_commands([*TRAIN, "--mesh", "tensor=2", "--steps", "100000",
                              "--batch", "2", "--seq", "16", "--metrics", str(metrics)],
                             2, port)  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", _TRAIN_MAIN, *a], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for a in argvs]  # fmt: skip
    try:
        _wait_for_metrics(metrics, procs)
        procs[0].send_signal(signal.SIGKILL)  # process 0 also hosts the coordination service
        start = time.monotonic()
        out, _ = procs[1].communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        _reap(procs)
    assert procs[1].returncode == 1 and took < 60
    assert "process 1 of 2" in out and "stopped: a peer process is gone" in out, out[-3000:]
    assert "Restart all 2 processes" in out


@pytest.mark.slow
def test_launch_ends_the_run_when_a_process_dies(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = [*LAUNCHER, "--local-processes", "2", "--", *TRAIN, "--mesh", "data=2",
           "--steps", "100000", "--batch", "2", "--seq", "16", "--metrics", str(metrics)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_metrics(metrics, [proc])
        os.kill(_child_with(proc.pid, "--process-id\0" + "1"), signal.SIGKILL)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        _reap([proc])
    assert proc.returncode != 0 and took < 60
    assert "process 1 failed (signal SIGKILL)" in out, out[-3000:]


_TRAIN_MAIN = "import sys; from sharding.cli import main; sys.exit(main())"


def _reap(procs) -> None:
    for p in procs:
        p.kill()
        p.wait()
        p.stdout.close()


def _child_with(pid: int, arg: str) -> int:
    """The child process of `pid` whose command line contains `arg` (NUL-separated words)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    for c in children:
        with open(f"/proc/{c}/cmdline") as f:
            if arg in f.read():
                return c
    raise AssertionError(f"no child of {pid} runs with {arg!r}: {children}")
