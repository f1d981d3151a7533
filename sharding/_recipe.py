"""The one recipe that turns (workload, strategy, mesh, batch) into a compiled train step.

`compare` measures with it, `plan --aot` compiles with it and `fit` trains with it, so the three
always build the same program for the same settings: the workload's rules under the named
strategy (over its own logical names), the batch shapes for a global batch and sequence length,
and, for a pipeline strategy, a `PipelineSpec` over the workload's layer stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from jax import sharding as jshard

from partition_rules import PIPELINE_STRATEGIES, composition
from sharding._attention import attention_kernels
from sharding._bound import BoundStrategy
from sharding._mesh import MeshSpec, make_mesh
from sharding._step import StepConfigError, TrainProgram, compile_train_step
from sharding._workload import Workload, load_workload
from sharding.context import context_kernels, seam_calls
from sharding.experts import expert_kernels
from sharding.pipeline import PipelineSpec, balanced_stages


def check_pipelined_experts(strategy: str, mesh: jshard.Mesh) -> None:
    """Expert parallelism inside a pipeline's stages: the stages are manual over ``expert`` and
    run the experts' kernel on each device's tokens directly; fsdp may not split the experts
    inside them too."""
    sizes = dict(mesh.shape)
    if sizes.get("fsdp", 1) > 1:
        raise StepConfigError(
            f"strategy {strategy!r} pipelines over stage={sizes['stage']} with experts split "
            f"over expert={sizes['expert']} and fsdp={sizes['fsdp']}: expert parallelism inside "
            f"a pipeline's stages runs with data, tensor or context beside it, not fsdp; use "
            f"ep+pp (with tp or cp if you need them) on a mesh with fsdp=1, or fsdp+ep without "
            f"stages"
        )


def pipeline_for(
    strategy: str,
    stages: int,
    *,
    schedule: str | None = None,
    microbatches: int | None = None,
    repeats: int | None = None,
    stage_layers: tuple[int, ...] | None = None,
) -> PipelineSpec | None:
    """The `PipelineSpec` a strategy needs on ``stages`` stages (None for a non-pipeline one).

    Defaults: gpipe, 2 x stages micro-batches, 2 repeats (chunks per stage) for circular and
    interleaved. Asking for a schedule,
    micro-batches or repeats under a strategy that does not pipeline is an error, and so is a
    pipeline strategy on a mesh without stages: neither is silently ignored.

    Example:
        >>> pipeline_for("pp", 4, schedule="1f1b").microbatches
        8
    """
    asked = [f"--{k}" for k, v in (("schedule", schedule), ("microbatches", microbatches),
                                   ("repeats", repeats), ("stage-layers", stage_layers))
             if v is not None]  # fmt: skip
    if not composition(strategy).pipelined:
        if asked:
            raise StepConfigError(
                f"{', '.join(asked)} configure a pipeline, but strategy {strategy!r} does not "
                f"pipeline; add pp (e.g. {composition(strategy).name}+pp), or use one of "
                f"{sorted(PIPELINE_STRATEGIES)}, with a 'stage' mesh axis"
            )
        return None
    if stages < 2:
        raise StepConfigError(
            f"strategy {strategy!r} pipelines the layer stack over the 'stage' mesh axis, but the "
            f"mesh has stage={stages}; add stage=N with N >= 2 to --mesh, e.g. 'stage=2,data=4'"
        )
    schedule = schedule or "gpipe"
    return PipelineSpec(
        schedule=schedule,
        microbatches=microbatches or 2 * stages,
        repeats=repeats or (2 if schedule in ("circular", "interleaved") else 1),
        stage_layers=None if stage_layers is None else tuple(stage_layers),
    )


def build_program(
    workload: Workload | Any,
    strategy: str,
    mesh: jshard.Mesh | MeshSpec | str,
    *,
    batch: int,
    seq: int | None = None,
    optimizer: optax.GradientTransformation | None = None,
    accum_steps: int = 1,
    compute_dtype: str = "float32",
    remat: str = "none",
    clip_norm: float | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    repeats: int | None = None,
    stage_layers: tuple[int, ...] | str | None = None,
    devices: list | None = None,
    context_method: str | None = None,
    attention: str | None = None,
) -> TrainProgram:
    """The train step of a `Workload` (or a shipped family module at size tiny) under a strategy.

    Nothing compiles until the program is first used (``program.compiled``, ``report()``,
    ``step``), so ``program.abstract_state`` sizes any model first.

    Args:
        workload: a `Workload` (`Workload.from_family(models.llama, cfg)` for a shipped one).
        strategy: a strategy name (`partition_rules.STRATEGIES`) or a composition of parts
            (``"fsdp+tp+sp+cp+pp"``), applied over the workload's logical names; refused
            (`StrategyMeshError`) where the mesh has an axis none of its parts splits over.
        mesh: a jax Mesh, or a spec built over ``devices`` (default: all devices).
        batch, seq: global batch (sequences or samples per step) and sequence length (default:
            the workload's; ignored by a workload without one).
        optimizer: default ``optax.adamw(1e-3)``.
        accum_steps, compute_dtype, remat, clip_norm: as in `compile_train_step`.
        schedule, microbatches, repeats: the pipeline (see `pipeline_for`).
        stage_layers: layers per virtual stage for balanced stages, e.g. ``(3, 5)``, or
            ``"auto"`` for `sharding.pipeline.balanced_stages` (measured on the workload).
        context_method: how attention runs over a ``context`` axis of the mesh: "ring"
            (default), "allgather" or "ulysses" (`sharding.context`).
        attention: the attention kernel (`models.attention.KINDS`): None or "auto" keeps the
            model's own (for models built from `models.layers`, the backend's flash kernel or
            the pure-JAX blockwise one); "blockwise", "xla", "cudnn" or "splash" substitute the
            workload's kernel of that name (``Workload.attention``) through its kernel seam.

    Example (with ``llama`` the model family module ``models.llama``):
        >>> work = Workload.from_family(llama, llama.config("tiny"))
        >>> program = build_program(work, "fsdp", "fsdp=8", batch=16, seq=32)  # doctest: +SKIP
    """
    work = load_workload(workload)
    if not isinstance(mesh, jshard.Mesh):
        mesh = make_mesh(mesh, devices)
    stages = dict(mesh.shape).get("stage", 1)
    auto = stage_layers == "auto"
    pipeline = pipeline_for(strategy, stages, schedule=schedule, microbatches=microbatches,
                            repeats=repeats, stage_layers=None if auto else stage_layers)  # fmt: skip
    if auto and pipeline is None:  # raises: stage layers asked of a strategy that does not pipe
        pipeline_for(strategy, stages, stage_layers=())
    BoundStrategy.of(strategy, mesh, experts=work.places("experts"))
    context = dict(mesh.shape).get("context", 1)
    if pipeline is not None and dict(mesh.shape).get("expert", 1) > 1:
        check_pipelined_experts(strategy, mesh)
    kernels, batch_order = context_kernels(work, mesh, context_method, seq or work.seq,
                                           None if pipeline is None else pipeline.schedule)  # fmt: skip
    asked = attention not in (None, "auto") and work.kernels is not None
    seam = seam_calls(work, seq or work.seq or 8) if asked else {}
    platform = mesh.devices.flat[0].platform  # a compile-only target's, not this host's
    with jshard.use_abstract_mesh(mesh.abstract_mesh):  # the model's own check sees it too
        chosen = attention_kernels(work, attention, seq or work.seq, context, seam, platform)
    kernels = {**chosen, **kernels, **expert_kernels(work, mesh)}
    if auto and pipeline is not None:
        split = dict(mesh.shape).get("data", 1) * dict(mesh.shape).get("fsdp", 1)
        rows = max(batch // accum_steps // pipeline.microbatches // split, 1)
        counts = balanced_stages(work, pipeline, stages, rows, seq or work.seq)
        pipeline = dataclasses.replace(pipeline, stage_layers=counts)
    return compile_train_step(
        work.model,
        work.loss,
        optax.adamw(1e-3) if optimizer is None else optimizer,
        work.rules,
        work.axis_map(strategy),
        mesh,
        work.batch_shapes(batch, seq or work.seq),
        accum_steps=accum_steps,
        compute_dtype=compute_dtype,
        remat=remat,
        clip_norm=clip_norm,
        pipeline=pipeline,
        stack=work.stack,
        check_batch=work.check_batch,
        kernels=kernels,
        use_kernels=work.kernels,
        batch_order=batch_order,
    )
