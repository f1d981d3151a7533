"""How close the step-time model has come to measured runs: the error to expect from a prediction.

``accuracy.json`` beside this module is written by the project's benchmark of published runs
(its ``source`` names the command), which prices measured Megatron-LM and torchtitan runs on
their own layouts with `predict` and `step_time`. The library reads only these summary figures,
never the runs, so nothing in the model is tuned to a run; a test recomputes the table from the
benchmark and fails when it is stale.

Example:
    >>> expected_error({"data": 4, "tensor": 8}).kind
    'tensor'
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from sharding._mesh import mesh_text

ACCURACY_FILE = Path(__file__).with_name("accuracy.json")
NAMES = {"pipeline": "pipeline-parallel", "tensor": "tensor-parallel", "fsdp": "FSDP",
         "data": "data-parallel"}  # fmt: skip


@dataclass(frozen=True)
class Accuracy:
    """The step-time model's error on the published runs of one layout kind; ``measured``: the
    sources of those runs."""

    kind: str
    runs: int
    median: float
    worst: float
    within_15: float
    source: str
    measured: str

    def sentence(self) -> str:
        """What to expect of a prediction of this kind, in one sentence."""
        return (
            f"Expected error: on {self.runs} published {NAMES[self.kind]} runs ({self.measured}) "
            f"the step-time model's throughput was off by {self.median:.0%} (median), "
            f"{self.worst:.0%} at worst, and within 15% on {self.within_15:.0%} of them "
            f"({self.source})."
        )


def layout_kind(mesh: dict[str, int]) -> str | None:
    """The kind a mesh's layout is judged as: pipeline, tensor, fsdp or data parallel; None for
    one that splits context or experts (no published run of ours does)."""
    if any(mesh.get(a, 1) > 1 for a in ("context", "expert")):
        return None
    for kind, axis in (("pipeline", "stage"), ("tensor", "tensor"), ("fsdp", "fsdp")):
        if mesh.get(axis, 1) > 1:
            return kind
    return "data"


@functools.cache
def _table() -> dict:
    return json.loads(ACCURACY_FILE.read_text())


def expected_error(mesh: dict[str, int]) -> Accuracy | None:
    """The error published runs of ``mesh``'s kind (`layout_kind`) showed, or None where none
    of that kind was priced."""
    kind, table = layout_kind(mesh), _table()
    row = table["kinds"].get(kind) if kind else None
    if row is None:
        return None
    return Accuracy(kind, row["runs"], row["median"], row["worst"], row["within_15"],
                    table["source"], row["measured"])  # fmt: skip


def error_to_expect(mesh: dict[str, int]) -> str:
    """`expected_error`'s sentence for ``mesh``, or that no published run of its kind says."""
    known = expected_error(mesh)
    if known is not None:
        return known.sentence()
    return (f"Expected error: unknown; no published run of this kind ({mesh_text(mesh)}) has "
            f"been priced yet.")  # fmt: skip


__all__ = ["ACCURACY_FILE", "Accuracy", "error_to_expect", "expected_error", "layout_kind"]
