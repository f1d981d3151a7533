"""Rank layouts for a model on a target: the search behind `spmdkit plan`.

Every layout is priced by the one step-time model (`step_time` on a `sharding.targets.Target`),
fed one of two ways:

- `candidates`, for the language-model families with closed forms: every layout `layouts(...,
  search=True)` lists (each factorisation of the devices over the axes a strategy uses, with
  what the model calls for, `called_for`; pipelines under `SEARCH_SCHEDULES`), remat none, dots
  and full, predicted by `predict`, priced by `work_from_prediction`; nothing compiles (70B: 1 s).
- `compiled_candidates`, for any other workload: a few layouts per strategy (`few_layouts`) are
  compiled ahead of time for the target's device count from abstract shapes and priced from the
  compiled program, by compare's own path (`sharding.comparison.evaluate`).

`check_candidate` compiles one closed-form estimate the same way and keeps both predictions side
by side (`Check`): how far the formula is from the program XLA really builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from partition_rules import composition
from sharding._resolve import RuleError
from sharding._shardings import OptimizerSplitError
from sharding._units import fmt_bytes
from sharding._workload import Workload
from sharding.costmodel._batching import micro_steps
from sharding.costmodel._layouts import Layout, called_for, layouts, strategy_names
from sharding.costmodel._predict import CostModelError, Prediction, predict
from sharding.costmodel._steptime import MEMORY_FRACTION, StepTime, step_time
from sharding.costmodel._stepwork import work_from_prediction
from sharding.pipeline import PipelineConfigError, ScheduleError
from sharding.targets import Target, target

# Searched beside the strategies once the sequence is long enough for context parallelism.
LONG_COMPOSITION = "fsdp+tp+sp+cp+pp"
# The closed-form search tries every policy; compiled layouts run "none".
REMATS = ("none", "dots", "full")
# The most layouts `compiled_candidates` compiles for one workload (each is a full AOT compile).
MAX_COMPILES = 16


class NoFittingStrategyError(CostModelError):
    """No (strategy, mesh) keeps the model within the device memory."""


class NoValidLayoutError(CostModelError):
    """No strategy's rules divide the model on any factorisation of the devices."""


def _rel(formula: float | None, compiled: float | None) -> float | None:
    if formula is None or compiled is None or compiled == 0:
        return None
    return (formula - compiled) / compiled


@dataclass
class Check:
    """A closed-form estimate beside its compiled program, both priced on the target at ``dtype``.

    ``rate`` is the matmul FLOP/s per device the step time charged (peak x matmul fraction), so
    the compiled program's critical-path FLOPs are its matmul and bubble seconds times it.
    """

    dtype: str
    formula: StepTime
    formula_flops: float
    prediction: Prediction
    compiled: Any  # sharding.comparison.Candidate
    rate: float

    def pairs(self) -> dict[str, tuple[float | None, float | None]]:
        """(formula, compiled) per figure: step split, collective bytes, FLOPs, memory."""
        f, c = self.formula, self.compiled.predicted
        return {
            "step_s": (f.step_s, c.step_s),
            "compute_s": (f.compute_s, c.compute_s),
            "exposed_comm_s": (f.exposed_comm_s, c.exposed_comm_s),
            "bubble_s": (f.bubble_s, c.bubble_s),
            "collective_bytes": (
                self.prediction.collective_bytes(),
                self.compiled.collective_bytes,
            ),
            "matmul_flops": (self.formula_flops, (c.matmul_s + c.bubble_s) * self.rate),
            "memory_bytes": (self.prediction.memory_bytes, self.compiled.allocated),
        }

    def errors(self) -> dict[str, float | None]:
        """(formula - compiled) / compiled per figure; None where the compiled one is 0 or unknown."""
        return {k: _rel(f, c) for k, (f, c) in self.pairs().items()}

    def to_dict(self) -> dict[str, Any]:
        pairs = self.pairs()
        return {
            "dtype": self.dtype,
            "compile_time_s": self.compiled.compile_time_s,
            "formula": {k: f for k, (f, _) in pairs.items()},
            "compiled": {k: c for k, (_, c) in pairs.items()},
            "error": self.errors(),
        }


@dataclass
class Estimate:
    """One layout at one remat policy, priced on the target.

    ``predicted`` is its step there: from the closed form when ``prediction`` is set, else from
    its compiled program (``candidate``, a `sharding.comparison.Candidate`). ``check`` holds the
    compiled program beside a closed-form estimate once `check_candidate` ran.
    """

    layout: Layout
    remat: str
    predicted: StepTime
    memory_bytes: int
    fits: bool
    collective_bytes: float
    prediction: Prediction | None = None
    candidate: Any = None
    check: Check | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        return "formula" if self.prediction is not None else "compiled program"

    @property
    def accum(self) -> int:
        """Micro-steps per step (gradient accumulation)."""
        if self.prediction is not None:
            return self.prediction.accum
        return getattr(self.candidate, "accum", 1)

    @property
    def micro_batch(self) -> int | None:
        """Rows per device per forward pass (Megatron's micro-batch size); None if unknown."""
        return None if self.prediction is None else self.prediction.micro_batch

    @property
    def step_s(self) -> float:
        return self.predicted.step_s

    @property
    def mesh_text(self) -> str:
        return self.layout.mesh

    @property
    def label(self) -> str:
        return self.layout.label

    def to_dict(self) -> dict[str, Any]:
        st = self.predicted
        return {
            "strategy": self.layout.strategy, "label": self.label, "mesh": self.layout.sizes,
            "pipeline": None if self.layout.schedule is None else {
                "schedule": self.layout.schedule, "microbatches": self.layout.microbatches,
                "repeats": self.layout.repeats},
            "remat": self.remat, "source": self.source, "fits": self.fits,
            "global_batch": None if self.prediction is None else self.prediction.batch,
            "micro_batch": self.micro_batch, "accum": self.accum,
            "memory_bytes": self.memory_bytes, "collective_bytes": self.collective_bytes,
            "bytes_by_kind": None if self.prediction is None else self.prediction.bytes_by_kind(),
            "step_s": st.step_s, "compute_s": st.compute_s, "exposed_comm_s": st.exposed_comm_s,
            "comm_s": st.comm_s, "bubble_s": st.bubble_s, "throughput": st.throughput,
            "throughput_per_device": st.throughput_per_device, "unit": st.unit, "mfu": st.mfu,
            "warnings": st.warnings, "check": None if self.check is None else self.check.to_dict(),
            "notes": self.notes,
        }  # fmt: skip


def memory_budget(tgt: Target, memory_bytes: int | None = None) -> int:
    """Bytes a step may fill per device: ``memory_bytes``, else `MEMORY_FRACTION` of the HBM."""
    return int(MEMORY_FRACTION * tgt.device.hbm_bytes) if memory_bytes is None else memory_bytes


def candidates(
    family: Any,
    cfg: Any,
    tgt: Target | str,
    batch: int,
    seq: int,
    *,
    strategies: str | tuple[str, ...] | None = None,
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    memory_bytes: int | None = None,
    attention: str = "auto",
    accum: int | None = None,
    micro_batch: int | None = None,
    rejected: list[dict] | None = None,
) -> list[Estimate]:
    """Every valid layout of a language-model family on ``tgt``, from the closed forms: fitting
    ones first by predicted step time, then the rest by memory. ``rejected``, a list, receives
    ``{"layout", "mesh", "reason"}`` for each layout searched and not priced (`_pruned`, or the
    closed form's error: a rule that does not divide, a batch that does not split).

    The global ``batch`` is searched as micro-steps (`micro_steps`): per layout and remat
    policy, the smallest accumulation that fits (each extra micro-step re-gathers fsdp's weights
    and reduces the gradients again); ``accum`` and ``micro_batch`` (rows per device per
    forward pass) pin them.

    Raises:
        NoValidLayoutError: nothing divides (names the strategies tried).
        NoFittingStrategyError: layouts exist but none fits; says the smallest memory needed.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> ranked = candidates(llama, "7b", "h100:1x8", 8, 1024)  # doctest: +SKIP
        >>> ranked[0].fits, ranked[0].label  # doctest: +SKIP
        (True, 'fsdp')
    """
    tgt = target(tgt)
    if isinstance(cfg, str):
        cfg = family.config(cfg)
    budget = memory_budget(tgt, memory_bytes)
    # Useful work for MFU, the same for every layout: the unsplit step without recompute.
    useful = predict(family, cfg, "dp", {}, batch, seq, dtype=dtype, optimizer=optimizer,
                     attention=attention)  # fmt: skip
    out: list[Estimate] = []
    extra = called_for(Workload.from_family(family, cfg), seq)  # long sequence, experts
    if "cp" in extra:  # every split at once, as the longest runs lay out (Llama 3 405B at 128K)
        extra = (*extra, LONG_COMPOSITION)
    for layout in layouts(tgt.devices, cfg.n_layers, strategies=strategies, search=True,
                          batch=batch, extra=extra, rejected=rejected):  # fmt: skip
        why = _pruned(layout, tgt)
        found = False
        for remat in REMATS if why is None else ():
            for k, run in micro_steps(layout, batch, accum=accum, micro_batch=micro_batch):
                try:
                    pred = predict(family, cfg, run.strategy, run.sizes, batch, seq,
                                   pipeline=run.pipeline(), dtype=dtype, optimizer=optimizer,
                                   remat=remat, attention=attention, accum=k)  # fmt: skip
                except (CostModelError, OptimizerSplitError, PipelineConfigError, RuleError,
                        ScheduleError) as e:  # fmt: skip
                    why = _reason(e)
                    continue
                st = step_time(work_from_prediction(pred, model_flops=useful.matmul_flops), tgt)
                fits = pred.memory_bytes <= budget
                out.append(Estimate(run, remat, st, pred.memory_bytes, fits,
                                    pred.collective_bytes(), prediction=pred))  # fmt: skip
                found = True
                if fits:
                    break
        if rejected is not None and not found:
            pinned = " at the pinned --accum / --micro-batch" if accum or micro_batch else ""
            why = why or (f"the global batch {batch} does not split over the mesh's batch "
                          f"axes (data x fsdp x expert) in whole rows{pinned}")  # fmt: skip
            rejected.append({"layout": layout.label, "mesh": layout.mesh, "reason": why})
    return rank_estimates(out, f"{family.NAME} {cfg.name}", tgt, batch, f"batch {batch} x seq {seq}, "
                 f"{dtype}", strategies, budget)  # fmt: skip


def _reason(err: Exception) -> str:
    """An error's first lines, one line of at most 300 characters (a rule error's first line
    only says how many parameters did not place; the next names one)."""
    text = " ".join(line.strip() for line in str(err).splitlines()[:3] if line.strip())
    return text if len(text) <= 300 else text[:297] + "..."


def _pruned(layout: Layout, tgt: Target) -> str | None:
    """Why a layout is not worth predicting, or None: tensor parallelism across nodes (its
    reductions run in every layer, over the inter-node links). Layouts that do not fit are
    priced all the same, ranked after the fitting ones."""
    sz = layout.sizes
    if sz["tensor"] > 1 and not tgt.topology(sz).group(("tensor",)).inside_node:
        return (f"tensor={sz['tensor']} spans nodes of {tgt.per_node}: its per-layer "
                f"reductions would cross the inter-node links")  # fmt: skip
    return None


def rank_estimates(out: list[Estimate], what: str, tgt: Target, batch: int, setting: str,
          strategies: Any, budget: int) -> list[Estimate]:  # fmt: skip
    if not out:
        raise NoValidLayoutError(
            f"{what}: no strategy of {', '.join(strategy_names(strategies))} places the model on "
            f"any factorisation of {tgt.devices} devices ({tgt.name}) with batch {batch} (the "
            f"rules must divide every split dimension and data x fsdp must divide the batch); "
            f"try another --target size or --batch"
        )
    fitting = sorted((c for c in out if c.fits), key=lambda c: (c.step_s, c.memory_bytes))
    if not fitting:
        best = min(out, key=lambda c: c.memory_bytes)
        raise NoFittingStrategyError(
            f"{what} ({setting}) fits no strategy on {tgt.name} at {fmt_bytes(budget)} per "
            f"device: the smallest per-device memory any layout needs is "
            f"{fmt_bytes(best.memory_bytes)} ({best.label} on {best.mesh_text}, remat "
            f"{best.remat}); use devices with at least that much memory (--target, --memory), "
            f"more devices, or a smaller --batch / --seq"
        )
    return fitting + sorted((c for c in out if not c.fits), key=lambda c: c.memory_bytes)


def few_layouts(found: list[Layout], per_node: int, limit: int = MAX_COMPILES) -> list[Layout]:
    """The layouts `compiled_candidates` compiles: per strategy the least and the most split
    mesh (tensor kept within a node of ``per_node`` where possible), pipelines at their fewest
    stages under each schedule; at most ``limit``, in `ORDER`, over the limit dropping the
    zero1 compositions first (their programs differ from their bases' in the optimizer update
    alone), then the interleaved pipelines, zb-h1's, 1f1b's and gpipe's.

    Example:
        >>> found = layouts(8, 4, strategies="fsdp,pp", search=True, batch=8)
        >>> [f"{x.label} {x.mesh}" for x in few_layouts(found, 8)]  # doctest: +NORMALIZE_WHITESPACE
        ['fsdp data=4,fsdp=2', 'fsdp fsdp=8', 'pp gpipe m=2 stage=2,data=4',
         'pp 1f1b m=2 stage=2,data=4', 'pp interleaved m=2 r=2 stage=2,data=4',
         'pp zb-h1 m=2 stage=2,data=4']
    """
    groups: dict[tuple[str, str | None], list[Layout]] = {}
    for x in found:  # tp and dp_tp are one strategy family in the search (tp with data > 1)
        groups.setdefault(("tp" if x.strategy == "dp_tp" else x.strategy, x.schedule), []).append(x)

    def split(x: Layout) -> int:
        return math.prod(n for a, n in x.sizes.items() if a != "data")

    out: list[Layout] = []
    for (_, schedule), group in groups.items():
        inside = [x for x in group if x.sizes["tensor"] <= per_node] or group
        least = min(inside, key=lambda x: (split(x), x.sizes["tensor"], x.sizes["stage"]))
        most = max(inside, key=lambda x: (split(x), -x.sizes["tensor"], -x.sizes["stage"]))
        out += [least] if schedule is not None or most == least else [least, most]
    rank = {s: i for i, s in enumerate(("gpipe", "1f1b", "zb-h1", "interleaved"))}

    def drop(x: Layout) -> int:  # zero1's program differs from its base's in the update alone
        return len(rank) if "zero1" in composition(x.strategy).parts else rank.get(x.schedule, -1)

    keep = sorted(range(len(out)), key=lambda i: (drop(out[i]), i))[:limit]
    return [out[i] for i in sorted(keep)]


__all__ = [
    "MAX_COMPILES",
    "Check",
    "Estimate",
    "NoFittingStrategyError",
    "NoValidLayoutError",
    "candidates",
    "few_layouts",
    "memory_budget",
    "rank_estimates",
]
