"""MLP classifier: input projection, stacked residual blocks `h + fc2(gelu(fc1(h)))`, output.

Parameter paths (L = n_layers stacked on the leading axis; I = d_in, C = n_classes):

    input/kernel       [I, D]       input/bias    [D]
    layers/fc1/kernel  [L, D, F]    layers/fc1/bias  [L, F]
    layers/fc2/kernel  [L, F, D]    layers/fc2/bias  [L, D]
    output/kernel      [D, C]       output/bias   [C]

Kernels use LeCun-normal init (std 1/sqrt(fan_in)); `fc2` is further scaled by 1/sqrt(2L) so the
norm-free residual stream stays O(1) through depth.

Example:
    >>> cfg = config("tiny")
    >>> Model(cfg, rngs=nnx.Rngs(0))(make_batch(cfg, 4)["x"]).shape
    (4, 16)
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models import _config
from models.layers import Dense, Remat, cross_entropy, make_stacked

# The batch entry that `Model.__call__` takes (the rest feed the loss).
NAME = "mlp"  # the family name partition_rules presets are keyed by
INPUT = "x"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """MLP classifier sizes."""

    family: ClassVar[str] = "mlp"
    name: str
    d_in: int
    d_model: int
    n_layers: int
    d_ff: int
    n_classes: int

    def __post_init__(self):
        _config.check_positive(self, "d_in", "d_model", "n_layers", "d_ff", "n_classes")


SIZES: dict[str, Config] = {
    "tiny": Config(name="tiny", d_in=32, d_model=64, n_layers=4, d_ff=128, n_classes=16),
    "base": Config(name="base", d_in=1024, d_model=1024, n_layers=8, d_ff=4096, n_classes=1000),
}


def config(size: str, **overrides) -> Config:
    """`SIZES[size]` with fields replaced, e.g. `config("tiny", n_layers=8)`."""
    return _config.pick("mlp", SIZES, size, overrides)


def _lecun(fan_in: int) -> float:
    return 1.0 / math.sqrt(fan_in)


class Block(nnx.Module):
    """Residual block `x + fc2(gelu(fc1(x)))`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.fc1 = Dense((d,), (f,), std=_lecun(d), use_bias=True, rngs=rngs)
        out_std = _lecun(f) / math.sqrt(2 * cfg.n_layers)
        self.fc2 = Dense((f,), (d,), std=out_std, use_bias=True, rngs=rngs)

    def __call__(self, x_BD: jax.Array) -> jax.Array:
        return x_BD + self.fc2(jax.nn.gelu(self.fc1(x_BD)))


class Model(nnx.Module):
    """MLP classifier: `output(layers(input(x)))`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        self.input = Dense((cfg.d_in,), (d,), std=_lecun(cfg.d_in), use_bias=True, rngs=rngs)
        self.layers = make_stacked(lambda r: Block(cfg, rngs=r), cfg.n_layers, rngs)
        self.output = Dense((d,), (cfg.n_classes,), std=_lecun(d), use_bias=True, rngs=rngs)

    def embed(self, x_BI: jax.Array) -> jax.Array:
        """Input projection; x is cast to the parameters' dtype, which sets the compute dtype."""
        return self.input(x_BI.astype(self.input.kernel.dtype))

    def head(self, h_BD: jax.Array) -> jax.Array:
        return self.output(h_BD)

    def __call__(self, x_BI: jax.Array, *, remat: Remat | None = None) -> jax.Array:
        return self.head(self.layers(self.embed(x_BI), remat=remat))


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
    """`{"x": float32[B, d_in], "labels": int32[B]}`; seq_len must be None."""
    _config.no_seq_len(cfg, seq_len)
    batch_size = _config.batch_size_for(cfg, batch_size)
    return {
        "x": jax.ShapeDtypeStruct((batch_size, cfg.d_in), jnp.float32),
        "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def make_batch(
    cfg: Config, batch_size: int, seq_len: int | None = None, *, key: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Standard-normal inputs and uniformly random labels."""
    _config.no_seq_len(cfg, seq_len)
    batch_size = _config.batch_size_for(cfg, batch_size)
    kx, ky = jax.random.split(jax.random.key(0) if key is None else key)
    return {
        "x": jax.random.normal(kx, (batch_size, cfg.d_in), jnp.float32),
        "labels": jax.random.randint(ky, (batch_size,), 0, cfg.n_classes, jnp.int32),
    }


def check_batch(cfg: Config, batch: dict) -> None:
    """Refuse a host batch this model cannot compute on, before it reaches a compiled step:
    the entries (`x`, `labels`), their shapes and dtypes, and every label in
    ``0 .. n_classes - 1`` (a jitted step turns a label past the classes into a NaN loss).

    Example:
        >>> cfg = config("tiny")
        >>> check_batch(cfg, make_batch(cfg, 4))
    """
    arrays = _config.host_batch(cfg, batch, batch_shapes, seq=False)
    _config.check_ids(_config.who(cfg), "labels", arrays["labels"], cfg.n_classes, "label")


def param_count(cfg: Config) -> int:
    """Number of parameters, in closed form."""
    d, f = cfg.d_model, cfg.d_ff
    block = 2 * d * f + f + d
    return (cfg.d_in + 1) * d + cfg.n_layers * block + (d + 1) * cfg.n_classes
