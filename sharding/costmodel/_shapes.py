"""Mesh shapes: the axes a strategy uses (`splits`), and the shapes `spmdkit compare` offers each
strategy on a device count (`_suggested`, `_node_wide`)."""

from __future__ import annotations

from partition_rules import composition
from sharding._mesh import AXES


def splits(strategy: str) -> tuple[set[str], set[str]]:
    """(mesh axes the strategy may use, axes it needs > 1 to be itself).

    The axes that split parameters must all be > 1 (fsdp with fsdp=1 is dp), and only those
    and ``data`` may be: any other axis would only replicate.
    """
    axes = {
        a
        for name, v in composition(strategy).axis_map.items()
        if name != "batch"
        for a in ((v,) if isinstance(v, str) else (v or ()))
    }
    return axes | {"data"}, axes


def _node_wide(name: str, n: int, per_node: int | None) -> list[str]:
    """Shapes with tensor over one whole node and the batch axis across nodes (the guides'
    rule for a multi-node cluster: tensor parallelism inside the fast interconnect)."""
    if per_node is None or per_node < 2 or n <= per_node or n % per_node:
        return []
    across = n // per_node
    return {"tp": [f"data={across},tensor={per_node}"],
            "dp_tp": [f"data={across},tensor={per_node}"],
            "fsdp_tp": [f"fsdp={across},tensor={per_node}"],
            "pp_tp": [f"stage={across},tensor={per_node}"] if across >= 2 else []}.get(name, [])  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _suggested(name: str, n: int) -> list[str]:
    """Mesh shapes to offer ``name`` on ``n`` devices, best first (first that resolves wins)."""
    half = max(n // 2, 1)
    stage = next((s for s in (4, 2) if n % s == 0 and n > s), None)
    table = {
        "dp": [f"data={n}"],
        "fsdp": [f"fsdp={n}"],
        "tp": [f"tensor={t},data={n // t}" for t in _divisors(n) if t > 1],
        "dp_tp": [f"data={half},tensor=2"] if n >= 4 and n % 2 == 0 else [],
        "fsdp_tp": [f"fsdp={half},tensor=2"] if n >= 4 and n % 2 == 0 else [],
        "pp": [f"stage={stage},data={n // stage}"] if stage else [],
        "pp_tp": [f"stage=2,tensor=2,data={n // 4}"] if n >= 4 and n % 4 == 0 else [],
        "pp_fsdp": [f"stage=2,fsdp={half}"] if n >= 4 and n % 2 == 0 else [],
        "fsdp+tp+pp": [f"stage=2,fsdp={n // 4},tensor=2"] if n >= 8 and n % 4 == 0 else [],
        # Split the sequence / the experts as far as leaves a second axis (fallbacks follow).
        "tp_sp": [f"tensor={t},data={n // t}" for t in _divisors(n) if t > 1],
        "fsdp_tp_sp": [f"fsdp={half},tensor=2"] if n >= 4 and n % 2 == 0 else [],
        "cp": [f"context={c},data={n // c}" for c in _divisors(n) if c > 1],
        "fsdp_cp": [f"fsdp={n // c},context={c}" for c in _divisors(n) if 1 < c < n],
        "ep": [f"expert={e},data={n // e}" for e in _divisors(n) if e > 1],
        "fsdp_ep": [f"fsdp={n // e},expert={e}" for e in _divisors(n) if 1 < e < n],
        "ep_tp": [f"expert={e},tensor=2,data={n // e // 2}" for e in _divisors(n // 2) if e > 1]
        if n % 2 == 0
        else [],
        # Pipelines with a split inside the stages: two stages, the split as wide as leaves data.
        "pp_cp": [f"stage=2,context={c},data={n // 2 // c}" for c in _divisors(n // 2) if c > 1]
        if n % 2 == 0
        else [],
        "pp_tp_sp": [f"stage=2,tensor=2,data={n // 4}"] if n >= 4 and n % 4 == 0 else [],
        "pp_ep": [f"stage=2,expert={e},data={n // 2 // e}" for e in _divisors(n // 2) if e > 1]
        if n % 2 == 0
        else [],
    }
    if name in table:
        return table[name]
    # Any other composition: 2 on every axis it splits, the rest of the devices over data (which
    # zero1 needs > 1: it splits the optimizer state over it).
    split = splits(name)[1]
    needs = sorted(split - {"data"}, key=AXES.index)
    k = 2 ** len(needs)
    data = n // k if n % k == 0 else 0
    if not data or (data < 2 and "data" in split):
        return []
    return [",".join([*(f"{a}=2" for a in needs), f"data={data}"])]


__all__ = ["splits"]
