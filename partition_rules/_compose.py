"""Strategies as compositions of parallelisms: ``fsdp+tp+sp+cp+pp`` and the names that alias them.

A strategy is a set of parts, each a block of the axis map (`partition_rules.strategies`) and the
mesh axis it splits over: ``dp`` (the batch over ``data``; a ``data`` axis always carries the
batch, so ``dp`` may be left out), ``zero1`` (the optimizer state over ``data`` on top of each
parameter's layout: ZeRO-1, Megatron's distributed optimizer), ``fsdp`` (ZeRO-3 over ``fsdp``),
``ep`` (experts over ``expert``), ``tp`` (Megatron over ``tensor``), ``sp`` (Megatron sequence
parallelism: the sequence over ``tensor`` between tp's matmuls, so only with tp), ``cp`` (the
sequence over ``context``) and ``pp`` (the layer stack's stages over ``stage``). The mesh's
axis sizes say how far each goes. Today's names (``pp_tp_sp``, ``fsdp_tp``, ...) are aliases
of compositions, in one table.

Example:
    >>> c = composition("tp+fsdp+pp")
    >>> c.name, c.pipelined, c.axes
    ('fsdp+tp+pp', True, ('data', 'fsdp', 'tensor', 'stage'))
    >>> composition("pp_tp_sp").name
    'tp+sp+pp'
    >>> composition("fsdp+tp+sp+cp+pp").axis_map["sequence"]
    ('context', 'tensor')
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from partition_rules._rules import AxisMap, UnknownPresetError

# Each part, in the order a composition is written: its mesh axis and its block of the axis map.
PART_AXES: dict[str, str] = {
    "dp": "data",
    "zero1": "data",
    "fsdp": "fsdp",
    "ep": "expert",
    "tp": "tensor",
    "sp": "tensor",
    "cp": "context",
    "pp": "stage",
}
PARTS = tuple(PART_AXES)

# ZeRO-3 shards every parameter, per-feature vectors included, so that parameter and optimizer
# bytes per device are the total over fsdp: a replicated remainder would grow with the mesh.
_BLOCKS: dict[str, AxisMap] = {
    "dp": AxisMap(),
    # ZeRO-1 (Megatron's distributed optimizer, MaxText's shard_optimizer_over_data): no
    # parameter moves; "optimizer" names no parameter dimension either, it says which mesh axis
    # the optimizer state is split over on top of its parameter's layout (`sharding.StepLayout`).
    "zero1": AxisMap({"optimizer": "data"}),
    "fsdp": AxisMap({"embed": "fsdp", "features": "fsdp", "conv_out": "fsdp", "norm": "fsdp"}),
    # Expert parallelism: each expert's weights live on one `expert` device; tokens travel to
    # them by all-to-all (the batch is split over `expert` too, `sharding.BATCH_AXES`).
    "ep": AxisMap({"experts": "expert"}),
    "tp": AxisMap(dict.fromkeys(("heads", "kv_heads", "mlp", "vocab", "classes"), "tensor")),
    "pp": AxisMap({"layers": "stage"}),
}

# What each part splits, in the guides' terms (a composition's description joins its parts').
PART_TEXT: dict[str, str] = {
    "dp": "batch split over data, gradients all-reduced once per step",
    "zero1": "optimizer state split over data (ZeRO-1): gradients all-reduced as dp's, each "
    "device updates its slice, updated weights all-gathered over data once per step",
    "fsdp": "weights and batch split over fsdp (ZeRO-3): weights all-gathered per layer "
    "(per step inside a pipeline's stages), gradients reduce-scattered",
    "ep": "experts split over expert, tokens sent to them and back by all-to-alls",
    "tp": "each layer's matrices split over tensor (Megatron), activations reduced per layer",
    "sp": "the sequence split over tensor between tp's matmuls (all-gather + reduce-scatter "
    "instead of all-reduce)",
    "cp": "the sequence split over context, attention passes keys/values over it",
    "pp": "the layer stack split into stages over stage, activations cross stages per micro-batch",
}

# Today's names, each a composition (dp_tp is tp: a data axis always carries the batch).
ALIASES: dict[str, str] = {
    "dp": "dp",
    "fsdp": "fsdp",
    "tp": "tp",
    "fsdp_tp": "fsdp+tp",
    "dp_tp": "dp+tp",
    "pp": "pp",
    "pp_tp": "tp+pp",
    "pp_fsdp": "fsdp+pp",
    "tp_sp": "tp+sp",
    "fsdp_tp_sp": "fsdp+tp+sp",
    "cp": "cp",
    "fsdp_cp": "fsdp+cp",
    "cp_tp_sp": "tp+sp+cp",
    "ep": "ep",
    "fsdp_ep": "fsdp+ep",
    "ep_tp": "ep+tp",
    "pp_cp": "cp+pp",
    "pp_tp_sp": "tp+sp+pp",
    "pp_ep": "ep+pp",
}


class CompositionError(UnknownPresetError):
    """A strategy that is neither a known name nor a valid composition of parts."""


@dataclass(frozen=True)
class Composition:
    """A strategy as its parts, in the order of `PARTS` (``dp`` kept only when alone).

    ``name``: the parts joined by ``+`` ("fsdp+tp+sp+cp+pp"); ``alias``: today's name for it,
    if it has one. ``axes``: the mesh axes its parts split over (``data`` always: it carries
    the batch whatever the strategy).
    """

    parts: tuple[str, ...]

    @property
    def name(self) -> str:
        return "+".join(self.parts)

    @property
    def alias(self) -> str | None:
        return next((a for a, c in ALIASES.items() if composition(c) == self and a != "dp_tp"),
                    None)  # fmt: skip

    @property
    def pipelined(self) -> bool:
        return "pp" in self.parts

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(("data", *(PART_AXES[p] for p in self.parts))))

    @functools.cached_property
    def axis_map(self) -> AxisMap:
        """Every logical axis mapped: the parts' blocks, the sequence where sp and cp put it,
        and everything else replicated, stated per name."""
        from partition_rules.strategies import LOGICAL_AXES

        named = AxisMap()
        for part in self.parts:
            named = named | _BLOCKS.get(part, AxisMap())
        sequence = tuple(PART_AXES[p] for p in ("cp", "sp") if p in self.parts)
        if sequence:
            named = named | AxisMap({"sequence": sequence[0] if len(sequence) == 1 else sequence})
        return named | AxisMap({k: None for k in LOGICAL_AXES if k not in named})

    @property
    def description(self) -> str:
        """What it splits, in the guides' terms: an alias's own text, else its parts'."""
        from partition_rules.strategies import DESCRIPTIONS

        alias = self.alias
        return DESCRIPTIONS[alias] if alias else "; ".join(PART_TEXT[p] for p in self.parts)


def composition(strategy: str) -> Composition:
    """The composition a strategy name or ``a+b+...`` spelling stands for, checked (each
    spelling read once: `_composition`).

    Raises:
        CompositionError: an unknown name or part, a part written twice, ``sp`` without
            ``tp``, ``zero1`` with ``fsdp``, or not a string (the message lists the parts and
            the names).
    """
    if not isinstance(strategy, str):
        raise CompositionError(f"strategy {strategy!r} is not a name; {_known()}")
    return _composition(strategy)


@functools.lru_cache(maxsize=512)
def _composition(strategy: str) -> Composition:
    if not strategy.strip():
        raise CompositionError(f"strategy {strategy!r} is not a name; {_known()}")
    spelled = ALIASES.get(strategy.strip(), strategy.strip())
    parts = [p.strip() for p in spelled.split("+")]
    unknown = [p for p in parts if p not in PART_AXES]
    if unknown:
        hint = (f" ({unknown[0]!r} is a name, not a part: write its parts, "
                f"{ALIASES[unknown[0]]})" if unknown[0] in ALIASES and len(parts) > 1 else "")  # fmt: skip
        raise CompositionError(f"unknown strategy {strategy!r}{hint}; {_known()}")
    twice = sorted({p for p in parts if parts.count(p) > 1})
    if twice:
        raise CompositionError(
            f"strategy {strategy!r} names {twice[0]!r} twice; write each part once, e.g. "
            f"{'+'.join(dict.fromkeys(parts))}"
        )
    if "sp" in parts and "tp" not in parts:
        raise CompositionError(
            f"strategy {strategy!r} has sp without tp: Megatron sequence parallelism splits the "
            f"sequence over tensor between tensor parallelism's matmuls; write "
            f"{'+'.join(sorted({*parts, 'tp'}, key=PARTS.index))}, or cp to split the sequence "
            f"on its own"
        )
    if "zero1" in parts and "fsdp" in parts:
        raise CompositionError(
            f"strategy {strategy!r} has zero1 with fsdp: fsdp splits the optimizer state with "
            f"the weights already; write {'+'.join(p for p in parts if p != 'zero1')} (and give "
            f"fsdp the data devices), or zero1 without fsdp"
        )
    ordered = tuple(p for p in PARTS if p in parts)
    return Composition(ordered if ordered == ("dp",) else tuple(p for p in ordered if p != "dp"))


def _known() -> str:
    return (f"strategies that exist: {', '.join(ALIASES)}, or parts joined by '+' "
            f"({', '.join(PARTS)}; e.g. fsdp+tp+sp+cp+pp)")  # fmt: skip


__all__ = ["ALIASES", "PARTS", "PART_AXES", "Composition", "CompositionError", "composition"]
