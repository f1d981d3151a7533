"""Bad inputs of `spmdkit launch`, `spmdkit reshard` and train's multi-host flags: each refused
up front with exit 2, a message naming the value and the flag that fixes it, no traceback, no
process started and no file created or changed."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from sharding.training import Checkpointer, CheckpointMeta

TRAIN = ["train", "--mesh", "fsdp=8", "--steps", "2"]
TO_TP = ["--mesh", "fsdp=2,tensor=4", "--strategy", "fsdp_tp"]


def make_fixtures(root) -> None:
    """In the test's directory: ``ck`` (a checkpoint with steps 5 and 10), ``empty/``, ``full/``
    (one file in it) and ``afile``."""
    meta = CheckpointMeta("llama", "tiny", {}, "fsdp", {"fsdp": 8}, 16, 32, 1)
    with Checkpointer(root / "ck", keep=None, async_save=False) as ck:
        for step in (5, 10):
            ck.save(step, {"params": {"w": jnp.zeros(4)}}, meta)
    (root / "empty").mkdir()
    (root / "full").mkdir()
    (root / "full" / "notes.txt").write_text("mine")
    (root / "afile").write_text("not a directory")


CASES = [
    pytest.param(
        ["launch", "--local-processes", "0", "--", *TRAIN],
        r"--local-processes: 0 must be >= 1",
        id="launch-no-processes",
    ),
    pytest.param(
        ["launch", "--local-processes", "2", "--", "explain"],
        r"the command after -- must be one of: train; got 'explain'",
        id="launch-not-launchable",
    ),
    pytest.param(
        ["launch", "--local-processes", "2"],
        r"must be one of: train; got nothing. Write e\.g\. 'spmdkit launch",
        id="launch-no-command",
    ),
    pytest.param(
        ["launch", "--local-processes", "2", "--", *TRAIN, "--process-id", "1"],
        r"--process-id in the launched command: launch sets --coordinator, --num-processes, "
        r"--process-id itself for each process; drop them",
        id="launch-reserved-flag",
    ),
    pytest.param(
        [
            "launch",
            "--local-processes",
            "2",
            "--devices-per-process",
            "4",
            "--",
            *TRAIN,
            "--devices",
            "4",
        ],
        r"both --devices-per-process and --devices in the launched command; give one",
        id="launch-devices-twice",
    ),
    pytest.param(
        ["launch", "--local-processes", "2", "--devices-per-process", "0", "--", *TRAIN],
        r"--devices-per-process: 0 must be >= 1",
        id="launch-no-devices-per-process",
    ),
    pytest.param(
        ["launch", "--local-processes", "2", "--grace", "-1", "--", *TRAIN],
        r"--grace -1.0 must be a number of seconds >= 0 .* e\.g\. --grace 10",
        id="launch-negative-grace",
    ),
    pytest.param(
        ["launch", "--local-processes", "2", "--grace", "nan", "--", *TRAIN],
        r"--grace nan must be a number of seconds >= 0",
        id="launch-nan-grace",
    ),
    pytest.param(
        ["launch", "--local-processes", "2", "--port", "70000", "--", *TRAIN],
        r"--port 70000 is not a TCP port; give one in 1\.\.65535, or drop --port",
        id="launch-port-out-of-range",
    ),
    pytest.param(
        ["launch", "--local-processes", "2", "--", *TRAIN, "--steps", "0"],
        r"spmdkit launch -- train: error: argument --steps: 0 must be >= 1",
        id="launch-bad-value-in-command",
    ),
    pytest.param(
        ["launch", "--local-processes", "2", "--", *TRAIN, "--stpes", "5"],
        r"unrecognized arguments: --stpes 5",
        id="launch-unknown-flag-in-command",
    ),
    pytest.param(
        ["reshard", "ck", "ck", *TO_TP],
        r"SRC and DST are both ck; give a new directory as DST",
        id="reshard-same-dir",
    ),
    pytest.param(
        ["reshard", "ck", "./empty/../ck", *TO_TP],
        r"SRC and DST are both ck",
        id="reshard-same-dir-spelled-otherwise",
    ),
    pytest.param(
        ["reshard", "missing", "out", *TO_TP],
        r"SRC missing does not exist; give as SRC the --checkpoint-dir of a spmdkit train run",
        id="reshard-missing-src",
    ),
    pytest.param(
        ["reshard", "afile", "out", *TO_TP],
        r"SRC afile is a file, not a checkpoint directory",
        id="reshard-src-is-a-file",
    ),
    pytest.param(
        ["reshard", "empty", "out", *TO_TP],
        r"SRC empty holds no committed checkpoint; give as SRC the --checkpoint-dir",
        id="reshard-src-without-checkpoint",
    ),
    pytest.param(
        ["reshard", "ck", "full", *TO_TP],
        r"DST full is not empty \(1 entries: notes\.txt\); give a new or empty directory as DST, "
        r"or pass --overwrite",
        id="reshard-dst-not-empty",
    ),
    pytest.param(
        ["reshard", "ck", "afile", *TO_TP],
        r"DST afile is a file; give a new or empty directory",
        id="reshard-dst-is-a-file",
    ),
    pytest.param(
        ["reshard", "ck", "ck/tp", *TO_TP],
        r"DST ck/tp is inside SRC ck; give a DST outside SRC",
        id="reshard-dst-inside-src",
    ),
    pytest.param(
        ["reshard", "ck", "out", *TO_TP, "--step", "7"],
        r"--step 7: SRC ck has no step 7; its saved steps are 5, 10; give one of them, or drop "
        r"--step for the latest \(10\)",
        id="reshard-unknown-step",
    ),
    pytest.param(
        ["reshard", "ck", "out", *TO_TP, "--step", "-1"],
        r"argument --step: -1 must be >= 0",
        id="reshard-negative-step",
    ),
    pytest.param(
        ["reshard", "ck", "out", *TO_TP, "--devices", "4"],
        r"--mesh fsdp=2,tensor=4 spans 8 devices but --devices is 4; make them agree",
        id="reshard-mesh-and-devices-disagree",
    ),
    pytest.param(
        [*TRAIN, "--heartbeat-timeout", "0"],
        r"argument --heartbeat-timeout: 0 must be >= 1",
        id="train-zero-heartbeat",
    ),
    pytest.param(
        [*TRAIN, "--num-processes", "0"],
        r"argument --num-processes: 0 must be >= 1",
        id="train-zero-processes",
    ),
    pytest.param(
        [*TRAIN, "--process-id", "-1"],
        r"argument --process-id: -1 must be >= 0",
        id="train-negative-process-id",
    ),
    pytest.param(
        [*TRAIN, "--num-processes", "2", "--process-id", "0"],
        r"--num-processes=2, --process-id=0 given, but --coordinator missing; give all three",
        id="train-no-coordinator",
    ),
    pytest.param(
        [*TRAIN, "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
        r"coordinator address 'localhost' \(from flags\) is not HOST:PORT; write e\.g\.",
        id="train-coordinator-without-port",
    ),
    pytest.param(
        [*TRAIN, "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
        r"--process-id=2 is outside 0\.\.1 \(--num-processes=2, from flags\); number the processes",
        id="train-process-id-out-of-range",
    ),
]


@pytest.mark.parametrize(("args", "match"), CASES)
def test_refused(args, match, refused, tmp_path):
    make_fixtures(tmp_path)
    refused(args, match)
