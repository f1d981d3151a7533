"""`compare`: which strategy for this model on this cluster, predicted from compiled programs.

Each candidate (a layout from `sharding.costmodel.layouts`, at each compute dtype; remat and
gradient accumulation added where memory needs them) is compiled for the target's device count
on this host, ahead of time from abstract shapes, and its per-device FLOPs, collectives and
memory are priced on the target by `sharding.costmodel.step_time` (`_evaluate`). The ranking is
that predicted step time, the same on every run; steps timed here are only a sanity column on
simulated devices, and the ranking on real ones. `Comparison` holds the candidates, what was
skipped and why, and the recommendation (`_verdict`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from sharding._attention import check_runs_here
from sharding._devices import cpu_only
from sharding._mesh import BATCH_AXES, MeshSpec, simulate_cpu_devices
from sharding._units import fmt_bytes
from sharding._workload import Workload
from sharding.comparison._arguments import (
    budget_bytes,
    check_counts,
    choices,
    names,
    workload_of,
)
from sharding.comparison._errors import (
    CompareArgumentError,
    CompareError,
    CompilerRefusedError,
)
from sharding.comparison._evaluate import (
    Candidate,
    Settings,
    evaluate,
    measure_here,
    reference_flops,
)
from sharding.comparison._result import Comparison, Skipped, check_output
from sharding.comparison._verdict import recommend
from sharding.costmodel import MEMORY_FRACTION, Layout, called_for, layouts, strategy_names
from sharding.targets import CompilerError, Target, check_choice, compiler_for
from sharding.targets import target as parse_target

DTYPES = ("float32", "bfloat16")
REMATS = ("none", "dots", "full")
DEFAULT_TARGET = "h100:1x8"
MAX_ACCUM = 8  # gradient accumulation tried up to this many micro-steps where memory needs it
REFERENCE_TASK = "unsplit step (1 device)"

# on_progress(task, done, total, note): a task starts (done 0), advances, or is skipped (note
# says so); tasks are the reference step and "LABEL on MESH" for each candidate.
Progress = Callable[[str, int, int, str | None], None]


def compare(
    model: Any,
    *,
    size: str | None = None,
    cfg: Any = None,
    target: str | Target = DEFAULT_TARGET,
    batch: int = 32,
    seq: int | None = None,
    dtype: str | Sequence[str] | None = None,
    remat: str | Sequence[str] | None = None,
    strategies: str | Sequence[str] | None = None,
    mesh: str | dict | None = None,
    memory_budget: int | str | None = None,
    measure: bool | None = None,
    timed_steps: int = 3,
    warmup_steps: int = 1,
    profile: str | os.PathLike | None = None,
    on_progress: Progress | None = None,
    attention: str | None = None,
    accum: int | None = None,
    micro_batch: int | None = None,
    compiler: str = "auto",
) -> Comparison:
    """Which strategy for ``model`` on ``target``: `spmdkit compare`.

    Every layout (`sharding.costmodel.layouts`; a fallback shape only when the earlier failed)
    at every dtype is compiled for the target's device count and priced there; where the plain
    step does not fit, remat dots, then full, then gradient accumulation are tried. The ranking
    is the predicted step time (on real devices, the measured one); the recommendation is the
    fastest that fits, explained with the table's figures.

    Args:
        model: a `sharding.Workload`, or a shipped family module at ``size`` (default tiny) or
            ``cfg``.
        target: a `sharding.targets.Target` or its text (``"h100:4x8"``, a TOML profile). On a
            CPU-only host its device count is simulated (before JAX starts); elsewhere this
            process must have exactly that many devices.
        batch, seq: global batch and (for a model with a sequence axis) its length (default 128).
        dtype, remat: narrow the candidates (a name, a comma list or a sequence); default: both
            dtypes, and remat only where memory needs it.
        strategies: a subset of the strategies (default: all); mesh: one mesh for all.
        memory_budget: bytes per device a step may allocate (default: 90% of the target's HBM).
        measure: also time steps on this process's devices (default: only where they are real
            accelerators); timed_steps, warmup_steps: how many.
        profile: a folder: each measured candidate's timed steps are traced with
            `jax.profiler` into ``profile/<candidate>`` (implies ``measure``).
        on_progress: ``(task, done, total, note)`` as candidates compile and run.
        attention: the attention kernel every candidate compiles with (`models.attention`:
            "auto", "blockwise", "xla", "cudnn", "splash"); None: the model's own (for the
            shipped models "auto": blockwise on a CPU host beyond one block of 512 tokens, so
            the programs priced for a GPU hold what its flash kernel holds). A kernel this host
            cannot compile is refused before anything compiles.
        accum: run every candidate at this many accumulation micro-steps (the batch's rows per
            device per micro-step, across layouts, are then batch / accum / batch shards), each
            remat policy in turn until one fits; a layout the micro-steps do not split evenly is
            skipped, saying so. Default: accumulation only where memory needs it.
        micro_batch: rows per device per forward pass in every candidate (plan's too): each
            layout's accumulation follows; one it does not divide is skipped, saying so.
        compiler: whose programs the facts come from (`sharding.targets.compiler_for`):
            "auto", the target's own compiler (XLA:GPU, libtpu) on compile-only devices where
            its extra is installed, else XLA:CPU on simulated devices, saying so in the notes;
            "target", the target's or an error naming the extra; "cpu", XLA:CPU.

    Raises:
        CompareArgumentError (before anything compiles), `NothingMeasuredError` /
        `NoStrategyFitsError` after compiling (the error's ``comparison`` holds what was found).

    Example (with ``llama`` the model family module ``models.llama``):
        >>> result = compare(llama, target="h100:1x8", strategies="dp,fsdp")  # doctest: +SKIP
        >>> result.recommendation.best.label  # doctest: +SKIP
        'dp bf16'
    """
    work = workload_of(model, size, cfg)
    seq = check_counts(work, batch, seq, timed_steps, warmup_steps)
    if profile is not None:
        if measure is False:
            raise CompareArgumentError(
                f"--profile {os.fspath(profile)!r} traces the measured steps, but --no-measure "
                f"turns measuring off; drop --no-measure (--profile measures on this host)"
            )
        existing = next(p for p in (Path(profile).absolute(), *Path(profile).absolute().parents)
                        if p.exists())  # fmt: skip
        if not existing.is_dir():
            raise CompareArgumentError(
                f"--profile {os.fspath(profile)!r}: {existing} is a file; give a folder for the "
                f"traces, e.g. --profile traces/compare"
            )
        measure = True
    whole = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1  # noqa: E731
    if accum is not None and (not whole(accum) or batch % accum):
        raise CompareArgumentError(
            f"--accum {accum!r}: give a whole number >= 1 that divides --batch {batch}"
        )
    if micro_batch is not None and (not whole(micro_batch) or accum is not None):
        raise CompareArgumentError(f"--micro-batch {micro_batch!r}: give a whole number >= 1, and "
                                   f"not with --accum {accum} (each fixes the other)")  # fmt: skip
    tgt = target if isinstance(target, Target) else parse_target(target)
    dtypes, remats = choices("--dtype", dtype, DTYPES), choices("--remat", remat, REMATS)
    budget = (
        int(MEMORY_FRACTION * tgt.device.hbm_bytes)
        if memory_budget is None
        else budget_bytes(memory_budget)
    )
    try:
        check_choice(compiler)
    except CompilerError as e:
        raise CompareArgumentError(str(e)) from None
    devices = _devices(tgt)
    try:
        chosen = compiler_for(tgt, compiler)
    except CompilerError as e:
        raise CompareArgumentError(f"--compiler {compiler}: {e}") from None
    if attention is not None:
        check_runs_here(attention, chosen.platform)
    depth = work.depth() or 0
    extra = called_for(work, seq)  # long sequences: sequence splits; experts: expert splits
    todo = layouts(tgt.devices, depth, strategies=strategies, mesh=mesh, batch=batch,
                   per_node=tgt.per_node if tgt.nodes > 1 else None, extra=extra)  # fmt: skip
    skipped = _without_layout(strategies, todo, tgt.devices, depth, mesh, work, extra)
    if not todo:
        raise CompareArgumentError(
            f"--strategies {','.join(strategy_names(strategies, extra))}: none of them has a "
            f"layout on {tgt.devices} devices for {depth} layers"
            f"{f' on --mesh {mesh}' if mesh else ''} "
            f"({'; '.join(s.reason for s in skipped)}); use another --target, --mesh or "
            f"--strategies"
        )
    progress = on_progress or (lambda *a: None)
    real = devices[0].platform != "cpu"
    settings = Settings(batch, seq, attention=attention, compiler=chosen)
    started = time.perf_counter()
    progress(REFERENCE_TASK, 0, 1, None)
    useful, unsplit = reference_flops(work, settings, dtypes[0])
    progress(REFERENCE_TASK, 1, 1, None)
    if measure is None:
        measure = real
    found, notes, placed = [], [], set()
    for layout in todo:
        if layout.fallback and layout.strategy in placed:
            continue
        for dt in dtypes:
            task = f"{layout.label}{' bf16' if dt == 'bfloat16' else ''} on {layout.mesh}"
            progress(task, 0, 1, None)
            try:
                pinned = accum if micro_batch is None else _accum_for(layout, batch, micro_batch)
                got = _variants(layout, work, settings, tgt, dt, remats, useful, budget, notes,
                                pinned)  # fmt: skip
            except ValueError as e:  # a layout the model or mesh cannot take: say why
                skipped.append(Skipped(layout.label, layout.mesh, f"{type(e).__name__}: {e}"))
                progress(task, 0, 1, "skipped")
                break  # the same placement at every dtype
            placed.add(layout.strategy)
            for candidate, program in got:
                if measure:
                    measure_here(candidate, program, work, settings, warmup=warmup_steps,
                                 timed=timed_steps,
                                 profile=None if profile is None else Path(profile))  # fmt: skip
                found.append(candidate)
            progress(task, 1, 1, None)
    if measure and not real:
        notes.append("'here' times steps on this host's simulated devices: they share its "
                     "cores, so pipelines and collectives there predict no cluster")  # fmt: skip
    if widened := max((c.widened for c in found), default=0):
        notes.append(f"memory counts bfloat16 arrays in bfloat16: XLA:CPU carries whole "
                     f"bfloat16 arrays it slices (a layer stack's saved activations) as float32 "
                     f"copies, up to {fmt_bytes(widened)} per device here, which a GPU or TPU "
                     f"does not (sharding.inspection.widened_bytes)")  # fmt: skip
    if chosen.note:
        notes.insert(0, chosen.note)
    name, size_name = names(work)
    result = Comparison(
        name, size_name, work.param_count(), tgt, settings, dtypes,
        {"count": len(devices), "platform": devices[0].platform, "kind": devices[0].device_kind},
        real and measure, useful, unsplit, budget, found, skipped,
        time.perf_counter() - started, notes, compiler=chosen,
    )  # fmt: skip
    try:
        result.recommendation = recommend(found, unsplit, budget, tgt, measured=result.measured,
                                          simulated=not real)  # fmt: skip
    except CompareError as e:
        e.comparison = result  # what was found, for the caller to show
        raise
    return result


def _variants(layout: Layout, work: Workload, settings: Settings, tgt: Target, dtype: str,
              remats: tuple[str, ...] | None, useful: float, budget: int,
              notes: list[str], pinned: int | None = None) -> list[tuple[Candidate, Any]]:  # fmt: skip
    """The candidates of one layout at one dtype: each asked remat policy, or (by default) the
    plain step, then remat and accumulation, stopping at the first that fits ``budget``;
    ``pinned`` fixes the accumulation (each remat policy in turn)."""
    if pinned is not None and not _splits(layout, settings, pinned):
        raise CompareArgumentError(
            f"--accum {pinned}: batch {settings.batch} does not split into {pinned} micro-steps "
            f"over this mesh's batch shards{' and micro-batches' if layout.schedule else ''}"
        )
    if remats is not None:
        plan = [(r, pinned or 1) for r in remats]
    elif pinned is not None:
        plan = [(r, pinned) for r in ("none", "dots", "full")]
    else:
        plan = [("none", 1), ("dots", 1), ("full", 1)]
        plan += [("full", k) for k in (2, 4, 8) if k <= MAX_ACCUM and _splits(layout, settings, k)]
    first, out, refused = None, [], []
    for remat, accum in plan:
        try:
            got = evaluate(
                layout,
                work,
                settings,
                tgt,
                dtype=dtype,
                remat=remat,
                accum=accum,
                useful_flops=useful,
            )
        except jax.errors.JaxRuntimeError as e:  # libtpu: a program larger than HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            refused.append(f"remat={remat}, accum={accum}: {str(e).strip().splitlines()[0]}")
            continue
        if remats is not None:
            out.append(got)
            continue
        cand = got[0]
        first = first or cand
        if cand.memory_bytes <= budget:
            if (remat, accum) != ("none", pinned or 1):
                notes.append(f"{layout.label} ({dtype}) on {layout.mesh} needs "
                             f"{fmt_bytes(first.memory_bytes)} per device as a plain step: "
                             f"compared with remat={remat}, accum={accum}")  # fmt: skip
            return [got]
        out = [got]
        if cand.state_bytes > budget:  # the train state alone: remat cannot help
            break
    if not out:
        raise CompilerRefusedError(
            f"{settings.compiler.name if settings.compiler else 'the compiler'} refused it at "
            f"every remat and accumulation tried ({'; '.join(refused)})"
        )
    return out


def _accum_for(layout: Layout, batch: int, micro_batch: int) -> int:
    """The micro-steps that give ``layout`` ``micro_batch`` rows per device per forward pass."""
    per_step = micro_batch * (layout.microbatches or 1)
    per_step *= math.prod(layout.sizes[a] for a in BATCH_AXES)
    if batch % per_step:
        raise CompareArgumentError(
            f"--micro-batch {micro_batch}: batch {batch} is not a whole number of micro-steps of "
            f"{per_step} rows ({micro_batch} per device, micro-batch and shard) on {layout.mesh}"
        )
    return batch // per_step


def _splits(layout: Layout, settings: Settings, accum: int) -> bool:
    sizes = layout.sizes
    rows = settings.batch // accum if settings.batch % accum == 0 else 0
    m = layout.microbatches or 1
    return rows > 0 and rows % (sizes["data"] * sizes["fsdp"] * m) == 0


def _without_layout(strategies, todo, devices, depth, mesh, work, extra=()) -> list[Skipped]:
    """A line for each strategy asked for that no layout places, and why."""
    have = {c.strategy for c in todo}
    out = []
    for name in strategy_names(strategies, extra):
        if name in have:
            continue
        if name.startswith("pp") and work.stack is None:
            why = f"the workload {work.name!r} names no layer stack to pipeline (stack=None)"
        elif (
            name.startswith("pp") and mesh and MeshSpec.of(mesh).resolve(devices).sizes["stage"] < 2
        ):
            why = f"--mesh {mesh} has no stage axis; a pipeline needs stage >= 2"
        elif name.startswith("pp"):
            why = (f"{depth} layers do not split into stages of {devices} devices (stages must "
                   f"divide the layers)")  # fmt: skip
        else:
            why = (
                f"no mesh shape of {devices} devices suits it{f' (--mesh {mesh})' if mesh else ''}"
            )
        out.append(Skipped(name, mesh or "-", why))
    return out


def _devices(tgt: Target) -> list:
    """This process's devices, simulated to the target's count on a CPU-only host."""
    if cpu_only():
        with contextlib.suppress(RuntimeError):  # JAX already started: checked below
            simulate_cpu_devices(tgt.devices)
    if jax.device_count() != tgt.devices:
        raise CompareArgumentError(
            f"--target {tgt.name} has {tgt.devices} devices but this process has "
            f"{jax.device_count()} {jax.default_backend()} devices; on a CPU host simulate them "
            f"before JAX starts (sharding.simulate_cpu_devices({tgt.devices}); spmdkit compare "
            f"does), or choose a target of {jax.device_count()} devices"
        )
    return jax.devices()


__all__ = ["Comparison", "check_output", "compare"]
