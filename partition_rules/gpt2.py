"""GPT-2 family: logical axes of every parameter (learned positions, LayerNorm, tied embeddings)."""

from partition_rules._rules import Rules

RULES = Rules(
    [
        (r"wte/embedding", ("vocab", "embed")),
        (r"wpe/embedding", ("positions", "embed")),
        (r"layers/ln(1|2)/(scale|bias)", ("layers", "norm")),
        (r"layers/attn/(q|k|v)/kernel", ("layers", "embed", "heads", "head_dim")),
        (r"layers/attn/(q|k|v)/bias", ("layers", "heads", "head_dim")),
        (r"layers/attn/o/kernel", ("layers", "heads", "head_dim", "embed")),
        (r"layers/attn/o/bias", ("layers", "norm")),
        (r"layers/mlp/fc/kernel", ("layers", "embed", "mlp")),
        (r"layers/mlp/fc/bias", ("layers", "mlp")),
        (r"layers/mlp/proj/kernel", ("layers", "mlp", "embed")),
        (r"layers/mlp/proj/bias", ("layers", "norm")),
        (r"ln_f/(scale|bias)", ("norm",)),
    ]
)
