"""Resuming a checkpoint on another mesh: the global-batch policy, and offline resharding.

A run saved with its batch split over ``data * fsdp = n`` devices and resumed where ``m`` devices
split it (fewer devices, or another split of the same ones) needs a decision about the global
batch, made explicitly (`elastic_batch`):

* ``keep-batch``: keep the global batch, and raise gradient accumulation so that no device
  takes more rows per micro-step than before; the optimizer sees the same batches, so the loss
  curve continues (up to float summation order).
* ``shrink-batch``: keep rows per device and accumulation, and scale the global batch by
  ``m / n``; fewer rows per step, and the caller says so in its log.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
from jax import sharding as jshard

from sharding._mesh import BATCH_AXES, mesh_sizes, mesh_text
from sharding._shardings import shardings_like_params
from sharding.training._checkpoint import Checkpointer, CheckpointError, CheckpointMeta

ELASTIC_POLICIES = ("keep-batch", "shrink-batch")


class ElasticPolicyError(CheckpointError):
    """The checkpoint's global batch cannot follow the new mesh under the chosen policy."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Global batch and accumulation for a resumed run; ``note`` says what changed ("" if none)."""

    global_batch: int
    accum_steps: int
    note: str = ""


def batch_split(sizes: dict[str, int]) -> int:
    """Devices that split the batch: the product of the ``data`` and ``fsdp`` axes."""
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def elastic_batch(meta: CheckpointMeta, sizes: dict[str, int], policy: str | None) -> BatchPlan:
    """Global batch and accumulation to resume ``meta``'s run on a mesh of ``sizes``.

    With ``policy=None`` the batch split must not have changed.

    Example:
        >>> meta = CheckpointMeta("llama", "tiny", {}, "fsdp", {"fsdp": 8}, 16, 32, 1)
        >>> plan = elastic_batch(meta, {"fsdp": 4}, "keep-batch")
        >>> plan.global_batch, plan.accum_steps
        (16, 2)
        >>> elastic_batch(meta, {"fsdp": 4}, "shrink-batch").global_batch
        8
    """
    old, new = meta.batch_split, batch_split(sizes)
    batch, accum = meta.global_batch, meta.accum_steps
    saved = f"saved with global batch {batch}, accumulation {accum}, batch split over {old}"
    if policy is not None and policy not in ELASTIC_POLICIES:
        raise ElasticPolicyError(
            f"unknown elastic policy {policy!r}; choose one of {ELASTIC_POLICIES}"
        )
    if policy is None:
        if old != new:
            raise ElasticPolicyError(
                f"the checkpoint was {saved} devices (mesh {mesh_text(meta.mesh)}), but the new mesh "
                f"{mesh_text(sizes)} splits it over {new}; choose --elastic keep-batch (same global "
                f"batch, more accumulation) or --elastic shrink-batch (global batch scaled to "
                f"{new}/{old})"
            )
        return BatchPlan(batch, accum)
    if policy == "keep-batch":
        least = max(1, -(-accum * old // new))
        for a in range(least, batch + 1):
            if batch % (a * new) == 0:
                note = (
                    f"keep-batch: global batch {batch} kept; gradient accumulation {accum} -> {a} "
                    f"(batch split over data x fsdp = {old} -> {new} devices)"
                )
                return BatchPlan(batch, a, note if (a, old) != (accum, new) else "")
        raise ElasticPolicyError(
            f"keep-batch: the checkpoint was {saved} devices; global batch {batch} does not "
            f"split into micro-batches over {new} devices (mesh {mesh_text(sizes)}) with at most "
            f"{batch // (accum * old)} rows per device; use --elastic shrink-batch or a mesh "
            f"whose data x fsdp divides {batch}"
        )
    rows = batch // (accum * old)  # per device per micro-step; whole for a saved batch
    resized = rows * accum * new
    verb = "shrinks" if resized < batch else "grows"
    note = (
        f"shrink-batch: global batch {verb} {batch} -> {resized} (batch split over data x fsdp "
        f"= {old} -> {new} devices, {rows} rows per device per micro-step "
        f"kept, accumulation {accum}); the learning-rate schedule is unchanged"
    )
    return BatchPlan(resized, accum, note if resized != batch else "")


def checkpoint_shardings(
    saved: dict[str, jax.ShapeDtypeStruct],
    params: Any,
    param_shardings: Any,
    mesh: jshard.Mesh,
) -> dict[str, jax.ShapeDtypeStruct]:
    """Targets for every saved array on ``mesh``, without the optimizer that wrote them.

    ``params``/``param_shardings`` are the model's abstract parameters and their resolved
    shardings; each saved array (``params/...``, ``opt_state/.../mu/...``) takes the sharding of
    the parameter that is the longest suffix of its path with the same shape, as in the step.
    """
    shardings = shardings_like_params(saved, params, param_shardings, mesh)
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in saved.items()
    }


def reshard_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    params: Any,
    param_shardings: Any,
    mesh: jshard.Mesh,
    strategy: str,
    *,
    step: int | None = None,
) -> CheckpointMeta:
    """Rewrite step ``step`` (default: latest) of ``src`` into ``dst`` for ``mesh``/``strategy``.

    Arrays go straight from ``src``'s files into their new shardings (no host gathers them) and
    are saved as the same step of ``dst``; the metadata records the new mesh and strategy.
    Returns the new metadata.
    """
    source = Checkpointer(src, keep=None, read_only=True)
    try:
        meta = source.meta(step)
        targets = checkpoint_shardings(
            source.array_metadata(meta.step), params, param_shardings, mesh
        )
        state, _ = source.restore(targets, meta.step)
    finally:
        source.close()
    new_meta = dataclasses.replace(meta, mesh=mesh_sizes(mesh), strategy=strategy)
    with Checkpointer(dst, keep=None) as target:
        target.save(meta.step, state, new_meta)
    return dataclasses.replace(new_meta, devices=jax.device_count())
