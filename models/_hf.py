"""Hugging Face checkpoints (config.json + safetensors) <-> our stacked parameter trees.

The pieces behind `models.hf` (which adds `load`, `save` and the llama / gpt2 mappings): a reader
for a local HF directory (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`), the `Source` that says where one of our parameters lives in it
(name, view, transpose, fused slot), and the `Family` descriptor. The loader builds every
parameter straight into its target sharding: each device's callback reads only its own slice of
each tensor (`safe_open(..., framework="numpy").get_slice`), so no host ever holds the whole
model. Pickle files (`.bin`, `.pt`, `.pth`) are refused, never opened. Where parameters go is the
caller's argument (`shardings`): nothing here knows of meshes or rules.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from models._errors import ModelError

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


class HFError(ModelError):
    """A Hugging Face checkpoint that cannot be read into (or written from) our model."""


class HFCheckpointNotFoundError(HFError):
    """The path is not a directory with config.json and safetensors weights."""


class HFCorruptFileError(HFError):
    """A checkpoint file that cannot be parsed: invalid JSON, a truncated or damaged shard."""


class PickleCheckpointError(HFError):
    """Weights stored as pickle (.bin/.pt/.pth): never loaded, loading runs arbitrary code."""


class UnsupportedHFConfigError(HFError):
    """config.json describes an architecture our model does not compute."""


class HFTensorMismatchError(HFError):
    """Tensors missing from, unexpected in, or of the wrong shape in the checkpoint."""


class HFExportError(HFError):
    """`to_hf` cannot write the checkpoint (wrong model, a directory that is not empty)."""


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
        self.config: dict[str, Any] = read_json(path / CONFIG)
        self.files = self._weight_map()
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}

    def _weight_map(self) -> dict[str, str]:
        path = self.path
        if (path / INDEX).is_file():
            weight_map = read_json(path / INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFCheckpointNotFoundError(f"{path / INDEX}: no 'weight_map' in the index")
            missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
            if missing:
                raise HFCheckpointNotFoundError(
                    f"{path / INDEX} lists shard(s) that are not in {path}: {', '.join(missing)}; "
                    f"copy every shard the index names"
                )
            for shard in sorted(set(weight_map.values())):
                names = set(_shard_keys(path / shard))
                absent = sorted(n for n, f in weight_map.items() if f == shard and n not in names)
                if absent:
                    raise HFCorruptFileError(
                        f"{path / shard}: lacks {len(absent)} tensor(s) that {INDEX} places in "
                        f"it (first: {absent[0]}); the shard and the index are from different "
                        f"downloads: fetch both again"
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
            for name in _shard_keys(shard):
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


def read_json(path: pathlib.Path) -> dict[str, Any]:
    """The JSON object in `path`; `HFCorruptFileError` naming the file and the line otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise HFCorruptFileError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); the file is "
            f"damaged or was edited by hand: restore it from the checkpoint's source"
        ) from None
    except UnicodeDecodeError:
        raise HFCorruptFileError(
            f"{path}: not a text file (not UTF-8); restore it from the checkpoint's source"
        ) from None
    if not isinstance(value, dict):
        raise HFCorruptFileError(
            f"{path}: holds a JSON {type(value).__name__}, not an object of settings; restore "
            f"it from the checkpoint's source"
        )
    return value


def _shard_keys(shard: pathlib.Path) -> list[str]:
    """The tensor names in one safetensors file (its header only); a damaged file is named."""
    try:
        with safe_open(shard, framework="numpy") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise HFCorruptFileError(
            f"{shard}: not a readable safetensors file ({e}; {shard.stat().st_size} bytes); it "
            f"is truncated or damaged, e.g. an interrupted download: fetch it again"
        ) from None


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
