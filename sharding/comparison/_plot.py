"""The PNG of `spmdkit compare`: speed, memory and traffic of each strategy side by side."""

from __future__ import annotations

from pathlib import Path

from sharding._mesh import mesh_text
from sharding.comparison._measure import Result

__all__ = ["plot"]


def plot(results: list[Result], path: Path, *, title: str = "") -> Path:
    """Three bar panels sharing the strategy axis: step time, memory per device (what the compiled
    step allocates, its train-state part darker), collective bytes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.candidate.label}\n{mesh_text(r.mesh_sizes)}" for r in results]
    panels = [
        ("step time (ms)", [r.step_time_s * 1e3 for r in results], "tab:blue"),
        ("memory / device (MiB): train state (dark) + rest of the step",
         [(r.peak_bytes or r.state_bytes) / 2**20 for r in results], "tab:olive"),
        ("collective bytes / device / step (MiB)",
         [r.collective_bytes / 2**20 for r in results], "tab:orange"),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.45 * len(results) + 1.8), sharey=True)
    best = min(range(len(results)), key=lambda i: results[i].step_time_s)
    for ax, (name, values, color) in zip(axes, panels, strict=True):
        bars = ax.barh(range(len(values)), values, color=color)
        bars[best].set_edgecolor("black")
        bars[best].set_linewidth(1.5)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.3g}", va="center", fontsize=7)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[1].barh(range(len(results)), [r.state_bytes / 2**20 for r in results], color="tab:green")
    fig.suptitle(f"spmdkit compare: {title} (outlined: fastest)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
