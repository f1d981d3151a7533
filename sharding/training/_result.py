"""`TrainResult`: what a training run did, with the one-screen summary `spmdkit train` prints."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from partition_rules import composition
from sharding._mesh import mesh_text
from sharding._units import fmt_bytes, fmt_count
from sharding.inspection import overlap_text
from sharding.training._errors import TrainingError


@dataclasses.dataclass
class TrainResult:
    """The outcome of `fit`: per-step records, the compiled program's facts, the final state.

    ``history`` holds one record per step trained (``step`` counts from 1; a resumed run starts
    after ``resumed_from``); ``batch``/``seq``/``accum`` are the values the run used (from the
    checkpoint or the elastic policy when resuming); ``report`` is the compiled step's
    `sharding.inspection.ProgramReport`; ``notes`` the messages about the run, in order.

    Example:
        >>> result = fit(models.llama, TrainConfig(steps=3, batch=8, seq=16))  # doctest: +SKIP
        >>> result.final_loss < result.history[0]["loss"]  # doctest: +SKIP
        True
        >>> rich.print(result.table())  # doctest: +SKIP
        >>> result.plot("loss.png")  # doctest: +SKIP
    """

    family: str
    size: str
    strategy: str
    mesh: dict[str, int]
    devices: int
    platform: str
    config: Any
    batch: int
    seq: int
    accum: int
    history: list[dict]
    resumed_from: int | None
    checkpoint_steps: list[int]
    notes: list[str]
    parameters: int
    param_bytes: int
    state_bytes: int
    report: Any = dataclasses.field(default=None, repr=False)
    program: Any = dataclasses.field(default=None, repr=False)
    state: Any = dataclasses.field(default=None, repr=False)

    @property
    def final_loss(self) -> float | None:
        """The loss of the last step trained (None when nothing was trained)."""
        return self.history[-1]["loss"] if self.history else None

    @property
    def median_step_time_s(self) -> float | None:
        """Median step time, leaving out the first step (it may still warm caches)."""
        if not self.history:
            return None
        timed = [h["step_time_s"] for h in self.history[1:]] or [self.history[0]["step_time_s"]]
        return statistics.median(timed)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for `json.dumps` (the program and the arrays of the state are left out)."""
        memory = None
        if self.report is not None and (m := self.report.memory) is not None:
            memory = {**dataclasses.asdict(m), "allocated": m.allocated}
        median = self.median_step_time_s
        return {
            "model": {"family": self.family, "size": self.size, "parameters": self.parameters},
            "strategy": self.strategy,
            "mesh": self.mesh,
            "devices": self.devices,
            "platform": self.platform,
            "config": self.config.to_dict(),
            "batch": self.batch,
            "seq": self.seq,
            "accum": self.accum,
            "resumed_from": self.resumed_from,
            "history": self.history,
            "checkpoint_steps": self.checkpoint_steps,
            "notes": self.notes,
            "param_bytes_per_device": self.param_bytes,
            "state_bytes_per_device": self.state_bytes,
            "memory_per_device": memory,
            "median_step_time_s": median,
            "tokens_per_s": None if median is None else self.batch * self.seq / median,
            "report": None if self.report is None else self.report.to_dict(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """`to_dict` as JSON text (strict: never a bare NaN)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def plot(self, path: str | os.PathLike) -> Path:
        """A PNG at ``path``: the loss and the gradient norm of every step trained."""
        if not self.history:
            raise TrainingError(
                f"this run trained no step (resumed at step {self.resumed_from}, --steps "
                f"{self.config.steps}), so there is no curve to plot; raise --steps"
            )
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [h["step"] for h in self.history]
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        for ax, key, color in zip(axes, ("loss", "grad_norm"), ("tab:blue", "tab:orange"),
                                  strict=True):  # fmt: skip
            ax.plot(steps, [h[key] for h in self.history], color=color, lw=1.2)
            ax.set_xlabel("step")
            ax.set_title(key.replace("_", " "), fontsize=10)
            ax.grid(alpha=0.3)
        fig.suptitle(
            f"spmdkit train: {self.family} {self.size}, {self.strategy} on "
            f"{mesh_text(self.mesh)}, batch {self.batch} x {self.seq}",
            fontsize=11,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return Path(path)

    def table(self) -> Group:
        """The one-screen summary: run, per-device sizes and memory, FLOPs, loss, speed, and the
        collectives of the step."""
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        mesh = mesh_text(self.mesh)
        grid.add_row("strategy", f"{self.strategy}: {composition(self.strategy).description}")
        grid.add_row("mesh", f"{mesh} ({self.devices} {self.platform} devices)")
        grid.add_row("model", f"{self.family} {self.size}, {fmt_count(self.parameters)} parameters")
        grid.add_row("batch", f"{self.batch} x {self.seq} tokens, accumulation {self.accum}")
        grid.add_row("params / device", fmt_bytes(self.param_bytes))
        grid.add_row("train state / device", fmt_bytes(self.state_bytes))
        report = self.report
        if report is not None and (m := report.memory) is not None:
            # What the compiled step allocates per device. XLA's own "peak" is left out: on CPU
            # it counts little more than the arguments and contradicts the temporaries.
            outputs = m.output - m.alias
            grid.add_row(
                "step allocates / device",
                f"{fmt_bytes(m.allocated)} = arguments {fmt_bytes(m.argument)} + outputs not "
                f"aliased to arguments {fmt_bytes(outputs)} + temporaries {fmt_bytes(m.temp)}",
            )
        if report is not None and report.matmul_flops:
            total = report.matmul_flops * self.devices
            grid.add_row(
                "matmul FLOPs / step",
                f"{fmt_count(report.matmul_flops)} per device, {fmt_count(total)} summed over "
                f"{self.devices} devices (every loop iteration counted)",
            )
        if report is not None and report.compile_time_s is not None:
            grid.add_row("compile", f"{report.compile_time_s:.2f} s")
        grid.add_row("XLA", overlap_text(self.platform).removeprefix("XLA "))
        if self.resumed_from is not None:
            grid.add_row("resumed", f"from step {self.resumed_from}")
        if self.history:
            first, last = self.history[0], self.history[-1]
            grid.add_row(
                "loss",
                f"{first['loss']:.4f} -> {last['loss']:.4f} over {len(self.history)} steps "
                f"({first['step']}..{last['step']})",
            )
            median = self.median_step_time_s
            grid.add_row(
                "step time",
                f"median {median * 1e3:.1f} ms, {self.batch * self.seq / median:,.0f} tokens/s",
            )
        if self.checkpoint_steps:
            grid.add_row("checkpoints", f"steps {self.checkpoint_steps}")
        if report is None:
            return Group(grid)
        # The report's own memory and FLOP lines are shown above with their meaning; XLA's FLOP
        # estimate counts a loop body once and is left out (it contradicts the matmul count).
        collectives = dataclasses.replace(
            report, memory=None, flops=None, matmul_flops=None, compile_time_s=None
        )
        return Group(grid, collectives)
