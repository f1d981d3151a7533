"""Llama <-> Hugging Face `LlamaForCausalLM` (config.json + safetensors).

The mapping is exact, with no permutation of q/k: HF stores q_proj/k_proj rows in the
rotate-half RoPE layout (its converter from Meta's interleaved weights already permuted them),
and `models.layers.rope` rotates halves too. Only the layouts differ:

    model.embed_tokens.weight                  [V, D]    -> embed/embedding        [V, D]
    model.layers.{i}.input_layernorm.weight    [D]       -> layers/attn_norm/scale [L, D]
    model.layers.{i}.self_attn.q_proj.weight   [N*H, D]  -> layers/attn/q/kernel   [L, D, N, H]
    model.layers.{i}.self_attn.{k,v}_proj      [K*H, D]  -> layers/attn/{k,v}      [L, D, K, H]
    model.layers.{i}.self_attn.o_proj.weight   [D, N*H]  -> layers/attn/o/kernel   [L, N, H, D]
    model.layers.{i}.post_attention_layernorm  [D]       -> layers/mlp_norm/scale  [L, D]
    model.layers.{i}.mlp.{gate,up}_proj.weight [F, D]    -> layers/mlp/{gate,up}   [L, D, F]
    model.layers.{i}.mlp.down_proj.weight      [D, F]    -> layers/mlp/down        [L, F, D]
    model.norm.weight                          [D]       -> final_norm/scale       [D]
    lm_head.weight                             [V, D]    -> lm_head/kernel         [D, V]

A checkpoint with `tie_word_embeddings: true` (Llama 3.2 1B/3B) loads with lm_head/kernel set to
the transposed token table (our head is always untied; logits are the same); `llama.to_hf`
then writes both tensors and `tie_word_embeddings: false`.

Example:
    >>> cfg, model = llama.from_hf("path/to/Llama-3.2-1B")  # doctest: +SKIP
    >>> cfg, model = llama.from_hf(path, shardings=lambda state: sharding.resolve(
    ...     *preset("llama", "fsdp"), state, sharding.make_mesh("fsdp=8")))  # doctest: +SKIP
"""

from __future__ import annotations

import pathlib
from typing import Any

from models import llama
from models._hf import (
    Family,
    Source,
    UnsupportedHFConfigError,
    check_config_keys,
    require,
)

_MAPPED = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "attention_bias", "mlp_bias", "pretraining_tp",
}  # fmt: skip


def _rope_theta(config: dict[str, Any], where: pathlib.Path) -> float:
    """rope_theta from either config layout; raise on any scaled or partial RoPE."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    for name, spec in (("rope_parameters", params), ("rope_scaling", scaling or {})):
        kind = spec.get("rope_type", spec.get("type", "default"))
        extra = sorted(set(spec) - {"rope_type", "type", "rope_theta"})
        if kind != "default" or extra:
            raise UnsupportedHFConfigError(
                f"{where / 'config.json'}: {name}={spec!r} is not supported: our RoPE is the "
                f"unscaled rotate-half kind (rope_type 'default', full head_dim). Use a "
                f"checkpoint without RoPE scaling, or set {name} to null only if you accept "
                f"different logits beyond the original context"
            )
    theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
    if "rope_theta" in config and config["rope_theta"] != theta:
        raise UnsupportedHFConfigError(
            f"{where / 'config.json'}: rope_theta={config['rope_theta']} disagrees with "
            f"rope_parameters.rope_theta={theta}; keep one"
        )
    return float(theta)


def config_from_hf(config: dict[str, Any], where: pathlib.Path) -> llama.Config:
    """Our `llama.Config` for an HF `LlamaConfig` dict; raise on anything we do not compute."""
    check_config_keys(config, _MAPPED, where)
    require(config, where, "hidden_act", ("silu",), "our MLP is SwiGLU with SiLU")
    require(config, where, "attention_bias", (False,), "our attention has no biases")
    require(config, where, "mlp_bias", (False,), "our MLP has no biases")
    heads = config["num_attention_heads"]
    return llama.Config(
        name=str(config.get("_name_or_path") or where.name),
        vocab_size=config["vocab_size"],
        d_model=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        d_ff=config["intermediate_size"],
        max_seq_len=config["max_position_embeddings"],
        rope_theta=_rope_theta(config, where),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        init_std=float(config.get("initializer_range", 0.02)),
    )


def config_to_hf(cfg: llama.Config) -> dict[str, Any]:
    """The HF `LlamaConfig` dict of `cfg` (read back by `config_from_hf` to the same cfg)."""
    return {
        "_name_or_path": cfg.name,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
    }


def sources(
    cfg: llama.Config, config: dict[str, Any] | None, names: frozenset | None
) -> dict[str, Source]:
    """Our parameter path -> where it lives in an HF Llama checkpoint."""
    d, f, v, h = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.head_dim
    n, k = cfg.n_heads, cfg.n_kv_heads
    layer = "model.layers.{i}."
    tied = bool(config and config.get("tie_word_embeddings", False))
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    return {
        "embed/embedding": Source("model.embed_tokens.weight", (v, d), (v, d), (0, 1), stacked=False),
        "layers/attn_norm/scale": Source(layer + "input_layernorm.weight", (d,), (d,), (0,)),
        "layers/attn/q/kernel": Source(layer + "self_attn.q_proj.weight", (n * h, d), (n, h, d), (2, 0, 1)),
        "layers/attn/k/kernel": Source(layer + "self_attn.k_proj.weight", (k * h, d), (k, h, d), (2, 0, 1)),
        "layers/attn/v/kernel": Source(layer + "self_attn.v_proj.weight", (k * h, d), (k, h, d), (2, 0, 1)),
        "layers/attn/o/kernel": Source(layer + "self_attn.o_proj.weight", (d, n * h), (d, n, h), (1, 2, 0)),
        "layers/mlp_norm/scale": Source(layer + "post_attention_layernorm.weight", (d,), (d,), (0,)),
        "layers/mlp/gate/kernel": Source(layer + "mlp.gate_proj.weight", (f, d), (f, d), (1, 0)),
        "layers/mlp/up/kernel": Source(layer + "mlp.up_proj.weight", (f, d), (f, d), (1, 0)),
        "layers/mlp/down/kernel": Source(layer + "mlp.down_proj.weight", (d, f), (d, f), (1, 0)),
        "final_norm/scale": Source("model.norm.weight", (d,), (d,), (0,), stacked=False),
        "lm_head/kernel": Source(head, (v, d), (v, d), (1, 0), stacked=False),
    }  # fmt: skip


def _ignored(config: dict[str, Any]) -> tuple[str, ...]:
    """Rotary buffers of old checkpoints, and a tied head's copy of the token table."""
    rotary = (
        r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
        r"model\.rotary_emb\.inv_freq",
    )
    return (*rotary, r"lm_head\.weight") if config.get("tie_word_embeddings") else rotary


FAMILY = Family(
    name="llama",
    model_type="llama",
    make_model=llama.Model,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    sources=sources,
    ignored=_ignored,
)
