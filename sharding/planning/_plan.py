"""`plan`: rank strategies and meshes for a model on a target cluster (`spmdkit plan`).

A language-model family is ranked from the closed forms (no devices, any size) priced by the one
step-time model on the target; when the target has at most `MAX_AOT_DEVICES` devices, its top
layouts are also compiled for it from abstract shapes (compare's path) and both predictions shown
side by side. Any other workload is ranked from compiled programs of a few layouts per strategy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from sharding._attention import check_kind, check_runs_here, runs_here
from sharding._units import SizeFormatError, fmt_bytes, parse_bytes
from sharding._workload import Workload
from sharding.costmodel import (
    DTYPE_BYTES,
    LM_FAMILIES,
    MAX_COMPILES,
    OPTIMIZER_MOMENTS,
    CostModelError,
    Estimate,
    candidates,
    error_to_expect,
    memory_budget,
    strategy_names,
)
from sharding.planning._check import check_top, devices_here
from sharding.planning._compiled import compiled_candidates
from sharding.planning._planview import PlanResult
from sharding.targets import Compiler, CompilerError, Target, check_choice, compiler_for
from sharding.targets import target as to_target

# Simulating more CPU devices than this makes an AOT compile too slow to be worth waiting for.
MAX_AOT_DEVICES = 64
# The size `plan` takes for a family when none is given: the largest of each language-model
# family that fits the default target, 8 H100s (llama 70b needs more than 8 x 80 GB); others tiny.
DEFAULT_SIZES = {"llama": "7b", "gpt2": "1.5b"}


class PlanError(CostModelError):
    """An argument of `plan` it cannot take."""


def plan(
    model: Any,
    *,
    size: str | None = None,
    cfg: Any = None,
    target: Target | str = "h100:1x8",
    memory: int | str | None = None,
    batch: int | None = None,
    seq: int | None = None,
    layers: int | None = None,
    strategies: str | Sequence[str] | None = None,
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    top: int = 12,
    aot: int | None = None,
    attention: str | None = None,
    accum: int | None = None,
    micro_batch: int | None = None,
    compiler: str = "auto",
) -> PlanResult:
    """Rank every (strategy, mesh, schedule, remat) layout of a model on a target cluster.

    Args:
        model: a `sharding.Workload` (yours, or a shipped family's), or a family module
            (``models.llama``). llama and gpt2 are ranked from closed forms; any other model
            from the compiled programs of a few layouts per strategy (`few_layouts`), which
            needs the target's devices simulated here (at most `MAX_AOT_DEVICES`).
        size, cfg: with a family module, a named size (default: `DEFAULT_SIZES`, else "tiny")
            or a Config; ``layers`` overrides a shipped config's layer count.
        target: the cluster, e.g. ``"h100:64x8"`` (64 nodes of 8 H100s), a
            `sharding.targets.Target`, or a TOML device profile: devices, peaks, HBM, links.
        memory: bytes a step may fill per device, or a size such as "70GB" (default: 90% of
            the target's HBM, as `step_time` counts a fit).
        batch, seq: global batch (default: the target's devices) and sequence length (default:
            min(4096, a family's maximum), or the workload's own).
        strategies: a subset of the presets (a comma list or a sequence; default: all).
        dtype, optimizer: compute dtype and optimizer ("adamw", "adam", "sgd").
        top: how many layouts the result shows.
        aot: compile this many of the top fitting layouts for the target beside their formula
            (default: 2 when the target has at most `MAX_AOT_DEVICES` devices; skipped, with a
            note, when this process holds another device count). On a CPU host a bfloat16
            plan is checked at float32 (XLA:CPU carries bfloat16 collectives in float32).
            Simulating CPU devices fixes this process's device count.
        attention: the attention kernel (`models.attention.KINDS`, default "auto"): the closed
            form prices "xla" as the materialising reference and the others flash-style (causal
            blocks skipped, backward recompute, no score matrix); a compile runs the kernel
            where this host can, else blockwise (said in the notes).
        accum, micro_batch: pin the accumulation steps, or the rows each device runs per
            forward pass (Megatron's micro-batch size); default: searched, per layout the
            smallest accumulation that fits (`micro_steps`). Closed-form families only.
        compiler: whose programs the compiled layouts come from (`sharding.targets.compiler_for`):
            "auto", the target's own compiler where its extra is installed (a bfloat16 plan is
            then checked at bfloat16), else XLA:CPU, saying so; "target" or an error; "cpu".

    Raises:
        PlanError: an argument out of range; `NoFittingStrategyError`, `NoValidLayoutError` from
            the search; `sharding.targets.TargetError` for a target it cannot read.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> result = plan(llama, size="70b", target="h100:64x8", top=3)  # doctest: +SKIP
        >>> result.shown[0].fits, result.devices  # doctest: +SKIP
        (True, 512)
    """
    tgt = to_target(target)
    _whole("--top", top, 1, "the rows to show, e.g. --top 12")
    for flag, value in (("--batch", batch), ("--layers", layers), ("--seq", seq)):
        if value is not None:
            _whole(flag, value, 1, "or leave it out for the default")
    for flag, value in (("--accum", accum), ("--micro-batch", micro_batch)):
        if value is not None:
            _whole(flag, value, 1, "or leave it out to search it")
    if aot is not None:
        _whole("--aot", aot, 0, "how many top layouts to compile; 0 for none")
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise PlanError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_MOMENTS)}")
    try:
        check_choice(compiler)
    except CompilerError as e:
        raise PlanError(str(e)) from None
    work = _workload(model, size, cfg, layers)
    kind = check_kind(attention or "auto")
    # Checked now; None stays None so that the layouts add what the model calls for (`called_for`).
    strategies = None if strategies is None else strategy_names(strategies)
    budget = memory_budget(tgt, None if memory is None else _memory(memory))
    batch = batch or tgt.devices
    name = getattr(work.family, "NAME", None)
    if name in LM_FAMILIES:
        return _closed_form(
            work,
            tgt,
            budget,
            batch,
            seq,
            strategies,
            dtype,
            optimizer,
            top,
            aot,
            kind,
            (accum, micro_batch),
            compiler,
        )
    if accum is not None or micro_batch is not None:
        raise PlanError(
            f"--accum / --micro-batch: {work.name} is priced from compiled programs, which "
            f"plan runs at accumulation 1; use spmdkit compare (which adds accumulation where "
            f"memory needs it) or leave them out"
        )
    return _compiled(
        work, tgt, budget, batch, seq, strategies, dtype, optimizer, top, aot, attention, compiler
    )


ATTENTION_NOTE = {
    "xla": "the whole score matrix kept",
    "flash": "flash-style: causal blocks skipped, the backward recomputing each block, no "
    "score matrix kept",
}


def _closed_form(
    work,
    tgt,
    budget,
    batch,
    seq,
    strategies,
    dtype,
    optimizer,
    top,
    aot,
    kind,
    pins=(None, None),
    compiler="auto",
):
    family, cfg = work.family, work.config
    too_long = None if seq is None else work.seq_refusal(seq)
    if too_long:
        raise PlanError(too_long)
    seq = seq or min(4096, cfg.max_seq_len)
    aot = aot if aot is not None else (2 if tgt.devices <= MAX_AOT_DEVICES else 0)
    have = devices_here(tgt.devices) if aot and tgt.devices <= MAX_AOT_DEVICES else None
    start, rejected = time.perf_counter(), []
    ranked = candidates(family, cfg, tgt, batch, seq, strategies=strategies and tuple(strategies),
                        dtype=dtype, optimizer=optimizer, memory_bytes=budget,
                        attention=kind, accum=pins[0], micro_batch=pins[1],
                        rejected=rejected)  # fmt: skip
    elapsed = time.perf_counter() - start
    notes = []
    if aot and tgt.devices > MAX_AOT_DEVICES:
        notes.append(f"not compiled: {tgt.devices} devices are more than the {MAX_AOT_DEVICES} "
                     f"this host simulates for an AOT compile")  # fmt: skip
    elif aot and have != tgt.devices:
        notes.append(f"AOT skipped: {have} devices here, not {tgt.devices}")
    elif aot:
        chosen = _compiler(tgt, compiler)
        notes += [chosen.note] if chosen.note else []
        notes += check_top(ranked, work, tgt, aot, optimizer, chosen)
        if not runs_here(kind, chosen.platform):
            notes.append(
                f"compiled with attention='blockwise' for {chosen.platform}, which "
                f"cannot run {kind!r}; the formula beside it is re-run for "
                f"blockwise"
            )
    assumptions = [
        *_top_assumptions(ranked),
        f"Memory: params + gradients + optimizer state + batch + saved activations + one "
        f"layer's backward transients + gathered layer weights + float32 logits, against "
        f"{fmt_bytes(budget)} per device; float32 master weights, {dtype} compute, {optimizer}.",
        f"Attention: {kind!r} ({ATTENTION_NOTE['xla' if kind == 'xla' else 'flash']}).",
        f"Searched every factorisation of the {tgt.devices} devices each strategy can use, "
        f"pipelines under gpipe, 1f1b, zb-h1 and interleaved, remat none, dots and full, "
        f"the global batch {batch} as micro-steps (per layout and remat, the least "
        f"accumulation that fits: each micro-step gathers fsdp's weights and reduces the "
        f"gradients again).",
    ]
    return PlanResult(family.NAME, cfg.name, cfg.n_layers, tgt, budget, batch, seq, dtype,
                      optimizer, "formula", elapsed, ranked, top, assumptions, notes,
                      rejected)  # fmt: skip


def _compiler(tgt: Target, choice: str) -> Compiler:
    """The compiler a plan's compiled layouts come from, after this process's devices are
    simulated; a `PlanError` where ``--compiler target`` cannot run here."""
    try:
        return compiler_for(tgt, choice)
    except CompilerError as e:
        raise PlanError(f"--compiler {choice}: {e}") from None


def _compiled(
    work,
    tgt,
    budget,
    batch,
    seq,
    strategies,
    dtype,
    optimizer,
    top,
    aot,
    attention,
    compiler="auto",
):
    if aot == 0:
        raise PlanError(
            f"--aot 0: {work.name} has no closed-form costs, so plan prices it from compiled "
            f"programs; leave --aot out"
        )
    if tgt.devices > MAX_AOT_DEVICES:
        raise PlanError(
            f"--target {tgt.name}: {work.name} has no closed-form costs and is priced from "
            f"programs compiled for the target's {tgt.devices} devices, more than the "
            f"{MAX_AOT_DEVICES} this host simulates; plan it on a target of at most "
            f"{MAX_AOT_DEVICES} devices (e.g. --target {tgt.device.name}:{min(tgt.per_node, MAX_AOT_DEVICES)})"
        )
    if work.seq is None and seq is not None:
        raise PlanError(f"--seq {seq}: {work.name} has no sequence axis; drop --seq")
    seq = seq or work.seq
    have = devices_here(tgt.devices)
    if have != tgt.devices:
        raise PlanError(
            f"--target {tgt.name}: {work.name} is priced from programs compiled for "
            f"{tgt.devices} devices, and this process holds {have} (JAX started before plan "
            f"could simulate them); run plan in a fresh process or pick a target of {have} devices"
        )
    chosen = _compiler(tgt, compiler)
    check_runs_here(check_kind(attention or "auto"), chosen.platform)
    start = time.perf_counter()
    ranked, notes = compiled_candidates(
        work,
        tgt,
        batch,
        seq,
        strategies=strategies and tuple(strategies),
        dtype=dtype,
        memory_bytes=budget,
        limit=MAX_COMPILES,
        attention=attention,
        compiler=chosen,
    )
    notes = [chosen.note, *notes] if chosen.note else notes
    elapsed = time.perf_counter() - start
    if optimizer != "adamw":
        notes.append(f"compiled steps use AdamW (compare's path), not {optimizer}")
    assumptions = [
        *_top_assumptions(ranked),
        f"Memory: what each compiled step allocates per device, against {fmt_bytes(budget)}.",
    ]
    name, size = getattr(work.family, "NAME", work.name), getattr(work.config, "name", "")
    return PlanResult(name, size, work.depth(), tgt, budget, batch, seq, dtype, "adamw",
                      "compiled program", elapsed, ranked, top, assumptions, notes)  # fmt: skip


def _top_assumptions(ranked: list[Estimate]) -> list[str]:
    """`step_time`'s assumptions, every figure used, as it priced the top layout."""
    top = ranked[0]
    return [f"Step times by sharding.costmodel.step_time; its assumptions, with the figures of "
            f"the top layout ({top.label} on {top.mesh_text}, remat {top.remat}):",
            *top.predicted.assumptions, error_to_expect(top.layout.sizes)]  # fmt: skip


def _workload(model: Any, size: str | None, cfg: Any, layers: int | None) -> Workload:
    if isinstance(model, Workload):
        if size is not None or cfg is not None:
            raise PlanError(
                f"plan({model.name!r}, size=/cfg=): a Workload carries its own size; give size= "
                f"or cfg= only with a family module (models.llama), or build the workload at it"
            )
        family, cfg = model.family, model.config
        if layers is None:
            return model
        if family is None or not hasattr(cfg, "n_layers"):
            raise PlanError(
                f"--layers {layers}: {model.name} is your own workload, whose layer count plan "
                f"cannot change; build it with {layers} layers (e.g. a size= argument) instead"
            )
        return Workload.from_family(family, dataclasses.replace(cfg, n_layers=layers))
    family = model
    if not (hasattr(family, "NAME") and hasattr(family, "SIZES")):
        raise PlanError(
            f"model {model!r}: give a sharding.Workload or a family module such as models.llama"
        )
    if cfg is None:
        size = size or DEFAULT_SIZES.get(family.NAME, "tiny")
        if size not in family.SIZES:
            raise PlanError(
                f"--size {size!r}: unknown {family.NAME} size; sizes: {', '.join(family.SIZES)}"
            )
        cfg = family.config(size)
    elif size is not None:
        raise PlanError(f"plan(size={size!r}, cfg=...): give a size or a config, not both")
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    return Workload.from_family(family, cfg)


def _whole(flag: str, value: Any, low: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PlanError(f"{flag} {value!r}: give a whole number >= {low} ({what})")


def _memory(memory: int | str) -> int:
    try:
        value = parse_bytes(memory) if isinstance(memory, str) else memory
    except SizeFormatError as e:
        raise PlanError(f"--memory {memory!r}: {e}") from None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise PlanError(f"--memory {memory!r}: give the memory per device > 0, e.g. --memory 80GB")
    return int(value)


__all__ = ["DEFAULT_SIZES", "MAX_AOT_DEVICES", "MAX_COMPILES", "PlanError", "PlanResult", "plan"]
