"""GPT-2: learned positions, pre-LayerNorm with bias, GELU (tanh), tied embeddings, biases everywhere.

Parameter paths (L = n_layers stacked on the leading axis; K = N for GPT-2):

    wte/embedding                [V, D]    also the output head: logits = h @ wte.T
    wpe/embedding                [S, D]
    layers/ln1/{scale,bias}      [L, D]
    layers/attn/{q,k,v}/kernel   [L, D, N, H]
    layers/attn/{q,k,v}/bias     [L, N, H]
    layers/attn/o/kernel         [L, N, H, D]
    layers/attn/o/bias           [L, D]
    layers/ln2/{scale,bias}      [L, D]
    layers/mlp/fc/kernel         [L, D, F]
    layers/mlp/fc/bias           [L, F]
    layers/mlp/proj/kernel       [L, F, D]
    layers/mlp/proj/bias         [L, D]
    ln_f/{scale,bias}            [D]

The real sizes use vocab_size=50304: GPT-2's 50257 tokens padded up to a multiple of 64, as
nanoGPT does, so the vocabulary divides the tensor-parallel axes; the extra rows are never targets.

Example:
    >>> cfg = config("tiny")
    >>> model = Model(cfg, rngs=nnx.Rngs(0))
    >>> model(make_batch(cfg, 2, 16)["inputs"]).shape
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
    LayerNorm,
    Remat,
    SelfAttention,
    cross_entropy,
    make_stacked,
    residual_std,
)

# The batch entry that `Model.__call__` takes (the rest feed the loss).
NAME = "gpt2"  # the family name partition_rules presets are keyed by
INPUT = "inputs"
# The kernel seam (`models.kernels`): a trainer may run attention distributed inside it.
use_kernels = kernels.use
attention_kernel = attention.kernel  # kind -> kernel, for Workload(attention=)
attention_core = attention.ONLINE_SOFTMAX  # for Workload(attention_core=)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """GPT-2 sizes; `head_dim` is `d_model // n_heads`."""

    family: ClassVar[str] = "gpt2"
    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        _config.check_positive(
            self, "vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"
        )
        _config.check_positive_float(self, "norm_eps")
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                f"gpt2 config {self.name!r}: d_model={self.d_model} must be a multiple of "
                f"n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _real(name: str, d_model: int, n_layers: int, n_heads: int, seq: int = 1024) -> Config:
    return Config(
        name=name, vocab_size=50_304, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        d_ff=4 * d_model, max_seq_len=seq,
    )  # fmt: skip


SIZES: dict[str, Config] = {
    "tiny": Config(
        name="tiny", vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_ff=256, max_seq_len=128
    ),
    "124m": _real("124m", 768, 12, 12),
    "350m": _real("350m", 1024, 24, 16),
    "774m": _real("774m", 1280, 36, 20),
    "1.5b": _real("1.5b", 1600, 48, 25),
    # GPT-3 (Brown et al. 2020, Table 2.1): the same architecture at a 2048-token context (its
    # alternating sparse attention layers aside). 1.3B's table lists 24 heads of 128 on a width
    # of 2048, which do not tile it: 16 heads of 128 here. 13B's width is 5120 (40 x 128; the
    # table's 5140 does not divide into its 40 heads).
    "gpt3-125m": _real("gpt3-125m", 768, 12, 12, 2048),
    "gpt3-350m": _real("gpt3-350m", 1024, 24, 16, 2048),
    "gpt3-760m": _real("gpt3-760m", 1536, 24, 16, 2048),
    "gpt3-1.3b": _real("gpt3-1.3b", 2048, 24, 16, 2048),
    "gpt3-2.7b": _real("gpt3-2.7b", 2560, 32, 32, 2048),
    "gpt3-6.7b": _real("gpt3-6.7b", 4096, 32, 32, 2048),
    "gpt3-13b": _real("gpt3-13b", 5120, 40, 40, 2048),
    "gpt3-175b": _real("gpt3-175b", 12_288, 96, 96, 2048),
}
# Where each size's numbers come from (`spmdkit ... --help` shows them). The vocabulary is
# GPT-2's 50,257 tokens padded to 50,304 (a multiple of 64), as nanoGPT and Megatron pad it.
SOURCES: dict[str, str] = {
    "tiny": "a test model",
    **{k: "GPT-2, Radford et al. 2019, Table 2" for k in ("124m", "350m", "774m", "1.5b")},
    **{k: "GPT-3, Brown et al. 2020, Table 2.1" for k in SIZES if k.startswith("gpt3-")},
}


def config(size: str, **overrides) -> Config:
    """`SIZES[size]` with fields replaced, e.g. `config("tiny", n_layers=8)`."""
    return _config.pick("gpt2", SIZES, size, overrides)


class Mlp(nnx.Module):
    """`proj(gelu_tanh(fc(x)))`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        out_std = residual_std(cfg.init_std, cfg.n_layers)
        self.fc = Dense((cfg.d_model,), (cfg.d_ff,), std=cfg.init_std, use_bias=True, rngs=rngs)
        self.proj = Dense((cfg.d_ff,), (cfg.d_model,), std=out_std, use_bias=True, rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x_BSD), approximate=True))


class Block(nnx.Module):
    """Pre-LayerNorm block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.ln1 = LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = SelfAttention(
            cfg.d_model, cfg.n_heads, cfg.n_heads, cfg.head_dim,
            std=cfg.init_std, out_std=residual_std(cfg.init_std, cfg.n_layers),
            use_bias=True, rope_theta=None, rngs=rngs,
        )  # fmt: skip
        self.ln2 = LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = Mlp(cfg, rngs=rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = x_BSD + self.attn(self.ln1(x_BSD))
        return x_BSD + self.mlp(self.ln2(x_BSD))


class Model(nnx.Module):
    """GPT-2 decoder with the output head tied to the token table."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = Embed(cfg.vocab_size, cfg.d_model, std=cfg.init_std, rngs=rngs)
        self.wpe = Embed(cfg.max_seq_len, cfg.d_model, std=cfg.init_std, rngs=rngs)
        self.layers = make_stacked(lambda r: Block(cfg, rngs=r), cfg.n_layers, rngs)
        self.ln_f = LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def embed(self, inputs_BS: jax.Array) -> jax.Array:
        """Token plus learned position embeddings for positions `0 .. S-1`, or for the positions
        the ``positions`` kernel gives (a caller that reordered the sequence, `models.kernels`)."""
        s = _config.seq_len_for(self.cfg, inputs_BS.shape[-1])
        # Eager calls only (a no-op under jit): an id past the table would gather NaN silently.
        _config.checked_ids(
            _config.who(self.cfg), "inputs", inputs_BS, self.cfg.vocab_size, "token"
        )
        h_BSD = self.wte(inputs_BS)
        positions = kernels.resolve("positions", None)
        if positions is None:  # the written order: a slice of the table (a gather otherwise)
            return h_BSD + self.wpe.embedding[:s].astype(h_BSD.dtype)
        table_SD = jnp.take(self.wpe.embedding[...], positions(s), axis=0)
        return h_BSD + table_SD.astype(h_BSD.dtype)

    def head(self, h_BSD: jax.Array) -> jax.Array:
        return self.wte.attend(self.ln_f(h_BSD))

    def __call__(self, inputs_BS: jax.Array, *, remat: Remat | None = None) -> jax.Array:
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
    d, f = cfg.d_model, cfg.d_ff
    attn = 4 * d * d + 4 * d  # q, k, v, o kernels (N*H = D) and biases
    block = 4 * d + attn + 2 * d * f + f + d
    return (cfg.vocab_size + cfg.max_seq_len) * d + cfg.n_layers * block + 2 * d


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
        ...     check_batch(cfg, {"inputs": ok, "targets": np.zeros((2, 200), np.int32)})
        ... except ValueError as e:  # models.BatchError
        ...     print(e)  # doctest: +ELLIPSIS
        batch['targets'] is int32[2, 200] beside batch['inputs'] int32[2, 8]; gpt2 'tiny' takes ...
    """
    for key, ids in _config.host_batch(cfg, batch, batch_shapes, seq=True).items():
        _config.check_ids(_config.who(cfg), key, ids, cfg.vocab_size, "token")


def from_hf(path, *, shardings=None) -> tuple[Config, Model]:
    """Read a local Hugging Face GPT-2 directory (config.json + *.safetensors, a sharded index
    included) into ``(cfg, model)``.

    Args:
        path: the checkpoint directory (never created, never written).
        shardings: where each parameter goes. None: one device. Otherwise a function from the
            abstract state (``nnx.split(model)[1]`` of ``ShapeDtypeStruct``s) to a matching tree
            of ``jax.sharding.Sharding``, a tree of them, or one for every parameter. Each
            device reads only its own slice of each tensor. With spmdkit's placement:
            ``shardings=lambda state: sharding.resolve(*preset("gpt2", "fsdp"), state, mesh)``.

    Raises:
        HFCheckpointNotFoundError: no such directory, no config.json, or a shard is missing.
        HFCorruptFileError: config.json or the index is not JSON, a shard is truncated.
        PickleCheckpointError: the weights are .bin/.pt/.pth (never unpickled).
        UnsupportedHFConfigError: untied head, another activation, per-layer score scaling.
        HFTensorMismatchError: tensors missing, unexpected or of the wrong shape.

    Example:
        >>> cfg, model = from_hf("path/to/gpt2")  # doctest: +SKIP
    """
    from models import hf  # lazy: it imports this module

    return hf.load(hf.GPT2, path, shardings=shardings)


def to_hf(cfg: Config, model: Model, path, *, overwrite: bool = False) -> pathlib.Path:
    """Write ``model`` as a Hugging Face GPT-2 directory (config.json + model.safetensors) and
    return its path; ``from_hf`` of it gives back ``cfg`` and bit-identical parameters.

    A directory that is not empty is refused (nothing written) unless ``overwrite=True``, which
    replaces config.json and the *.safetensors weights there and keeps other files (tokenizer).

    Example:
        >>> to_hf(cfg, model, "out/gpt2")  # doctest: +SKIP
    """
    from models import hf

    return hf.save(hf.GPT2, cfg, model, path, overwrite=overwrite)
