"""One compiled SPMD training step for any data / FSDP / tensor-parallel layout.

The layout is entirely in the shardings: parameters from the rules, optimizer state like its
parameters, the batch split over ``("data", "fsdp")``. XLA's SPMD partitioner inserts the
collectives, so DP, FSDP, TP and their hybrids are the same program text with different
shardings, and the model code never changes between strategies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import sharding as jshard

from partition_rules import AxisMap, Rules
from sharding._checks import (
    StepConfigError,
    check_batch_shapes,
    check_callable,
    check_clip,
    check_mesh,
    check_optimizer,
    check_positive_int,
    check_rules,
    takes_remat,
)
from sharding._init import abstract_params
from sharding._layout import StepLayout
from sharding._program import TrainProgram
from sharding._sequence import SequenceLayout
from sharding._shardings import (  # noqa: F401  (re-exported: the errors are the step's)
    AccumulationError,
    BatchShardingError,
    check_batch_split,
    layer_wrapper,
    remat_wrapper,
)
from sharding._stack import StackError, find_stack, n_layers, scan_call, taken_over
from sharding.pipeline import PipelineSpec, Schedule, check_pipeline, pipelined_loss

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compile_train_step(
    make_model: Callable[[nnx.Rngs], nnx.Module],
    loss_fn: Callable[..., jax.Array],
    optimizer: optax.GradientTransformation,
    rules: Rules,
    axis_map: AxisMap,
    mesh: jshard.Mesh,
    batch_shapes: dict[str, jax.ShapeDtypeStruct],
    *,
    accum_steps: int = 1,
    compute_dtype: str = "float32",
    remat: str = "none",
    clip_norm: float | None = None,
    pipeline: PipelineSpec | None = None,
    stack: str | None = None,
    check_batch: Callable[[dict], None] | None = None,
    kernels: Mapping[str, Callable] | None = None,
    use_kernels: Callable[..., Any] | None = None,
    batch_order: Callable[[dict], dict] | None = None,
) -> TrainProgram:
    """Build the sharded training step of a model under (rules, axis_map) on `mesh`.

    Args:
        make_model: ``rngs -> nnx.Module``; called abstractly for shapes and inside the jitted
            initialiser for values.
        loss_fn: ``(model, batch) -> scalar``, e.g. `models.llama.loss`; run as written under
            every strategy and pipeline schedule.
        optimizer: any optax transformation; its state is sharded like the parameters.
        rules, axis_map: a preset, e.g. ``partition_rules.preset("llama", "fsdp_tp")``.
        mesh: the device mesh (`sharding.make_mesh`).
        batch_shapes: the global batch as ``{name: ShapeDtypeStruct}``; dim 0 is the batch.
        accum_steps: micro-steps per optimizer step, run as a `lax.scan` (the batch is split).
        compute_dtype: "float32", or "bfloat16" with float32 master weights (the loss and softmax
            stay float32 inside the models).
        remat: "none", "full" (recompute each layer in backward), "dots" (save matmul outputs);
            applied by spmdkit to each layer of ``stack``.
        clip_norm: clip gradients to this global norm (optax.clip_by_global_norm) if given.
        pipeline: pipeline ``stack`` over the ``stage`` axis (`PipelineSpec`); its parameters
            must be split over ``stage`` on their layer axis (a pp, pp_tp or pp_fsdp strategy).
        stack: module path of the model's layer stack ("layers", "decoder/blocks"): a module
            built by `models.layers.make_stacked` (or any whose class names ``layer_class``) that
            the model calls once as ``self.blocks(h, *extras)``. spmdkit takes over that call to
            pin activations between layers, apply ``remat`` and pipeline; None: no stack.
        check_batch: ``batch -> None``, raising for a host batch the model cannot take (token
            ids outside the vocabulary); `TrainProgram.shard_batch` calls it.
        kernels: ``{name: fn}`` distributed kernels (context-parallel attention, expert-parallel
            experts) that replace the model's own while the loss is traced, through
            ``use_kernels`` (the workload's `models.kernels.use`); None: the model's own.
        batch_order: ``micro-batch -> micro-batch`` before the loss (`sharding.context`'s reorder).

    Example (with ``llama`` the model family module ``models.llama``):
        >>> from partition_rules import preset
        >>> cfg = llama.config("tiny")
        >>> program = compile_train_step(  # doctest: +SKIP
        ...     lambda rngs: llama.Model(cfg, rngs=rngs), llama.loss, optax.adamw(1e-3),
        ...     *preset("llama", "fsdp_tp"), make_mesh("data=2,fsdp=2,tensor=2"),
        ...     llama.batch_shapes(cfg, 8, 64))
        >>> state = program.init(seed=0)  # doctest: +SKIP
        >>> state, metrics = program.step(state, batch)  # doctest: +SKIP
    """
    fn = "compile_train_step"
    dtype = _checked(fn, make_model, loss_fn, optimizer, rules, axis_map, mesh, batch_shapes,
                     accum_steps, check_batch, clip_norm, kernels, use_kernels, pipeline,
                     compute_dtype)  # fmt: skip
    sequence = SequenceLayout.of(axis_map, mesh, pipeline=pipeline, stack=stack,
                                 kernels=kernels or {})  # fmt: skip
    wrap = layer_wrapper(remat, mesh, sequence.axes)
    # Without a stack, a loss with a remat= keyword applies the policy itself (the layer wrapper).
    remat_kw = stack is None and takes_remat(loss_fn)
    check_batch_split(batch_shapes, dict(mesh.shape), accum_steps)
    if clip_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)

    graphdef, params = abstract_params(lambda: make_model(nnx.Rngs(0)))
    schedule = _schedule(fn, graphdef, params, pipeline, stack, mesh, batch_shapes, accum_steps)
    opt_state = jax.eval_shape(optimizer.init, params)
    layout = StepLayout.of(rules, axis_map, mesh, params, opt_state, sequence=sequence,
                           stack=stack, schedule=schedule, fn=fn,
                           stage_layers=pipeline.stage_layers if pipeline else None)  # fmt: skip
    if remat != "none" and stack is None and not remat_kw:
        raise StepConfigError(
            f"{fn}(remat={remat!r}): spmdkit applies a remat policy to each layer of the model's "
            f"layer stack, and no stack was named; pass stack='<module path>' (e.g. "
            f"stack='layers'), or use remat='none'"
        )

    def init(seed: jax.Array) -> dict[str, Any]:
        model = make_model(nnx.Rngs(jax.random.key(seed)))
        p = nnx.state(model, nnx.Param)
        return {"params": p, "opt_state": optimizer.init(p), "step": jnp.zeros((), jnp.int32)}

    def micro_loss(p: Any, micro: dict[str, jax.Array]) -> jax.Array:
        if batch_order is not None:
            micro = batch_order(micro)
        if not kernels:
            return _micro_loss(p, micro)
        with use_kernels(**kernels):
            return _micro_loss(p, micro)

    def _micro_loss(p: Any, micro: dict[str, jax.Array]) -> jax.Array:
        cast = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p
        )
        model = nnx.merge(graphdef, cast)
        if layout.staging is not None:
            return pipelined_loss(loss_fn, model, micro, layout.staging, remat_wrapper(remat))
        if stack is None:
            return loss_fn(model, micro, remat=wrap) if remat_kw else loss_fn(model, micro)
        run = sequence.runner(wrap) or (lambda call: scan_call(call, wrap))
        with taken_over(model, stack, run) as calls:
            value = loss_fn(model, micro)
        if not calls:
            raise StackError(
                f"the loss never called the stack {stack!r}; spmdkit applies remat and pipelines "
                f"through that call, so the model must apply its layers as "
                f"self.{stack.rsplit('/', 1)[-1]}(h, ...) (not with a function of the module)"
            )
        return value

    if stack is not None:
        # Trace once now (abstractly: nothing runs or compiles) so that a model the stack seam
        # cannot take is refused here, by name, not at the first step.
        micro = {k: jax.ShapeDtypeStruct((v.shape[0] // accum_steps, *v.shape[1:]), v.dtype)
                 for k, v in batch_shapes.items()}  # fmt: skip
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the devices' platform
            jax.eval_shape(micro_loss, params, micro)
    return _program(layout, graphdef, params, opt_state, init, micro_loss, optimizer,
                    batch_shapes, accum_steps, schedule, pipeline, check_batch)  # fmt: skip


def _checked(fn: str, make_model: Any, loss_fn: Any, optimizer: Any, rules: Any, axis_map: Any,
             mesh: Any, batch_shapes: Any, accum_steps: Any, check_batch: Any, clip_norm: Any,
             kernels: Any, use_kernels: Any, pipeline: Any, compute_dtype: Any) -> Any:  # fmt: skip
    """The arguments' types and values, refused by name before anything is traced; returns the
    compute dtype."""
    check_callable(fn, "make_model", make_model, "a function rngs -> nnx.Module")
    check_callable(fn, "loss_fn", loss_fn, "a loss function (model, batch, *, remat) -> scalar")
    check_optimizer(fn, optimizer)
    check_rules(fn, rules, axis_map)
    check_mesh(fn, mesh)
    check_batch_shapes(fn, batch_shapes)
    check_positive_int(fn, "accum_steps", accum_steps)
    if check_batch is not None:
        check_callable(fn, "check_batch", check_batch, "a function batch -> None, or None")
    check_clip(fn, clip_norm)
    if kernels and use_kernels is None:
        raise StepConfigError(
            f"{fn}(kernels={sorted(kernels)}): substituting the model's kernels needs the model's "
            f"hook, use_kernels= (models.kernels.use for models built from models.layers; a "
            f"Workload passes its own kernels field)"
        )
    if pipeline is not None and not isinstance(pipeline, PipelineSpec):
        raise StepConfigError(
            f"{fn}(pipeline={pipeline!r}): expected a sharding.pipeline.PipelineSpec or None, e.g. "
            f"PipelineSpec('1f1b', microbatches=8)"
        )
    if compute_dtype not in COMPUTE_DTYPES:
        raise StepConfigError(
            f"unknown compute dtype {compute_dtype!r}; choose one of {list(COMPUTE_DTYPES)}"
        )
    return COMPUTE_DTYPES[compute_dtype]


def _schedule(fn: str, graphdef: Any, params: Any, pipeline: PipelineSpec | None,
              stack: str | None, mesh: jshard.Mesh, batch_shapes: dict,
              accum_steps: int) -> Schedule | None:  # fmt: skip
    """The pipeline's schedule checked against the stack's depth and each micro-step's rows
    (None without a pipeline)."""
    if pipeline is not None and stack is None:
        raise StepConfigError(
            f"{fn}(pipeline={pipeline.schedule!r}): a pipeline splits the model's layer stack "
            f"into stages; name it with stack='<module path>' (e.g. stack='layers')"
        )
    if stack is not None:
        depth = n_layers(find_stack(nnx.merge(graphdef, params), stack))
    if pipeline is None:
        return None
    batch = next(iter(batch_shapes.values())).shape[0]
    return check_pipeline(pipeline, mesh, depth, batch // accum_steps)


def _program(layout: StepLayout, graphdef: Any, params: Any, opt_state: Any, init: Callable,
             micro_loss: Callable, optimizer: optax.GradientTransformation, batch_shapes: dict,
             accum_steps: int, schedule: Schedule | None, pipeline: PipelineSpec | None,
             check_batch: Callable | None) -> TrainProgram:  # fmt: skip
    """The jitted initialiser, step, gradient and loss of ``micro_loss`` under ``layout``, with
    ``accum_steps`` micro-steps summed per step."""
    grad_fn = jax.value_and_grad(micro_loss)
    batch_shardings, micro_shardings = layout.batch(batch_shapes)  # after the trace
    param_shardings, state_shardings = layout.params, layout.state

    def accumulate(p: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        if accum_steps == 1:
            return grad_fn(p, batch)

        def split(x: jax.Array, micro_sharding: jshard.NamedSharding) -> jax.Array:
            # [B, ...] -> [B/k, k, ...] -> [k, B/k, ...]: each device keeps its own rows, so the
            # split costs no communication; micro-batch i takes every k-th row.
            x = x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:])
            return jax.lax.with_sharding_constraint(jnp.swapaxes(x, 0, 1), micro_sharding)

        def body(carry: tuple, micro: dict[str, jax.Array]) -> tuple[tuple, None]:
            loss_sum, grad_sum = carry
            loss, grads = grad_fn(p, micro)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, p)
        (loss_sum, grad_sum), _ = jax.lax.scan(
            body, (jnp.zeros(()), zeros), jax.tree.map(split, batch, micro_shardings)
        )
        return loss_sum / accum_steps, jax.tree.map(lambda g: g / accum_steps, grad_sum)

    def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict, dict]:
        loss, grads = accumulate(state["params"], batch)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    replicated = layout.replicated
    init_fn = jax.jit(init, out_shardings=state_shardings)
    grad_only = jax.jit(
        accumulate,
        in_shardings=(param_shardings, batch_shardings),
        out_shardings=(replicated, param_shardings),
    )
    eval_fn = jax.jit(
        micro_loss, in_shardings=(param_shardings, batch_shardings), out_shardings=replicated
    )
    step_fn = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    abstract_state = {
        "params": params,
        "opt_state": opt_state,
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    return TrainProgram(
        mesh=layout.mesh,
        graphdef=graphdef,
        abstract_state=abstract_state,
        state_shardings=state_shardings,
        batch_shardings=batch_shardings,
        batch_shapes=dict(batch_shapes),
        accum_steps=accum_steps,
        _init_fn=init_fn,
        _step_fn=step_fn,
        _grad_fn=grad_only,
        _eval_fn=eval_fn,
        schedule=schedule,
        pipeline=pipeline,
        check_batch=check_batch,
        unused_rules=layout.unused_rules,
        optimizer_whole=layout.optimizer_whole,
    )
