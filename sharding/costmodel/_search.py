"""Rank (strategy, mesh) layouts for a model on N devices from the cost model (`spmdkit plan`).

Every factorisation of the devices over stage, data, fsdp and tensor that a strategy uses and the
preset's rules divide is predicted with `sharding.costmodel._predict.predict` (remat none and full, for
pipelines gpipe and 1f1b), kept if its estimated memory per device fits, and ranked by an
estimated step time: matmul FLOPs at the device's peak plus each collective's ring traffic at
the bandwidth of the links its group spans, with no overlap (a pessimistic bound). Nothing is
compiled or allocated; `compile_candidate` checks a candidate with an ahead-of-time compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from partition_rules import PIPELINE_STRATEGIES, STRATEGIES
from sharding._mesh import AXES
from sharding._resolve import RuleError
from sharding._units import fmt_bytes
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
class Candidate:
    """One ranked layout: its prediction and estimated step time split."""

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
        return ",".join(f"{a}={n}" for a, n in self.prediction.mesh.items() if n > 1) or "data=1"

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


def meshes(devices: int) -> list[dict[str, int]]:
    """Every (stage, data, fsdp, tensor) whose sizes multiply to ``devices``."""
    divisors = [k for k in range(1, devices + 1) if devices % k == 0]
    out = []
    for s in divisors:
        for d in divisors:
            for f in divisors:
                if devices % (s * d * f) == 0:
                    out.append({"stage": s, "data": d, "fsdp": f, "tensor": devices // (s * d * f)})
    return out


def _uses(strategy: str) -> tuple[set[str], set[str]]:
    """(mesh axes the strategy may use, axes it needs > 1 to be itself).

    The axes that split parameters must all be > 1 (fsdp with fsdp=1 is dp), and only those
    and ``data`` may be: any other axis would only replicate.
    """
    splits = {
        a
        for name, v in STRATEGIES[strategy].items()
        if name != "batch"
        for a in ((v,) if isinstance(v, str) else (v or ()))
    }
    return splits | {"data"}, splits


def candidates(
    family: Any,
    cfg: Any,
    devices: int,
    batch: int,
    seq: int,
    *,
    strategies: tuple[str, ...] | None = None,
    dtype: str = "float32",
    optimizer: str = "adamw",
    memory_bytes: int,
    profile: DeviceProfile,
) -> list[Candidate]:
    """Every valid layout, fitting ones first by estimated step time, then by memory.

    Raises:
        NoValidLayoutError: nothing divides (names the strategies tried).
        NoFittingStrategyError: layouts exist but none fits; says the smallest memory needed.
    """
    if isinstance(cfg, str):
        cfg = family.config(cfg)
    names = tuple(strategies or STRATEGIES)
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise CostModelError(f"unknown strategies {unknown}; strategies: {', '.join(STRATEGIES)}")
    if "tp" in names and "dp_tp" in names:  # one axis map: tp with data > 1 is dp_tp
        names = tuple(s for s in names if s != "dp_tp")
    out: list[Candidate] = []
    for strategy in names:
        allowed, needs = _uses(strategy)
        for sizes in meshes(devices):
            if any(n > 1 for a, n in sizes.items() if a not in allowed):
                continue
            if any(sizes[a] == 1 for a in needs):
                continue
            name = strategy
            if strategy in ("tp", "dp_tp"):
                name = "dp_tp" if sizes["data"] > 1 else "tp"
            for pipe in _pipelines(name, sizes, batch):
                for remat in ("none", "full"):
                    try:
                        pred = predict(family, cfg, name, sizes, batch, seq, pipeline=pipe,
                                       dtype=dtype, optimizer=optimizer, remat=remat)  # fmt: skip
                    except (CostModelError, PipelineConfigError, RuleError, ScheduleError):
                        continue
                    compute = pred.critical_flops / profile.peak_flops[dtype]
                    fits = pred.memory_bytes <= memory_bytes
                    out.append(Candidate(pred, fits, compute, comm_seconds(pred, profile)))
    if not out:
        raise NoValidLayoutError(
            f"{family.NAME} {cfg.name}: no strategy of {', '.join(names)} places the model on any "
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


def _pipelines(strategy: str, sizes: dict[str, int], batch: int) -> list[Any]:
    if strategy not in PIPELINE_STRATEGIES:
        return [None]
    p, split = sizes["stage"], sizes["data"] * sizes["fsdp"]
    # The most micro-batches of 4p, 2p, p that the batch splits into (a smaller bubble).
    m = next((m for m in (4 * p, 2 * p, p) if batch % m == 0 and (batch // m) % split == 0), None)
    return [] if m is None else [(schedule, m, 1) for schedule in ("gpipe", "1f1b")]


def compile_candidate(candidate: Candidate, family: Any, cfg: Any) -> Candidate:
    """AOT-compile a candidate on this host's devices from abstract shapes; fill its figures.

    Needs ``jax.device_count()`` equal to the mesh size (simulate CPU devices first). Nothing is
    materialised: the step is lowered from `ShapeDtypeStruct`s and compiled.
    """
    import optax

    from partition_rules import preset
    from sharding._mesh import make_mesh
    from sharding._step import compile_train_step
    from sharding.pipeline import PipelineSpec

    p = candidate.prediction
    fam = family
    spec = None
    if p.pipeline:
        spec = PipelineSpec(p.pipeline["name"], p.pipeline["microbatches"],
                            p.pipeline["repeats"], fam.INPUT, fam.loss_from_logits)  # fmt: skip
    tx = optax.adamw(1e-4) if p.optimizer in ("adamw", "adam") else optax.sgd(1e-3)
    program = compile_train_step(
        lambda rngs: fam.Model(cfg, rngs=rngs),
        fam.loss,
        tx,
        *preset(p.family, p.strategy),
        make_mesh(p.mesh),
        fam.batch_shapes(cfg, p.batch, p.seq),
        compute_dtype=p.dtype,
        remat=p.remat,
        pipeline=spec,
    )
    report = program.report()
    if report.memory is not None:
        candidate.compiled_memory = report.memory.allocated
    candidate.compile_time_s = report.compile_time_s
    return candidate


__all__ = [
    "PROFILES",
    "Candidate",
    "DeviceProfile",
    "NoFittingStrategyError",
    "NoValidLayoutError",
    "candidates",
    "comm_seconds",
    "compile_candidate",
    "meshes",
]
