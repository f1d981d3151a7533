"""Flax NNX model families with stacked (scannable, pipeline-cuttable) layers and no device logic.

Every family module has the same interface: `NAME`, `INPUT`, `Config`, `SIZES`,
`config(size, **overrides)`, `Model(cfg, rngs=...)` with `embed(inputs) -> h`, `layers` (stacked
blocks), `head(h) -> logits`, `loss(model, batch)`, `loss_from_logits(logits, batch)`,
`batch_shapes(cfg, batch_size, seq_len)`, `make_batch(cfg, batch_size, seq_len, key=...)`,
`check_batch(cfg, batch)` (refuses a host batch the model cannot compute on, e.g. token ids past
the vocabulary, which a jitted step would turn into a NaN loss) and `param_count(cfg)`.

`models.layers` holds the building blocks for families of your own, `models.hf` the Hugging Face
loader. Nothing here knows of meshes or partition rules: placement is the caller's argument.
Errors for input a family cannot take are `ModelError`s (`ValueError`s).

Example:
    >>> from flax import nnx
    >>> fam = get_family("llama")
    >>> cfg = build_config("llama", "tiny")
    >>> model = fam.Model(cfg, rngs=nnx.Rngs(0))
    >>> float(fam.loss(model, fam.make_batch(cfg, 2, 16))) > 0
    True
"""

from models import attention, cnn, gpt2, kernels, layers, llama, llama_moe, mlp, moe
from models._errors import BatchError, ModelConfigError, ModelError, UnknownFamilyError
from models._registry import FAMILIES, build_config, get_family
from models.attention import AttentionKernelError
from models.hf import (
    HFCheckpointNotFoundError,
    HFCorruptFileError,
    HFError,
    HFExportError,
    HFTensorMismatchError,
    PickleCheckpointError,
    UnsupportedHFConfigError,
)
from models.layers import scan_layers

__all__ = [
    "FAMILIES",
    "AttentionKernelError",
    "BatchError",
    "HFCheckpointNotFoundError",
    "HFCorruptFileError",
    "HFError",
    "HFExportError",
    "HFTensorMismatchError",
    "ModelConfigError",
    "ModelError",
    "PickleCheckpointError",
    "UnknownFamilyError",
    "UnsupportedHFConfigError",
    "attention",
    "build_config",
    "cnn",
    "get_family",
    "gpt2",
    "hf",
    "kernels",
    "layers",
    "llama",
    "llama_moe",
    "mlp",
    "moe",
    "scan_layers",
]
