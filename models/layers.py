"""Building blocks of the model families, public for your own: dense and norm modules,
attention, RoPE, loss, layer stacking.

No device or sharding logic lives here (nor anywhere in `models`): parameters are plain
`nnx.Param` arrays whose "/"-joined state paths are matched by the partition rules elsewhere.

Shape suffixes used in names: B batch, S query positions, T key positions, D model width,
N query heads, K key/value heads, H head width, F feed-forward width, V vocabulary, L layers.

Dtypes: parameters are created in float32. Computation runs in the dtype of the activations,
which the model's entry (embedding lookup or input projection) takes from the parameters, so a
trainer that casts the parameters to bfloat16 gets a bfloat16 forward. Weights are cast to the
activation dtype at each use (a no-op when they already agree), so mixing never trips strict dtype
promotion. Only norm statistics, attention softmax and the loss run in float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models import attention, kernels

__all__ = [
    "Dense",
    "Embed",
    "LayerNorm",
    "RMSNorm",
    "Remat",
    "SelfAttention",
    "causal_attention",
    "cross_entropy",
    "layer",
    "layer_class",
    "layer_norm",
    "make_stacked",
    "normal",
    "residual_std",
    "rms_norm",
    "rope",
    "scan_layers",
]

# A per-layer wrapper such as `jax.checkpoint` (rematerialisation), applied to the scan body.
Remat = Callable[[Callable], Callable]


def normal(key: jax.Array, shape: Sequence[int], std: float) -> jax.Array:
    """float32 normal(0, std**2) initial values, drawn in their final shape.

    Drawn in shape (not flat and reshaped) so a jitted init gives bit-identical values under any
    out_shardings: with a flat draw the scale multiply lands in different fusions per sharding
    and can differ by one ulp.
    """
    return std * jax.random.normal(key, tuple(shape), jnp.float32)


class Dense(nnx.Module):
    """`y = x . kernel (+ bias)`, contracting the last `len(in_shape)` axes of x.

    The kernel has shape `(*in_shape, *out_shape)`, so attention projections keep their head axes
    (`q/kernel [D, N, H]`, `o/kernel [N, H, D]`) and partition rules can name each one.

    Example:
        >>> q = Dense((64,), (4, 16), std=0.02, rngs=nnx.Rngs(0))
        >>> q(jnp.ones((2, 8, 64))).shape
        (2, 8, 4, 16)
    """

    def __init__(
        self,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        *,
        std: float,
        use_bias: bool = False,
        rngs: nnx.Rngs,
    ):
        self.n_in = len(in_shape)
        self.kernel = nnx.Param(normal(rngs.params(), (*in_shape, *out_shape), std))
        self.bias = nnx.Param(jnp.zeros(tuple(out_shape), jnp.float32)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.tensordot(x, self.kernel[...].astype(x.dtype), axes=self.n_in)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class Embed(nnx.Module):
    """Token table `embedding [V, D]`: lookup, and `attend` for tied output heads."""

    def __init__(self, num: int, dim: int, *, std: float, rngs: nnx.Rngs):
        self.embedding = nnx.Param(normal(rngs.params(), (num, dim), std))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x_BSD: jax.Array) -> jax.Array:
        """Logits against the table: `x @ embedding.T`."""
        return jnp.einsum("...d,vd->...v", x_BSD, self.embedding[...].astype(x_BSD.dtype))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMS norm over the last axis; statistics in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis; statistics in float32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return normed.astype(x.dtype) * scale.astype(x.dtype) + bias.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Learned `scale [D]` (ones at init) over an RMS norm of the last axis."""

    def __init__(self, dim: int, *, eps: float):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class LayerNorm(nnx.Module):
    """LayerNorm with `scale [D]` (ones) and `bias [D]` (zeros)."""

    def __init__(self, dim: int, *, eps: float):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], self.eps)


def rope(x_BSNH: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half convention, as Llama in HF transformers).

    Pairs feature i with i + H/2 and rotates the pair by `position * theta**(-2i/H)`, so the dot
    product of a rotated query and key depends only on their position difference.

    Args:
        x_BSNH: queries or keys, `[..., S, N, H]` with H even.
        positions: `[S]` or `[B, S]` integer positions.
        theta: base wavelength (10_000 for Llama 2, 500_000 for Llama 3).
    """
    half = x_BSNH.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., S, H/2]
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]  # broadcast over heads
    x1, x2 = jnp.split(x_BSNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSNH.dtype)


def causal_attention(q_BSNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """Causal softmax attention with grouped-query support, the whole score matrix at once.

    Each of the K key/value heads serves N/K consecutive query heads, matching Llama's
    grouped-query attention. Scores and softmax run in float32. The reference kernel
    (``attention="xla"``, `models.attention.xla_attention`); `SelfAttention` runs
    `models.attention.auto_attention` (flash-style, memory linear in the sequence) by default.

    Returns:
        `[B, S, N, H]` in q's dtype.
    """
    n_heads, n_kv = q_BSNH.shape[-2], k_BTKH.shape[-2]
    if n_heads % n_kv:
        raise ValueError(f"query heads ({n_heads}) must be a multiple of kv heads ({n_kv})")
    return attention.xla_attention(q_BSNH, k_BTKH, v_BTKH)


class SelfAttention(nnx.Module):
    """Causal self-attention with projections `q, k, v: [D, N|K, H]` and `o: [N, H, D]`.

    `rope_theta=None` means no rotary embedding (GPT-2 uses learned positions instead).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        std: float,
        out_std: float,
        use_bias: bool,
        rope_theta: float | None,
        rngs: nnx.Rngs,
    ):
        self.rope_theta = rope_theta
        self.q = Dense((d_model,), (n_heads, head_dim), std=std, use_bias=use_bias, rngs=rngs)
        self.k = Dense((d_model,), (n_kv_heads, head_dim), std=std, use_bias=use_bias, rngs=rngs)
        self.v = Dense((d_model,), (n_kv_heads, head_dim), std=std, use_bias=use_bias, rngs=rngs)
        self.o = Dense((n_heads, head_dim), (d_model,), std=out_std, use_bias=use_bias, rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        q_BSNH, k_BSKH, v_BSKH = self.q(x_BSD), self.k(x_BSD), self.v(x_BSD)
        if self.rope_theta is not None:
            # Through the kernel seam: a caller that reorders the sequence (context-parallel
            # load balancing) says where each slot really sits.
            positions_S = kernels.resolve("positions", kernels.default_positions)(x_BSD.shape[1])
            q_BSNH = rope(q_BSNH, positions_S, self.rope_theta)
            k_BSKH = rope(k_BSKH, positions_S, self.rope_theta)
        attend = kernels.resolve("attention", attention.auto_attention)
        return self.o(attend(q_BSNH, k_BSKH, v_BSKH))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over all positions; logits are cast to float32 first.

    Example:
        >>> round(float(cross_entropy(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3), jnp.int32))), 4)
        2.0794
    """
    x = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(x, axis=-1) - picked)


def make_stacked(make_block: Callable[[nnx.Rngs], nnx.Module], n_layers: int, rngs: nnx.Rngs):
    """Build `n_layers` independent blocks stacked on a leading axis of every parameter.

    Uses `nnx.split_rngs` + `nnx.vmap`, so each layer gets its own key and the result is one
    module whose params have shape `[n_layers, ...]` (the axis partition rules and pipelines cut
    on). Its parameter paths are the block's own (``layers/attn/q/kernel``), and calling it
    applies the layers in order: ``stack(h, *extras, **kw_extras)`` runs
    ``block(h, *extras, **kw_extras)`` once per layer in a `jax.lax.scan`, every layer seeing the
    same extra inputs (positions, masks, segment ids). That call is the seam spmdkit drives: it
    pipelines the stack or wraps each layer in a remat policy by taking over exactly this call.

    Example:
        >>> stack = make_stacked(lambda r: Dense((8,), (8,), std=0.1, rngs=r), 3, nnx.Rngs(0))
        >>> stack.kernel.shape, stack(jnp.ones((2, 8))).shape
        ((3, 8, 8), (2, 8))
        >>> layer_class(stack).__name__
        'Dense'
    """

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> nnx.Module:
        return make_block(rngs)

    stack = create(rngs)
    stack.__class__ = _stacked_class(type(stack))
    return stack


@functools.cache
def _stacked_class(block_class: type) -> type:
    """``Stacked[Block]``: the block's class whose call scans over the leading layer axis.

    A subclass, so a stack is still a ``Block`` to `isinstance` and to anything that walks
    modules, and its state has exactly the block's parameter paths.
    """

    def __call__(self, h: jax.Array, *extras, remat: Remat | None = None, **kw_extras):
        return scan_layers(self, h, *extras, remat=remat, **kw_extras)

    name = f"Stacked[{block_class.__name__}]"
    return type(name, (block_class,), {"__call__": __call__, "layer_class": block_class,
                                       "__qualname__": name, "__module__": block_class.__module__})  # fmt: skip


def layer_class(stack: nnx.Module) -> type | None:
    """The class of one layer of a stack built by `make_stacked` (None for any other module)."""
    return getattr(type(stack), "layer_class", None)


def layer(stack: nnx.Module, i: int) -> nnx.Module:
    """Layer ``i`` of a stack built by `make_stacked`, as a plain block (its own call).

    Example:
        >>> stack = make_stacked(lambda r: Dense((8,), (8,), std=0.1, rngs=r), 3, nnx.Rngs(0))
        >>> type(layer(stack, 1)).__name__, layer(stack, 1).kernel.shape
        ('Dense', (8, 8))
    """
    graphdef, state = nnx.split(stack)
    one = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
    one.__class__ = layer_class(stack) or type(stack)
    return one


def scan_layers(
    layers: nnx.Module, h: jax.Array, *extras, remat: Remat | None = None, **kw_extras
) -> jax.Array:
    """Apply a stacked block module to `h`, one layer per `jax.lax.scan` step.

    Args:
        layers: module built by `make_stacked` (any leading-axis size: the whole depth or one
            pipeline stage's slice of it).
        h: activations carried from layer to layer.
        *extras, **kw_extras: inputs every layer takes besides `h` (positions, masks), passed
            unchanged to each layer.
        remat: optional wrapper of the per-layer body, e.g. `jax.checkpoint` or
            `functools.partial(jax.checkpoint, policy=...)`; None stores activations as usual.

    Example:
        >>> from models import llama
        >>> m = llama.Model(llama.config("tiny"), rngs=nnx.Rngs(0))
        >>> h = m.embed(jnp.zeros((2, 8), jnp.int32))
        >>> scan_layers(m.layers, h, remat=jax.checkpoint).shape
        (2, 8, 64)
    """
    graphdef, state = nnx.split(layers)
    call = (layer_class(layers) or type(layers)).__call__

    def body(h, layer_state):
        return call(nnx.merge(graphdef, layer_state), h, *extras, **kw_extras), None

    if remat is not None:
        body = remat(body)
    h, _ = jax.lax.scan(body, h, state)
    return h


def residual_std(std: float, n_layers: int) -> float:
    """GPT-2's init for projections that write into the residual stream: std / sqrt(2L)."""
    return std / math.sqrt(2 * n_layers)
