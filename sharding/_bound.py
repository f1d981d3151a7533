"""A strategy bound to a mesh: the one object that answers where everything goes.

`BoundStrategy.of(strategy, mesh)` reads a strategy name or composition (`partition_rules.
composition`), refuses what cannot be placed before anything is traced (a mesh axis that no part
of the strategy splits over, expert parallelism for a model without experts), and answers the
placement questions the step compiler asks: the axis map over the workload's logical names, the
mesh axes the batch and the sequence are split over, whether and over what the layer stack is
pipelined, and the axes a pipeline's stages are manual over (where each gradient is summed by
hand).

Example:
    >>> from sharding import make_mesh
    >>> bound = BoundStrategy.of("fsdp+tp+sp+pp", make_mesh("stage=2,fsdp=2,tensor=2"))
    >>> bound.pipelined, bound.batch_axes, bound.sequence, bound.manual
    (True, ('fsdp',), ('tensor',), ('stage', 'data', 'fsdp'))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jax import sharding as jshard

from partition_rules import AxisMap, Composition, composition, strategy
from sharding._checks import StepConfigError
from sharding._mesh import BATCH_AXES
from sharding._sequence import outer_sequence_axes, sequence_axes
from sharding.pipeline import stage_manual_axes

# The part that splits over each mesh axis (``data`` carries the batch whatever the strategy).
_PART_OF = {"fsdp": "fsdp", "expert": "ep", "tensor": "tp", "context": "cp", "stage": "pp"}


class StrategyMeshError(StepConfigError):
    """A strategy that cannot be placed on a mesh, or for a model: an axis no part uses, expert
    parallelism without experts."""


@dataclass(frozen=True)
class BoundStrategy:
    """``strategy`` (as written) composed of ``parts``, bound to ``mesh``."""

    strategy: str
    parts: Composition
    mesh: jshard.Mesh

    @classmethod
    def of(
        cls, strategy_name: str, mesh: jshard.Mesh, *, experts: bool | None = None
    ) -> BoundStrategy:
        """Bind ``strategy_name`` to ``mesh``; ``experts``: whether the model has experts
        (None: unknown, not checked).

        Raises:
            partition_rules.CompositionError: not a strategy name or composition.
            StrategyMeshError: a mesh axis of size > 1 that no part splits over (``stage=2``
                without ``pp``), or ``ep`` on a model without experts.
        """
        parts = composition(strategy_name)
        sizes = dict(mesh.shape)
        unused = [a for a, n in sizes.items() if n > 1 and a not in parts.axes]
        if unused:
            axis = unused[0]
            part = _PART_OF.get(axis)
            fix = composition("+".join((*parts.parts, part))).name if part else None
            raise StrategyMeshError(
                f"strategy {strategy_name!r} ({parts.name}) splits nothing over mesh axis "
                f"{axis}={sizes[axis]}: none of its parts uses {axis}"
                + (f" (the part {part} would)" if part else "")
                + "; "
                + (f"use --strategy {fix}, or " if fix else "")
                + f"drop {axis} from --mesh (or give the devices to an axis it splits over, "
                f"e.g. data)"
            )
        if experts is False and "ep" in parts.parts:
            raise StrategyMeshError(
                f"strategy {strategy_name!r} ({parts.name}) splits experts over expert, and the "
                f"model has none (its rules place no dimension on the logical axis 'experts'); "
                f"drop ep (e.g. --strategy "
                f"{composition('+'.join(p for p in parts.parts if p != 'ep') or 'dp').name})"
            )
        return cls(strategy_name, parts, mesh)

    def axis_map(self, names: Mapping[str, str | tuple[str, ...]] | None = None) -> AxisMap:
        """The strategy's axis map over a rule table's own logical names (``names``: shipped
        logical axis -> yours, as `partition_rules.strategy` takes them)."""
        return strategy(self.parts.name, **dict(names or {}))

    @property
    def pipelined(self) -> bool:
        """Whether the layer stack is split into stages over ``stage``."""
        return self.parts.pipelined

    @property
    def stages(self) -> int:
        return dict(self.mesh.shape).get("stage", 1)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes of size > 1 the batch's rows are split over."""
        sizes = dict(self.mesh.shape)
        return tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)

    @property
    def sequence(self) -> tuple[str, ...]:
        """The mesh axes of size > 1 the stack's activations' sequence is split over."""
        return sequence_axes(self.parts.axis_map, self.mesh)

    @property
    def manual(self) -> tuple[str, ...]:
        """The axes a pipeline's stages are manual over (each weight's gradient summed by hand
        over those it is replicated on); empty without a pipeline."""
        if not self.pipelined:
            return ()
        return ("stage", *stage_manual_axes(outer_sequence_axes(self.sequence), self.mesh))


__all__ = ["BoundStrategy", "StrategyMeshError"]
