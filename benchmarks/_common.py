"""What every benchmark shares: device setup, output folder, JSON, timing."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["finish_claim", "median_time", "out_dir", "parser", "setup", "write_json"]


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


def finish_claim(name: str, args: Any, rows: list, claim: dict, started: float, console: Any,
                 plot: Callable[[Path], Any]) -> int:  # fmt: skip
    """The end of a benchmark that checks one claim: print the verdict and the time, write
    ``<out>/<name>.json`` (args, rows, claim) and ``<name>.png``; exit status 1 if it fails."""
    if claim["holds"] is not None:
        verdict = "[green]holds[/]" if claim["holds"] else "[red]FAILS[/]"
        console.print(f"{verdict} {claim['claim']}: ratio {claim['ratio']:.3f}")
    elapsed = time.perf_counter() - started
    console.print(f"{len(rows)} programs compiled in {elapsed:.1f} s")
    out = out_dir(args.out)
    record = {"benchmark": name, "args": {k: v for k, v in vars(args).items() if k != "out"},
              "rows": rows, "claim": claim, "elapsed_s": elapsed}  # fmt: skip
    write_json(out / f"{name}.json", record)
    plot(out / f"{name}.png")
    console.print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")
    return 1 if claim["holds"] is False else 0
