"""`explain()`: which rule placed each parameter, how, and what it costs per device.

Works on abstract shapes and on a `MeshSpec` (no devices needed), so it answers for a 70B model
on a 512-device mesh instantly on a laptop.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from partition_rules import AxisMap, Rules
from sharding._checks import check_mesh, check_rules
from sharding._init import abstract_params as abstract_params_of
from sharding._mesh import MeshSpec
from sharding._resolve import Placement, place
from sharding._shardings import optimizer_axes, optimizer_split_dim
from sharding._units import fmt_bytes, fmt_count

# Adam/AdamW keep two float32 moments per parameter, sharded like the parameter (and over data
# too under zero1).
ADAM_MOMENTS = 2
OPT_STATE_ITEMSIZE = 4


@dataclass
class Explanation:
    """The per-parameter table and per-device totals of one (rules, axis map, mesh) binding."""

    mesh: dict[str, int]
    rows: list[Placement]
    unused_rules: list[dict]
    title: str = ""
    # Mesh axes the strategy splits the stack's activations' sequence over ("sequence"); () whole.
    sequence: tuple[str, ...] = ()
    # Mesh axes zero1 splits the optimizer state over ("optimizer"), on top of the parameters'.
    optimizer: tuple[str, ...] = ()

    @property
    def totals(self) -> dict[str, int | float]:
        n_params = sum(math.prod(r.shape) for r in self.rows)
        params = sum(r.bytes_per_device for r in self.rows)
        n = math.prod(self.mesh.get(a, 1) for a in self.optimizer)
        optimizer = ADAM_MOMENTS * OPT_STATE_ITEMSIZE * sum(
            math.prod(r.per_device_shape) // (1 if optimizer_split_dim(r.per_device_shape, n) is
                                              None else n) for r in self.rows)  # fmt: skip
        total = sum(r.bytes_total for r in self.rows)
        return {
            "parameters": n_params,
            "param_bytes": total,
            "param_bytes_per_device": params,
            "grad_bytes_per_device": params,
            "adam_bytes_per_device": optimizer,
            "state_bytes_per_device": 2 * params + optimizer,
            "devices": math.prod(self.mesh.values()),
            # 1.0: every byte lives on one device only; devices: fully replicated.
            "replication": round(params * math.prod(self.mesh.values()) / total, 4) if total else 0,
        }

    def to_dict(self) -> dict[str, Any]:
        def row(p: Placement) -> dict[str, Any]:
            d = asdict(p)
            for k in ("shape", "per_device_shape"):
                d[k] = list(d[k])
            d["logical"] = None if p.logical is None else [_jsonable(e) for e in p.logical]
            d["spec"] = [_jsonable(e) for e in p.spec]
            return d

        return {
            "title": self.title,
            "mesh": self.mesh,
            "parameters": [row(p) for p in self.rows],
            "totals": self.totals,
            "unused_rules": self.unused_rules,
            "sequence": list(self.sequence),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 1, **kwargs})

    def table(self) -> Group:
        """The placement table and the per-device totals, as a rich renderable."""
        return self.__rich__()

    def __rich__(self) -> Group:
        mesh_txt = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        table = Table(title=f"{self.title} on mesh {mesh_txt}".strip(), title_justify="left")
        for col, just in [
            ("parameter", "left"),
            ("shape", "right"),
            ("dtype", "left"),
            ("rule", "left"),
            ("logical axes", "left"),
            ("spec", "left"),
            ("per device", "right"),
            ("bytes/device", "right"),
        ]:
            table.add_column(col, justify=just, no_wrap=True)
        for r in self.rows:
            logical = "replicated" if r.logical is None else ",".join(map(_txt, r.logical))
            table.add_row(
                r.path,
                "x".join(map(str, r.shape)),
                r.dtype,
                f"{r.rule_index}: {r.pattern}",
                logical,
                "P(" + ", ".join(map(_txt, r.spec)) + ")",
                "x".join(map(str, r.per_device_shape)),
                fmt_bytes(r.bytes_per_device),
            )
        t = self.totals
        summary = Table.grid(padding=(0, 2))
        summary.add_row("parameters", fmt_count(t["parameters"]), fmt_bytes(t["param_bytes"]))
        summary.add_row("params / device", "", fmt_bytes(t["param_bytes_per_device"]))
        summary.add_row("grads / device", "", fmt_bytes(t["grad_bytes_per_device"]))
        split = f"split over {'x'.join(self.optimizer)} too (zero1)" if self.optimizer else ""
        summary.add_row("adam state / device", "", fmt_bytes(t["adam_bytes_per_device"]), split)
        summary.add_row(
            Text("train state / device", style="bold"),
            "",
            Text(fmt_bytes(t["state_bytes_per_device"]), style="bold"),
        )
        summary.add_row("replication", f"{t['replication']:g}x", f"over {t['devices']} devices")
        summary.add_row("activation sequence", "", self.sequence_text())
        parts: list[Any] = [table, summary]
        if self.unused_rules:
            parts.append(Text("rules that placed nothing:", style="yellow"))
            parts.extend(
                Text(f"  rule {u['index']} {u['pattern']!r}: {u['reason']}")
                for u in self.unused_rules
            )
        return Group(*parts)

    def sequence_text(self) -> str:
        """Where the sequence of the stack's activations goes, in words."""
        split = [a for a in self.sequence if self.mesh.get(a, 1) > 1]
        if not split:
            return "whole on every device" + (
                f" ({'x'.join(f'{a}=1' for a in self.sequence)})" if self.sequence else ""
            )
        what = {"tensor": "between the tensor-parallel matmuls (Megatron SP)",
                "context": "everywhere, attention included (context parallel)"}  # fmt: skip
        return "split over " + ", ".join(
            f"{a}={self.mesh[a]} {what.get(a, '')}".strip() for a in split
        )

    def print(self, console: Console | None = None) -> None:
        (console or Console()).print(self)


def _jsonable(entry: Any) -> Any:
    return list(entry) if isinstance(entry, tuple) else entry


def _txt(entry: Any) -> str:
    if entry is None:
        return "-"
    return "(" + ",".join(entry) + ")" if isinstance(entry, tuple) else str(entry)


def explain(
    rules: Rules, axis_map: AxisMap, abstract_params: Any, mesh: Any, *, title: str = ""
) -> Explanation:
    """Which rule placed each parameter, and the memory per device it implies: `spmdkit explain`.

    Per-parameter placement table and per-device totals, as data (`print()` renders it with rich,
    `to_json()` for machines). ``abstract_params`` is a parameter tree (arrays or
    `ShapeDtypeStruct`s), or a zero-argument function returning an `nnx.Module`, which is
    evaluated abstractly: no memory, any model size.

    `mesh` may be a jax Mesh, a resolved `MeshSpec` or a spec string (no devices needed). Raises the same
    `RuleError`s as `resolve`.

    Example:
        >>> from partition_rules import preset
        >>> ex = explain(*preset("llama", "fsdp_tp"), params, MeshSpec(fsdp=64, tensor=8))  # doctest: +SKIP
        >>> ex.totals["state_bytes_per_device"]  # doctest: +SKIP
    """
    if callable(abstract_params):
        abstract_params = abstract_params_of(abstract_params)[1]
    if isinstance(mesh, str):  # a spec string needs no devices either
        mesh = MeshSpec.parse(mesh)
    check_rules("explain", rules, axis_map)
    check_mesh("explain", mesh, spec_ok=True)
    p = place(rules, axis_map, abstract_params, mesh)
    sequence = () if axis_map.is_identity or "sequence" not in axis_map else (
        axis_map.mesh_axes("sequence"))  # fmt: skip
    optimizer = optimizer_axes(axis_map, p.sizes)
    return Explanation(mesh=p.sizes, rows=p.placements, unused_rules=p.unused_rules, title=title,
                       sequence=sequence, optimizer=optimizer)  # fmt: skip
