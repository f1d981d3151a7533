"""Measure layouts on one model and device count: the numbers behind `spmdkit compare`.

`measure` compiles one `Layout` (from `sharding.costmodel.layouts`) and times its steps,
`reference` compiles the unsplit step once, on one device: its matmul FLOPs are the numerator of
MFU for every layout alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import optax

from sharding._init import state_bytes
from sharding._workload import Workload
from sharding.costmodel import Layout
from sharding.inspection import Peak, mfu

__all__ = ["CompareConfig", "Result", "Skipped", "build", "measure", "reference"]


@dataclass(frozen=True)
class CompareConfig:
    """What is compared: one model, one global batch, the step's settings."""

    family: str = "llama"
    size: str = "tiny"
    batch: int = 32
    seq: int | None = 128  # None for models whose batch has no sequence axis (images, features)
    dtype: str = "float32"
    timed_steps: int = 8
    warmup_steps: int = 2
    lr: float = 1e-3
    remat: str = "none"


@dataclass(frozen=True)
class Skipped:
    """A layout that cannot run, with the error that says why."""

    candidate: Layout
    reason: str


@dataclass
class Result:
    """What one layout measured; bytes and FLOPs are per device per step."""

    candidate: Layout
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
    tokens_per_step: int  # tokens, or samples for models without a sequence axis (`unit`)
    losses: list[float]
    bubble: float | None = None
    mfu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    unit: str = "tokens"  # what tokens_per_step counts: tokens, or samples

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


def build(cand: Layout, work: Workload, conf: CompareConfig, devices: list | None = None) -> Any:
    """The `TrainProgram` of ``cand`` under ``conf`` (AdamW), on ``devices`` (default: all).

    Nothing compiles until ``program.compiled`` (or ``report()``, ``step``) is first used, so
    ``program.abstract_state`` can be sized for any model first.
    """
    return cand.program(work, batch=conf.batch, seq=conf.seq, optimizer=optax.adamw(conf.lr),
                        dtype=conf.dtype, remat=conf.remat, devices=devices)  # fmt: skip


def reference(work: Workload, conf: CompareConfig) -> tuple[float, int]:
    """The unsplit step, compiled for one device: ``(matmul FLOPs, train-state bytes)``.

    The FLOPs (forward and backward, no recompute) are the useful work every candidate does, the
    numerator of MFU for all alike; the bytes are what one device would hold without any split.
    """
    program = build(Layout("dp", "data=1"), work, conf, jax.devices()[:1])
    return program.report().matmul_flops, state_bytes(program.abstract_state)


def measure(
    cand: Layout,
    work: Workload,
    conf: CompareConfig,
    *,
    useful_flops: float | None = None,
    peak: Peak | None = None,
    on_step: Callable[[], None] | None = None,
) -> Result:
    """Compile ``cand``, run ``conf.warmup_steps`` steps, then time ``conf.timed_steps`` steps one
    by one (``on_step`` is called after each)."""
    devices = jax.devices()
    program = build(cand, work, conf, devices)
    program.compiled  # noqa: B018 - compile now, timed into program.compile_time_s
    report = program.report()
    state = program.init(0)
    batch = program.shard_batch(work.synthetic_batch(conf.batch, conf.seq))
    times, losses = [], []
    for i in range(conf.warmup_steps + conf.timed_steps):
        start = time.perf_counter()
        state, metrics = program.step(state, batch)
        loss = float(metrics["loss"])  # waits for the step
        if i >= conf.warmup_steps:
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
        tokens_per_step=conf.batch * (conf.seq or 1),
        unit="tokens" if conf.seq else "samples",
        losses=losses,
        bubble=report.extra.get("bubble_fraction"),
    )
    if useful_flops and peak:
        result.mfu = mfu(useful_flops, result.step_time_s, peak)
    return result
