"""The comparison table in the guides' terms, and a recommendation built from its own figures.

Every sentence quotes values of the table's rows (the same objects the table prints), so the
words cannot contradict the numbers: "fastest" is the minimum of the ranked column over the rows
that fit, "moves the least" the minimum of the bytes column, and so on. Times are the step
predicted for the target from each compiled program; on real devices, the measured step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rich.table import Table

from sharding._units import fmt_bytes, fmt_count
from sharding.comparison._errors import NoStrategyFitsError, NothingMeasuredError
from sharding.comparison._evaluate import Candidate
from sharding.costmodel import CollectiveWork, StepTime, error_to_expect, step_time
from sharding.targets import Target

__all__ = ["Recommendation", "comparison_table", "rank", "recommend", "scaled"]

_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
          "all-to-all": "A2A", "collective-permute": "CP"}  # fmt: skip


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _share(x: float) -> str:
    return f"{x:.2%}" if x >= 1e-4 else "under 0.01%"


def time_of(c: Candidate, measured: bool) -> float:
    """The ranked time: measured on real devices, else predicted for the target."""
    return c.measured_step_s if measured and c.measured_step_s is not None else c.step_s


def rank(cands: list[Candidate], budget: int, *, measured: bool = False) -> list[Candidate]:
    """Those that fit ``budget`` bytes per device by time, then the rest by memory."""
    fits = sorted((c for c in cands if c.memory_bytes <= budget),
                  key=lambda c: time_of(c, measured))  # fmt: skip
    rest = sorted((c for c in cands if c not in fits), key=lambda c: c.memory_bytes)
    return fits + rest


def _comm(c: Candidate) -> str:
    """Total bytes, and the collective that moves the most (kind and axes)."""
    if not c.collectives:
        return "none"
    top = max(c.collectives, key=lambda r: r["bytes"])
    more = f" +{len(c.collectives) - 1}" if len(c.collectives) > 1 else ""
    return (f"{fmt_bytes(c.collective_bytes)}\n{_SHORT[top['kind']]} "
            f"{','.join(top['axes']) or '-'}{more}")  # fmt: skip


def comparison_table(
    cands: list[Candidate], unsplit_state: int, budget: int, *, measured: bool, target: Target
) -> Table:
    """One row per candidate, ranked: what is split, what moves, memory, predicted time split."""
    unit = cands[0].unit
    when = "measured" if measured else f"predicted on {target.name}"
    table = Table(title=f"candidates, ranked by step time {when} (per device, per step)",
                  title_justify="left")  # fmt: skip
    here = any(c.measured_s for c in cands)
    cols = ["#", "candidate", "splits", "traffic", "state", "memory", "fits", "step",
            "comp+comm+bub", f"{'tok' if unit == 'tokens' else 'smp'}/s/dev", "MFU"]  # fmt: skip
    cols += (["measured"] if measured else ["here"]) if here else []
    for col in [*cols, "compile"]:
        left = col in ("candidate", "splits", "traffic")
        table.add_column(col, justify="left" if left else "right", no_wrap=col != "splits")
    for i, c in enumerate(rank(cands, budget, measured=measured), 1):
        p, fits = c.predicted, c.memory_bytes <= budget
        parts = "+".join(f"{x * 1e3:.2g}" for x in (p.compute_s, p.exposed_comm_s, p.bubble_s))
        row = [
            str(i), f"{c.label}\n[dim]{c.mesh} mb {c.micro_batch}x{c.accum}[/]", c.split, _comm(c),
            f"{fmt_bytes(c.state_bytes)}\n{c.state_bytes / unsplit_state:.2f}x",
            fmt_bytes(c.memory_bytes), "yes" if fits else "[red]no[/]",
            _ms(time_of(c, measured)), parts, fmt_count(p.throughput_per_device),
            "-" if p.mfu is None else f"{p.mfu:.1%}",
        ]  # fmt: skip
        if here:
            m = c.measured_step_s
            row.append(_ms(m) + (f"\npred {p.step_s / m - 1:+.0%}" if measured and m else ""))
        table.add_row(*row, f"{c.compile_time_s:.1f} s",
                      style="bold green" if i == 1 and fits else None)  # fmt: skip
    table.caption = (
        f"splits: the axes the batch and the weights are split over (from the compiled "
        f"shardings); mb RxK under each candidate: R rows per device per forward pass, K "
        f"accumulation micro-steps (global batch {cands[0].batch}); traffic: collective bytes per device per step and the largest (AR "
        f"all-reduce, AG all-gather, RS reduce-scatter, CP permute); train state = params + "
        f"optimizer state per device (x: of the unsplit {fmt_bytes(unsplit_state)}); memory = "
        f"what the compiled step needs per device (the target compiler's peak; XLA:CPU's "
        f"allocation), fits = within {fmt_bytes(budget)}; "
        f"comp+comm+bub: compute, communication exposed after overlap and bubble, in ms"
        + ("; here = steps timed on this host's simulated devices (a sanity check, not a "
           "prediction: they share its cores)" if here and not measured else "")
    )  # fmt: skip
    table.caption_justify = "left"
    return table


def scaled(c: Candidate, target: Target, factor: int = 2) -> tuple[str, Target, StepTime] | None:
    """The same layout on ``factor`` x the devices, the global batch unchanged, by the same
    model: the batch axis (fsdp, else data) grows; per-device compute, the non-matmul operations'
    memory traffic and activation traffic shrink with the rows each device holds, weight and
    gradient traffic per device stays.

    Returns (what changed, the larger target, its predicted step), or None when the batch does
    not split over the larger axis.
    """
    work, sizes = c.predicted_work, dict(c.predicted_work.mesh)
    axis = "fsdp" if sizes.get("fsdp", 1) > 1 else "data"
    new = {**sizes, axis: sizes.get(axis, 1) * factor}
    split = math.prod(new.get(a, 1) for a in ("data", "fsdp"))
    if c.batch % (split * c.accum * (c.layout.microbatches or 1)):
        return None
    weights = {"data", "fsdp"}

    def collective(x: CollectiveWork) -> CollectiveWork:
        per_row = x.kind == "collective-permute" or not set(x.axes or ()) <= weights
        return dataclasses.replace(x, bytes=x.bytes / factor) if per_row else x

    bigger = dataclasses.replace(
        work, mesh=new, matmul_flops=work.matmul_flops / factor,
        bubble_flops=work.bubble_flops / factor,
        # the optimizer's share follows the train state (split by fsdp only), the non-matmul
        # operations' the rows each device runs
        memory_bound_bytes=(work.memory_bound_bytes - work.elementwise_bytes)
        / (factor if axis == "fsdp" else 1) + work.elementwise_bytes / factor,
        elementwise_bytes=work.elementwise_bytes / factor,
        collectives=[collective(x) for x in work.collectives], memory_bytes=None,
    )  # fmt: skip
    devices = target.devices * factor
    per = target.per_node if devices > target.per_node else devices
    tgt = Target(f"{target.device.name.lower()}:{devices // per}x{per}", target.device,
                 devices // per, per)  # fmt: skip
    return f"{axis} {sizes.get(axis, 1)} -> {new[axis]}", tgt, step_time(bigger, tgt)


@dataclass
class Recommendation:
    """The candidate chosen, and one sentence per figure that backs the choice."""

    best: Candidate
    lines: list[str]

    def to_dict(self) -> dict:
        return {"candidate": self.best.label, "mesh": self.best.mesh, "dtype": self.best.dtype,
                "remat": self.best.remat, "accum": self.best.accum, "reasons": self.lines}  # fmt: skip


def recommend(
    cands: list[Candidate], unsplit_state: int, budget: int, target: Target, *,
    measured: bool = False, simulated: bool = True,
) -> Recommendation:  # fmt: skip
    """The fastest candidate that fits, and why, in the guides' terms, from the table's values."""
    if not cands:
        raise NothingMeasuredError(
            "nothing was compiled: every layout was skipped (reasons above); try other "
            "--strategies, --target or --mesh"
        )
    ranked = rank(cands, budget, measured=measured)
    fits = [c for c in ranked if c.memory_bytes <= budget]
    if not fits:
        least = ranked[0]
        raise NoStrategyFitsError(
            f"no candidate fits {fmt_bytes(budget)} per device on {target.name}; the least, "
            f"{least.label} on {least.mesh}, needs {fmt_bytes(least.memory_bytes)}: use a target "
            f"with more devices or memory, a smaller --batch, or --remat full"
        )
    best, t = fits[0], (lambda c: time_of(c, measured))
    p, how = best.predicted, "measured" if measured else "predicted"
    mfu = "" if p.mfu is None else f", MFU {p.mfu:.1%}"
    lines = [
        f"{best.label} on {best.mesh}: the fastest {how} step on {target.name} of the "
        f"{len(fits)} candidates that fit {fmt_bytes(budget)} per device: {_ms(t(best))} "
        f"(predicted compute {_ms(p.compute_s)} + exposed communication "
        f"{_ms(p.exposed_comm_s)} + bubble {_ms(p.bubble_s)}), "
        f"{fmt_count(p.throughput_per_device)} {best.unit}/s per device{mfu}, "
        f"{fmt_bytes(best.memory_bytes)} per device."
    ]
    if not measured:
        lines.append(error_to_expect(best.mesh_sizes))
    hbm = target.device.hbm_bytes
    one = unsplit_state <= budget
    lines.append(
        f"Does the model fit one device? Its unsplit train state is {fmt_bytes(unsplit_state)}, "
        f"{_share(unsplit_state / hbm)} of one {target.device.name}'s {fmt_bytes(hbm)}: "
        + ("it fits, so the guides' first choice is data parallelism (replicate the weights, "
           "split the batch)." if one else "it does not, so the weights must be split (fsdp, "
           "tp or pp) before the batch is.")
    )  # fmt: skip
    dp = [c for c in fits if c.layout.strategy == "dp"]
    if one and dp and dp[0] is not best:
        d = dp[0]
        parts = {"compute": (d.predicted.compute_s, p.compute_s),
                 "exposed communication": (d.predicted.exposed_comm_s, p.exposed_comm_s),
                 "bubble": (d.predicted.bubble_s, p.bubble_s)}  # fmt: skip
        worst = max(parts, key=lambda k: parts[k][0] - parts[k][1])
        lines.append(
            f"Here dp ({d.label}) is {_ms(t(d))}, {t(d) / t(best) - 1:+.0%}: its {worst} is "
            f"{_ms(parts[worst][0])} against {_ms(parts[worst][1])}."
        )
    elif one and dp:
        lines.append("And dp is the fastest here too.")
    moved = sorted(p.collectives, key=lambda x: -x.time_s)[:3]
    if moved:
        said = [
            f"{x.kind} of {fmt_bytes(x.bytes)} over {','.join(x.axes or ('?',))} ({x.group} "
            f"devices, {x.link}, {'inside a node' if x.inside_node else 'across nodes'}) in "
            f"{x.count} op(s): {_ms(x.time_s)}, {_ms(x.exposed_s)} exposed"
            for x in moved
        ]
        lines.append("What it communicates per step: " + "; ".join(said) + ".")
    if len(fits) > 1:
        r = fits[1]
        lines.append(f"Next: {r.label} on {r.mesh} ({_ms(t(r))}, {t(r) / t(best) - 1:+.0%}).")
    lean = min(fits, key=lambda c: (c.memory_bytes, t(c)))
    if lean is not best:
        lines.append(
            f"If memory per device binds: {lean.label} needs the least "
            f"({fmt_bytes(lean.memory_bytes)}, train state {lean.state_bytes / unsplit_state:.2f}x "
            f"the unsplit model) at {_ms(t(lean))} ({t(lean) / t(best) - 1:+.0%})."
        )
    quiet = min(fits, key=lambda c: c.collective_bytes)
    loud = max(fits, key=lambda c: c.collective_bytes)
    if loud is not quiet:
        lines.append(
            f"Traffic: {quiet.label} moves the least ({fmt_bytes(quiet.collective_bytes)} per "
            f"device per step), {loud.label} the most ({fmt_bytes(loud.collective_bytes)})."
        )
    grown = scaled(best, target)
    if grown is not None:
        change, bigger, st = grown
        gain = (st.throughput / p.throughput) if p.throughput else float("nan")
        lines.append(
            f"Scaling, by the same model: on {bigger.devices} devices ({bigger.name}, {change}, "
            f"same global batch) the step would take {_ms(st.step_s)}: {gain:.2f}x the "
            f"throughput ({gain / 2:.0%} scaling efficiency)."
        )
    pipes = [c for c in fits if c.bubble is not None][:2]  # the two fastest pipelines
    if pipes:
        lines.append("Pipeline bubble, fastest pipelines: " + "; ".join(
            f"{c.label} idles {c.bubble:.0%} of its ticks: {_ms(c.predicted.bubble_s)} of "
            f"{_ms(t(c))}" for c in pipes) + ".")  # fmt: skip
    lines += [f"Warning: {w}" for w in p.warnings]
    if simulated:
        here = any(c.measured_s for c in cands)
        lines.append(
            f"Times are predicted for {target.name} from each compiled program (the assumptions "
            f"are in compare.json), not measured"
            + ("; the 'here' column times this host's simulated devices, which share its "
               "cores: a sanity check, never the ranking." if here else ".")
        )  # fmt: skip
    elif measured:
        lines.append(f"Ranked by the time measured on these {target.devices} devices; the "
                     f"prediction's error is beside each.")  # fmt: skip
    return Recommendation(best, lines)
