"""One candidate of `compare`: compile its step for the target's device count, read the compiled
program's facts, price them on the target, and (where it is cheap) run a few steps here.

The step is compiled ahead of time from abstract shapes (`TrainProgram.compiled`), so a 32-device
Llama-3-8B step compiles on a laptop: nothing is materialised. Its per-device FLOPs, collectives
(kind, mesh axes, bytes) and memory are what `sharding.costmodel.step_time` prices on the target.
Steps measured here are a sanity column only on simulated devices (they share the host's cores:
a pipeline's stages add up instead of running side by side); on real devices they are the time.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import optax

from partition_rules import composition
from sharding._init import state_bytes
from sharding._mesh import mesh_text
from sharding._workload import Workload
from sharding.costmodel import (
    UPDATED_WEIGHTS,
    CostModelError,
    Layout,
    Prediction,
    StepTime,
    StepWork,
    apart_of,
    predict,
    rows_per_pass,
    step_time,
    work_from_report,
)
from sharding.targets import Compiler, Target, compiler_name
from sharding.training import profile_steps

__all__ = ["Candidate", "Settings", "closed_form", "evaluate", "measure_here", "reference_flops"]


@dataclass(frozen=True)
class Settings:
    """What every candidate shares: the global batch, the optimizer's learning rate, the
    attention kernel (`models.attention.KINDS`; None: the model's own) and the compiler the
    programs come from (`sharding.targets.compiler_for`; None: this process's devices)."""

    batch: int
    seq: int | None
    lr: float = 1e-3
    attention: str | None = None
    compiler: Compiler | None = None


@dataclass
class Candidate:
    """One layout at one dtype, remat policy and accumulation: compiled facts and prediction.

    Bytes and FLOPs are per device per step. ``predicted`` is the step on the target;
    ``measured_s`` the steps timed here (empty when not run).
    """

    layout: Layout
    dtype: str
    remat: str
    accum: int
    mesh_sizes: dict[str, int]
    split: str  # what the compiled program splits: "batch data(8)\nweights fsdp(8)"
    param_bytes: int
    state_bytes: int
    # What the compiled step needs per device: the target compiler's peak; from XLA:CPU, what it
    # allocates with bfloat16 arrays counted in bfloat16 (it carries some as float32 copies:
    # ``widened`` bytes, `sharding.inspection.widened_bytes`).
    allocated: int | None
    collectives: list[dict[str, Any]]  # {kind, axes, count, bytes}, one per (kind, axes)
    collective_bytes: int
    matmul_flops: float  # executed; an explicit pipeline's busiest stage (lanes run or skip)
    compile_time_s: float
    bubble: float | None
    predicted: StepTime
    predicted_work: StepWork  # what was priced: the program's per-device work
    batch: int
    tokens_per_step: int
    unit: str
    measured_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    widened: int = 0
    compiler: str = "XLA:CPU"  # whose program the facts are read from

    @property
    def label(self) -> str:
        """``pp 1f1b m=8``, then what differs from the plain step: ``bf16 remat=full accum=2``."""
        extra = ["bf16"] if self.dtype == "bfloat16" else []
        extra += [f"remat={self.remat}"] if self.remat != "none" else []
        extra += [f"accum={self.accum}"] if self.accum > 1 else []
        return " ".join([self.layout.label, *extra])

    @property
    def mesh(self) -> str:
        return mesh_text(self.mesh_sizes)

    @property
    def micro_batch(self) -> int:
        """Rows each device runs per forward pass (Megatron's micro-batch size): the global
        batch over the accumulation, the batch shards and a pipeline's micro-batches."""
        return max(
            rows_per_pass(self.batch, self.mesh_sizes, self.accum, self.layout.microbatches), 1
        )

    @property
    def step_s(self) -> float:
        """The predicted step time on the target."""
        return self.predicted.step_s

    @property
    def measured_step_s(self) -> float | None:
        return statistics.median(self.measured_s) if self.measured_s else None

    @property
    def memory_bytes(self) -> int:
        """Memory per device: what the compiled step allocates (the train state without it)."""
        return self.allocated if self.allocated is not None else self.state_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layout"]["label"] = self.layout.label
        data.pop("predicted_work")
        data.update(label=self.label, mesh=self.mesh, predicted=self.predicted.to_dict(),
                    measured_step_s=self.measured_step_s, global_batch=self.batch,
                    micro_batch=self.micro_batch)  # fmt: skip
        return data


def _split_text(program: Any) -> str:
    """What the program splits, from its shardings: ``batch data(8)`` / ``weights fsdp(8)``."""
    sizes = dict(program.mesh.shape)
    used = {a for s in jax.tree.leaves(program.param_shardings) for e in s.spec if e
            for a in ((e,) if isinstance(e, str) else e) if sizes[a] > 1}  # fmt: skip
    batch = [f"{a}({sizes[a]})" for a in ("data", "fsdp") if sizes.get(a, 1) > 1]
    weights = [f"{a}({sizes[a]})" for a in ("stage", "fsdp", "tensor") if a in used]
    return f"batch {','.join(batch) or 'whole'}\nweights {','.join(weights) or 'whole'}"


def build(
    layout: Layout, work: Workload, settings: Settings, *, dtype: str = "float32",
    remat: str = "none", accum: int = 1, devices: list | None = None,
) -> Any:  # fmt: skip
    """The `TrainProgram` of one candidate (AdamW), compiled on first use: on ``devices``, else
    the settings' compiler's (compile-only devices of the target), else this process's."""
    if devices is None and settings.compiler is not None:
        devices = settings.compiler.device_list()
    return layout.program(work, batch=settings.batch, seq=settings.seq,
                          optimizer=optax.adamw(settings.lr), dtype=dtype, remat=remat,
                          accum_steps=accum, devices=devices,
                          attention=settings.attention)  # fmt: skip


def reference_flops(work: Workload, settings: Settings, dtype: str) -> tuple[float, int]:
    """The unsplit step on one device: ``(matmul FLOPs, train-state bytes)``; compiled only.

    The FLOPs (forward and backward, no recompute) are the useful work of every candidate, the
    numerator of MFU for all alike; the bytes are what one device holds without any split.
    """
    program = build(Layout("dp", "data=1"), work, settings, dtype=dtype, devices=jax.devices()[:1])
    return program.report().matmul_flops, state_bytes(program.abstract_state)


def evaluate(
    layout: Layout, work: Workload, settings: Settings, target: Target, *, dtype: str,
    remat: str = "none", accum: int = 1, useful_flops: float | None = None,
) -> tuple[Candidate, Any]:  # fmt: skip
    """Compile one candidate for ``target`` on this process's devices and price it there.

    Returns the `Candidate` and its `TrainProgram` (to run steps with `measure_here`).
    """
    program = build(layout, work, settings, dtype=dtype, remat=remat, accum=accum)
    report = program.report()
    tokens = settings.batch * (settings.seq or 1)
    piped = program.schedule is not None
    closed = closed_form(layout, work, settings, dtype, remat, accum)
    on_cpu = program.mesh.devices.flat[0].platform == "cpu"  # else its compiler ran them already
    apart = apart_of(closed.traffic) if closed and on_cpu else None  # what a GPU runs otherwise
    sw = work_from_report(report, tokens=tokens, dtype=dtype, unit=work.unit,
                          model_flops=useful_flops, schedule=program.schedule,
                          hlo_text=program.compiled.as_text() if piped else None, remat=remat,
                          stage_layers=program.pipeline.stage_layers if piped else None,
                          accum=accum, elementwise_bytes=closed and closed.elementwise_bytes,
                          apart=apart)  # fmt: skip
    if "zero1" in composition(layout.strategy).parts:  # its gathers over data alone: zero1's
        sw.collectives = [replace(c, what=UPDATED_WEIGHTS)
                          if c.kind == "all-gather" and c.axes == ("data",) else c
                          for c in sw.collectives]  # fmt: skip
    by_axes = [{"kind": k, "axes": list(a or ()), "count": s.count, "bytes": s.bytes}
               for (k, a), s in report.summary(by_axes=True).items()]  # fmt: skip
    candidate = Candidate(
        layout=layout, dtype=dtype, remat=remat, accum=accum,
        mesh_sizes=dict(program.mesh.shape), split=_split_text(program),
        param_bytes=state_bytes(program.abstract_state["params"], program.param_shardings),
        state_bytes=state_bytes(program.abstract_state, program.state_shardings),
        allocated=None if report.memory is None else report.memory.needed,
        widened=0 if report.memory is None else report.memory.widened,
        collectives=by_axes, collective_bytes=report.collective_bytes(),
        matmul_flops=(sw.pipeline or {}).get("busiest_device_flops", report.matmul_flops),
        compile_time_s=program.compile_time_s or 0.0,
        bubble=report.extra.get("bubble_fraction"), predicted=step_time(sw, target),
        predicted_work=sw, batch=settings.batch, tokens_per_step=tokens, unit=work.unit,
        compiler=compiler_name(report.platform),
    )  # fmt: skip
    return candidate, program


def closed_form(layout: Layout, work: Workload, settings: Settings, dtype: str, remat: str,
                accum: int) -> Prediction | None:  # fmt: skip
    """The candidate's closed-form `Prediction`, for a workload with one (``family``), whose
    counts the compiled program lacks: the bytes the non-matmul work moves, and the collectives
    XLA for GPU runs otherwise than a CPU compile shows (`APART`: input gradients it sums before
    reducing, SP's all-reduce-and-slice it makes reduce-scatters); None without one."""
    if work.family is None or not hasattr(work.config, "n_layers") or settings.seq is None:
        return None
    try:
        pred = predict(work.family, work.config, layout.strategy, layout.sizes, settings.batch,
                       settings.seq, pipeline=layout.pipeline(), dtype=dtype, remat=remat,
                       attention=settings.attention or "auto", accum=accum)  # fmt: skip
    except CostModelError:
        return None
    return pred


def measure_here(
    candidate: Candidate, program: Any, work: Workload, settings: Settings, *, warmup: int,
    timed: int, on_step: Callable[[], None] | None = None, profile: Path | None = None,
) -> Candidate:  # fmt: skip
    """Run ``warmup`` then ``timed`` steps on this process's devices; fill the timings. With
    ``profile``, the timed steps are traced (`sharding.training.profile_steps`) into
    ``profile/<candidate label>``. A program compiled for a target's compile-only devices is
    rebuilt on this process's devices to run."""
    if program.mesh.devices.flat[0].platform != jax.default_backend():
        program = build(
            candidate.layout,
            work,
            replace(settings, compiler=None),
            dtype=candidate.dtype,
            remat=candidate.remat,
            accum=candidate.accum,
        )
    state = program.init(0)
    batch = program.shard_batch(work.synthetic_batch(settings.batch, settings.seq))
    trace = None
    if profile is not None:
        name = re.sub(r"[^\w.=-]+", "_", f"{candidate.label} {candidate.layout.mesh}").strip("_")
        trace = profile_steps(profile / name, warmup + 1, warmup + timed)
    for i in range(warmup + timed):
        start = time.perf_counter()
        with trace.step(i + 1) if trace else contextlib.nullcontext():
            state, metrics = program.step(state, batch)
            loss = float(metrics["loss"])  # waits for the step
        if i >= warmup:
            candidate.measured_s.append(time.perf_counter() - start)
        candidate.losses.append(loss)
        if on_step:
            on_step()
    return candidate
