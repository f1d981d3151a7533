"""A Hugging Face ``config.json`` alone as one of our families at that size: for planning and
comparing an architecture before (or without) its weights.

`read_config` dispatches on ``model_type``: ``llama`` and ``mistral`` (without a sliding window)
to `models.llama`, ``gpt2`` to `models.gpt2`, ``mixtral`` to `models.llama_moe`. Every key is
checked as the weight loaders check it (`models._hf_llama`, `models._hf_gpt2`): a key that
would change what the model computes is refused by name, never ignored.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from models import gpt2, llama, llama_moe
from models._hf import (
    CONFIG,
    HFCheckpointNotFoundError,
    UnsupportedHFConfigError,
    read_json,
    require,
)
from models._hf_gpt2 import config_from_hf as _gpt2_config
from models._hf_llama import config_from_hf as _llama_config

# model_type -> the family that computes it (its config mapping below).
MODEL_TYPES = {"llama": llama, "mistral": llama, "gpt2": gpt2, "mixtral": llama_moe}
# Mixtral's keys beyond Llama's: the experts, and router settings that do not change the model.
_MIXTRAL = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
            "output_router_logits", "router_jitter_noise")  # fmt: skip


def _config_path(path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / CONFIG
    if not path.is_file():
        raise HFCheckpointNotFoundError(
            f"{path}: no such file; give a Hugging Face config.json, or the folder holding one"
        )
    return path


def _window(config: dict[str, Any], where: pathlib.Path) -> dict[str, Any]:
    """The config without Mistral's ``sliding_window`` (refused unless null: ours attends over the
    whole causal prefix)."""
    require(config, where.parent, "sliding_window", (None,),
            "our attention is full causal attention; a sliding window attends to fewer keys, "
            "so set it to null to plan the model with full attention")  # fmt: skip
    return {k: v for k, v in config.items() if k not in ("sliding_window", "use_sliding_window")}


def _mixtral(config: dict[str, Any], where: pathlib.Path) -> llama_moe.Config:
    config = _window(config, where)
    require(config, where.parent, "router_jitter_noise", (0, 0.0),
            "our router adds no noise to its logits")  # fmt: skip
    for key in ("num_local_experts", "num_experts_per_tok"):
        if key not in config:
            raise UnsupportedHFConfigError(
                f"{where}: required field {key!r} is missing; a mixtral config.json names the "
                f"experts (num_local_experts) and how many each token uses (num_experts_per_tok)"
            )
    dense = _llama_config({k: v for k, v in config.items() if k not in _MIXTRAL}, where.parent)
    return llama_moe.Config(
        **{f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)},
        n_experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
        aux_loss_coef=float(config.get("router_aux_loss_coef", 0.01)),
    )  # fmt: skip


def read_config(path: str | pathlib.Path) -> tuple[Any, Any]:
    """``(family module, Config)`` of a Hugging Face ``config.json`` (or the folder holding it).

    Raises:
        HFCheckpointNotFoundError: no such file (or no config.json in the folder).
        HFCorruptFileError: the file is not a JSON object.
        UnsupportedHFConfigError: an unknown ``model_type`` (naming the supported ones), a key
            our model does not compute, or a required key missing.

    Example:
        >>> family, cfg = read_config("path/to/Meta-Llama-3-8B")  # doctest: +SKIP
        >>> family.NAME, cfg.n_kv_heads  # doctest: +SKIP
        ('llama', 8)
    """
    where = _config_path(path)
    config = read_json(where)
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise UnsupportedHFConfigError(
            f"{where}: model_type={kind!r} is not one spmdkit computes; supported model types: "
            f"{', '.join(MODEL_TYPES)} (a model of your own: --model module:attribute naming a "
            f"sharding.Workload)"
        )
    try:
        if kind == "mixtral":
            cfg = _mixtral(config, where)
        elif kind == "gpt2":
            cfg = _gpt2_config(config, where.parent)
        else:
            llama_keys = _window(config, where) if kind == "mistral" else config
            cfg = _llama_config({**llama_keys, "model_type": "llama"}, where.parent)
    except KeyError as e:
        raise UnsupportedHFConfigError(
            f"{where}: required field {e} is missing; a {kind} config.json names it"
        ) from None
    # A name that says where the sizes came from (the model's own, else the folder's).
    name = config.get("_name_or_path") or where.parent.name or where.stem
    return MODEL_TYPES[kind], dataclasses.replace(cfg, name=str(name))


__all__ = ["MODEL_TYPES", "read_config"]
