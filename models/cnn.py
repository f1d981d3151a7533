"""CNN classifier: convolutions (data parallel) feeding a very wide dense head (tensor parallel).

The classic hybrid case (AlexNet's "one weird trick"): the convolutions hold few parameters and
much compute, the head holds most parameters. NHWC images, no batch statistics anywhere.

    stem: 3x3 conv, C_in -> C, SAME
    layers (L residual blocks at constant resolution): x + conv2(gelu(conv1(rms_norm(x))))
        rms_norm is over channels per pixel (no batch statistics), conv1/conv2 3x3 SAME
    head: average pool with window = stride = `pool`, flatten to P = (S/pool)**2 * C features,
          fc1 [P, W], gelu, fc2 [W, NC]

Parameter paths (L = n_layers stacked on the leading axis):

    stem/kernel          [3, 3, C_in, C]      stem/bias          [C]
    layers/norm/scale    [L, C]
    layers/conv1/kernel  [L, 3, 3, C, C]      layers/conv1/bias  [L, C]
    layers/conv2/kernel  [L, 3, 3, C, C]      layers/conv2/bias  [L, C]
    head/fc1/kernel      [P, W]               head/fc1/bias      [W]
    head/fc2/kernel      [W, NC]              head/fc2/bias      [NC]

Sizes: "tiny" pools 16x16 by 2 (P = 8*8*16 = 1024); "base" pools 64x64 by 8 (P = 8*8*128 = 8192,
fc1 33.6M params, like AlexNet's fc6) so the head is wide without being absurd.
`model.head` is the head module itself (callable: `head(h) -> logits`).

Example:
    >>> cfg = config("tiny")
    >>> Model(cfg, rngs=nnx.Rngs(0))(make_batch(cfg, 2)["images"]).shape
    (2, 16)
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models import _config
from models._errors import ModelConfigError
from models.layers import Dense, Remat, RMSNorm, cross_entropy, make_stacked, normal

# The batch entry that `Model.__call__` takes (the rest feed the loss).
NAME = "cnn"  # the family name partition_rules presets are keyed by
INPUT = "images"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """CNN sizes: square `image_size` images with `in_channels` channels."""

    family: ClassVar[str] = "cnn"
    name: str
    image_size: int
    in_channels: int
    channels: int
    n_layers: int
    pool: int
    head_width: int
    n_classes: int
    norm_eps: float = 1e-5

    def __post_init__(self):
        _config.check_positive(
            self, "image_size", "in_channels", "channels", "n_layers", "pool", "head_width",
            "n_classes",
        )  # fmt: skip
        _config.check_positive_float(self, "norm_eps")
        if self.image_size % self.pool:
            raise ModelConfigError(
                f"cnn config {self.name!r}: image_size={self.image_size} must be a multiple of "
                f"pool={self.pool}"
            )

    @property
    def n_features(self) -> int:
        """P: flattened features after pooling, the input width of head/fc1."""
        return (self.image_size // self.pool) ** 2 * self.channels


SIZES: dict[str, Config] = {
    "tiny": Config(
        name="tiny", image_size=16, in_channels=3, channels=16, n_layers=4, pool=2,
        head_width=512, n_classes=16,
    ),
    "base": Config(
        name="base", image_size=64, in_channels=3, channels=128, n_layers=8, pool=8,
        head_width=4096, n_classes=1000,
    ),
}  # fmt: skip


def config(size: str, **overrides) -> Config:
    """`SIZES[size]` with fields replaced, e.g. `config("tiny", head_width=1024)`."""
    return _config.pick("cnn", SIZES, size, overrides)


class Conv(nnx.Module):
    """3x3 SAME convolution, stride 1, NHWC; `kernel [3, 3, C_in, C_out]` (HWIO), `bias [C_out]`."""

    def __init__(self, c_in: int, c_out: int, *, std_scale: float = 1.0, rngs: nnx.Rngs):
        std = std_scale / math.sqrt(9 * c_in)  # LeCun normal
        self.kernel = nnx.Param(normal(rngs.params(), (3, 3, c_in, c_out), std))
        self.bias = nnx.Param(jnp.zeros((c_out,), jnp.float32))

    def __call__(self, x_BYXC: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(
            x_BYXC, self.kernel[...].astype(x_BYXC.dtype), window_strides=(1, 1),
            padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )  # fmt: skip
        return y + self.bias[...].astype(y.dtype)


class Block(nnx.Module):
    """Pre-norm residual block at constant resolution."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        c = cfg.channels
        self.norm = RMSNorm(c, eps=cfg.norm_eps)
        self.conv1 = Conv(c, c, rngs=rngs)
        self.conv2 = Conv(c, c, std_scale=1 / math.sqrt(2 * cfg.n_layers), rngs=rngs)

    def __call__(self, x_BYXC: jax.Array) -> jax.Array:
        return x_BYXC + self.conv2(jax.nn.gelu(self.conv1(self.norm(x_BYXC))))


class Head(nnx.Module):
    """Average pool, flatten, `fc2(gelu(fc1(.)))`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        p, w = cfg.n_features, cfg.head_width
        self.pool = cfg.pool
        self.fc1 = Dense((p,), (w,), std=1 / math.sqrt(p), use_bias=True, rngs=rngs)
        self.fc2 = Dense((w,), (cfg.n_classes,), std=1 / math.sqrt(w), use_bias=True, rngs=rngs)

    def __call__(self, h_BYXC: jax.Array) -> jax.Array:
        b, y, x, c = h_BYXC.shape
        k = self.pool
        pooled = jnp.mean(h_BYXC.reshape(b, y // k, k, x // k, k, c), axis=(2, 4))
        return self.fc2(jax.nn.gelu(self.fc1(pooled.reshape(b, -1))))


class Model(nnx.Module):
    """CNN classifier: `head(layers(stem(images)))`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.stem = Conv(cfg.in_channels, cfg.channels, rngs=rngs)
        self.layers = make_stacked(lambda r: Block(cfg, rngs=r), cfg.n_layers, rngs)
        self.head = Head(cfg, rngs=rngs)

    def embed(self, images_BYXC: jax.Array) -> jax.Array:
        """Stem convolution; images are cast to the parameters' dtype (the compute dtype)."""
        return self.stem(images_BYXC.astype(self.stem.kernel.dtype))

    def __call__(self, images_BYXC: jax.Array, *, remat: Remat | None = None) -> jax.Array:
        return self.head(self.layers(self.embed(images_BYXC), remat=remat))


def loss_from_logits(logits_BC: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean classification cross-entropy (float32); eager calls refuse labels outside the
    classes (`BatchError`), jitted ones do not look: check host batches with `check_batch`."""
    _config.checked_ids(NAME, "labels", batch["labels"], logits_BC.shape[-1], "label")
    return cross_entropy(logits_BC, batch["labels"])


def loss(model: Model, batch: dict[str, jax.Array], *, remat: Remat | None = None) -> jax.Array:
    """Mean classification cross-entropy of `model` on `batch` (float32 scalar)."""
    return loss_from_logits(model(batch[INPUT], remat=remat), batch)


def batch_shapes(
    cfg: Config, batch_size: int, seq_len: int | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """`{"images": float32[B, S, S, C_in], "labels": int32[B]}`; seq_len must be None."""
    _config.no_seq_len(cfg, seq_len)
    s, batch_size = cfg.image_size, _config.batch_size_for(cfg, batch_size)
    return {
        "images": jax.ShapeDtypeStruct((batch_size, s, s, cfg.in_channels), jnp.float32),
        "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def make_batch(
    cfg: Config, batch_size: int, seq_len: int | None = None, *, key: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Standard-normal images and uniformly random labels."""
    shapes = batch_shapes(cfg, batch_size, seq_len)
    ki, kl = jax.random.split(jax.random.key(0) if key is None else key)
    return {
        "images": jax.random.normal(ki, shapes["images"].shape, jnp.float32),
        "labels": jax.random.randint(kl, (batch_size,), 0, cfg.n_classes, jnp.int32),
    }


def check_batch(cfg: Config, batch: dict) -> None:
    """Refuse a host batch this model cannot compute on, before it reaches a compiled step:
    the entries (`images`, `labels`), their shapes and dtypes, and every label in
    ``0 .. n_classes - 1`` (a jitted step turns a label past the classes into a NaN loss).

    Example:
        >>> cfg = config("tiny")
        >>> check_batch(cfg, make_batch(cfg, 4))
    """
    arrays = _config.host_batch(cfg, batch, batch_shapes, seq=False)
    _config.check_ids(_config.who(cfg), "labels", arrays["labels"], cfg.n_classes, "label")


def param_count(cfg: Config) -> int:
    """Number of parameters, in closed form."""
    c = cfg.channels
    stem = 9 * cfg.in_channels * c + c
    block = c + 2 * (9 * c * c + c)
    head = (cfg.n_features + 1) * cfg.head_width + (cfg.head_width + 1) * cfg.n_classes
    return stem + cfg.n_layers * block + head
