"""GPT-2 <-> Hugging Face `GPT2LMHeadModel` (config.json + safetensors).

HF's GPT-2 uses `Conv1D` (weight `[in, out]`, so no transposes) and one fused `c_attn` whose
output is `[q | k | v]`, each `[N, H]`-major; each of our q/k/v kernels reads its third:

    wte.weight                   [V, D]    -> wte/embedding            [V, D] (also the head)
    wpe.weight                   [S, D]    -> wpe/embedding            [S, D]
    h.{i}.ln_1.{weight,bias}     [D]       -> layers/ln1/{scale,bias}  [L, D]
    h.{i}.attn.c_attn.weight     [D, 3*D]  -> layers/attn/{q,k,v}/kernel [L, D, N, H]
    h.{i}.attn.c_attn.bias       [3*D]     -> layers/attn/{q,k,v}/bias   [L, N, H]
    h.{i}.attn.c_proj.weight     [D, D]    -> layers/attn/o/kernel     [L, N, H, D]
    h.{i}.attn.c_proj.bias       [D]       -> layers/attn/o/bias       [L, D]
    h.{i}.ln_2.{weight,bias}     [D]       -> layers/ln2/{scale,bias}  [L, D]
    h.{i}.mlp.c_fc.{weight,bias} [D, F]    -> layers/mlp/fc/{kernel,bias}
    h.{i}.mlp.c_proj.{w,b}       [F, D]    -> layers/mlp/proj/{kernel,bias}
    ln_f.{weight,bias}           [D]       -> ln_f/{scale,bias}

Names may carry the `transformer.` prefix (`save_pretrained` of GPT2LMHeadModel) or not (the
original hub files, which also hold the causal-mask buffers `h.{i}.attn.bias`, skipped here).
`gpt2.to_hf` writes the prefixed form. The head is tied, as in our model: a checkpoint with
`tie_word_embeddings: false` is refused.

Example:
    >>> cfg, model = gpt2.from_hf("path/to/gpt2")  # doctest: +SKIP
"""

from __future__ import annotations

import pathlib
from typing import Any

from models import gpt2
from models._hf import Family, Source, check_config_keys, require

_MAPPED = {
    "model_type", "vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "n_ctx",
    "activation_function", "layer_norm_epsilon", "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention",
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_type", "summary_use_proj",
    "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
}  # fmt: skip
PREFIX = "transformer."


def config_from_hf(config: dict[str, Any], where: pathlib.Path) -> gpt2.Config:
    """Our `gpt2.Config` for an HF `GPT2Config` dict; raise on anything we do not compute."""
    check_config_keys(config, _MAPPED, where)
    require(
        config, where, "activation_function", ("gelu_new", "gelu_pytorch_tanh"),
        "our MLP uses GELU with the tanh approximation",
    )  # fmt: skip
    require(config, where, "scale_attn_weights", (True,), "our scores are scaled by 1/sqrt(H)")
    require(
        config, where, "scale_attn_by_inverse_layer_idx", (False,),
        "our scores are not scaled per layer",
    )  # fmt: skip
    require(config, where, "add_cross_attention", (False,), "ours is a decoder-only model")
    require(config, where, "tie_word_embeddings", (True,), "our head is the token table wte")
    d = config["n_embd"]
    return gpt2.Config(
        name=str(config.get("_name_or_path") or where.name),
        vocab_size=config["vocab_size"],
        d_model=d,
        n_layers=config["n_layer"],
        n_heads=config["n_head"],
        d_ff=config.get("n_inner") or 4 * d,
        max_seq_len=config["n_positions"],
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        init_std=float(config.get("initializer_range", 0.02)),
    )


def config_to_hf(cfg: gpt2.Config) -> dict[str, Any]:
    """The HF `GPT2Config` dict of `cfg` (read back by `config_from_hf` to the same cfg)."""
    return {
        "_name_or_path": cfg.name,
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.max_seq_len,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "tie_word_embeddings": True,
        "initializer_range": cfg.init_std,
        # No dropout in our model: make HF's training-mode forward agree as well.
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
    } | _special_tokens(cfg)


def _special_tokens(cfg: gpt2.Config) -> dict[str, Any]:
    """GPT-2's <|endoftext|> (50256) where the vocabulary has it; none for toy vocabularies."""
    eot = 50_256 if cfg.vocab_size > 50_256 else None
    return {"bos_token_id": eot, "eos_token_id": eot}


def sources(
    cfg: gpt2.Config, config: dict[str, Any] | None, names: frozenset | None
) -> dict[str, Source]:
    """Our parameter path -> where it lives in an HF GPT-2 checkpoint."""
    d, f, n, h = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.head_dim
    top = PREFIX if names is None or PREFIX + "wte.weight" in names else ""
    layer = top + "h.{i}."
    out: dict[str, Source] = {
        "wte/embedding": Source(top + "wte.weight", (cfg.vocab_size, d), (cfg.vocab_size, d), (0, 1), stacked=False),
        "wpe/embedding": Source(top + "wpe.weight", (cfg.max_seq_len, d), (cfg.max_seq_len, d), (0, 1), stacked=False),
        "layers/attn/o/kernel": Source(layer + "attn.c_proj.weight", (d, d), (n, h, d), (0, 1, 2)),
        "layers/attn/o/bias": Source(layer + "attn.c_proj.bias", (d,), (d,), (0,)),
        "layers/mlp/fc/kernel": Source(layer + "mlp.c_fc.weight", (d, f), (d, f), (0, 1)),
        "layers/mlp/fc/bias": Source(layer + "mlp.c_fc.bias", (f,), (f,), (0,)),
        "layers/mlp/proj/kernel": Source(layer + "mlp.c_proj.weight", (f, d), (f, d), (0, 1)),
        "layers/mlp/proj/bias": Source(layer + "mlp.c_proj.bias", (d,), (d,), (0,)),
        "ln_f/scale": Source(top + "ln_f.weight", (d,), (d,), (0,), stacked=False),
        "ln_f/bias": Source(top + "ln_f.bias", (d,), (d,), (0,), stacked=False),
    }  # fmt: skip
    for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
        out[f"layers/{ours}/scale"] = Source(layer + theirs + ".weight", (d,), (d,), (0,))
        out[f"layers/{ours}/bias"] = Source(layer + theirs + ".bias", (d,), (d,), (0,))
    for slot, qkv in enumerate("qkv"):
        kernel, bias = layer + "attn.c_attn.weight", layer + "attn.c_attn.bias"
        out[f"layers/attn/{qkv}/kernel"] = Source(
            kernel, (d, 3 * d), (d, 3, n, h), (0, 1, 2), fixed=((1, slot),)
        )
        out[f"layers/attn/{qkv}/bias"] = Source(
            bias, (3 * d,), (3, n, h), (0, 1), fixed=((0, slot),)
        )
    return out


def _ignored(config: dict[str, Any]) -> tuple[str, ...]:
    """Causal-mask buffers of old checkpoints, and the head's copy of the tied token table."""
    return (r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", r"lm_head\.weight")


FAMILY = Family(
    name="gpt2",
    model_type="gpt2",
    make_model=gpt2.Model,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    sources=sources,
    ignored=_ignored,
)
