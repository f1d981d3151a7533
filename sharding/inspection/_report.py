"""What a compiled program does per device: collectives, memory, FLOPs, compile time.

Every figure is read from the compiled program itself (see `sharding.inspection._hlo` for the collective
conventions), so it is deterministic and testable.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import numpy as np
from jax import sharding as jshard
from rich.console import Group
from rich.table import Table
from rich.text import Text

from sharding._mesh import mesh_sizes
from sharding._units import fmt_bytes, fmt_count
from sharding.inspection._flops import FlopCount, count_flops
from sharding.inspection._hlo import (
    COLLECTIVE_KINDS,
    CollectiveOp,
    CollectiveSummary,
    parse_collectives,
    summarize,
)
from sharding.inspection._widened import compile_partitioned, partitioned_widths, widened_bytes

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveOp",
    "CollectiveSummary",
    "FlopCount",
    "MemoryStats",
    "ProgramReport",
    "compile_and_inspect",
    "count_flops",
    "inspect_compiled",
    "parse_collectives",
    "summarize",
]


@dataclass(frozen=True)
class MemoryStats:
    """`compiled.memory_analysis()` per device in bytes; ``peak`` None where not reported."""

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int
    peak: int | None
    widened: int = 0  # float32 copies XLA:CPU carries of whole bfloat16 arrays (`widened_bytes`)
    platform: str = "cpu"  # whose compiler assigned the buffers: "cpu", "gpu" or "tpu"

    @property
    def allocated(self) -> int:
        """Bytes the executable needs per device: arguments, outputs not aliased to them, and
        the temporary buffer (already packed by XLA's buffer assignment).

        Use this, not ``peak``, to ask whether a program fits: XLA:CPU's ``peak`` counts little
        more than the arguments and leaves the temporaries out.
        """
        return self.argument + self.output - self.alias + self.temp

    @property
    def native(self) -> int:
        """`allocated` as a backend whose slices take bfloat16 holds the program: less
        ``widened``, what XLA:CPU's float normalisation adds by carrying whole bfloat16 arrays
        (a layer stack's saved activations) as float32 copies. ``allocated`` itself for float32
        programs and off CPU."""
        return self.allocated - self.widened

    @property
    def needed(self) -> int:
        """Bytes per device the program needs: an accelerator compiler's ``peak`` (its buffer
        assignment's largest live set, arguments included), which is what must fit the
        device's memory; on XLA:CPU, whose ``peak`` leaves the temporaries out, `native`."""
        return self.peak if self.platform != "cpu" and self.peak else self.native


@dataclass
class ProgramReport:
    """Per-device facts of one compiled program (byte conventions in the module doc).

    ``flops`` and ``bytes_accessed`` are XLA's estimates, None where the backend gives none;
    XLA counts a while loop's body once, so ``flops`` under-counts a scanned program, while
    ``matmul_flops`` (`count_flops`: dots and convolutions only) counts every iteration.
    ``extra`` holds the caller's figures (e.g. a pipeline bubble) for `to_dict` and rendering.

    Example:
        >>> _, report = compile_and_inspect(jax.jit(grad_fn), w, x)  # doctest: +SKIP
        >>> report.count("all-reduce", "data"), report.count("all-gather")  # doctest: +SKIP
        (1, 0)
    """

    collectives: list[CollectiveOp]
    memory: MemoryStats | None = None
    flops: float | None = None
    matmul_flops: float | None = None
    bytes_accessed: float | None = None
    compile_time_s: float | None = None
    mesh: dict[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    platform: str = "cpu"  # whose compiler produced the program: "cpu", "gpu" or "tpu"

    def summary(self, *, by_axes: bool = False) -> dict[Any, CollectiveSummary]:
        """`summarize` of this program's collectives."""
        return summarize(self.collectives, by_axes=by_axes)

    def _select(self, kind: str | None, axes: str | tuple | None) -> list[CollectiveOp]:
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise ValueError(
                f"unknown collective kind {kind!r}; the kinds are {', '.join(COLLECTIVE_KINDS)}"
            )
        axes = (axes,) if isinstance(axes, str) else axes
        return [
            op
            for op in self.collectives
            if kind in (None, op.kind) and (axes is None or op.axes == tuple(axes))
        ]

    def collective_bytes(self, kind: str | None = None, axes: str | tuple | None = None) -> int:
        """Payload bytes per device per run, of ``kind`` and over exactly ``axes`` if given.

        ``axes="data"`` means ``("data",)``; None selects every kind or every axis set.
        """
        return sum(op.bytes * op.multiplicity for op in self._select(kind, axes))

    def count(self, kind: str, axes: str | tuple | None = None) -> int:
        """Executions per run of the collectives of ``kind`` (over exactly ``axes`` if given)."""
        return sum(op.multiplicity for op in self._select(kind, axes))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `json.dumps`; the replica group lists are left out."""
        by_axes = self.summary(by_axes=True).items()
        data = {
            "mesh": self.mesh,
            "collectives": {kind: asdict(s) for kind, s in self.summary().items()},
            "collectives_by_axes": [{"kind": k, "axes": a, **asdict(s)} for (k, a), s in by_axes],
            "ops": [{**asdict(op), "groups": None} for op in self.collectives],
            "memory": None if self.memory is None else asdict(self.memory),
        }
        for key in ("flops", "matmul_flops", "bytes_accessed", "compile_time_s", "extra"):
            data[key] = getattr(self, key)
        return _plain(data)

    def __rich__(self) -> Group:
        mesh = ",".join(f"{a}={n}" for a, n in (self.mesh or {}).items() if n > 1)
        head = Text(f"collectives per device per step{' on ' + mesh if mesh else ''}:")
        table = Table()
        for col in ("collective", "axes", "ops", "count", "bytes/device"):
            table.add_column(col, justify="left" if col in ("collective", "axes") else "right")
        for (kind, axes), s in self.summary(by_axes=True).items():
            ops = [op for op in self.collectives if (op.kind, op.axes) == (kind, axes)]
            count = f"{s.count}{'' if all(op.exact for op in ops) else '*'}"
            axes_txt = "?" if axes is None else ",".join(axes) or "-"
            table.add_row(kind, axes_txt, str(s.static_count), count, fmt_bytes(s.bytes))
        table.add_row("total", "", "", "", fmt_bytes(self.collective_bytes()), style="bold")
        lines = []
        if not all(op.exact for op in self.collectives):
            lines.append("* counting conditional branches as taken, unknown loops as run once")
        if m := self.memory:
            lines.append(
                f"memory/device: {fmt_bytes(m.allocated)} allocated = arguments "
                f"{fmt_bytes(m.argument)} + outputs not aliased to them "
                f"{fmt_bytes(m.output - m.alias)} + temporaries {fmt_bytes(m.temp)}"
            )
        if self.matmul_flops is not None:
            lines.append(
                f"matmul FLOPs/device (loop-aware): {fmt_count(self.matmul_flops)} per step "
                f"(dots and convolutions, every loop iteration counted)"
            )
        if self.flops is not None:
            lines.append(
                f"XLA's cost estimate: {fmt_count(self.flops)} FLOPs/device (all ops, but a "
                f"loop's body counted once)"
            )
        if self.compile_time_s is not None:
            lines.append(f"compile time: {self.compile_time_s:.2f} s")
        lines += [f"{k}: {v}" for k, v in self.extra.items()]
        return Group(head, table, *map(Text, lines))


def _plain(x: Any) -> Any:
    """A JSON-ready copy: tuples to lists, numpy values to Python ones."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x.tolist() if isinstance(x, np.ndarray | np.generic) else x


def _analysis(compiled: Any, name: str) -> Any:
    try:
        return getattr(compiled, name)()
    except (NotImplementedError, RuntimeError):  # some backends and PJRT plugins lack them
        return None


def inspect_compiled(
    compiled: Any,
    *,
    mesh: Any = None,
    compile_time_s: float | None = None,
    partitioned: str | None = None,
) -> ProgramReport:
    """The `ProgramReport` of a ``jax.stages.Compiled``.

    Args:
        compiled: ``jax.jit(f).lower(*args).compile()``.
        mesh: names the axes of each collective. Default: the mesh of the program's first
            NamedSharding input or output; without one, ``axes`` stay None.
        compile_time_s: recorded as given.
        partitioned: the module's text right after SPMD partitioning (`compile_partitioned`):
            collectives XLA:CPU widened from bfloat16 to float32 after it are counted in
            bfloat16, as the partitioner placed them and as a GPU or TPU runs them.

    Example:
        >>> report = inspect_compiled(jax.jit(f).lower(x).compile())  # doctest: +SKIP
        >>> rich.print(report)  # doctest: +SKIP
    """
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    if mesh is None:
        mesh = next((s.mesh for s in shardings if isinstance(s, jshard.NamedSharding)), None)
    platform = next(iter(shardings[0].device_set)).platform if shardings else "cpu"
    memory, cost, hlo_text = None, _analysis(compiled, "cost_analysis"), compiled.as_text()
    if isinstance(cost, list | tuple):  # older jax gave one dict per program
        cost = cost[0] if cost else None
    cost = cost or {}  # and a collective-only program has no "flops"
    if (stats := _analysis(compiled, "memory_analysis")) is not None:
        fields = ("argument", "output", "temp", "alias", "generated_code")
        peak = getattr(stats, "peak_memory_in_bytes", None)
        memory = MemoryStats(
            **{f: int(getattr(stats, f"{f}_size_in_bytes")) for f in fields},
            peak=None if peak is None else int(peak),
            widened=widened_bytes(hlo_text) if platform == "cpu" else 0,
            platform=platform,
        )
    flops, accessed = cost.get("flops"), cost.get("bytes accessed")
    return ProgramReport(
        collectives=parse_collectives(hlo_text, mesh, narrow=partitioned_widths(partitioned)),
        memory=memory,
        flops=None if flops is None else float(flops),
        matmul_flops=float(count_flops(hlo_text).total),
        bytes_accessed=None if accessed is None else float(accessed),
        compile_time_s=compile_time_s,
        mesh=None if mesh is None else mesh_sizes(mesh),
        platform=platform,
    )


def compile_and_inspect(
    jitted_fn: Any, *args: Any, mesh: Any = None, **kwargs: Any
) -> tuple[Any, ProgramReport]:
    """Lower and compile ``jitted_fn`` for ``args``; return ``(compiled, report)``.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct``s with shardings (nothing is allocated).
    ``compile_time_s`` is the wall time of tracing, lowering and XLA compilation together: what
    a first call waits before it runs.

    Example:
        >>> x = jax.ShapeDtypeStruct((64, 1024), jnp.float32, sharding=x_sharding)  # doctest: +SKIP
        >>> compiled, report = compile_and_inspect(jax.jit(f), x)  # doctest: +SKIP
        >>> report.collective_bytes("all-reduce", axes="data")  # doctest: +SKIP
        4194304
    """
    start = time.perf_counter()
    placed = [getattr(a, "sharding", None) for a in jax.tree.leaves((args, kwargs))]
    platform = next((next(iter(s.device_set)).platform for s in placed if s is not None), None)
    compiled, partitioned = compile_partitioned(jitted_fn.lower(*args, **kwargs), platform)
    elapsed = time.perf_counter() - start
    return compiled, inspect_compiled(compiled, mesh=mesh, compile_time_s=elapsed,
                                      partitioned=partitioned)  # fmt: skip
