"""GEMM efficiency by shape on one device: the measurement a shape-dependent matmul term needs.

`sharding.costmodel.step_time` prices every matmul at one fraction of the dense peak. A real
step's matmuls are not all large and square: tensor parallelism cuts the MLP's and attention's
weights ``tensor`` ways, so a device multiplies ``tokens x d`` by ``d x 4d/t`` (column-parallel)
and ``tokens x 4d/t`` by ``4d/t x d`` (row-parallel), and narrow ones run further from the peak
(fewer output tiles than the device has cores, lower arithmetic intensity). `grid` lists such
shapes for model widths 2048-8192 split 1-8 ways; `rate` times one, back to back, as the step
would run it. The table says, per shape, the fraction of the datasheet peak and of the best
large square matmul (calibrate's (a) sizes, timed the same way), so that a profile can carry a measured table of
efficiencies rather than a figure fitted to a training run.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

# Calls per timed burst. A burst of N calls costs a fixed start (the first dispatch, the final
# wait) plus N matmuls; timing N and 2N and taking the difference leaves the N matmuls alone, as
# long as the host dispatches faster than the device multiplies (true for the grid's smallest,
# ~17 GFLOP, ~25 us on an H100, against a few us of dispatch per call).
BURST = 8


class GemmArgumentError(ValueError):
    """A --gemms entry that is not MxKxN of positive whole numbers."""


def grid(cpu: bool) -> list[dict[str, Any]]:
    """Training-shaped GEMMs: for each token count and model width d, the MLP's column-parallel
    (d -> 4d/t) and row-parallel (4d/t -> d) matmul at each tensor split t; 64-wide on a CPU."""
    tokens, widths, splits = ((64,), (64,), (1, 2)) if cpu else ((4096, 16384), (2048, 4096, 8192),
                                                                 (1, 2, 4, 8))  # fmt: skip
    out = []
    for m in tokens:
        for d in widths:
            for t in splits:
                out.append({"m": m, "k": d, "n": 4 * d // t, "what": f"column d={d} tensor={t}"})
                out.append({"m": m, "k": 4 * d // t, "n": d, "what": f"row d={d} tensor={t}"})
    return out


def parse(text: str) -> list[dict[str, Any]]:
    """``"4096x8192x1024,..."`` -> shapes (M x K times K x N); ``"none"`` -> none.

    Example:
        >>> parse("64x32x16")
        [{'m': 64, 'k': 32, 'n': 16, 'what': 'given'}]
    """
    if text.strip().lower() == "none":
        return []
    out = []
    for item in [s.strip() for s in text.split(",")]:
        dims = item.lower().split("x")
        if len(dims) != 3 or not all(d.isascii() and d.isdigit() and int(d) > 0 for d in dims):
            raise GemmArgumentError(
                f"--gemms {item!r}: write MxKxN (an M x K matrix times a K x N one), e.g. "
                f"--gemms 4096x8192x1024,4096x1024x8192, or --gemms none"
            )
        m, k, n = map(int, dims)
        out.append({"m": m, "k": k, "n": n, "what": "given"})
    return out


def squares(sizes: list[int]) -> list[dict[str, Any]]:
    """The square matmuls of calibrate's (a), timed as the others: the yardstick column."""
    return [{"m": n, "k": n, "n": n, "what": f"square n={n}"} for n in sizes]


def rate(shape: dict[str, Any], dtype: str, steps: int, device: Any) -> dict[str, Any]:
    """``shape`` timed on ``device``: seconds per matmul (the median over ``steps`` of a
    2 x `BURST` burst's time less a `BURST` one's, over `BURST`), FLOP/s, and its arithmetic
    intensity (FLOPs per byte of its operands and result)."""
    import jax
    import jax.numpy as jnp

    m, k, n = shape["m"], shape["k"], shape["n"]
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(ka, (m, k), jnp.float32).astype(dtype), device)
    b = jax.random.normal(kb, (k, n), jnp.float32) / math.sqrt(k)
    b = jax.device_put(b.astype(dtype), device)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()

    def burst(calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            out = matmul(a, b)
        out.block_until_ready()
        return time.perf_counter() - start

    per_call = []
    for _ in range(steps):
        one, two = burst(BURST), burst(2 * BURST)
        # noise can make the difference vanish on a host: then the longer burst's mean
        per_call.append((two - one if two > one else two / 2) / BURST)
    seconds, flops, size = statistics.median(per_call), 2.0 * m * k * n, jnp.dtype(dtype).itemsize
    return {**shape, "dtype": dtype, "seconds": seconds, "flops": flops,
            "flops_per_s": flops / seconds,
            "intensity": flops / (size * (m * k + k * n + m * n)), "times_s": per_call}  # fmt: skip


def table(rows: list[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in ("M", "K", "N", "shape", "GFLOP", "FLOP/byte", "time", "TFLOP/s",
                "of peak", "of best square"):  # fmt: skip
        t.add_column(col, justify="left" if col == "shape" else "right")
    for r in rows:
        t.add_row(str(r["m"]), str(r["k"]), str(r["n"]), r["what"], f"{r['flops'] / 1e9:.4g}",
                  f"{r['intensity']:.0f}", f"{r['seconds'] * 1e3:.3g} ms",
                  f"{r['flops_per_s'] / 1e12:.4g}", f"{r['fraction']:.1%}",
                  f"{r['of_square']:.1%}")  # fmt: skip
    return t


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Fraction of peak against FLOPs per matmul (log): a marker per kind (column- or
    row-parallel, square, given), a colour per tensor split (or square size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"column": "o", "row": "s", "square": "^", "given": "x"}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        kind, _, split = r["what"].partition(" ")
        groups.setdefault((kind, split.rpartition(" ")[2]), []).append(r)
    colours = {t: f"C{i}" for i, t in enumerate(sorted({t for _, t in groups}))}
    for (kind, split), sel in sorted(groups.items()):
        ax.scatter([r["flops"] for r in sel], [r["fraction"] for r in sel], marker=markers[kind],
                   color=colours[split], label=f"{kind} {split}".strip())  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per matmul")
    ax.set_ylabel("fraction of the datasheet peak")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["BURST", "GemmArgumentError", "grid", "parse", "plot", "rate", "squares", "table"]
