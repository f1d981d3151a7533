"""How a train step's pieces are sharded beyond the parameters: optimizer state like its
parameters, the batch over the batch axes, activations pinned between layers, remat policies,
and the sequence layout a strategy's ``"sequence"`` asks for (Megatron sequence parallelism on
``tensor``, the sequence split over ``context``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from jax import sharding as jshard

from sharding._checks import StepConfigError
from sharding._mesh import BATCH_AXES
from sharding._resolve import path_str
from sharding._stack import split_state
from sharding.pipeline import PipelineConfigError

REMAT_POLICIES = ("none", "full", "dots")


class BatchShardingError(StepConfigError):
    """The global batch does not split evenly over the batch mesh axes."""


class AccumulationError(StepConfigError):
    """Gradient accumulation steps do not divide the batch evenly."""


class OptimizerSplitError(StepConfigError):
    """Optimizer state that a strategy splits over a mesh axis (zero1) and cannot be split."""


def remat_wrapper(policy: str) -> Callable | None:
    """The per-layer wrapper for a remat policy name: none, full, or dots.

    dots saves the outputs of the matmuls against weights (dot products without batch
    dimensions: projections, MLP) and recomputes the rest, attention's products included, as
    MaxText's ``dots_with_no_batch_dims_saveable``: saving attention's score products would keep
    ``S x S`` per head (the reference kernel) or every block pair's scores stacked by a flash
    kernel's scan.
    """
    if policy == "none":
        return None
    if policy == "full":
        return jax.checkpoint
    if policy == "dots":
        return functools.partial(
            jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        )
    raise StepConfigError(f"unknown remat policy {policy!r}; choose one of {REMAT_POLICIES}")


def layer_wrapper(remat: str, mesh: jshard.Mesh, sequence: tuple[str, ...] = ()) -> Callable:
    """Wraps the per-layer body of a scanned stack: pins the carried activations to the batch
    sharding at every layer boundary, then applies the remat policy.

    Without the pin, XLA is free to keep FSDP weights sharded and all-reduce activations instead
    (for small models it often does), which is not ZeRO-3; with it, the batch stays split over
    ("data", "fsdp") and a weight sharded over fsdp must be all-gathered where it is used.

    ``sequence``: the mesh axes that also split dim 1 of ``h[B, S, ...]`` at the boundaries
    (the strategy's ``"sequence"``, `sharding._sequence.SequenceLayout`), which adds the pins
    inside the layer that Megatron sequence parallelism needs.
    """
    checkpoint = remat_wrapper(remat)

    def wrap(body: Callable) -> Callable:
        def pinned(h: jax.Array, layer: Any) -> tuple[jax.Array, Any]:
            pin = functools.partial(pin_sequence, mesh=mesh, sequence=sequence)
            out, ys = body(pin(h), layer)
            return pin(out), ys

        return checkpoint(pinned) if checkpoint else pinned

    return wrap


def pin_sequence(h: jax.Array, *, mesh: jshard.Mesh, sequence: tuple[str, ...]) -> jax.Array:
    """``h`` constrained to ``P(BATCH_AXES, sequence or None, None, ...)``."""
    seq = (sequence[0] if len(sequence) == 1 else sequence) if sequence else None
    rest = [seq] if h.ndim > 1 else []
    spec = jshard.PartitionSpec(BATCH_AXES, *rest, *([None] * (h.ndim - 1 - len(rest))))
    return jax.lax.with_sharding_constraint(h, jshard.NamedSharding(mesh, spec))


def check_no_stage_split(param_shardings: Any, mesh: jshard.Mesh) -> None:
    """Without a pipeline, no parameter may be split over a ``stage`` axis larger than 1.

    XLA would compile it as an ordinary step with those weights split over the stage devices:
    every device runs every layer, gathering weights it does not hold. That is neither pipeline
    parallelism nor what a pp preset asks for.
    """
    stages = dict(mesh.shape).get("stage", 1)
    if stages == 1:
        return
    leaves = jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    staged = [path_str(k) for k, s in leaves
              if any("stage" in ((e,) if isinstance(e, str) else (e or ())) for e in s.spec)]  # fmt: skip
    if staged:
        raise StepConfigError(
            f"compile_train_step: {len(staged)} parameters are split over the 'stage' mesh axis "
            f"(stage={stages}; e.g. {staged[0]}) but no pipeline was given; pass "
            f"pipeline=PipelineSpec(...) (spmdkit train: a pp strategy takes --schedule and "
            f"--microbatches), or use a strategy that does not split over 'stage'"
        )


def check_stack_staged(param_shardings: Any, stack: str, mesh: jshard.Mesh) -> None:
    """Under a pipeline every stack parameter is split over ``stage`` on its layer axis."""
    stages = dict(mesh.shape)["stage"]
    inside, _ = split_state(param_shardings, stack)
    leaves = jax.tree_util.tree_flatten_with_path(inside)[0]
    for key, s in leaves:
        first = s.spec[0] if len(s.spec) else None
        first = (first,) if isinstance(first, str) else tuple(first or ())
        if stages > 1 and "stage" not in first:
            raise PipelineConfigError(
                f"mesh has stage={stages} but the stack parameter {stack}/{path_str(key)} has "
                f"layout {s.spec} (its layer axis is not split over 'stage'), so it would not be "
                f"cut into stages; use a pipeline strategy (pp, pp_tp, pp_fsdp), whose rules map "
                f"the layer axis to 'stage' (for your own names: strategy('pp', layers='blocks'))"
            )


def stage_weights_whole_over_fsdp(param_shardings: Any, mesh: jshard.Mesh) -> Any:
    """The parameters' shardings without ``fsdp`` (None when fsdp is 1): under pp_fsdp a stage
    gathers its weights once per step instead of once per layer per tick."""
    if dict(mesh.shape).get("fsdp", 1) == 1:
        return None

    def drop(e: Any) -> Any:
        kept = tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if a != "fsdp")
        return kept[0] if len(kept) == 1 else (kept or None)

    return jax.tree.map(
        lambda s: jshard.NamedSharding(mesh, jshard.PartitionSpec(*map(drop, s.spec))),
        param_shardings,
    )


def check_batch_split(batch_shapes: dict, mesh_shape: dict[str, int], accum_steps: int) -> int:
    """Validate the global batch against the mesh and accumulation; returns the batch size."""
    sizes = {k: v.shape[0] for k, v in batch_shapes.items()}
    if len(set(sizes.values())) != 1:
        raise BatchShardingError(f"batch entries disagree on the batch dimension: {sizes}")
    batch = next(iter(sizes.values()))
    split = math.prod(mesh_shape.get(a, 1) for a in BATCH_AXES)
    # The axes that split it, as the user wrote them (the size-1 ones say nothing).
    split_txt = "x".join(
        f"{a}={mesh_shape.get(a, 1)}" for a in BATCH_AXES if mesh_shape.get(a, 1) > 1
    ) or "x".join(f"{a}=1" for a in BATCH_AXES)
    if accum_steps < 1:
        raise AccumulationError(f"accumulation steps must be >= 1, got {accum_steps}")
    if batch % accum_steps:
        raise AccumulationError(
            f"global batch {batch} is not divisible by {accum_steps} accumulation steps; use a "
            f"batch that is a multiple of {accum_steps} (e.g. {_round_up(batch, accum_steps)}) or "
            f"an accumulation count that divides {batch}"
        )
    micro = batch // accum_steps
    if micro % split:
        what = f"micro-batch {micro} (global batch {batch} / {accum_steps} accumulation steps)"
        if accum_steps == 1:
            what = f"global batch {batch}"
        raise BatchShardingError(
            f"{what} is not divisible by {split_txt} = {split} devices that split the batch; use "
            f"a global batch that is a multiple of {split * accum_steps} "
            f"(e.g. {_round_up(batch, split * accum_steps)}), or fewer data/fsdp/expert devices"
        )
    return batch


def _round_up(n: int, k: int) -> int:
    return max(k, -(-n // k) * k)


def shardings_like_params(tree: Any, params: Any, param_shardings: Any, mesh: jshard.Mesh) -> Any:
    """Shardings for a tree that embeds copies of the parameter tree (optimizer state).

    A leaf takes the sharding of the parameter whose path is the longest suffix of its own path
    and whose shape matches (Adam's ``mu/layers/attn/q/kernel`` -> ``layers/attn/q/kernel``);
    anything else (step counts, scalars) is replicated.
    """
    by_path = {
        path_str(p): (leaf.shape, s)
        for (p, leaf), s in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree.leaves(param_shardings),
            strict=True,
        )
    }
    replicated = jshard.NamedSharding(mesh, jshard.PartitionSpec())

    def pick(key_path: tuple, leaf: Any) -> jshard.NamedSharding:
        parts = path_str(key_path).split("/")
        for i in range(len(parts)):
            hit = by_path.get("/".join(parts[i:]))
            if hit and tuple(hit[0]) == tuple(leaf.shape):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def optimizer_axes(axis_map: Any, sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 the strategy splits the optimizer state over on top of its
    parameters' layouts (its ``"optimizer"`` entry: zero1's ``data``); () for none."""
    if getattr(axis_map, "is_identity", False) or "optimizer" not in axis_map:
        return ()
    return tuple(a for a in axis_map.mesh_axes("optimizer") if sizes.get(a, 1) > 1)


def optimizer_split_dim(local: tuple[int, ...], n: int) -> int | None:
    """The dimension of an array, ``local`` per device under its parameter's layout, that zero1
    splits ``n`` ways: the largest that ``n`` divides (the first of equals); None: kept whole.
    The program (`split_optimizer`), the closed form and `explain` all split by it."""
    fits = [i for i, d in enumerate(local) if d % n == 0]
    return max(fits, key=lambda k: (local[k], -k)) if fits else None


def unsplittable(axes: tuple[str, ...], n: int, path: str, local: tuple[int, ...]) -> Exception:
    """The refusal of a zero1 that splits no array (``path`` one of them, ``local`` its shape)."""
    return OptimizerSplitError(
        f"zero1 splits the optimizer state over {'x'.join(axes)}={n}, and {n} divides no "
        f"dimension of any of its arrays (e.g. {path}, {list(local)} per device under its "
        f"parameter's layout); use a mesh whose {'x'.join(axes)} size divides one of "
        f"{sorted(set(local))}, or drop zero1 from the strategy"
    )


def split_optimizer(
    tree: Any, shardings: Any, axes: tuple[str, ...], mesh: jshard.Mesh
) -> tuple[Any, list[str]]:
    """Optimizer-state ``shardings`` further split over ``axes`` (ZeRO-1), and the paths of the
    arrays kept whole over them. Each array leaf of ``tree`` takes the axes on the dimension
    `optimizer_split_dim` picks, after the axes its parameter's layout already puts there;
    scalars (step counts) stay whole, and so does an array none of whose dimensions they divide
    (a bias of 16 under data=48: listed, `TrainProgram.report` says so).

    Raises:
        OptimizerSplitError: no array could be split, or a parameter's layout uses the axes.
    """
    if not axes:
        return shardings, []
    sizes = dict(mesh.shape)
    n = math.prod(sizes[a] for a in axes)
    whole: list[tuple[str, tuple[int, ...]]] = []

    def entry(e: Any) -> tuple[str, ...]:
        return (e,) if isinstance(e, str) else tuple(e or ())

    def split(key_path: tuple, leaf: Any, s: jshard.NamedSharding) -> jshard.NamedSharding:
        if not getattr(leaf, "shape", ()):
            return s
        spec = list(s.spec) + [None] * (len(leaf.shape) - len(s.spec))
        taken = [a for e in spec for a in entry(e) if a in axes]
        if taken:
            raise OptimizerSplitError(
                f"the optimizer state is to be split over {'x'.join(axes)} on top of its "
                f"parameter's layout, and {path_str(key_path)}'s layout {s.spec} splits over "
                f"{taken[0]} already; split the optimizer state over another mesh axis (zero1: "
                f"data), or drop {taken[0]} from the rules' axis map"
            )
        local = tuple(d // math.prod(sizes[a] for a in entry(e))
                      for d, e in zip(leaf.shape, spec, strict=True))  # fmt: skip
        i = optimizer_split_dim(local, n)
        if i is None:
            whole.append((path_str(key_path), local))
            return s
        merged = entry(spec[i]) + axes
        spec[i] = merged[0] if len(merged) == 1 else merged
        return jshard.NamedSharding(mesh, jshard.PartitionSpec(*spec))

    out = jax.tree_util.tree_map_with_path(split, tree, shardings)
    arrays = [x for x in jax.tree.leaves(tree) if getattr(x, "shape", ())]
    if arrays and len(whole) == len(arrays):
        raise unsplittable(axes, n, *whole[0])
    return out, [p for p, _ in whole]
