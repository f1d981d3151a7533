"""Layouts of any workload priced from their compiled programs (`plan` for a model without
closed-form costs): compare's compiled path, above the cost model."""

from __future__ import annotations

from typing import Any

from sharding._errors import SpmdkitError
from sharding.comparison import Settings, evaluate, reference_flops
from sharding.costmodel import (
    MAX_COMPILES,
    Estimate,
    NoValidLayoutError,
    called_for,
    few_layouts,
    layouts,
    memory_budget,
    rank_estimates,
)
from sharding.targets import Compiler, Target, target


def compiled_candidates(
    work: Any,
    tgt: Target | str,
    batch: int,
    seq: int | None,
    *,
    strategies: str | tuple[str, ...] | None = None,
    dtype: str = "bfloat16",
    memory_bytes: int | None = None,
    limit: int = MAX_COMPILES,
    attention: str | None = None,
    compiler: Compiler | None = None,
) -> tuple[list[Estimate], list[str]]:
    """A few layouts of any `sharding.Workload` (`few_layouts`), each compiled for ``tgt`` from
    abstract shapes on this process's devices and priced from its program; ranked as
    `candidates` ranks, with notes on what was left out.

    Needs ``jax.device_count() == tgt.devices`` (simulate CPU devices first). ``compiler``
    (`sharding.targets.compiler_for`): whose programs; None, this process's devices.

    Example (with ``work`` a `sharding.Workload`):
        >>> ranked, notes = compiled_candidates(work, "h100:1x8", 16, 32)  # doctest: +SKIP
    """
    import jax

    tgt = target(tgt)
    depth = work.depth() or 1  # no stack: no pipeline divides one layer
    extra = called_for(work, seq)
    found = layouts(
        tgt.devices, depth, strategies=strategies, search=True, batch=batch, extra=extra
    )
    chosen, notes = few_layouts(found, tgt.per_node, limit), []
    platform = compiler.platform if compiler else jax.default_backend()
    if dtype == "bfloat16" and platform == "cpu" and any(x.schedule for x in chosen):
        chosen = [x for x in chosen if x.schedule is None]
        notes.append("bfloat16 pipelines not compiled: XLA:CPU aborts compiling them (its "
                     "all-reduce promotion); plan them with --dtype float32")  # fmt: skip
    settings = Settings(batch, seq, attention=attention, compiler=compiler)
    budget = memory_budget(tgt, memory_bytes)
    useful = reference_flops(work, settings, dtype)[0]
    out: list[Estimate] = []
    for layout in chosen:
        try:
            cand, _ = evaluate(layout, work, settings, tgt, dtype=dtype, useful_flops=useful)
        except SpmdkitError as e:
            notes.append(f"{layout.label} on {layout.mesh} not compiled: {str(e).splitlines()[0]}")
            continue
        mem = cand.memory_bytes
        out.append(Estimate(layout, "none", cand.predicted, mem, mem <= budget,
                            cand.collective_bytes, candidate=cand))  # fmt: skip
    if not out and notes:  # layouts were listed, and none could be compiled here
        raise NoValidLayoutError(f"{work.name} on {tgt.name}: nothing compiled: {'; '.join(notes)}")
    notes.insert(0, f"{work.name} has no closed-form costs: priced from {len(out)} compiled "
                 f"programs, {len(chosen)} of the {len(found)} layouts the search lists (per "
                 f"strategy the least and the most split mesh, pipelines at their fewest stages; "
                 f"remat none; at most {limit} compiles)")  # fmt: skip
    if dtype == "bfloat16" and jax.default_backend() == "cpu":
        notes.append("compiled here on CPU: XLA:CPU carries bfloat16 collectives in float32, so "
                     "their bytes (and exposed communication) are those of float32")  # fmt: skip
    unit = "" if seq is None else f" x seq {seq}"
    return rank_estimates(out, work.name, tgt, batch, f"batch {batch}{unit}, {dtype}", strategies,
                 budget), notes  # fmt: skip


__all__ = ["compiled_candidates"]
