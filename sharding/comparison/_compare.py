"""`compare`: measure every strategy that fits on a model and these devices, and choose one.

The layouts come from `sharding.costmodel.layouts` (each strategy on the mesh shape that suits
it); a strategy's fallback shape runs only when its earlier shape failed, and every layout that
cannot run is kept with the error that says why. `Comparison` holds what was measured, the
reference FLOPs and peak behind MFU, and the recommendation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Group

from sharding._units import SizeFormatError, parse_bytes
from sharding._workload import Workload
from sharding.comparison._errors import (
    CompareArgumentError,
    CompareError,
    NothingMeasuredError,
    OutputExistsError,
)
from sharding.comparison._measure import CompareConfig, Result, Skipped, measure, reference
from sharding.comparison._plot import plot
from sharding.comparison._verdict import Recommendation, comparison_table, recommend
from sharding.costmodel import Layout, layouts, strategy_names
from sharding.inspection import Peak, host_peak

DTYPES = ("float32", "bfloat16")
DEFAULT_SEQ = 128  # tokens per sequence when a language model is compared without --seq
OUTPUTS = ("compare.json", "compare.png")
REFERENCE_TASK = "unsplit step (1 device)"

# on_progress(task, done, total, note): a task starts (done 0), advances a step, or is skipped
# (note says so); tasks are the reference step and "LABEL on MESH" for each layout.
Progress = Callable[[str, int, int, str | None], None]


@dataclass
class Comparison:
    """What `compare` measured on one model and device count, and what it recommends.

    ``results`` holds one `Result` per layout that ran, ``skipped`` the layouts that could not
    (with the reason); ``recommendation`` is None only on a comparison attached to an error.
    """

    family: str
    size: str
    parameters: int
    config: CompareConfig
    devices: dict[str, Any]  # count, platform, kind
    peak: Peak
    useful_flops: float
    unsplit_state: int
    memory_budget: int | None
    layouts: list[Layout]
    results: list[Result]
    skipped: list[Skipped]
    elapsed_s: float
    recommendation: Recommendation | None = None

    @property
    def shown_skips(self) -> list[Skipped]:
        """The skipped layouts worth a line: not those of a strategy a later shape placed."""
        shaped = {c.strategy for c in self.layouts if c.fallback}  # offered several shapes
        placed = {r.candidate.strategy for r in self.results}
        hidden = shaped & placed
        return [s for s in self.skipped if s.candidate.strategy not in hidden]

    def table(self) -> Group:
        """The header line, the comparison table, skipped layouts and the recommendation."""
        conf, dev = self.config, self.devices
        parts: list[Any] = [
            f"[bold]{self.family} {self.size}[/]: {self.parameters:,} parameters, global batch "
            f"{_batch_text(conf)}, {conf.dtype}, {dev['count']} {dev['platform']} "
            f"devices ({dev['kind']}); MFU against {self.peak.flops_per_s / 1e12:.3g} TFLOP/s "
            f"({self.peak.source}), useful matmul FLOPs/step {self.useful_flops:.4g}"
        ]
        if self.results:
            parts.append(comparison_table(self.results, self.unsplit_state, self.memory_budget))
        for s in self.shown_skips:
            first = s.reason.splitlines()[0]
            parts.append(f"[yellow]skipped[/] {s.candidate.label} on {s.candidate.mesh}: {first}")
        if self.recommendation is not None:
            parts.append("[bold]Recommendation[/]")
            for i, line in enumerate(self.recommendation.lines):
                parts.append(("  -> " if i == 0 else "     ") + line)
        parts.append(f"measured {len(self.results)} candidates in {self.elapsed_s:.0f} s")
        return Group(*parts)

    def to_dict(self) -> dict[str, Any]:
        """The record `spmdkit compare` writes to compare.json."""
        return {
            "model": {"family": self.family, "size": self.size, "parameters": self.parameters},
            "config": dataclasses.asdict(self.config),
            "devices": dict(self.devices),
            "peak": self.peak.to_dict(),
            "useful_flops_per_step": self.useful_flops,
            "unsplit_state_bytes": self.unsplit_state,
            "memory_budget": self.memory_budget,
            "results": [r.to_dict() for r in self.results],
            "skipped": [
                {"label": s.candidate.label, "mesh": s.candidate.mesh, "reason": s.reason}
                for s in self.skipped
            ],
            "recommendation": None
            if self.recommendation is None
            else self.recommendation.to_dict(),
            "elapsed_s": self.elapsed_s,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def plot(self, path: str | Path) -> Path:
        """The PNG: step time, memory and collective bytes of each layout side by side."""
        if not self.results:
            raise NothingMeasuredError("nothing was measured, so there is nothing to plot")
        return plot(self.results, Path(path), title=f"{self.family} {self.size}")

    def save(self, out: str | Path, *, overwrite: bool = False) -> tuple[Path, Path]:
        """Write compare.json and compare.png into the folder ``out`` (created if missing)."""
        out = check_output(out, overwrite=overwrite)
        out.mkdir(parents=True, exist_ok=True)
        paths = tuple(out / name for name in OUTPUTS)
        paths[0].write_text(self.to_json())
        self.plot(paths[1])
        return paths


def check_output(out: str | Path, *, overwrite: bool = False) -> Path:
    """``out`` as a Path, if `Comparison.save` may write there: not a file (nor under one), and
    holding no compare.json / compare.png unless ``overwrite``. Checks only; creates nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(
            f"--out {str(out)!r} is a file; compare writes {' and '.join(OUTPUTS)} into a folder: "
            f"give a folder path, e.g. --out compare-out"
        )
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise OutputExistsError(f"--out {str(out)!r}: {str(above)!r} is a file, not a folder")
    held = [name for name in OUTPUTS if (out / name).exists()]
    if held and not overwrite:
        raise OutputExistsError(
            f"--out {str(out)!r} already holds {' and '.join(held)}; pass --overwrite to replace "
            f"them, or choose another --out"
        )
    return out


def compare(
    model: Any,
    *,
    size: str | None = None,
    cfg: Any = None,
    batch: int = 32,
    seq: int | None = None,
    dtype: str = "float32",
    timed_steps: int = 8,
    warmup_steps: int = 2,
    strategies: str | Sequence[str] | None = None,
    mesh: str | dict | None = None,
    memory_budget: int | str | None = None,
    peak_tflops: float | None = None,
    on_progress: Progress | None = None,
) -> Comparison:
    """Measure every strategy on this process's devices and recommend one: `spmdkit compare`.

    Each strategy runs on the mesh shape that suits it (`sharding.costmodel.layouts`; a fallback
    shape only when the earlier one failed), pipelines under each schedule; each layout is
    compiled, run ``warmup_steps`` steps, then timed over ``timed_steps`` steps. Layouts that
    cannot run are kept in ``skipped`` with the error. The recommendation is the fastest layout
    that fits ``memory_budget``, explained with the measured figures.

    Args:
        model: a `sharding.Workload` (your model), or a shipped family module
            (``models.llama``, ``models.cnn``) at ``size`` (default tiny) or ``cfg``.
        size, cfg: a named size of a family, or its Config (then ``size`` is ignored).
        batch, seq: global batch (sequences or samples per step) and, for a model with a
            sequence axis, the sequence length (default 128); None for a model without one.
        dtype: compute dtype, "float32" or "bfloat16".
        timed_steps, warmup_steps: steps timed per layout, and untimed steps before them.
        strategies: a subset of the presets (a comma list or a sequence; default: all).
        mesh: run every strategy on this one mesh instead of its own shape.
        memory_budget: bytes per device, or a size such as "80GB": adds a fits column and
            recommends only what fits.
        peak_tflops: peak TFLOP/s per device for MFU (default: the datasheet, or the matmul
            roofline measured on CPU).
        on_progress: ``(task, done, total, note)``, called when the reference step or a layout
            starts (done 0), after each step, and when a layout is skipped (note "skipped").

    Raises:
        CompareArgumentError: an argument out of range (before anything compiles);
            `NothingMeasuredError` / `NoStrategyFitsError` after measuring (the error's
            ``comparison`` holds what was measured).

    Example (with ``llama`` the model family module ``models.llama``):
        >>> result = compare(llama, batch=16, seq=32, strategies="dp,fsdp",
        ...                  timed_steps=2)  # doctest: +SKIP
        >>> result.recommendation.best.candidate.label  # doctest: +SKIP
        'fsdp'
    """
    import jax

    work = _workload(model, size, cfg)
    seq = _check(work, batch, seq, dtype, timed_steps, warmup_steps)
    budget = None if memory_budget is None else _bytes(memory_budget)
    if peak_tflops is not None and not _positive(peak_tflops):
        raise CompareArgumentError(
            f"--peak-tflops {peak_tflops!r}: give the peak TFLOP/s of one device, a number > 0, "
            f"e.g. --peak-tflops 989 (H100 bfloat16); leave it out to use the datasheet"
        )
    family, size = _names(work)
    conf = CompareConfig(family, size, batch, seq, dtype, timed_steps, warmup_steps)
    devices = jax.devices()
    depth = work.depth() or 0
    todo = layouts(len(devices), depth, strategies=strategies, mesh=mesh)
    if not todo:  # e.g. pp_tp on 2 devices: say so before compiling anything
        names, on = ",".join(strategy_names(strategies)), f" on --mesh {mesh}" if mesh else ""
        raise CompareArgumentError(
            f"--strategies {names}: none of them has a layout on {len(devices)} devices for "
            f"{depth} layers{on}; use more --devices, another --mesh, or other --strategies"
        )
    progress = on_progress or (lambda *a: None)
    peak = host_peak(devices, dtype=dtype, tflops=peak_tflops)
    started = time.perf_counter()
    progress(REFERENCE_TASK, 0, 1, None)
    useful, unsplit = reference(work, conf)
    progress(REFERENCE_TASK, 1, 1, None)
    results, skipped, placed = [], [], set()
    for cand in todo:
        if cand.fallback and cand.strategy in placed:
            continue
        task, total, done = f"{cand.label} on {cand.mesh}", warmup_steps + timed_steps, [0]

        def step(task=task, total=total, done=done) -> None:
            done[0] += 1
            progress(task, done[0], total, None)

        progress(task, 0, total, None)
        try:
            results.append(measure(cand, work, conf, useful_flops=useful, peak=peak,
                                   on_step=step))  # fmt: skip
            placed.add(cand.strategy)
        except ValueError as e:  # a strategy the model or mesh cannot take: say why
            skipped.append(Skipped(cand, f"{type(e).__name__}: {e}"))
            progress(task, done[0], total, "skipped")
    result = Comparison(
        family, size, work.param_count(), conf,
        {"count": len(devices), "platform": devices[0].platform, "kind": devices[0].device_kind},
        peak, useful, unsplit, budget, todo, results, skipped, time.perf_counter() - started,
    )  # fmt: skip
    try:
        result.recommendation = recommend(results, unsplit, memory_budget=budget,
                                          simulated=devices[0].platform == "cpu")  # fmt: skip
    except CompareError as e:
        e.comparison = result  # what was measured, for the caller to show
        raise
    return result


def _batch_text(conf: CompareConfig) -> str:
    return f"{conf.batch} x {conf.seq} tokens" if conf.seq else f"{conf.batch} samples"


def _workload(model: Any, size: str | None, cfg: Any) -> Workload:
    if isinstance(model, Workload):
        if size is not None or cfg is not None:
            raise CompareArgumentError(
                f"--size/cfg configure a shipped family; {model.name!r} is a Workload: build it "
                f"at the size you want instead"
            )
        return model
    if not all(hasattr(model, a) for a in ("NAME", "Model", "loss", "config", "SIZES")):
        raise CompareArgumentError(
            f"--model {model!r}: compare takes a sharding.Workload or a model family module "
            f"(e.g. models.llama, models.cnn)"
        )
    if cfg is None:
        if (size or "tiny") not in model.SIZES:
            raise CompareArgumentError(
                f"--size {size!r}: unknown {model.NAME} size; sizes: {', '.join(model.SIZES)}"
            )
        cfg = model.config(size or "tiny")
    return Workload.from_family(model, cfg)


def _names(work: Workload) -> tuple[str, str]:
    """(model, size) for tables and JSON: the family and its size, or the workload's name."""
    if work.family is not None:
        return work.family.NAME, work.config.name
    return work.name, "-"


def _check(work: Workload, batch, seq, dtype, timed_steps, warmup_steps) -> int | None:
    sequences = work.seq is not None
    if not sequences and seq is not None:
        raise CompareArgumentError(
            f"--seq {seq!r}: {' '.join(_names(work)).rstrip(' -')} has no sequence axis (its batch is "
            f"{', '.join(work.batch_shapes(1, None))}); drop --seq"
        )
    seq = (DEFAULT_SEQ if seq is None else seq) if sequences else None
    counts = (("--batch", batch, 1), ("--timed-steps", timed_steps, 1),
              ("--warmup-steps", warmup_steps, 0)) + ((("--seq", seq, 1),) if sequences else ())  # fmt: skip
    for flag, value, low in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CompareArgumentError(f"{flag} {value!r}: give a whole number >= {low}")
    limit = getattr(work.config, "max_seq_len", None)
    if sequences and limit is not None and seq > limit:
        raise CompareArgumentError(
            f"--seq {seq}: {' '.join(_names(work))} holds at most {limit} positions; use --seq "
            f"{limit} or less"
        )
    if dtype not in DTYPES:
        raise CompareArgumentError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return seq


def _positive(value: Any) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value) and value > 0


def _bytes(memory: int | str) -> int:
    try:
        value = parse_bytes(memory) if isinstance(memory, str) else memory
    except SizeFormatError as e:
        raise CompareArgumentError(f"--memory {memory!r}: {e}") from None
    if not _positive(value):
        raise CompareArgumentError(
            f"--memory {memory!r}: give the memory per device, more than 0 bytes, e.g. "
            f"--memory 80GB"
        )
    return int(value)


__all__ = ["Comparison", "check_output", "compare"]
