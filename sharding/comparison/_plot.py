"""The PNG of `spmdkit compare`: each candidate's predicted step, split, and its memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sharding._units import fmt_bytes
from sharding.comparison._evaluate import Candidate

__all__ = ["plot"]


def plot(
    cands: list[Candidate], path: Path, *, title: str, target: Any, budget: int,
    best: Candidate | None, measured: bool = False,
) -> Path:  # fmt: skip
    """Two panels sharing the candidate axis (ranked order): the step time on the target, split
    into compute, exposed communication and bubble (measured time marked on real devices), and
    the memory each compiled step allocates per device against the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c.label}\n{c.mesh}" for c in cands]
    rows = range(len(cands))
    # Constrained layout keeps the 2-line title clear of the panels at any height.
    fig, (ax_t, ax_m) = plt.subplots(
        1, 2, figsize=(14, 0.42 * len(cands) + 2.4), sharey=True, layout="constrained"
    )
    left = [0.0] * len(cands)
    for name, color, part in (("compute", "tab:blue", lambda c: c.predicted.compute_s),
                              ("exposed communication", "tab:orange",
                               lambda c: c.predicted.exposed_comm_s),
                              ("bubble", "tab:gray", lambda c: c.predicted.bubble_s)):  # fmt: skip
        values = [part(c) * 1e3 for c in cands]
        ax_t.barh(rows, values, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    for i, c in enumerate(cands):
        ax_t.text(left[i], i, f" {left[i]:.3g}", va="center", fontsize=7)
        if measured and c.measured_step_s is not None:
            ax_t.plot(c.measured_step_s * 1e3, i, "k|", markersize=12)
    ax_t.set_xlim(0, max(left, default=0) * 1.15 or 1)  # room for the labels
    ax_t.set_title(f"step time on {target.name} (ms, {'measured |' if measured else 'predicted'})",
                   fontsize=10)  # fmt: skip
    # Rows run fastest first, so the top right is where the bars leave room.
    ax_t.legend(fontsize=7, loc="upper right")
    # Memory on a log axis, each bar labelled: a tiny model's MiB and an 80 GiB budget, or
    # candidates a hundred times apart, stay readable side by side.
    mem = [max(c.memory_bytes, 1) / 2**20 for c in cands]
    floor = min([*mem, budget / 2**20]) / 4
    colors = ["tab:green" if c.memory_bytes <= budget else "tab:red" for c in cands]
    ax_m.barh(rows, [m - floor for m in mem], left=floor, color=colors)
    ax_m.set_xscale("log")
    ax_m.set_xlim(floor, max([*mem, budget / 2**20]) * 4)
    for i, c in enumerate(cands):
        ax_m.text(mem[i], i, f" {fmt_bytes(c.memory_bytes)}", va="center", fontsize=7)
    ax_m.axvline(budget / 2**20, color="black", linestyle="--", linewidth=1)
    ax_m.set_title(f"memory / device (MiB, log scale); dashed: budget {fmt_bytes(budget)}",
                   fontsize=10)  # fmt: skip
    for ax in (ax_t, ax_m):
        ax.grid(axis="x", alpha=0.3)
    ax_t.set_yticks(list(rows), labels, fontsize=7)
    ax_t.invert_yaxis()
    if best is not None and best in cands:
        i = cands.index(best)
        ax_t.get_yticklabels()[i].set_fontweight("bold")
    pick = "none fits" if best is None else f"recommended: {best.label} on {best.mesh}"
    how = ("measured on these devices" if measured else
           "predicted from each compiled program, not measured")  # fmt: skip
    fig.suptitle(f"spmdkit compare: {title} on {target.describe().split(';')[0]}\n{pick} "
                 f"(times {how})", fontsize=10)  # fmt: skip
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
