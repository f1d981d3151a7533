"""What every benchmark shares: device setup, output folder, JSON, timing."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["median_time", "out_dir", "parser", "setup", "write_json"]


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """An argparse parser with the flags every benchmark has: --devices and --out."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU hosts)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out") / name,
                   help="folder for the JSON and PNG (default: %(default)s)")  # fmt: skip
    return p


def setup(devices: int) -> None:
    """Simulate ``devices`` CPU devices on a CPU-only host; must run before any JAX use."""
    from sharding import cpu_only, simulate_cpu_devices

    if cpu_only():
        simulate_cpu_devices(devices)


def out_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, record: Any) -> Path:
    """Write ``record`` (with the jax version and devices it ran on) as indented JSON."""
    import jax

    dev = jax.devices()[0]
    meta = {"jax": jax.__version__, "platform": dev.platform, "device_kind": dev.device_kind,
            "device_count": jax.device_count()}  # fmt: skip
    out_dir(path.parent)
    path.write_text(json.dumps({"environment": meta, **record}, indent=2, default=str))
    return path


def median_time(fn: Callable[[], Any], steps: int) -> tuple[float, list[float]]:
    """Median and all wall times of ``steps`` calls of ``fn`` (which must block on its result)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times
