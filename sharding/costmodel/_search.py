"""Rank layouts for a model on N devices from the cost model: the search behind `spmdkit plan`.

Every layout `layouts(..., search=True)` lists (each factorisation of the devices over stage,
data, fsdp and tensor that a strategy uses; pipelines under gpipe and 1f1b) is predicted with
`predict` under remat none and full, kept if the preset's rules divide it, and ranked by an
estimated step time: matmul FLOPs at the device's peak plus each collective's ring traffic at
the bandwidth of the links its group spans, with no overlap (a pessimistic bound). Nothing is
compiled or allocated; `compile_candidate` checks an estimate with an ahead-of-time compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sharding._mesh import AXES
from sharding._resolve import RuleError
from sharding._units import fmt_bytes
from sharding._workload import Workload
from sharding.costmodel._layouts import Layout, layouts, strategy_names
from sharding.costmodel._predict import CostModelError, Prediction, predict
from sharding.pipeline import PipelineConfigError, ScheduleError


class NoFittingStrategyError(CostModelError):
    """No (strategy, mesh) keeps the model within the device memory."""


class NoValidLayoutError(CostModelError):
    """No strategy's rules divide the model on any factorisation of the devices."""


@dataclass(frozen=True)
class DeviceProfile:
    """Peak matmul FLOP/s per compute dtype, memory, and link bandwidth per direction."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]
    intra_node_bw: float
    inter_node_bw: float
    devices_per_node: int

    def describe(self) -> str:
        peaks = ", ".join(f"{k} {v / 1e12:g} TF/s" for k, v in self.peak_flops.items())
        return (
            f"{self.name}: {fmt_bytes(self.memory_bytes)}, dense peak {peaks}; "
            f"{self.intra_node_bw / 1e9:g} GB/s within a node of {self.devices_per_node}, "
            f"{self.inter_node_bw / 1e9:g} GB/s between nodes (per direction)"
        )


# Dense peaks from the vendors' data sheets; float32 matmuls run as TF32 (XLA's GPU default).
PROFILES: dict[str, DeviceProfile] = {
    "h100-80gb": DeviceProfile("h100-80gb", 80 * 10**9, {"bfloat16": 989e12, "float32": 494e12},
                               450e9, 50e9, 8),
    "a100-80gb": DeviceProfile("a100-80gb", 80 * 10**9, {"bfloat16": 312e12, "float32": 156e12},
                               300e9, 25e9, 8),
}  # fmt: skip


@dataclass
class Estimate:
    """One layout ranked by the cost model: its prediction and estimated step time split."""

    layout: Layout
    prediction: Prediction
    fits: bool
    compute_s: float
    comm_s: float
    compiled_memory: int | None = None
    compile_time_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def mesh_text(self) -> str:
        return self.layout.mesh

    def to_dict(self) -> dict[str, Any]:
        p = self.prediction
        return {
            "strategy": p.strategy,
            "mesh": p.mesh,
            "pipeline": p.pipeline,
            "remat": p.remat,
            "fits": self.fits,
            "memory_bytes": p.memory_bytes,
            "compiled_memory_bytes": self.compiled_memory,
            "compile_time_s": self.compile_time_s,
            "collective_bytes": p.collective_bytes(),
            "bytes_by_kind": p.bytes_by_kind(),
            "matmul_flops": p.matmul_flops,
            "bubble_fraction": p.bubble_fraction,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "step_s": self.step_s,
            "tokens_per_s": p.batch * p.seq / self.step_s,
            "notes": self.notes,
        }


_RING = {"all-reduce": lambda n: 2 * (n - 1) / n, "collective-permute": lambda n: 1.0}


def comm_seconds(pred: Prediction, profile: DeviceProfile) -> float:
    """Ring-algorithm time of every collective at the bandwidth of the links its group spans.

    Axes are laid out stage, data, fsdp, tensor (tensor innermost, `sharding._mesh`): a group
    stays inside a node when its outermost axis' stride times its size is at most a node.
    """
    sizes, total = pred.mesh, 0.0
    stride = {a: math.prod(sizes[b] for b in AXES[i + 1 :]) for i, a in enumerate(AXES)}
    for x in pred.traffic:
        n = math.prod(sizes[a] for a in x.axes)
        span = max(stride[a] * sizes[a] for a in x.axes)
        bw = profile.intra_node_bw if span <= profile.devices_per_node else profile.inter_node_bw
        total += _RING.get(x.kind, lambda n: (n - 1) / n)(n) * x.bytes / bw
    return total


def candidates(
    family: Any,
    cfg: Any,
    devices: int,
    batch: int,
    seq: int,
    *,
    strategies: str | tuple[str, ...] | None = None,
    dtype: str = "float32",
    optimizer: str = "adamw",
    memory_bytes: int,
    profile: DeviceProfile,
) -> list[Estimate]:
    """Every valid layout, fitting ones first by estimated step time, then by memory.

    Raises:
        NoValidLayoutError: nothing divides (names the strategies tried).
        NoFittingStrategyError: layouts exist but none fits; says the smallest memory needed.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> ranked = candidates(llama, "7b", 8, 8, 1024, memory_bytes=80 * 10**9,
        ...                     profile=PROFILES["h100-80gb"])  # doctest: +SKIP
        >>> ranked[0].fits, ranked[0].layout.label  # doctest: +SKIP
        (True, 'fsdp')
    """
    if isinstance(cfg, str):
        cfg = family.config(cfg)
    todo = layouts(devices, cfg.n_layers, strategies=strategies, search=True, batch=batch)
    out: list[Estimate] = []
    for layout in todo:
        pipe = None if layout.schedule is None else (layout.schedule, layout.microbatches,
                                                     layout.repeats)  # fmt: skip
        for remat in ("none", "full"):
            try:
                pred = predict(family, cfg, layout.strategy, layout.sizes, batch, seq,
                               pipeline=pipe, dtype=dtype, optimizer=optimizer, remat=remat)  # fmt: skip
            except (CostModelError, PipelineConfigError, RuleError, ScheduleError):
                continue
            compute = pred.critical_flops / profile.peak_flops[dtype]
            fits = pred.memory_bytes <= memory_bytes
            out.append(Estimate(layout, pred, fits, compute, comm_seconds(pred, profile)))
    if not out:
        names = ", ".join(strategy_names(strategies))
        raise NoValidLayoutError(
            f"{family.NAME} {cfg.name}: no strategy of {names} places the model on any "
            f"factorisation of {devices} devices with batch {batch} (the rules must divide every "
            f"split dimension and data x fsdp must divide the batch); try another --devices or "
            f"--batch"
        )
    fitting = sorted((c for c in out if c.fits), key=lambda c: c.step_s)
    if not fitting:
        best = min(out, key=lambda c: c.prediction.memory_bytes)
        p = best.prediction
        raise NoFittingStrategyError(
            f"{family.NAME} {cfg.name} (batch {batch} x seq {seq}, {dtype}) fits no strategy on "
            f"{devices} devices of {fmt_bytes(memory_bytes)}: the smallest per-device memory any "
            f"layout needs is {fmt_bytes(p.memory_bytes)} ({p.strategy} on {best.mesh_text}, "
            f"remat {p.remat}); use devices with at least that much memory, more devices, or a "
            f"smaller --batch / --seq"
        )
    rest = sorted((c for c in out if not c.fits), key=lambda c: c.prediction.memory_bytes)
    return fitting + rest


def compile_candidate(candidate: Estimate, family: Any, cfg: Any) -> Estimate:
    """AOT-compile an estimate's layout on this host's devices from abstract shapes; fill its
    compiled memory and compile time.

    Needs ``jax.device_count()`` equal to the mesh size (simulate CPU devices first). Nothing is
    materialised: the step is lowered from `ShapeDtypeStruct`s and compiled.
    """
    import optax

    p = candidate.prediction
    tx = optax.adamw(1e-4) if p.optimizer in ("adamw", "adam") else optax.sgd(1e-3)
    work = Workload.from_family(family, cfg)
    program = candidate.layout.program(work, batch=p.batch, seq=p.seq, optimizer=tx,
                                       dtype=p.dtype, remat=p.remat)  # fmt: skip
    report = program.report()
    if report.memory is not None:
        candidate.compiled_memory = report.memory.allocated
    candidate.compile_time_s = report.compile_time_s
    return candidate


__all__ = [
    "PROFILES",
    "DeviceProfile",
    "Estimate",
    "NoFittingStrategyError",
    "NoValidLayoutError",
    "candidates",
    "comm_seconds",
    "compile_candidate",
]
