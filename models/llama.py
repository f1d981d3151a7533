"""Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied head, no biases.

Parameter paths (L = n_layers stacked on the leading axis):

    embed/embedding              [V, D]
    layers/attn_norm/scale       [L, D]
    layers/attn/{q}/kernel       [L, D, N, H]
    layers/attn/{k,v}/kernel     [L, D, K, H]
    layers/attn/o/kernel         [L, N, H, D]
    layers/mlp_norm/scale        [L, D]
    layers/mlp/{gate,up}/kernel  [L, D, F]
    layers/mlp/down/kernel       [L, F, D]
    final_norm/scale             [D]
    lm_head/kernel               [D, V]

The head is always untied, so "1b" (Llama-3.2-1B, which ties it upstream) counts 1.50e9 params
here instead of 1.24e9.

Example:
    >>> cfg = config("tiny")
    >>> model = Model(cfg, rngs=nnx.Rngs(0))
    >>> batch = make_batch(cfg, 2, 16)
    >>> model(batch["inputs"]).shape
    (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models import _config, attention, kernels
from models._errors import ModelConfigError
from models.layers import (
    Dense,
    Embed,
    Remat,
    RMSNorm,
    SelfAttention,
    cross_entropy,
    make_stacked,
    residual_std,
)

# The batch entry that `Model.__call__` takes (the rest feed the loss).
NAME = "llama"  # the family name partition_rules presets are keyed by
INPUT = "inputs"
# The kernel seam (`models.kernels`): a trainer may run attention distributed inside it.
use_kernels = kernels.use
attention_kernel = attention.kernel  # kind -> kernel, for Workload(attention=)
attention_core = attention.ONLINE_SOFTMAX  # for Workload(attention_core=)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Llama sizes. `head_dim` is independent of `d_model / n_heads` (as in Llama 3)."""

    family: ClassVar[str] = "llama"
    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        _config.check_positive(
            self, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
            "d_ff", "max_seq_len",
        )  # fmt: skip
        _config.check_positive_float(self, "rope_theta", "norm_eps")
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"llama config {self.name!r}: n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"llama config {self.name!r}: head_dim={self.head_dim} must be even for RoPE"
            )


_LLAMA3_8B = Config(
    name="8b", vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
    head_dim=128, d_ff=14_336, max_seq_len=8192, rope_theta=500_000.0,
)  # fmt: skip
SIZES: dict[str, Config] = {
    "tiny": Config(
        name="tiny", vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4,
        head_dim=8, d_ff=128, max_seq_len=4096,
    ),
    "maxtext-tiny": Config(
        name="maxtext-tiny", vocab_size=1024, d_model=256, n_layers=8, n_heads=4, n_kv_heads=4,
        head_dim=64, d_ff=1024, max_seq_len=256,
    ),
    # Llama-3.2-1B (head untied here, see the module docstring).
    "1b": Config(
        name="1b", vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
        head_dim=64, d_ff=8192, max_seq_len=8192, rope_theta=500_000.0,
    ),
    # Llama-2-7B.
    "7b": Config(
        name="7b", vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
        head_dim=128, d_ff=11_008, max_seq_len=4096,
    ),
    # Llama-3-8B.
    "8b": _LLAMA3_8B,
    # Llama-3.1-8B's shape at its 128k context, for planning long sequences (context
    # parallelism). Its rope scaling is not modelled: it costs nothing and changes no shape.
    "8b-128k": Config(
        name="8b-128k", vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        head_dim=128, d_ff=14_336, max_seq_len=131_072, rope_theta=500_000.0,
    ),
    # Llama-2-70B.
    "70b": Config(
        name="70b", vocab_size=32_000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        head_dim=128, d_ff=28_672, max_seq_len=4096,
    ),
    # The Llama 3 herd (Dubey et al. 2024, Table 3), under the names people plan them by.
    "3-8b": dataclasses.replace(_LLAMA3_8B, name="3-8b"),
    "3-70b": Config(
        name="3-70b", vocab_size=128_256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        head_dim=128, d_ff=28_672, max_seq_len=8192, rope_theta=500_000.0,
    ),
    "3.1-405b": Config(
        name="3.1-405b", vocab_size=128_256, d_model=16_384, n_layers=126, n_heads=128,
        n_kv_heads=8, head_dim=128, d_ff=53_248, max_seq_len=131_072, rope_theta=500_000.0,
    ),
}  # fmt: skip
# Where each size's numbers come from (`spmdkit ... --help` shows them).
SOURCES: dict[str, str] = {
    "tiny": "a test model",
    "maxtext-tiny": "MaxText's tiny test config",
    "1b": "Llama 3.2 1B, Meta's config.json",
    "7b": "Llama 2 7B, Touvron et al. 2023, Table 1",
    "8b": "Llama 3 8B, Dubey et al. 2024, Table 3",
    "8b-128k": "Llama 3.1 8B at its 128k context, Dubey et al. 2024",
    "70b": "Llama 2 70B, Touvron et al. 2023, Table 1",
    "3-8b": "Llama 3 8B, Dubey et al. 2024, Table 3",
    "3-70b": "Llama 3 70B, Dubey et al. 2024, Table 3",
    "3.1-405b": "Llama 3.1 405B, Dubey et al. 2024, Table 3",
}


def config(size: str, **overrides) -> Config:
    """`SIZES[size]` with fields replaced, e.g. `config("tiny", n_layers=8)`."""
    return _config.pick("llama", SIZES, size, overrides)


class Mlp(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        std, out_std = cfg.init_std, residual_std(cfg.init_std, cfg.n_layers)
        self.gate = Dense((cfg.d_model,), (cfg.d_ff,), std=std, rngs=rngs)
        self.up = Dense((cfg.d_model,), (cfg.d_ff,), std=std, rngs=rngs)
        self.down = Dense((cfg.d_ff,), (cfg.d_model,), std=out_std, rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x_BSD)) * self.up(x_BSD))


class Block(nnx.Module):
    """Pre-norm decoder block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = SelfAttention(
            cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            std=cfg.init_std, out_std=residual_std(cfg.init_std, cfg.n_layers),
            use_bias=False, rope_theta=cfg.rope_theta, rngs=rngs,
        )  # fmt: skip
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = Mlp(cfg, rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))


class Model(nnx.Module):
    """Llama decoder. `model.embed` is the token table module itself: `embed(inputs) -> h`.
    ``block``: the class of its layers (a variant swaps it, `models.llama_moe`)."""

    block: ClassVar[type] = Block

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, std=cfg.init_std, rngs=rngs)
        self.layers = make_stacked(lambda r: self.block(cfg, rngs=r), cfg.n_layers, rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = Dense((cfg.d_model,), (cfg.vocab_size,), std=cfg.init_std, rngs=rngs)

    def head(self, h_BSD: jax.Array) -> jax.Array:
        return self.lm_head(self.final_norm(h_BSD))

    def __call__(self, inputs_BS: jax.Array, *, remat: Remat | None = None) -> jax.Array:
        # Eager calls only (a no-op under jit): an id past the table would gather NaN silently.
        _config.checked_ids(
            _config.who(self.cfg), "inputs", inputs_BS, self.cfg.vocab_size, "token"
        )
        return self.head(self.layers(self.embed(inputs_BS), remat=remat))


def loss_from_logits(logits_BSV: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (float32).

    Called eagerly, target ids outside the vocabulary raise `BatchError` (they would give a NaN
    loss); under `jit` nothing is checked here: check host batches with `check_batch`.
    """
    _config.checked_ids(NAME, "targets", batch["targets"], logits_BSV.shape[-1], "token")
    return cross_entropy(logits_BSV, batch["targets"])


def loss(model: Model, batch: dict[str, jax.Array], *, remat: Remat | None = None) -> jax.Array:
    """Mean next-token cross-entropy of `model` on `batch` (float32 scalar)."""
    return loss_from_logits(model(batch[INPUT], remat=remat), batch)


def batch_shapes(
    cfg: Config, batch_size: int, seq_len: int | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """`{"inputs", "targets"}: int32[batch_size, seq_len]`; seq_len None -> cfg.max_seq_len."""
    b, s = _config.batch_size_for(cfg, batch_size), _config.seq_len_for(cfg, seq_len)
    tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)
    return {"inputs": tokens, "targets": tokens}


def make_batch(
    cfg: Config, batch_size: int, seq_len: int | None = None, *, key: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Random tokens; targets are the inputs shifted left by one (next-token prediction)."""
    b, s = _config.batch_size_for(cfg, batch_size), _config.seq_len_for(cfg, seq_len)
    key = jax.random.key(0) if key is None else key
    tokens = jax.random.randint(key, (b, s + 1), 0, cfg.vocab_size, jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def param_count(cfg: Config) -> int:
    """Number of parameters, in closed form."""
    d, f, h = cfg.d_model, cfg.d_ff, cfg.head_dim
    attn = d * cfg.n_heads * h * 2 + d * cfg.n_kv_heads * h * 2  # q, o; k, v
    block = 2 * d + attn + 3 * d * f
    return 2 * cfg.vocab_size * d + cfg.n_layers * block + d


def check_batch(cfg: Config, batch: dict) -> None:
    """Refuse a host batch this model cannot compute on, before it reaches a compiled step.

    Checks the entries (`inputs`, `targets`), that both are int[B, S] with B >= 1 and
    S <= max_seq_len, and that every id is a token of the vocabulary: inside a jitted step an
    id >= vocab_size gathers NaN and the loss is NaN without a word, so a training loop calls
    this on each host batch (numpy) it is about to place on devices.

    Raises:
        BatchError: naming the entry, the offending value (and where), and the model's limit.

    Example:
        >>> import numpy as np
        >>> cfg = config("tiny")
        >>> ok = np.zeros((2, 8), np.int32)
        >>> check_batch(cfg, {"inputs": ok, "targets": ok})
        >>> try:
        ...     check_batch(cfg, {"inputs": ok, "targets": ok + 300})
        ... except ValueError as e:  # models.BatchError
        ...     print(e)  # doctest: +ELLIPSIS
        batch['targets'] holds token id 300 (at [0, 0]; 16 of 16 ids out of range), ...
    """
    for key, ids in _config.host_batch(cfg, batch, batch_shapes, seq=True).items():
        _config.check_ids(_config.who(cfg), key, ids, cfg.vocab_size, "token")


def from_hf(path, *, shardings=None) -> tuple[Config, Model]:
    """Read a local Hugging Face Llama directory (config.json + *.safetensors, a sharded index
    included) into ``(cfg, model)``.

    Args:
        path: the checkpoint directory (never created, never written).
        shardings: where each parameter goes. None: one device. Otherwise a function from the
            abstract state (``nnx.split(model)[1]`` of ``ShapeDtypeStruct``s) to a matching tree
            of ``jax.sharding.Sharding``, a tree of them, or one for every parameter. Each
            device reads only its own slice of each tensor. With spmdkit's placement:
            ``shardings=lambda state: sharding.resolve(*preset("llama", "fsdp"), state, mesh)``.

    Raises:
        HFCheckpointNotFoundError: no such directory, no config.json, or a shard is missing.
        HFCorruptFileError: config.json or the index is not JSON, a shard is truncated.
        PickleCheckpointError: the weights are .bin/.pt/.pth (never unpickled).
        UnsupportedHFConfigError: config.json asks for RoPE scaling, biases, another activation.
        HFTensorMismatchError: tensors missing, unexpected or of the wrong shape.

    Example:
        >>> cfg, model = from_hf("path/to/Llama-3.2-1B")  # doctest: +SKIP
    """
    from models import hf  # lazy: it imports this module

    return hf.load(hf.LLAMA, path, shardings=shardings)


def to_hf(cfg: Config, model: Model, path, *, overwrite: bool = False) -> pathlib.Path:
    """Write ``model`` as a Hugging Face Llama directory (config.json + model.safetensors) and
    return its path; ``from_hf`` of it gives back ``cfg`` and bit-identical parameters.

    A directory that is not empty is refused (nothing written) unless ``overwrite=True``, which
    replaces config.json and the *.safetensors weights there and keeps other files (tokenizer).

    Example:
        >>> to_hf(cfg, model, "out/llama")  # doctest: +SKIP
    """
    from models import hf

    return hf.save(hf.LLAMA, cfg, model, path, overwrite=overwrite)
