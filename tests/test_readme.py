"""README.md runs as written: every Python block in a fresh one-device CPU process, and the
quickstart is the two commands CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def test_the_readme_has_python_blocks_and_a_two_command_quickstart():
    assert len(BLOCKS) >= 5
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^```\n(.*?)\n```", quickstart, flags=re.S | re.M)
    assert commands == ["pip install -e '.[gpu]' && spmdkit compare",
                        "pip install -e '.[test,gpu,tpu]' && python -m pytest -n auto --dist loadfile -q "
                        "--durations=10"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i + 1}")
def test_python_block_runs_as_written(index, tmp_path):
    """Each block in a fresh interpreter on a host with one CPU device (the JAX default), with
    the repository as its working directory, as a reader who copies it would run it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["SPMDKIT_README_TMP"] = str(tmp_path)  # unused by the blocks; keeps runs apart
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"block {index + 1}:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"
