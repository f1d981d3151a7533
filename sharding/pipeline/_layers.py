"""One chunk of a stage's layers as explicit VJP pieces: forward keeping residuals, backward,
and zb-h1's split of the backward into input gradient (B) and weight gradient (W).

Used by the explicit schedules' tick scan (`sharding.pipeline._explicit`) and, compiled on one
device, by `sharding.pipeline.stage_work` to measure what each piece costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax import sharding as jshard

from sharding._manual import manual_axes
from sharding._mesh import BATCH_AXES, SEQUENCE_AXIS
from sharding._stack import LayerFn
from sharding.pipeline._split import Split, varying_axes


class Layers:
    """One chunk of layers as explicit VJP pieces over their stacked weights ``[Lr, ...]``.

    A layer's residuals are the leaves of its `jax.vjp` pullback (a pytree whose static part is
    the linearized program); those that are the layer's own weights are dropped and read back
    from the weights, the rest are stacked over layers and stored per micro-batch.
    """

    def __init__(self, layer_fn: LayerFn, wrap: Callable | None, floats: list[bool],
                 spread: bool = True):  # fmt: skip
        self.layer_fn, self.wrap, self.floats = layer_fn, wrap, floats
        self.spread = spread  # each tensor rank sends its share between stages (`shift_spread`)
        self.tree: Any = None
        self.weight_of: list[int] = []  # per pullback leaf: the weight leaf it is, or -1
        # Lock-step lanes (`sharding.pipeline._explicit`): a spare layer slot is computed and
        # discarded instead of skipped, so every stage runs the same collectives.
        self.lockstep = False

    def _branch(self, ok: jax.Array, run: Callable, skip: Callable, *ops: Any) -> Any:
        if not self.lockstep:
            return lax.cond(ok, uniform(run), uniform(skip), *ops)
        return jax.tree.map(lambda a, b: jnp.where(ok, a, b), uniform(run)(*ops),
                            uniform(skip)(*ops))  # fmt: skip

    def _layer(self, ex: list) -> Callable:
        def layer(w_l: Any, h: jax.Array, fex: list) -> jax.Array:
            it = iter(fex)
            arrays = [next(it) if f else e for e, f in zip(ex, self.floats, strict=True)]
            return self.layer_fn(w_l, h, arrays)

        return layer if self.wrap is None else self.wrap(layer)

    def forward(
        self, w: Any, x: jax.Array, fex: list, ex: list, valid: jax.Array | None = None
    ) -> tuple[jax.Array, list]:
        """``(y, residuals)``: the chunk's output and its residuals, each stacked ``[Lr, ...]``.
        ``valid``: ``[Lr]`` bools, False for a balanced stage's spare layer slots (skipped)."""
        layer = self._layer(ex)

        def run(w_l: Any, h: jax.Array) -> tuple[jax.Array, list]:
            y, pullback = jax.vjp(layer, w_l, h, fex)
            leaves, self.tree = jax.tree.flatten(pullback)
            weights = jax.tree.leaves(w_l)
            self.weight_of = [next((j for j, a in enumerate(weights) if a is leaf), -1)
                              for leaf in leaves]  # fmt: skip
            return y, [x for x, j in zip(leaves, self.weight_of, strict=True) if j < 0]

        if valid is None:
            return lax.scan(lambda h, w_l: run(w_l, h), x, w)
        shapes = jax.eval_shape(run, jax.tree.map(lambda a: a[0], w), x)[1]

        def skip(w_l: Any, h: jax.Array) -> tuple[jax.Array, list]:
            return h, [jnp.zeros(a.shape, a.dtype) for a in shapes]

        def body(h: jax.Array, xs: tuple) -> tuple[jax.Array, list]:
            w_l, ok = xs
            return self._branch(ok, run, skip, w_l, h)

        return lax.scan(body, x, (w, valid))

    def _pullback(self, w_l: Any, res: list) -> Callable:
        weights, it = jax.tree.leaves(w_l), iter(res)
        leaves = [weights[j] if j >= 0 else next(it) for j in self.weight_of]
        return jax.tree.unflatten(self.tree, leaves)

    def _flat_pullback(self, w_l: Any, r_l: list, g: jax.Array) -> list:
        dw_l, dh, dfex_l = self._pullback(w_l, r_l)(g)
        return [*jax.tree.leaves(dw_l), dh, *dfex_l]

    def _split(self, w_l: Any, r_l: list, g: jax.Array) -> Split:
        return Split(self._flat_pullback, [w_l, r_l, g], len(jax.tree.leaves(w_l)), keep={0, 1})

    def backward(self, w: Any, res: list, ct: jax.Array, fex: list, *, weights: bool,
                 valid: jax.Array | None = None) -> tuple:  # fmt: skip
        """``(dx, dfex, dw or W's inputs)``: the whole backward, or (zb-h1's B) the input
        gradient only, handing each layer's boundary values (`Split`) to `weight_grad`."""

        def run(w_l: Any, r_l: list, g: jax.Array) -> tuple:
            if weights:
                dw_l, dh, dfex_l = self._pullback(w_l, r_l)(g)
                return dh, dfex_l, dw_l
            (dh, *dfex_l), boundary = self._split(w_l, r_l, g).input_grads([w_l, r_l, g])
            return dh, dfex_l, boundary

        def body(carry: tuple, xs: tuple) -> tuple[tuple, Any]:
            g, dfex = carry
            w_l, r_l, ok = xs
            if valid is None:
                dh, dfex_l, out = run(w_l, r_l, g)
            else:
                shapes = jax.eval_shape(run, w_l, r_l, g)[2]

                def skip(w_l: Any, r_l: list, g: jax.Array) -> tuple:
                    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
                    return g, [jnp.zeros_like(e) for e in fex], zeros

                dh, dfex_l, out = self._branch(ok, run, skip, w_l, r_l, g)
            dfex = [a + b for a, b in zip(dfex, dfex_l, strict=True)]
            return (dh, dfex), out

        zeros = [jnp.zeros_like(e) for e in fex]
        ok = jnp.ones(jax.tree.leaves(w)[0].shape[0], bool) if valid is None else valid
        (dx, dfex), out = lax.scan(body, (ct, zeros), (w, res, ok), reverse=True)
        return dx, dfex, out

    def weight_grad(self, w: Any, res: list, boundary: list, like: jax.Array,
                    valid: jax.Array | None = None) -> Any:  # fmt: skip
        """zb-h1's W: each layer's weight gradient from its residuals and B's boundary values
        (``like``: a value typed as the layer's output gradient, to trace the same split)."""

        def run(w_l: Any, r_l: list, b_l: list) -> Any:
            dw = self._split(w_l, r_l, like).weight_grads([w_l, r_l], b_l)
            return jax.tree.unflatten(jax.tree.structure(w_l), dw)

        def skip(w_l: Any, r_l: list, b_l: list) -> Any:
            return jax.tree.map(jnp.zeros_like, w_l)

        def body(_: None, xs: tuple) -> tuple[None, Any]:
            w_l, r_l, b_l, ok = xs
            if valid is None:
                return None, run(w_l, r_l, b_l)
            return None, self._branch(ok, run, skip, w_l, r_l, b_l)

        ok = jnp.ones(jax.tree.leaves(w)[0].shape[0], bool) if valid is None else valid
        return lax.scan(body, None, (w, res, boundary, ok))[1]


P = jshard.PartitionSpec


def auto_batch_axes() -> tuple[str, ...]:
    """The batch axes the pipeline's shard_map leaves automatic (data is manual in it, and
    expert where the mesh has one: `replicas`)."""
    return tuple(a for a in BATCH_AXES if a not in manual_axes())


def shift_spread(x: jax.Array, shift: Callable[[jax.Array], jax.Array], spread: bool = True,
                 axis: str = "tensor") -> jax.Array:  # fmt: skip
    """``shift(x)`` (a stage's activations or cotangents crossing to a neighbour stage), each
    ``axis`` rank sending its share: Megatron's scatter/gather (Narayanan et al. 2021, §4.1).

    After a row-parallel layer every tensor rank holds the whole activation. Split along its
    first dimension after the batch that ``axis`` divides, each rank sends 1/t of it, and the
    receiving stage gathers it whole over its own links: t times fewer bytes between stages,
    which are often nodes apart, for one gather inside the stage. Pinned split on both sides of
    the shift and whole around them, so the split stays at the crossing. ``spread=False`` where
    the activations cross split already (Megatron SP); a plain shift where ``axis`` is absent,
    of size 1, manual here, or divides no dimension. The first pin assumes what a tensor-parallel
    stage leaves: activations whole over ``axis`` (one split otherwise would be gathered first).
    """
    mesh = jax.sharding.get_abstract_mesh()
    size = dict(mesh.shape).get(axis, 1)
    dims = [d for d in range(1, x.ndim) if x.shape[d] % size == 0]
    if not spread or size <= 1 or axis in manual_axes() or not dims:
        return shift(x)
    whole = [auto_batch_axes() or None] + [None] * (x.ndim - 1)
    split = list(whole)
    split[dims[0]] = axis

    def pin(v: jax.Array, spec: list) -> jax.Array:
        return lax.with_sharding_constraint(v, jshard.NamedSharding(mesh, P(*spec)))

    return pin(pin(shift(pin(pin(x, whole), split)), split), whole)


def varying(x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """``lax.pcast(x, axes, to="varying")`` whose transpose, the psum of x's cotangent over
    ``axes``, runs in float32: gradients of bfloat16 weights are summed in float32 (and XLA:CPU
    cannot promote a bfloat16 all-reduce whose reducer Shardy tagged with a sharding)."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float32:
        return lax.pcast(x, axes, to="varying")
    return lax.pcast(x.astype(jnp.float32), axes, to="varying").astype(x.dtype)


def psum32(x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """``lax.psum`` computed in float32 for floating-point x (see `varying`)."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float32:
        return lax.psum(x, axes)
    return lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)


def replicas(sequence: tuple[str, ...], mesh: jshard.Mesh) -> tuple[str, ...]:
    """The axes a pipeline's shard_map is manual over besides ``stage``: ``data`` (so the
    gradients' reduction can be placed once per step); ``fsdp``, the weights entering the stages
    gathered whole over it once per step (`Staging.gathered`, still split over tensor) and their
    gradients summed over it once (left automatic, XLA's partitioner reduced them over fsdp at
    every tick, 2.3x the step's bytes for pp_fsdp on llama tiny, and aborts with fsdp and tensor
    both automatic inside a region manual over stage, a CHECK failure in its device groups; a
    gather inside the region gathered tensor-split weights over tensor too); ``expert``
    when the mesh has one, as the batch axis it also is, so that the experts' kernel runs on each
    device's tokens and experts directly; and ``context`` when the sequence is split over it, so
    that the attention kernels run on each device's slice directly (a shard_map nested in this
    one cannot be differentiated on jax 0.10). A stage weight not split over one of them is
    replicated over it, its gradient summed over it (`own_axes`)."""
    sizes = dict(mesh.shape)
    context = tuple(a for a in sequence if a == SEQUENCE_AXIS)
    fsdp = ("fsdp",) if sizes.get("fsdp", 1) > 1 else ()
    expert = ("expert",) if sizes.get("expert", 1) > 1 else ()
    return ("data", *fsdp, *expert, *context)


def stage_weights(layers: Any, dims: list | None, reps: tuple[str, ...]) -> Any:
    """This stage's weights ``[r, Lr, ...]`` (of ``[1, r, Lr, ...]``) as its layers use them:
    cast varying over the manual axes each is replicated on, once, outside the tick loop (the
    transpose, the gradient's psum over them, then runs once per step)."""
    return per_leaf(lambda a, d: varying(a[0], own_axes(d, reps)), layers, dims)


def summed_grad(g: jax.Array, d: tuple | None, reps: tuple[str, ...]) -> jax.Array:
    """A stage weight's gradient summed over the manual axes it is replicated on (the explicit
    schedules' transpose of `stage_weights`)."""
    return psum32(g, own_axes(d, reps))


def psum_scatter32(x: jax.Array, axis: str, dimension: int = 0) -> jax.Array:
    """``lax.psum_scatter`` over ``dimension`` (tiled), in float32 for floating-point x (see
    `varying`)."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float32:
        return lax.psum_scatter(x, axis, scatter_dimension=dimension, tiled=True)
    wide = x.astype(jnp.float32)
    return lax.psum_scatter(wide, axis, scatter_dimension=dimension, tiled=True).astype(x.dtype)


def row_axes(reps: tuple[str, ...]) -> tuple[str, ...]:
    """The manual axes that split the batch's rows (all but context)."""
    return tuple(a for a in reps if a != SEQUENCE_AXIS)


def micro_spec(x: jax.Array, reps: tuple[str, ...], seq: int | None) -> P:
    """The pipeline's spec of micro-batches ``x [m, b, ...]``: rows over the manual batch axes,
    and the sequence over context (when manual) for an array whose dim 2 is the sequence."""
    context = tuple(a for a in reps if a == SEQUENCE_AXIS)
    return P(None, row_axes(reps), *seq_tail(x.shape[1:], context, seq))


def layer_spec(dims: tuple | None) -> P:
    """The spec of a stage weight viewed ``[p, r, Lr, ...]``: over stage, and over the manual
    axes ``dims`` names for its own dimensions (an expert's weights over expert)."""
    return P("stage", None, None, *dims) if dims else P("stage")


def per_leaf(fn: Callable, tree: Any, dims: list | None) -> Any:
    """``fn(leaf, its dims)`` over the leaves of ``tree`` (dims None: None for every leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    dims = [None] * len(leaves) if dims is None else dims
    return jax.tree.unflatten(treedef, [fn(x, d) for x, d in zip(leaves, dims, strict=True)])


def own_axes(dims: tuple | None, reps: tuple[str, ...]) -> tuple[str, ...]:
    """The manual axes a weight is replicated over (its gradient summed over them)."""
    split = {a for e in dims or () for a in ((e,) if isinstance(e, str) else e or ())}
    return tuple(a for a in reps if a not in split)


def seq_tail(shape: tuple, sequence: tuple[str, ...], seq: int | None) -> list:
    """The spec entries after the batch's of an array shaped ``[B, ...]``: ``sequence`` on
    dim 1 where it is the stack's sequence (length ``seq``), None elsewhere."""
    rest: list = [None] * (len(shape) - 1)
    if sequence and rest and shape[1] == seq:
        rest[0] = sequence[0] if len(sequence) == 1 else sequence
    return rest


def uniform(fn: Callable) -> Callable:
    """``fn`` with every floating output varying over every manual axis, so that a `lax.cond`
    between a layer and its skip (whose zeros vary over nothing) has one output type."""

    def run(*args: Any) -> Any:
        def cast(x: jax.Array) -> jax.Array:
            missing = tuple(sorted(manual_axes() - varying_axes(x)))
            return lax.pcast(x, missing, to="varying") if missing else x

        return jax.tree.map(cast, fn(*args))

    return run
