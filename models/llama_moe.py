"""Llama with mixture-of-experts feed-forward layers (Mixtral): every block's SwiGLU replaced by
`models.moe.MoE`, top-k routed with a capacity factor and a load-balancing loss.

Parameter paths (L = n_layers stacked on the leading axis, E = n_experts):

    embed/embedding              [V, D]
    layers/attn_norm/scale       [L, D]
    layers/attn/{q}/kernel       [L, D, N, H]
    layers/attn/{k,v}/kernel     [L, D, K, H]
    layers/attn/o/kernel         [L, N, H, D]
    layers/mlp_norm/scale        [L, D]
    layers/moe/router/kernel     [L, D, E]
    layers/moe/{gate,up}         [L, E, D, F]
    layers/moe/down              [L, E, F, D]
    final_norm/scale             [D]
    lm_head/kernel               [D, V]

The auxiliary loss crosses the layer stack as part of its carry: the model calls
``self.layers((h, aux))`` and each block returns ``(h, aux + its own)``, so the loss is the
mean next-token cross-entropy plus ``aux_loss_coef`` times the mean over layers of each layer's
load-balancing loss. Each block adds its own term to the carried value, so a pipeline can run
the blocks of each stage apart and add up their terms (gpipe and circular do; each micro-batch's
loss is then its own, as under gradient accumulation).

Example:
    >>> cfg = config("tiny")
    >>> model = Model(cfg, rngs=nnx.Rngs(0))
    >>> batch = make_batch(cfg, 2, 16)
    >>> model(batch["inputs"]).shape
    (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models import _config, attention, kernels, llama, moe
from models._errors import ModelConfigError
from models.layers import Remat, RMSNorm, SelfAttention, residual_std

NAME = "llama-moe"
INPUT = "inputs"
# The kernel seam: a trainer may run the experts expert-parallel (and attention distributed).
use_kernels = kernels.use
attention_kernel = attention.kernel  # kind -> kernel, for Workload(attention=)
attention_core = attention.ONLINE_SOFTMAX  # for Workload(attention_core=)
loss_from_logits = llama.loss_from_logits  # the cross-entropy alone (the aux loss is not in logits)
batch_shapes = llama.batch_shapes
make_batch = llama.make_batch


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(llama.Config):
    """Llama sizes plus the experts: `d_ff` is one expert's width; ``capacity_factor=None`` is
    dropless routing."""

    family: ClassVar[str] = "llama-moe"
    n_experts: int
    top_k: int
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        moe.check_moe(_config.who(self), self.n_experts, self.top_k, self.capacity_factor)
        if not (isinstance(self.aux_loss_coef, int | float) and self.aux_loss_coef >= 0):
            raise ModelConfigError(
                f"{_config.who(self)}: aux_loss_coef={self.aux_loss_coef!r}; use a number >= 0 "
                f"(0.01 is common, 0 turns load balancing off)"
            )


SIZES: dict[str, Config] = {
    "tiny": Config(
        name="tiny", vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=4,
        head_dim=8, d_ff=128, max_seq_len=128, n_experts=4, top_k=2,
    ),
    # Mixtral-8x7B (46.7e9 parameters).
    "mixtral-8x7b": Config(
        name="mixtral-8x7b", vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32,
        n_kv_heads=8, head_dim=128, d_ff=14_336, max_seq_len=32_768, rope_theta=1_000_000.0,
        n_experts=8, top_k=2,
    ),
}  # fmt: skip


def config(size: str, **overrides) -> Config:
    """`SIZES[size]` with fields replaced, e.g. `config("tiny", capacity_factor=None)`."""
    return _config.pick(NAME, SIZES, size, overrides)


class Block(nnx.Module):
    """Pre-norm block on the carry ``(x, aux)``: ``x + attn(norm(x))``, then ``x + moe(norm(x))``
    with the layer's load-balancing loss added to ``aux``."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        out_std = residual_std(cfg.init_std, cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = SelfAttention(
            cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, std=cfg.init_std,
            out_std=out_std, use_bias=False, rope_theta=cfg.rope_theta, rngs=rngs,
        )  # fmt: skip
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.moe = moe.MoE(
            cfg.d_model, cfg.d_ff, n_experts=cfg.n_experts, top_k=cfg.top_k,
            capacity_factor=cfg.capacity_factor, std=cfg.init_std, out_std=out_std, rngs=rngs,
        )  # fmt: skip

    def __call__(self, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        x_BSD, aux = carry
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        y_BSD, layer_aux = self.moe(self.mlp_norm(x_BSD))
        return x_BSD + y_BSD, aux + layer_aux


class Model(llama.Model):
    """Mixture-of-experts Llama decoder (llama's, with MoE blocks); `forward` gives logits and
    the mean aux loss."""

    block: ClassVar[type] = Block

    def forward(self, inputs_BS: jax.Array, *, remat: Remat | None = None):
        """``(logits [B, S, V], aux)``: aux is the mean over layers of their balancing losses."""
        _config.checked_ids(
            _config.who(self.cfg), "inputs", inputs_BS, self.cfg.vocab_size, "token"
        )
        h_BSD = self.embed(inputs_BS)
        h_BSD, aux = self.layers((h_BSD, jnp.zeros((), jnp.float32)), remat=remat)
        return self.head(h_BSD), aux / self.cfg.n_layers

    def __call__(self, inputs_BS: jax.Array, *, remat: Remat | None = None) -> jax.Array:
        return self.forward(inputs_BS, remat=remat)[0]


def loss(model: Model, batch: dict[str, jax.Array], *, remat: Remat | None = None) -> jax.Array:
    """Mean next-token cross-entropy plus ``aux_loss_coef`` x the mean load-balancing loss."""
    logits_BSV, aux = model.forward(batch[INPUT], remat=remat)
    return loss_from_logits(logits_BSV, batch) + model.cfg.aux_loss_coef * aux


def param_count(cfg: Config) -> int:
    """Number of parameters, in closed form.

    Example:
        >>> round(param_count(config("mixtral-8x7b")) / 1e9, 1)
        46.7
    """
    d, f, h = cfg.d_model, cfg.d_ff, cfg.head_dim
    attn = d * cfg.n_heads * h * 2 + d * cfg.n_kv_heads * h * 2
    block = 2 * d + attn + d * cfg.n_experts + cfg.n_experts * 3 * d * f
    return 2 * cfg.vocab_size * d + cfg.n_layers * block + d


def check_batch(cfg: Config, batch: dict) -> None:
    """As `models.llama.check_batch`: entries, shapes, and every id inside the vocabulary."""
    llama.check_batch(cfg, batch)


def routing_report(model: Model, inputs_BS: jax.Array) -> list[dict]:
    """Per layer, where ``inputs``' tokens go: `models.moe.routing_stats` of each block's router
    on the activations that reach it (assignments and kept tokens per expert, dropped fraction),
    plus the layer's ``capacity`` and ``aux_loss``. Runs the blocks one by one, eagerly.

    Example:
        >>> cfg = config("tiny")
        >>> report = routing_report(Model(cfg, rngs=nnx.Rngs(0)), make_batch(cfg, 2, 16)["inputs"])
        >>> len(report) == cfg.n_layers, sum(report[0]["tokens_per_expert"]) == 2 * 16 * cfg.top_k
        (True, True)
    """
    from models.layers import layer

    h_BSD, out = model.embed(inputs_BS), []
    for i in range(model.cfg.n_layers):
        block = layer(model.layers, i)
        x_BSD = h_BSD + block.attn(block.attn_norm(h_BSD))
        r = block.moe.routing(block.mlp_norm(x_BSD))
        cap = block.moe.capacity(inputs_BS.shape[1])
        stats = moe.routing_stats(r.expert_BSK, r.slot_BSK, model.cfg.n_experts, cap)
        out.append({"layer": i, "capacity": cap, "aux_loss": float(moe.aux_loss(r)), **stats})
        h_BSD, _ = block((h_BSD, jnp.zeros((), jnp.float32)))
    return out
