"""Flax NNX model families with stacked (scannable, pipeline-cuttable) layers and no device logic.

Every family module has the same interface: `Config`, `SIZES`, `config(size, **overrides)`,
`Model(cfg, rngs=...)` with `embed(inputs) -> h`, `layers` (stacked blocks), `head(h) -> logits`,
`loss(model, batch)`, `loss_from_logits(logits, batch)`, `batch_shapes(cfg, batch_size, seq_len)`,
`make_batch(cfg, batch_size, seq_len, key=...)` and `param_count(cfg)`.

Example:
    >>> from flax import nnx
    >>> fam = get_family("llama")
    >>> cfg = build_config("llama", "tiny")
    >>> model = fam.Model(cfg, rngs=nnx.Rngs(0))
    >>> float(fam.loss(model, fam.make_batch(cfg, 2, 16))) > 0
    True
"""

from models import cnn, gpt2, llama, mlp
from models._hf import (
    HFCheckpointNotFoundError,
    HFError,
    HFExportError,
    HFTensorMismatchError,
    PickleCheckpointError,
    UnsupportedHFConfigError,
)
from models._layers import scan_layers
from models._registry import FAMILIES, build_config, get_family

__all__ = [
    "FAMILIES",
    "HFCheckpointNotFoundError",
    "HFError",
    "HFExportError",
    "HFTensorMismatchError",
    "PickleCheckpointError",
    "UnsupportedHFConfigError",
    "build_config",
    "cnn",
    "get_family",
    "gpt2",
    "llama",
    "mlp",
    "scan_layers",
]
