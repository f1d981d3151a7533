"""The comparison table in the guides' terms, and a recommendation that follows from it.

Every sentence of the recommendation quotes a measured figure; nothing here is a rule of thumb
that the numbers did not confirm on this model and these devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from partition_rules.strategies import DESCRIPTIONS
from sharding._mesh import mesh_text
from sharding._units import fmt_bytes, fmt_count
from sharding.comparison._errors import NoStrategyFitsError, NothingMeasuredError
from sharding.comparison._measure import Result

__all__ = ["Recommendation", "comparison_table", "recommend"]

_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
          "all-to-all": "A2A", "collective-permute": "CP"}  # fmt: skip


def _comm(r: Result) -> str:
    parts = [f"{_SHORT[k]} {fmt_bytes(v['bytes'])}" for k, v in r.collectives.items() if v["bytes"]]
    return "\n".join(parts) or "none"


def comparison_table(
    results: list[Result], unsplit_state: int, memory_budget: int | None = None
) -> Table:
    """One row per candidate: what is split, what moves, memory, speed, utilisation, bubble."""
    table = Table(title="strategies measured (per device, per step)", title_justify="left")
    cols = ["strategy / mesh", "splits", "communicates", "bytes/step", "train state",
            "memory", "step", f"{results[0].unit}/s", "MFU", "bubble", "compile", "loss@1"]  # fmt: skip
    if memory_budget is not None:
        cols.insert(6, "fits")
    for c in cols:
        left = c in cols[:3]
        table.add_column(c, justify="left" if left else "right", no_wrap=not left)
    best = min(r.step_time_s for r in results)
    for r in results:
        mesh = mesh_text(r.mesh_sizes)
        # What the strategy splits: the first clause of its description, in the guides' terms.
        splits = DESCRIPTIONS.get(r.candidate.strategy, r.candidate.strategy).split(";")[0]
        peak = r.peak_bytes or 0
        row = [
            f"{r.candidate.label}\n[dim]{mesh}[/]",
            splits,
            _comm(r),
            fmt_bytes(r.collective_bytes),
            f"{fmt_bytes(r.state_bytes)}\n{r.state_bytes / unsplit_state:.2f}x",
            fmt_bytes(peak) if r.peak_bytes is not None else "?",
            f"{r.step_time_s * 1e3:.1f} ms",
            fmt_count(r.tokens_per_s),
            "-" if r.mfu is None else f"{r.mfu:.1%}",
            "-" if r.bubble is None else f"{r.bubble:.0%}",
            f"{r.compile_time_s:.1f} s",
            f"{r.losses[0]:.5f}",
        ]
        if memory_budget is not None:
            row.insert(6, "yes" if peak <= memory_budget else "no")
        style = "bold green" if r.step_time_s == best else None
        table.add_row(*row, style=style)
    table.caption = (
        "train state = params + optimizer state on one device (x: of the unsplit model's "
        f"{fmt_bytes(unsplit_state)}); memory = what the compiled step allocates per device "
        "(arguments, outputs, temporaries); AR all-reduce, AG all-gather, "
        "RS reduce-scatter, CP collective-permute; loss@1 equal across rows = same numbers"
    )
    table.caption_justify = "left"
    return table


@dataclass
class Recommendation:
    """The layout chosen, and one sentence per figure that backs the choice."""

    best: Result
    lines: list[str]

    def to_dict(self) -> dict:
        return {"strategy": self.best.candidate.label, "mesh": self.best.candidate.mesh,
                "reasons": self.lines}  # fmt: skip


def recommend(
    results: list[Result], unsplit_state: int, *, memory_budget: int | None = None,
    simulated: bool = False,
) -> Recommendation:  # fmt: skip
    """Pick the fastest candidate that fits; explain the choice with the measured figures."""
    if not results:
        raise NothingMeasuredError(
            "nothing was measured: every layout was skipped (reasons above); try other "
            "--strategies, --devices or --mesh"
        )
    fits = [r for r in results if memory_budget is None or (r.peak_bytes or 0) <= memory_budget]
    if not fits:
        least = min(results, key=lambda r: r.peak_bytes or 0)
        raise NoStrategyFitsError(
            f"no strategy fits {fmt_bytes(memory_budget)} per device; the least, "
            f"{least.candidate.label} on {least.candidate.mesh}, needs "
            f"{fmt_bytes(least.peak_bytes or 0)}: use more devices or a larger --memory"
        )
    by_time = sorted(fits, key=lambda r: r.step_time_s)
    best = by_time[0]
    ms = lambda r: f"{r.step_time_s * 1e3:.1f} ms"  # noqa: E731
    lines = [
        f"{best.candidate.label} on {best.candidate.mesh}: the fastest step measured "
        f"({ms(best)}, {fmt_count(best.tokens_per_s)} {best.unit}/s), holding "
        f"{fmt_bytes(best.state_bytes)} of train state per device "
        f"({best.state_bytes / unsplit_state:.2f}x the unsplit model)."
    ]
    if len(by_time) > 1:
        runner = by_time[1]
        lines.append(
            f"Next: {runner.candidate.label} ({ms(runner)}, "
            f"{runner.step_time_s / best.step_time_s - 1:+.0%})."
        )
    lean = min(fits, key=lambda r: (r.peak_bytes or r.state_bytes, r.step_time_s))
    if lean is not best:
        lines.append(
            f"If memory per device is what binds: {lean.candidate.label} needs the least "
            f"({fmt_bytes(lean.peak_bytes or lean.state_bytes)} per device, train state "
            f"{fmt_bytes(lean.state_bytes)} = {lean.state_bytes / unsplit_state:.2f}x) at "
            f"{ms(lean)} per step ({lean.step_time_s / best.step_time_s - 1:+.0%})."
        )
    quiet = min(fits, key=lambda r: r.collective_bytes)
    loud = max(fits, key=lambda r: r.collective_bytes)
    if loud.collective_bytes:
        lines.append(
            f"Communication: {quiet.candidate.label} moves the least "
            f"({fmt_bytes(quiet.collective_bytes)}/step per device), {loud.candidate.label} the "
            f"most ({fmt_bytes(loud.collective_bytes)}/step): on slow links the gap widens."
        )
    pipes = [r for r in fits if r.bubble is not None]
    if pipes:
        parts = [f"{r.candidate.label} {r.bubble:.0%} idle ({ms(r)})" for r in pipes]
        lines.append("Pipeline bubbles: " + "; ".join(parts) + ".")
    if memory_budget is not None:
        dp = [r for r in results if r.candidate.strategy == "dp"]
        if dp and (dp[0].peak_bytes or 0) > memory_budget:
            lines.append(
                f"Replicated weights (dp) need {fmt_bytes(dp[0].peak_bytes or 0)} per device, "
                f"over the {fmt_bytes(memory_budget)} budget: data parallelism alone cannot "
                "hold this model."
            )
    if simulated:
        lines.append(
            "Caveat: these devices are simulated on one CPU host, so collectives are memory "
            "copies; bytes per step are what real links would carry, step times are not."
        )
    return Recommendation(best, lines)
