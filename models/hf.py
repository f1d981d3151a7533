"""Hugging Face checkpoints (config.json + safetensors) in and out of our model families.

`llama.from_hf` / `gpt2.from_hf` and `to_hf` are `load` / `save` with the family descriptors
`LLAMA` and `GPT2` (a `Family`: the config mapping `config_from_hf` / `config_to_hf` and, per
parameter, the `Source` tensor it lives in). A family of your own gets the same loader by
describing itself as a `Family`.

Where parameters go is an argument: `shardings` is None (one device), a function from the
abstract model state to a tree of `jax.sharding.Sharding`s, or such a tree. Each device reads only
its own slice of each tensor. This package knows nothing of meshes or partition rules; spmdkit's
placement is one such function:

    >>> import sharding  # doctest: +SKIP
    >>> from partition_rules import preset
    >>> mesh = sharding.make_mesh("fsdp=8")  # doctest: +SKIP
    >>> rules, axis_map = preset("llama", "fsdp")
    >>> place = lambda state: sharding.resolve(rules, axis_map, state, mesh)
    >>> cfg, model = load(LLAMA, "path/to/Llama-3.2-1B", shardings=place)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from models._hf import (
    CONFIG,
    INDEX,
    WEIGHTS,
    Checkpoint,
    Family,
    HFCheckpointNotFoundError,
    HFCorruptFileError,
    HFError,
    HFExportError,
    HFTensorMismatchError,
    PickleCheckpointError,
    Source,
    UnsupportedHFConfigError,
    check_config_keys,
    require,
)
from models._hf_configs import MODEL_TYPES, read_config
from models._hf_gpt2 import FAMILY as GPT2
from models._hf_llama import FAMILY as LLAMA

__all__ = [
    "GPT2",
    "LLAMA",
    "MODEL_TYPES",
    "Checkpoint",
    "Family",
    "HFCheckpointNotFoundError",
    "HFCorruptFileError",
    "HFError",
    "HFExportError",
    "HFTensorMismatchError",
    "PickleCheckpointError",
    "Source",
    "UnsupportedHFConfigError",
    "check_config_keys",
    "load",
    "read_config",
    "require",
    "save",
]


def load(family: Family, path: str | pathlib.Path, *, shardings: Any = None) -> tuple[Any, Any]:
    """``(cfg, model)`` from a local HF directory, every parameter born in its target sharding.

    Args:
        family: `LLAMA`, `GPT2`, or a `Family` of your own.
        path: the checkpoint directory; read only, never created.
        shardings: None (one device), a `jax.sharding.Sharding` for every parameter, a tree of
            them shaped like the model state, or a function ``abstract_state -> such a tree``.

    Example:
        >>> cfg, model = load(GPT2, "path/to/gpt2")  # doctest: +SKIP
    """
    with Checkpoint(path) as ckpt:
        model_type = ckpt.config.get("model_type")
        if model_type != family.model_type:
            raise UnsupportedHFConfigError(
                f"{ckpt.path / CONFIG}: model_type={model_type!r}, expected "
                f"{family.model_type!r}; use models.{family.name}.from_hf only for "
                f"{family.model_type} checkpoints"
            )
        try:
            cfg = family.config_from_hf(ckpt.config, ckpt.path)
        except KeyError as e:
            raise UnsupportedHFConfigError(
                f"{ckpt.path / CONFIG}: required field {e} is missing; a {family.model_type} "
                f"config.json written by transformers has it"
            ) from None
        sources = family.sources(cfg, ckpt.config, frozenset(ckpt.files))
        _check_tensors(ckpt, sources, cfg.n_layers, family)
        abstract = nnx.eval_shape(lambda: family.make_model(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        leaves = []
        for (p, leaf), sharding in zip(_paths(state), _placements(state, shardings), strict=True):
            src = sources[p]
            ours = (cfg.n_layers, *src.our_shape()) if src.stacked else src.our_shape()
            if ours != tuple(leaf.shape):  # a mapping bug, not a user error
                raise AssertionError(f"{p}: {src} gives {ours}, the model has {leaf.shape}")
            leaves.append(_build(ckpt, src, leaf, sharding, cfg.n_layers))
        params = jax.tree.unflatten(jax.tree.structure(state), leaves)
    return cfg, nnx.merge(graphdef, params)


def _placements(state: Any, shardings: Any) -> list[jax.sharding.Sharding]:
    """One sharding per leaf of `state`, in its order, from the caller's `shardings`."""
    n = len(jax.tree.leaves(state))
    if shardings is None:
        return [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * n

    def is_sharding(x: Any) -> bool:
        return isinstance(x, jax.sharding.Sharding)

    example = "shardings=lambda state: sharding.resolve(rules, axis_map, state, mesh)"
    if isinstance(shardings, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise HFError(
            f"shardings is a Mesh {dict(shardings.shape)}; a mesh does not say where each "
            f"parameter goes. Pass a function of the abstract state, e.g. {example}"
        )
    called = callable(shardings) and not is_sharding(shardings)
    given = shardings(state) if called else shardings
    if is_sharding(given):
        return [given] * n
    flat, tree = jax.tree.flatten(given, is_leaf=is_sharding)
    if tree != jax.tree.structure(state) or not all(map(is_sharding, flat)):
        kinds = sorted({type(x).__name__ for x in flat if not is_sharding(x)})
        got = f"a tree of {len(flat)} leaves" + (f" ({', '.join(kinds)})" if kinds else "")
        raise HFError(
            f"{'shardings(state)' if called else 'shardings'} gave {got}, not one "
            f"jax.sharding.Sharding per parameter ({n}, in a tree shaped like the model state); "
            f"pass None (one device), a Sharding, such a tree, or a function of the abstract "
            f"state, e.g. {example}"
        )
    return flat


def _paths(state: Any) -> Iterator[tuple[str, Any]]:
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in key_path]
        yield "/".join(names[:-1] if names and names[-1] == "value" else names), leaf


def _check_tensors(ckpt: Checkpoint, sources: dict[str, Source], n_layers: int, fam: Family):
    want = {n: s.shape for s in sources.values() for n in s.names(n_layers)}
    have = set(ckpt.files)
    patterns = fam.ignored(ckpt.config)
    ignored = {n for n in have if any(re.fullmatch(p, n) for p in patterns)}
    lines = [f"  - missing {n} {list(shape)}" for n, shape in want.items() if n not in have]
    lines += [f"  - unexpected {n}" for n in sorted(have - set(want) - ignored)]
    lines += [
        f"  - {n}: shape {list(ckpt.shape(n))}, config.json implies {list(shape)}"
        for n, shape in want.items()
        if n in have and ckpt.shape(n) != shape
    ]
    if lines:
        raise HFTensorMismatchError(
            f"{ckpt.path}: the {fam.name} checkpoint does not match its {CONFIG} "
            f"({len(lines)} problem(s)):\n" + "\n".join(lines) + "\nfix: use the config.json "
            f"saved with these weights, and a {fam.model_type} checkpoint of this layout"
        )


def _build(ckpt: Checkpoint, src: Source, leaf: Any, sharding: Any, n_layers: int) -> jax.Array:
    shape, dtype = tuple(leaf.shape), leaf.dtype

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
        if not src.stacked:
            return src.read(ckpt.tensor(src.name), index).astype(dtype)
        layers = range(n_layers)[index[0]]
        blocks = [src.read(ckpt.tensor(src.name.format(i=i)), index[1:]) for i in layers]
        return np.stack(blocks).astype(dtype)

    return jax.make_array_from_callback(shape, sharding, callback)


def save(
    family: Family,
    cfg: Any,
    model: nnx.Module,
    path: str | pathlib.Path,
    *,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write config.json + model.safetensors for `model` (exact values, our dtype).

    A directory that holds anything is refused, and nothing is written, unless
    ``overwrite=True``: then config.json and model.safetensors are replaced, other weight shards
    and the shard index removed (a reader would mix them in), and other files kept.

    Example:
        >>> save(GPT2, cfg, model, "out/gpt2")  # doctest: +SKIP
    """
    path = pathlib.Path(path)
    if getattr(cfg, "family", None) != family.name or not isinstance(model, nnx.Module):
        raise HFExportError(
            f"{family.name}_to_hf needs a {family.name} Config and Model, got "
            f"{type(cfg).__name__} and {type(model).__name__}"
        )
    if path.exists() and not path.is_dir():
        raise HFExportError(f"{path}: is a file; to_hf writes a directory: give a directory path")
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise HFExportError(
            f"{path}: already holds {shown}; a reader would mix old files with the new "
            f"{WEIGHTS}. Write into an empty directory, or call to_hf(..., overwrite=True) to "
            f"replace the checkpoint there"
        )
    tensors = _tensors(family, cfg, model)  # before touching the disk: it may refuse
    path.mkdir(parents=True, exist_ok=True)
    for stale in held:
        if stale != WEIGHTS and (stale.endswith(".safetensors") or stale == INDEX):
            (path / stale).unlink()
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    config = family.config_to_hf(cfg) | {"dtype": str(next(iter(tensors.values())).dtype)}
    (path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def _tensors(family: Family, cfg: Any, model: nnx.Module) -> dict[str, np.ndarray]:
    """Every HF tensor of `model`, gathered on this host."""
    sources = family.sources(cfg, None, None)
    buffers: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for p, leaf in _paths(nnx.state(model, nnx.Param)):
        if not leaf.is_fully_addressable:
            raise HFExportError(f"{p}: not fully addressable; gather it on this host first")
        value, src = np.asarray(jax.device_get(leaf)), sources[p]
        values = value if src.stacked else value[None]
        for name, layer_value in zip(src.names(cfg.n_layers), values, strict=True):
            src.write(buffers.setdefault(name, np.zeros(src.view, value.dtype)), layer_value)
            shapes[name] = src.shape
    return {n: b.reshape(shapes[n]) for n, b in buffers.items()}
