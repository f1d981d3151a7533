"""What `plan` returns: the ranked layouts with their assumptions, as a table and JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from sharding._units import fmt_bytes, fmt_count
from sharding.costmodel import Estimate
from sharding.targets import Target


# Simulating more CPU devices than this makes an AOT compile too slow to be worth waiting for.
@dataclass
class PlanResult:
    """The ranked layouts of one `plan` call, with what the ranking assumed.

    ``ranked`` holds every layout (fitting ones first, by predicted step time on the target);
    ``shown`` the first ``top`` of them, which `table`, `to_dict` and `to_json` report; every
    layout compiled for the target carries a `Check` (``checked``).
    """

    model: str
    size: str
    layers: int | None
    target: Target
    memory_bytes: int
    batch: int
    seq: int | None
    dtype: str
    optimizer: str
    source: str  # "formula" or "compiled program"
    search_s: float
    ranked: list[Estimate]
    top: int
    assumptions: list[str]
    notes: list[str] = field(default_factory=list)
    # Layouts searched and not priced, each ``{"layout", "mesh", "reason"}`` (closed form only).
    rejected: list[dict] = field(default_factory=list)

    @property
    def searched(self) -> dict[str, Any]:
        """What the search looked at: every layout, priced (at some remat and accumulation; a
        pipeline's micro-batches follow its accumulation) or rejected, and why."""
        priced = {(c.layout.strategy, c.layout.mesh, c.layout.schedule, c.layout.repeats)
                  for c in self.ranked}  # fmt: skip
        return {"layouts": len(priced) + len(self.rejected), "priced": len(priced),
                "estimates": len(self.ranked), "rejected": self.rejected}  # fmt: skip

    @property
    def devices(self) -> int:
        return self.target.devices

    @property
    def shown(self) -> list[Estimate]:
        return self.ranked[: self.top]

    @property
    def checked(self) -> list[tuple[int, Estimate]]:
        """(rank from 1, estimate) of every layout compiled beside its formula."""
        return [(i, c) for i, c in enumerate(self.ranked, 1) if c.check is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "size": self.size, "layers": self.layers,
            "target": self.target.to_dict(), "devices": self.devices,
            "memory_bytes": self.memory_bytes, "batch": self.batch, "seq": self.seq,
            "dtype": self.dtype, "optimizer": self.optimizer, "source": self.source,
            "search_s": self.search_s, "assumptions": self.assumptions + self.notes,
            "candidates": [c.to_dict() for c in self.shown],
            "train_command": self.train_command(),
            "train_command_even_stages": self._even_command(),
            "searched": self.searched,
            "checked": [{"rank": i, "label": c.label, "mesh": c.mesh_text, "remat": c.remat,
                         **c.check.to_dict()} for i, c in self.checked],
        }  # fmt: skip

    def train_command(self, rank: int = 1) -> str | None:
        """The `spmdkit train` command that runs the layout ranked ``rank`` (from 1): its
        strategy, mesh, schedule and micro-batches, accumulation, remat and dtype at this
        batch and sequence; None when it does not fit, has uneven stages (spmdkit's step needs
        stages that divide the layers) or was priced from a compiled program of a model that
        has no shipped name."""
        c = self.ranked[rank - 1]
        if not c.fits or self.source != "formula" or c.layout.stage_layers:
            return None  # uneven stages: spmdkit's step needs stages that divide the layers
        lay = c.layout
        # A config read from a Hugging Face config.json is named by its --model hf:PATH.
        model = [self.size] if self.size.startswith("hf:") else [self.model, "--size", self.size]
        flags = ["spmdkit train --model", *model, "--strategy", lay.strategy, "--mesh", lay.mesh,
                 "--batch", str(self.batch)]  # fmt: skip
        flags += ["--seq", str(self.seq)] if self.seq else []
        if lay.schedule is not None:
            flags += ["--schedule", lay.schedule, "--microbatches", str(lay.microbatches)]
            flags += ["--repeats", str(lay.repeats)] if lay.repeats > 1 else []
        return " ".join(
            [*flags, "--accum", str(c.accum), "--remat", c.remat, "--dtype", self.dtype]
        )

    def _even_rank(self) -> int | None:
        """Rank (from 1) of the best layout whose stages (if any) divide the layers."""
        return next((i for i, c in enumerate(self.ranked, 1) if not c.layout.stage_layers), None)

    def _even_command(self) -> str | None:
        even = self._even_rank()
        return None if even is None else self.train_command(even)

    @property
    def _searched_text(self) -> str:
        if not self.rejected:
            return ""
        n = self.searched
        return (f": {n['layouts']} layouts, {n['priced']} priced, {len(self.rejected)} rejected, "
                f"each with its reason in --json")  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def table(self) -> Group:
        """The ranking, the formula-vs-compiled checks, then the assumptions behind them (dim)."""
        shown, unit = self.shown, self.ranked[0].predicted.unit
        name = " ".join(filter(None, (self.model, self.size)))
        layers = f" ({self.layers} layers)" if self.layers else ""
        seq = f" x seq {self.seq}" if self.seq else ""
        table = Table(
            title=f"{name}{layers} on {self.target.name} ({self.devices} "
            f"devices, {fmt_bytes(self.memory_bytes)} each usable): batch {self.batch}{seq}, "
            f"{self.dtype} (micro-batch: rows per device per forward pass); "
            f"{sum(c.fits for c in shown)} of the top {len(shown)} fit; priced from the "
            f"{self.source} (searched in {self.search_s:.1f} s{self._searched_text})",
            title_justify="left",
        )
        for col in ("#", "layout", "mesh", "micro-batch", "accum", "memory/device", "fits",
                    "comm/step", "step", "compute", "exposed comm", "bubble", f"{unit}/s/device",
                    "MFU"):  # fmt: skip
            left = col in ("layout", "mesh")
            table.add_column(col, justify="left" if left else "right", no_wrap=left)
        warned = []
        for i, c in enumerate(shown, 1):
            p = c.predicted
            warned += [w for w in p.warnings if w not in warned]
            table.add_row(
                str(i), _label(c), c.mesh_text + (" !" if p.warnings else ""),
                "-" if c.micro_batch is None else str(c.micro_batch), str(c.accum),
                fmt_bytes(c.memory_bytes), "[green]yes[/green]" if c.fits else "[red]no[/red]",
                fmt_bytes(c.collective_bytes), _t(p.step_s), _t(p.compute_s),
                _t(p.exposed_comm_s), _t(p.bubble_s), fmt_count(p.throughput_per_device),
                "-" if p.mfu is None else f"{p.mfu:.1%}",
            )  # fmt: skip
        parts: list[Any] = [table]
        if self.checked:
            parts.append(self._check_table())
        lines = [f"! {w}" for w in warned] + self.assumptions + self.notes
        even = self._even_rank()
        run = None if even is None else self.train_command(even)
        if self.ranked[0].layout.stage_layers:
            below = (f"the command below runs #{even}, the best layout with even stages" if run
                     else "no layout with even stages fits")  # fmt: skip
            lines.insert(0, f"#1 gives its stages uneven layer counts ({self.layers} layers do "
                            f"not split evenly over them), as Megatron and torchtitan can; "
                            f"spmdkit train needs stages that divide the layers: {below}")  # fmt: skip
        parts += [Text(f"run #{even}: {run}", style="bold")] if run else []
        return Group(*parts, *(Text(f"- {line}", style="dim") for line in lines))

    def _check_table(self) -> Table:
        dtypes = sorted({c.check.dtype for _, c in self.checked})
        table = Table(
            title=f"formula vs compiled program for the top layouts, both priced on "
            f"{self.target.name} at {', '.join(dtypes)}",
            title_justify="left",
        )
        for col in ("#", "layout", "per device per step", "formula", "compiled", "error"):
            left = col in ("layout", "per device per step")
            table.add_column(col, justify="left" if left else "right", no_wrap=left)
        for i, c in self.checked:
            pairs, err = c.check.pairs(), c.check.errors()
            head = [str(i), f"{_label(c)} {c.mesh_text}"]
            for key, what, fmt in _CHECKED:
                f, m = pairs[key]
                e = err[key]
                table.add_row(*head, what, fmt(f), "-" if m is None else fmt(m),
                              "-" if e is None else f"{e:+.1%}")  # fmt: skip
                head = ["", ""]
            table.add_row("", "", "compile time", "", f"{c.check.compiled.compile_time_s:.1f} s",
                          "", end_section=True)  # fmt: skip
        return table


def _label(c: Estimate) -> str:
    return c.label + (f" remat={c.remat}" if c.remat != "none" else "")


def _t(seconds: float) -> str:
    """Seconds in the unit that suits them: us, ms or s, three significant digits."""
    if seconds == 0:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


# The figures the check table shows, formula beside compiled: (Check.pairs key, name, format).
_CHECKED = (
    ("step_s", "step time", _t), ("compute_s", "  compute", _t),
    ("exposed_comm_s", "  exposed communication", _t), ("bubble_s", "  bubble", _t),
    ("collective_bytes", "collective bytes", fmt_bytes),
    ("matmul_flops", "matmul FLOPs (critical path)", fmt_count),
    ("memory_bytes", "memory", fmt_bytes),
)  # fmt: skip


__all__ = ["PlanResult"]
