"""Llama-MoE family (Mixtral): llama's attention and norms, and per-layer experts whose leading
dimension is the logical axis ``"experts"`` (expert parallelism puts it on the ``expert`` mesh
axis). The router ``[D, E]`` is small and read by every token: its expert dimension stays
whole (``None``) under every strategy, so each device routes its own tokens without a gather."""

from partition_rules._rules import Rules

RULES = Rules(
    [
        (r"embed/embedding", ("vocab", "embed")),
        (r"layers/(attn|mlp)_norm/scale", ("layers", "norm")),
        (r"layers/attn/q/kernel", ("layers", "embed", "heads", "head_dim")),
        (r"layers/attn/(k|v)/kernel", ("layers", "embed", "kv_heads", "head_dim")),
        (r"layers/attn/o/kernel", ("layers", "heads", "head_dim", "embed")),
        (r"layers/moe/router/kernel", ("layers", "embed", None)),
        (r"layers/moe/(gate|up)", ("layers", "experts", "embed", "mlp")),
        (r"layers/moe/down", ("layers", "experts", "mlp", "embed")),
        (r"final_norm/scale", ("norm",)),
        (r"lm_head/kernel", ("embed", "vocab")),
    ]
)
