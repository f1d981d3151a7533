"""A closed-form plan checked against the compiled program: `check_candidate` compiles an
estimate's layout for the target (compare's path) and keeps both predictions side by side."""

from __future__ import annotations

import contextlib
from typing import Any

from sharding._attention import runs_here
from sharding._devices import cpu_only
from sharding._mesh import simulate_cpu_devices
from sharding.comparison import Settings, evaluate
from sharding.costmodel import (
    Check,
    CostModelError,
    Estimate,
    predict,
    step_time,
    work_from_prediction,
)
from sharding.targets import Compiler, Target, target


def check_candidate(
    estimate: Estimate,
    work: Any,
    tgt: Target | str,
    *,
    dtype: str | None = None,
    compiler: Compiler | None = None,
) -> Check:
    """Compile a closed-form estimate's layout for ``tgt`` (compare's path) and keep both
    predictions, at ``dtype`` (default: the estimate's; the formula is re-run at another).

    Needs ``jax.device_count() == tgt.devices``. The compiled step uses AdamW, as compare's;
    ``compiler`` (`sharding.targets.compiler_for`) says whose program (None: this process's
    devices).
    """
    tgt, p = target(tgt), estimate.prediction
    if p is None:
        raise CostModelError(f"{estimate.label}: no closed-form prediction to check")
    dtype = dtype or p.dtype
    family, cfg = work.family, work.config
    # The compile runs the kernel asked for where its platform can, else a flash-style stand-in.
    kind = p.attention if runs_here(p.attention, compiler and compiler.platform) else "blockwise"
    if dtype != p.dtype or kind != p.attention:
        p = predict(family, cfg, p.strategy, p.mesh, p.batch, p.seq,
                    pipeline=estimate.layout.pipeline(), dtype=dtype, optimizer=p.optimizer,
                    remat=p.remat, attention=kind, accum=p.accum)  # fmt: skip
    useful = predict(family, cfg, "dp", {}, p.batch, p.seq, dtype=dtype,
                     attention=kind).matmul_flops  # fmt: skip
    sw = work_from_prediction(p, model_flops=useful)
    settings = Settings(p.batch, p.seq, attention=kind, compiler=compiler)
    cand, _ = evaluate(estimate.layout, work, settings, tgt, dtype=dtype,
                       remat=p.remat, accum=p.accum, useful_flops=useful)  # fmt: skip
    rate = tgt.device.peak(dtype) * tgt.device.matmul_fraction
    estimate.check = Check(dtype, step_time(sw, tgt), sw.matmul_flops, p, cand, rate)
    return estimate.check


def check_top(
    ranked: list[Estimate],
    work: Any,
    tgt: Target,
    n: int,
    optimizer: str,
    compiler: Compiler | None = None,
) -> list[str]:
    """`check_candidate` on the first ``n`` fitting layouts (each at its best remat policy);
    notes on how they were checked.

    Compiled by XLA:CPU (``compiler`` None on a CPU host, or its fallback), a bfloat16 plan is
    checked at float32, formula and compile alike: XLA:CPU carries bfloat16 collectives in
    float32 (converts around them) and aborts compiling bfloat16 pipelines, so a bfloat16
    compile there would not be the program a GPU runs. The target's own compiler compiles it
    at bfloat16.
    """
    import jax

    dtype, notes = ranked[0].prediction.dtype, []
    platform = compiler.platform if compiler else jax.default_backend()
    if dtype == "bfloat16" and platform == "cpu":
        dtype = "float32"
        notes.append("checked at float32 on this CPU host, formula and compile alike: XLA:CPU "
                     "carries bfloat16 collectives in float32 and aborts compiling bfloat16 "
                     "pipelines")  # fmt: skip
    if optimizer != "adamw":
        notes.append(f"compiled steps use AdamW (compare's path); the formula's memory counts "
                     f"{optimizer}")  # fmt: skip
    chosen = {}  # distinct layouts: the same one at the other remat policy teaches less
    for c in ranked:
        if c.fits and len(chosen) < n:
            chosen.setdefault(c.layout, c)
    for c in chosen.values():
        check_candidate(c, work, tgt, dtype=dtype, compiler=compiler)
    return notes


def devices_here(devices: int) -> int:
    """Simulate ``devices`` CPU devices unless JAX has started; the devices this process has."""
    if cpu_only():
        with contextlib.suppress(RuntimeError):  # another count already: the caller says so
            simulate_cpu_devices(devices)
    import jax

    return jax.device_count()


__all__ = ["check_candidate", "check_top", "devices_here"]
