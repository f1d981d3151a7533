"""Measure every strategy on one model and mesh size: the numbers behind `spmdkit compare`.

`candidates` lists what to try (each strategy on a mesh shape that suits it, pipelines under
each schedule), `measure` compiles one and times its steps, `reference` compiles the unsplit
step once, on one device: its matmul FLOPs are the numerator of MFU for every candidate alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import optax

from partition_rules import PIPELINE_STRATEGIES, STRATEGIES, preset
from sharding._init import state_bytes
from sharding._mesh import MeshSpec
from sharding.inspection import Peak, mfu
from sharding.pipeline import PipelineSpec

__all__ = [
    "Candidate",
    "CompareConfig",
    "Result",
    "Skipped",
    "candidates",
    "measure",
    "reference",
]

# Default order of the comparison: the guides' three families, then their hybrids.
ORDER = ("dp", "fsdp", "tp", "dp_tp", "fsdp_tp", "pp", "pp_tp", "pp_fsdp")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "circular")


@dataclass(frozen=True)
class CompareConfig:
    """What is compared: one model, one global batch, the step's settings."""

    family: str = "llama"
    size: str = "tiny"
    batch: int = 32
    seq: int = 128
    dtype: str = "float32"
    steps: int = 8
    warmup: int = 2
    lr: float = 1e-3
    remat: str = "none"


@dataclass(frozen=True)
class Candidate:
    """One strategy on one mesh (and, for pipelines, one schedule)."""

    strategy: str
    mesh: str
    schedule: str | None = None
    microbatches: int | None = None
    repeats: int = 1
    fallback: bool = False  # an alternative shape, tried only if the ones before it failed

    @property
    def label(self) -> str:
        if self.schedule is None:
            return self.strategy
        r = f" r={self.repeats}" if self.repeats > 1 else ""
        return f"{self.strategy} {self.schedule} m={self.microbatches}{r}"

    def pipeline(self, family: Any) -> PipelineSpec | None:
        if self.schedule is None:
            return None
        return PipelineSpec(
            schedule=self.schedule,
            microbatches=self.microbatches,
            repeats=self.repeats,
            input_key=family.INPUT,
            loss_from_logits=family.loss_from_logits,
        )


@dataclass(frozen=True)
class Skipped:
    """A candidate that cannot run, with the error that says why."""

    candidate: Candidate
    reason: str


@dataclass
class Result:
    """What one candidate measured; bytes and FLOPs are per device per step."""

    candidate: Candidate
    mesh_sizes: dict[str, int]
    param_bytes: int
    state_bytes: int
    peak_bytes: int | None  # what the compiled step allocates (MemoryStats.allocated)
    temp_bytes: int | None
    collectives: dict[str, dict[str, int]]  # kind -> {"count", "bytes"}
    collective_bytes: int
    matmul_flops: float
    compile_time_s: float
    step_times_s: list[float]
    tokens_per_step: int
    losses: list[float]
    bubble: float | None = None
    mfu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["candidate"]["label"] = self.candidate.label
        data["step_time_s"] = self.step_time_s
        data["tokens_per_s"] = self.tokens_per_s
        return data


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def candidates(
    n_layers: int, devices: int, *, strategies: tuple[str, ...] | None = None,
    mesh: str | None = None,
) -> list[Candidate]:  # fmt: skip
    """What to compare: each strategy on a mesh that suits it, pipelines under every schedule.

    Without ``mesh`` each strategy gets its own shape of ``devices`` (``tp`` as many tensor
    shards as will divide, later filtered by `measure`); with ``mesh`` every strategy runs on it.
    A schedule needs ``n_layers`` divisible by its stages (times repeats for circular).
    """
    unknown = [s for s in strategies or () if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    names = [s for s in ORDER if strategies is None or s in strategies]
    out: list[Candidate] = []
    for name in names:
        shapes = [mesh] if mesh else _shapes(name, devices)
        for alt, shape in enumerate(shapes):
            spec = MeshSpec.of(shape).resolve(devices)
            if name not in PIPELINE_STRATEGIES:
                out.append(Candidate(name, str(spec), fallback=alt > 0))
                continue
            for schedule in PIPELINE_SCHEDULES if name == "pp" else ("gpipe",):
                repeats = 2 if schedule == "circular" else 1
                if not mesh and schedule == "circular":  # as many stages as the layers allow
                    stages = next((s for s in _divisors(devices) if 1 < s <= n_layers // 2
                                   and n_layers % (2 * s) == 0), 0)  # fmt: skip
                    spec = MeshSpec.of(f"stage={stages},data={devices // max(stages, 1)}")
                stages = spec.sizes["stage"]
                if stages < 2 or n_layers % (stages * repeats):
                    continue
                out.append(Candidate(name, str(spec.resolve(devices)), schedule, 2 * stages,
                                     repeats))  # fmt: skip
    return out


def _shapes(name: str, n: int) -> list[str]:
    """Mesh shapes to offer ``name`` on ``n`` devices, best first (first that resolves wins)."""
    half = max(n // 2, 1)
    stage = next((s for s in (4, 2) if n % s == 0 and n > s), None)
    table = {
        "dp": [f"data={n}"],
        "fsdp": [f"fsdp={n}"],
        "tp": [f"tensor={t},data={n // t}" for t in _divisors(n) if t > 1],
        "dp_tp": [f"data={half},tensor=2"] if n >= 4 and n % 2 == 0 else [],
        "fsdp_tp": [f"fsdp={half},tensor=2"] if n >= 4 and n % 2 == 0 else [],
        "pp": [f"stage={stage},data={n // stage}"] if stage else [],
        "pp_tp": [f"stage=2,tensor=2,data={n // 4}"] if n >= 4 and n % 4 == 0 else [],
        "pp_fsdp": [f"stage=2,fsdp={half}"] if n >= 4 and n % 2 == 0 else [],
    }
    return table[name]


def build(
    cand: Candidate, family: Any, cfg: Any, conf: CompareConfig, devices: list | None = None
) -> Any:
    """The `TrainProgram` of ``cand`` under ``conf`` (AdamW), on ``devices`` (default: all).

    Nothing compiles until ``program.compiled`` (or ``report()``, ``step``) is first used, so
    ``program.abstract_state`` can be sized for any model first.
    """
    from sharding._step import compile_train_step

    mesh = MeshSpec.of(cand.mesh).build(devices)
    return compile_train_step(
        lambda rngs: family.Model(cfg, rngs=rngs),
        family.loss,
        optax.adamw(conf.lr),
        *preset(conf.family, cand.strategy),
        mesh,
        family.batch_shapes(cfg, conf.batch, conf.seq),
        compute_dtype=conf.dtype,
        remat=conf.remat,
        pipeline=cand.pipeline(family),
    )


def reference(family: Any, cfg: Any, conf: CompareConfig) -> tuple[float, int]:
    """The unsplit step, compiled for one device: ``(matmul FLOPs, train-state bytes)``.

    The FLOPs (forward and backward, no recompute) are the useful work every candidate does, the
    numerator of MFU for all alike; the bytes are what one device would hold without any split.
    """
    program = build(Candidate("dp", "data=1"), family, cfg, conf, jax.devices()[:1])
    return program.report().matmul_flops, state_bytes(program.abstract_state)


def measure(
    cand: Candidate,
    family: Any,
    cfg: Any,
    conf: CompareConfig,
    *,
    useful_flops: float | None = None,
    peak: Peak | None = None,
    on_step: Callable[[], None] | None = None,
) -> Result:
    """Compile ``cand``, run ``conf.warmup`` steps, then time ``conf.steps`` steps one by one."""
    devices = jax.devices()
    program = build(cand, family, cfg, conf, devices)
    program.compiled  # noqa: B018 - compile now, timed into program.compile_time_s
    report = program.report()
    state = program.init(0)
    batch = program.shard_batch(family.make_batch(cfg, conf.batch, conf.seq))
    times, losses = [], []
    for i in range(conf.warmup + conf.steps):
        start = time.perf_counter()
        state, metrics = program.step(state, batch)
        loss = float(metrics["loss"])  # waits for the step
        if i >= conf.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss)
        if on_step:
            on_step()
    summary = report.summary()
    m = report.memory
    result = Result(
        candidate=cand,
        mesh_sizes=dict(program.mesh.shape),
        param_bytes=state_bytes(program.abstract_state["params"], program.param_shardings),
        state_bytes=state_bytes(program.abstract_state, program.state_shardings),
        peak_bytes=None if m is None else m.allocated,
        temp_bytes=None if m is None else m.temp,
        collectives={k: {"count": s.count, "bytes": s.bytes} for k, s in summary.items()},
        collective_bytes=report.collective_bytes(),
        matmul_flops=report.matmul_flops,
        compile_time_s=program.compile_time_s,
        step_times_s=times,
        tokens_per_step=conf.batch * conf.seq,
        losses=losses,
        bubble=report.extra.get("bubble_fraction"),
    )
    if useful_flops and peak:
        result.mfu = mfu(useful_flops, result.step_time_s, peak)
    return result
