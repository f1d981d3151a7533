"""Llama family: logical axes of every parameter (RMSNorm, RoPE, SwiGLU, GQA, untied head)."""

from partition_rules._rules import Rules

RULES = Rules(
    [
        (r"embed/embedding", ("vocab", "embed")),
        (r"layers/(attn|mlp)_norm/scale", ("layers", "norm")),
        (r"layers/attn/q/kernel", ("layers", "embed", "heads", "head_dim")),
        (r"layers/attn/(k|v)/kernel", ("layers", "embed", "kv_heads", "head_dim")),
        (r"layers/attn/o/kernel", ("layers", "heads", "head_dim", "embed")),
        (r"layers/mlp/(gate|up)/kernel", ("layers", "embed", "mlp")),
        (r"layers/mlp/down/kernel", ("layers", "mlp", "embed")),
        (r"final_norm/scale", ("norm",)),
        (r"lm_head/kernel", ("embed", "vocab")),
    ]
)
