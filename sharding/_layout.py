"""Where one training step puts everything, answered once for the step compiler.

`StepLayout.of` reads a rule table and axis map on a mesh for a model's abstract parameters and
optimizer state, and answers every placement question the step asks: the parameters' and the
optimizer state's shardings (and the rules that placed nothing), the sequence layout and the
batch's shardings, and for a pipeline its `Staging`: the schedule, the axes the stages are
manual over (where each weight's gradient is summed by hand) and the weights they gather once
per step. `compile_train_step` builds one and its parts read it; nothing re-derives a placement.
`sharding.BoundStrategy` answers the same questions for a strategy on a mesh before any model
exists, through the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jax import sharding as jshard

from partition_rules import AxisMap, Rules
from sharding._resolve import resolve_reporting
from sharding._sequence import SequenceLayout
from sharding._shardings import (
    check_no_stage_split,
    check_stack_staged,
    optimizer_axes,
    shardings_like_params,
    split_optimizer,
    stage_weights_whole_over_fsdp,
)
from sharding.pipeline import Schedule, Staging, stage_manual_axes


@dataclass
class StepLayout:
    """The placement of one step's state, batch and pipeline on ``mesh``.

    ``params`` / ``state``: the shardings of the parameters and of the whole train state
    (``{"params", "opt_state", "step"}``, optimizer state like its parameters, and split over
    the strategy's ``"optimizer"`` axes too: zero1); ``sequence``:
    the strategy's sequence layout, bound to the parameters' layouts; ``staging``: the
    pipeline's placement, None without one; ``unused_rules``: rules that matched no parameter;
    ``optimizer_whole``: optimizer-state arrays zero1 could not split (no dimension divides).
    """

    mesh: jshard.Mesh
    params: Any
    state: dict[str, Any]
    sequence: SequenceLayout
    staging: Staging | None
    unused_rules: list
    optimizer_whole: list[str]

    @classmethod
    def of(cls, rules: Rules, axis_map: AxisMap, mesh: jshard.Mesh, params: Any, opt_state: Any,
           *, sequence: SequenceLayout, stack: str | None, schedule: Schedule | None,
           stage_layers: tuple[int, ...] | None = None, fn: str = "compile_train_step",
           ) -> StepLayout:  # fmt: skip
        """Place ``params`` (abstract) and ``opt_state`` by ``rules`` under ``axis_map``.

        Raises:
            sharding.RuleError (and its kinds): a rule that cannot place a parameter.
            sharding.pipeline.PipelineConfigError: a pipelined stack whose layer axis is not
                split over ``stage``, or a stage split without a pipeline.
        """
        shardings, unused = resolve_reporting(rules, axis_map, params, mesh, fn=fn)
        staging = None
        if schedule is not None:
            check_stack_staged(shardings, stack, mesh)
            staging = Staging(
                mesh, stack, schedule, manual=stage_manual_axes(sequence.outer, mesh),
                gathered=stage_weights_whole_over_fsdp(shardings, mesh),
                stage_layers=stage_layers, sequence=sequence, shardings=shardings,
            )  # fmt: skip
        else:
            check_no_stage_split(shardings, mesh)
        replicated = jshard.NamedSharding(mesh, jshard.PartitionSpec())
        like = shardings_like_params(opt_state, params, shardings, mesh)
        opt, whole = split_optimizer(
            opt_state, like, optimizer_axes(axis_map, dict(mesh.shape)), mesh
        )
        state = {"params": shardings, "opt_state": opt, "step": replicated}
        sequence.bind(params, shardings, stack)
        return cls(mesh, shardings, state, sequence, staging, unused, whole)

    @property
    def replicated(self) -> jshard.NamedSharding:
        """A value every device holds whole (the loss, the step counter)."""
        return jshard.NamedSharding(self.mesh, jshard.PartitionSpec())

    def batch(self, batch_shapes: dict) -> tuple[dict, dict]:
        """({name: sharding} of the batch, of its accumulation micro-batches ``[k, B/k, ...]``);
        after the loss was traced once (the sequence layout reads the stack's length)."""
        return self.sequence.batch_shardings(batch_shapes)


__all__ = ["StepLayout"]
