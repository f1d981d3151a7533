"""What `compare` returns: the candidates, what was skipped and why, and the recommendation,
as a table, JSON and a PNG."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group

from sharding.comparison._errors import CompareError, OutputExistsError
from sharding.comparison._evaluate import Candidate, Settings
from sharding.comparison._plot import plot
from sharding.comparison._verdict import Recommendation, comparison_table, rank
from sharding.targets import Compiler, Target

OUTPUTS = ("compare.json", "compare.png")

__all__ = ["OUTPUTS", "Comparison", "Skipped", "check_output"]


@dataclass(frozen=True)
class Skipped:
    """A layout, or a strategy with no layout, that could not be compiled, and why."""

    label: str
    mesh: str
    reason: str


@dataclass
class Comparison:
    """What `compare` found for one model on one target, and what it recommends.

    ``candidates`` holds every compiled candidate, ``skipped`` what could not be (with the
    reason); ``recommendation`` is None only on a comparison attached to an error.
    """

    model: str
    size: str
    parameters: int
    target: Target
    settings: Settings
    dtypes: tuple[str, ...]
    devices: dict[str, Any]  # count, platform, kind
    measured: bool  # ranked by time measured on real devices (else predicted)
    useful_flops: float
    unsplit_state: int
    memory_budget: int
    candidates: list[Candidate]
    skipped: list[Skipped]
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    recommendation: Recommendation | None = None
    compiler: Compiler | None = None  # whose programs the facts come from (None: this host's)

    @property
    def ranked(self) -> list[Candidate]:
        return rank(self.candidates, self.memory_budget, measured=self.measured)

    @property
    def assumptions(self) -> list[str]:
        """The step-time model's assumptions (the same for every candidate but the first line)."""
        return self.candidates[0].predicted.assumptions if self.candidates else []

    def table(self) -> Group:
        """The header, the ranked table, skipped layouts, notes and the recommendation."""
        st, dev = self.settings, self.devices
        batch = f"{st.batch} x {st.seq} tokens" if st.seq else f"{st.batch} samples"
        parts: list[Any] = [
            f"[bold]{self.model} {self.size}[/]: {self.parameters:,} parameters, global batch "
            f"{batch}, {'/'.join(self.dtypes)}; target {self.target.describe()}; compiled by "
            + (
                self.compiler.describe()
                if self.compiler
                else f"XLA on {dev['count']} {dev['platform']} devices"
            )
        ]
        if self.candidates:
            parts.append(comparison_table(self.candidates, self.unsplit_state, self.memory_budget,
                                          measured=self.measured, target=self.target))  # fmt: skip
        parts += [f"[yellow]skipped[/] {s.label} on {s.mesh}: {s.reason.splitlines()[0]}"
                  for s in self.skipped]  # fmt: skip
        parts += [f"[dim]note: {n}[/]" for n in self.notes]
        if self.recommendation is not None:
            parts.append("[bold]Recommendation[/]")
            for i, line in enumerate(self.recommendation.lines):
                parts.append(("  -> " if i == 0 else "     ") + line)
        parts.append(f"compiled {len(self.candidates)} candidates in {self.elapsed_s:.0f} s")
        return Group(*parts)

    def to_dict(self) -> dict[str, Any]:
        """The record `spmdkit compare` writes to compare.json."""
        return {
            "model": {"name": self.model, "size": self.size, "parameters": self.parameters},
            "target": self.target.to_dict(),
            "settings": {k: v for k, v in vars(self.settings).items() if k != "compiler"},
            "compiler": None if self.compiler is None else self.compiler.to_dict(),
            "dtypes": list(self.dtypes),
            "devices": dict(self.devices),
            "ranked_by": "measured" if self.measured else "predicted",
            "useful_flops_per_step": self.useful_flops,
            "unsplit_state_bytes": self.unsplit_state,
            "memory_budget": self.memory_budget,
            "candidates": [c.to_dict() for c in self.ranked],
            "skipped": [asdict(s) for s in self.skipped],
            "notes": self.notes,
            "assumptions": self.assumptions,
            "recommendation": None
            if self.recommendation is None
            else self.recommendation.to_dict(),
            "elapsed_s": self.elapsed_s,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def plot(self, path: str | Path) -> Path:
        """The PNG: predicted step time split and memory per device for every candidate."""
        if not self.candidates:
            raise CompareError("nothing was compiled, so there is nothing to plot")
        best = None if self.recommendation is None else self.recommendation.best
        return plot(self.ranked, Path(path), title=f"{self.model} {self.size}",
                    target=self.target, budget=self.memory_budget, best=best,
                    measured=self.measured)  # fmt: skip

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
