"""Family registry: name -> module, and config lookup by family and size."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from models import cnn, gpt2, llama, llama_moe, mlp
from models._errors import UnknownFamilyError

FAMILIES: dict[str, ModuleType] = {
    "llama": llama, "gpt2": gpt2, "mlp": mlp, "cnn": cnn, "llama-moe": llama_moe,
}  # fmt: skip


def get_family(name: str) -> ModuleType:
    """The family module: `Config`, `SIZES`, `config`, `Model`, `loss`, `batch_shapes`, ...

    Example:
        >>> get_family("llama").config("tiny").d_model
        64
    """
    if not isinstance(name, str) or name not in FAMILIES:
        raise UnknownFamilyError(
            f"unknown model family {name!r}; known families: {', '.join(map(repr, FAMILIES))}"
        )
    return FAMILIES[name]


def build_config(family: str, size: str, **overrides: Any) -> Any:
    """`get_family(family).config(size, **overrides)`.

    Example:
        >>> build_config("gpt2", "tiny", n_layers=2).n_layers
        2
    """
    return get_family(family).config(size, **overrides)
