"""Hugging Face checkpoints (config.json + safetensors) <-> our stacked parameter trees.

Shared machinery for `models._hf_llama` and `models._hf_gpt2`: a reader for a local HF directory
(one `model.safetensors`, or shards listed by `model.safetensors.index.json`), the `Source` that
says where one of our parameters lives in it (name, view, transpose, fused slot), and the loader
that builds every parameter straight into its target sharding: each device's callback reads only
its own slice of each tensor (`safe_open(..., framework="numpy").get_slice`), so no host ever
holds the whole model. Pickle files (`.bin`, `.pt`, `.pth`) are refused, never opened.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Keys every HF config may carry that do not change the forward pass.
GENERIC_KEYS = frozenset(
    [
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "tie_word_embeddings",
        "initializer_range",
        "attention_dropout",
        "is_decoder",
        "is_encoder_decoder",
        "chunk_size_feed_forward",
        "problem_type",
        "id2label",
        "label2id",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
    ]
)


class HFError(ValueError):
    """A Hugging Face checkpoint that cannot be read into (or written from) our model."""


class HFCheckpointNotFoundError(HFError):
    """The path is not a directory with config.json and safetensors weights."""


class PickleCheckpointError(HFError):
    """Weights stored as pickle (.bin/.pt/.pth): never loaded, loading runs arbitrary code."""


class UnsupportedHFConfigError(HFError):
    """config.json describes an architecture our model does not compute."""


class HFTensorMismatchError(HFError):
    """Tensors missing from, unexpected in, or of the wrong shape in the checkpoint."""


class HFExportError(HFError):
    """`to_hf` cannot write the checkpoint (wrong model, stale shards in the directory)."""


@dataclass(frozen=True)
class Source:
    """Where one of our parameters lives in the HF checkpoint.

    The HF tensor `name` (with `{i}` for the layer when `stacked`) of shape `shape` is viewed as
    `view` (same elements, its axes refine `shape`'s); the axes in `fixed` are pinned to one
    index (the q/k/v slot of a fused projection); the remaining view axes, in order, become our
    axes through `perm` (our axis j is remaining axis `perm[j]`). Stacked parameters get the
    layer axis in front.
    """

    name: str
    shape: tuple[int, ...]
    view: tuple[int, ...]
    perm: tuple[int, ...]
    fixed: tuple[tuple[int, int], ...] = ()
    stacked: bool = True

    def names(self, n_layers: int) -> list[str]:
        return [self.name.format(i=i) for i in range(n_layers)] if self.stacked else [self.name]

    def kept(self) -> list[int]:
        pinned = dict(self.fixed)
        return [a for a in range(len(self.view)) if a not in pinned]

    def our_shape(self) -> tuple[int, ...]:
        kept = self.kept()
        return tuple(self.view[kept[p]] for p in self.perm)

    def groups(self) -> list[list[int]]:
        """View axes per HF dimension (consecutive axes whose sizes multiply to that dim)."""
        groups, axis = [], 0
        for dim in self.shape:
            group, size = [axis], self.view[axis]
            axis += 1
            while size < dim:
                group.append(axis)
                size *= self.view[axis]
                axis += 1
            groups.append(group)
        return groups

    def read(self, tensor: Any, index: tuple[slice, ...]) -> np.ndarray:
        """Our slice `index` (no layer axis) of this tensor, reading only the rows it needs."""
        kept, pinned = self.kept(), dict(self.fixed)
        view_sl = {a: slice(i, i + 1) for a, i in pinned.items()}
        for j, s in enumerate(index):
            view_sl[kept[self.perm[j]]] = s
        hf_sl, inner_sl, block_view = [], [], []
        for group in self.groups():
            outer, inner = view_sl[group[0]], math.prod(self.view[a] for a in group[1:])
            hf_sl.append(slice(outer.start * inner, outer.stop * inner))
            block_view += [outer.stop - outer.start] + [self.view[a] for a in group[1:]]
            inner_sl += [slice(None)] + [view_sl[a] for a in group[1:]]
        block = np.asarray(tensor[tuple(hf_sl)]).reshape(block_view)[tuple(inner_sl)]
        block = block.reshape([n for a, n in enumerate(block.shape) if a not in pinned])
        return block.transpose(self.perm)

    def write(self, buffer: np.ndarray, value: np.ndarray) -> None:
        """Put our `value` (no layer axis) into `buffer`, the HF tensor viewed as `view`."""
        where = tuple(dict(self.fixed).get(a, slice(None)) for a in range(len(self.view)))
        buffer[where] = value.transpose(np.argsort(self.perm))


def _refuse_pickle(found: list[pathlib.Path], where: pathlib.Path) -> PickleCheckpointError:
    names = ", ".join(p.name for p in found)
    return PickleCheckpointError(
        f"{where}: weights stored as pickle ({names}) are never loaded: unpickling runs arbitrary "
        f"code. Convert them to safetensors once, in a trusted environment with torch and "
        f"transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out), which "
        f"writes model.safetensors; then pass `out`"
    )


class Checkpoint:
    """A local HF checkpoint directory opened for slice reads. Use as a context manager."""

    def __init__(self, path: str | pathlib.Path):
        self.path = path = pathlib.Path(path)
        if path.is_file() and path.suffix in PICKLE_SUFFIXES:
            raise _refuse_pickle([path], path.parent)
        if not path.is_dir():
            hint = " (pass the directory that holds it)" if path.is_file() else ""
            raise HFCheckpointNotFoundError(
                f"{path}: not a Hugging Face checkpoint directory{hint}; expected a directory "
                f"with {CONFIG} and {WEIGHTS} or {INDEX} plus its shards"
            )
        if not (path / CONFIG).is_file():
            raise HFCheckpointNotFoundError(
                f"{path}: no {CONFIG}; a Hugging Face checkpoint directory holds {CONFIG} beside "
                f"its weights"
            )
        self.config: dict[str, Any] = json.loads((path / CONFIG).read_text())
        self.files = self._weight_map()
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}

    def _weight_map(self) -> dict[str, str]:
        path = self.path
        if (path / INDEX).is_file():
            weight_map = json.loads((path / INDEX).read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFCheckpointNotFoundError(f"{path / INDEX}: no 'weight_map' in the index")
            missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
            if missing:
                raise HFCheckpointNotFoundError(
                    f"{path / INDEX} lists shard(s) that are not in {path}: {', '.join(missing)}; "
                    f"copy every shard the index names"
                )
            return dict(weight_map)
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            pickles = [p for p in sorted(path.iterdir()) if p.suffix in PICKLE_SUFFIXES]
            if pickles:
                raise _refuse_pickle(pickles, path)
            raise HFCheckpointNotFoundError(
                f"{path}: no {WEIGHTS}, {INDEX} or other *.safetensors file"
            )
        files: dict[str, str] = {}
        for shard in shards:
            with safe_open(shard, framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in files:
                        raise HFCheckpointNotFoundError(
                            f"{path}: tensor {name!r} is in both {files[name]} and {shard.name}; "
                            f"keep one checkpoint per directory"
                        )
                    files[name] = shard.name
        return files

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def tensor(self, name: str) -> Any:
        """The lazily sliceable tensor `name` (`[...]` reads only the requested slice)."""
        file = self.files[name]
        if file not in self._open:
            handle = safe_open(self.path / file, framework="numpy")
            self._open[file] = self._stack.enter_context(handle)
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensor(name).get_shape())


def check_config_keys(config: Mapping[str, Any], known: set[str], where: pathlib.Path) -> None:
    """Raise if config.json has keys we neither map nor know to be harmless."""
    unknown = sorted(set(config) - known - GENERIC_KEYS)
    if unknown:
        raise UnsupportedHFConfigError(
            f"{where / CONFIG}: unsupported field(s) {', '.join(unknown)}; the model may compute "
            f"something ours does not. If they do not change the forward pass, remove them from "
            f"{CONFIG}"
        )


def require(config: Mapping[str, Any], where: pathlib.Path, key: str, allowed: tuple, why: str):
    """Raise unless `config[key]` (absent counts as `allowed[0]`) is one of `allowed`."""
    value = config.get(key, allowed[0])
    if value not in allowed:
        raise UnsupportedHFConfigError(
            f"{where / CONFIG}: {key}={value!r} is not supported ({why}); supported: "
            + " or ".join(repr(a) for a in allowed)
        )
    return value


@dataclass(frozen=True)
class Family:
    """What one model family needs from the shared loader."""

    name: str
    model_type: str
    make_model: Callable[..., nnx.Module]
    config_from_hf: Callable[[dict, pathlib.Path], Any]
    config_to_hf: Callable[[Any], dict]
    # sources(cfg, hf_config, names): our path -> Source; names is None when writing.
    sources: Callable[[Any, dict | None, frozenset | None], dict[str, Source]]
    # ignored(hf_config): HF tensors that are buffers or tied copies (regexes, full match).
    ignored: Callable[[dict], tuple[str, ...]] = lambda config: ()


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


def load(fam: Family, path: str | pathlib.Path, *, mesh=None, rules=None, axis_map=None):
    """(cfg, model) from a local HF directory, every parameter born in its target sharding."""
    with Checkpoint(path) as ckpt:
        model_type = ckpt.config.get("model_type")
        if model_type != fam.model_type:
            raise UnsupportedHFConfigError(
                f"{ckpt.path / CONFIG}: model_type={model_type!r}, expected "
                f"{fam.model_type!r}; use models.{fam.name}.from_hf only for {fam.model_type} "
                f"checkpoints"
            )
        try:
            cfg = fam.config_from_hf(ckpt.config, ckpt.path)
        except KeyError as e:
            raise UnsupportedHFConfigError(
                f"{ckpt.path / CONFIG}: required field {e} is missing; a {fam.model_type} "
                f"config.json written by transformers has it"
            ) from None
        sources = fam.sources(cfg, ckpt.config, frozenset(ckpt.files))
        _check_tensors(ckpt, sources, cfg.n_layers, fam)
        abstract = nnx.eval_shape(lambda: fam.make_model(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        shardings = _shardings(fam, state, mesh, rules, axis_map)
        flat_shardings = jax.tree.leaves(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
        leaves = []
        for (p, leaf), sharding in zip(_paths(state), flat_shardings, strict=True):
            src = sources[p]
            ours = (cfg.n_layers, *src.our_shape()) if src.stacked else src.our_shape()
            if ours != tuple(leaf.shape):  # a mapping bug, not a user error
                raise AssertionError(f"{p}: {src} gives {ours}, the model has {leaf.shape}")
            leaves.append(_build(ckpt, src, leaf, sharding, cfg.n_layers))
        params = jax.tree.unflatten(jax.tree.structure(state), leaves)
    return cfg, nnx.merge(graphdef, params)


def _shardings(fam: Family, state: Any, mesh, rules, axis_map) -> Any:
    if mesh is None:
        if rules is not None or axis_map is not None:
            raise HFError("rules/axis_map given without a mesh; pass mesh=make_mesh('...') too")
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: device, state)
    # Imported here: models know nothing of sharding unless asked to place on a mesh.
    from partition_rules import family_rules
    from sharding._resolve import resolve

    if axis_map is None:
        raise HFError(
            f"from_hf(mesh=...) needs axis_map (a strategy), e.g. "
            f"axis_map=partition_rules.strategy('fsdp_tp'); mesh axes {dict(mesh.shape)}"
        )
    return resolve(family_rules(fam.name) if rules is None else rules, axis_map, state, mesh)


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


def save(fam: Family, cfg: Any, model: nnx.Module, path: str | pathlib.Path) -> pathlib.Path:
    """Write config.json + model.safetensors for `model` (exact values, our dtype)."""
    path = pathlib.Path(path)
    if getattr(cfg, "family", None) != fam.name or not isinstance(model, nnx.Module):
        raise HFExportError(
            f"{fam.name}_to_hf needs a {fam.name} Config and Model, got "
            f"{type(cfg).__name__} and {type(model).__name__}"
        )
    path.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in path.glob("*.safetensors*") if p.name != WEIGHTS)
    if stale:
        raise HFExportError(
            f"{path}: already holds {', '.join(stale)}; a reader would mix them with the new "
            f"{WEIGHTS}. Write into an empty directory"
        )
    sources = fam.sources(cfg, None, None)
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
    tensors = {n: b.reshape(shapes[n]) for n, b in buffers.items()}
    save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    config = fam.config_to_hf(cfg) | {"dtype": str(next(iter(tensors.values())).dtype)}
    (path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
