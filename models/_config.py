"""Config and batch helpers shared by the families: size lookup with overrides, validation of
config fields, batch sizes, sequence lengths, and token / label ids against the model."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import numpy as np

from models._errors import BatchError, ModelConfigError

C = TypeVar("C")


def pick(family: str, sizes: Mapping[str, C], size: str, overrides: Mapping[str, Any]) -> C:
    """`sizes[size]` with `overrides` replaced; `ModelConfigError` naming what is unknown."""
    if not isinstance(size, str) or size not in sizes:
        raise ModelConfigError(
            f"unknown {family} size {size!r}; known sizes: {', '.join(repr(s) for s in sizes)}"
        )
    cfg = sizes[size]
    fields = [f.name for f in dataclasses.fields(cfg)]  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ModelConfigError(
            f"unknown {family} config field(s) {', '.join(unknown)}; fields: {', '.join(fields)}"
        )
    return dataclasses.replace(cfg, **overrides)  # type: ignore[type-var]


def check_positive(cfg: Any, *names: str) -> None:
    """Raise one `ModelConfigError` listing every named field that is not a positive int."""
    bad = [n for n in names if not _positive_int(getattr(cfg, n))]
    if bad:
        raise ModelConfigError(
            f"{cfg.family} config {cfg.name!r}: must be positive ints: "
            + ", ".join(f"{n}={getattr(cfg, n)!r}" for n in bad)
            + "; use whole numbers >= 1"
        )


def check_positive_float(cfg: Any, *names: str) -> None:
    """Raise one `ModelConfigError` listing every named field that is not a finite number > 0
    (norm epsilons, RoPE bases, init scales: zero or NaN there trains to NaN, silently)."""
    bad = [f"{n}={getattr(cfg, n)!r}" for n in names if not _positive_float(getattr(cfg, n))]
    if bad:
        raise ModelConfigError(
            f"{cfg.family} config {cfg.name!r}: must be finite numbers > 0: {', '.join(bad)}; "
            f"use the family's default (see {cfg.family}.SIZES) or another positive value"
        )


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_float(v: Any) -> bool:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
    return ok and math.isfinite(v) and v > 0


def batch_size_for(cfg: Any, batch_size: Any) -> int:
    """`batch_size` as an int; `BatchError` unless it is a positive integer."""
    if not _positive_int(batch_size) and not (
        isinstance(batch_size, np.integer) and batch_size > 0
    ):
        raise BatchError(
            f"batch size {batch_size!r} for {cfg.family} {cfg.name!r}: a batch holds at least "
            f"one example; use a batch size >= 1"
        )
    return int(batch_size)


def seq_len_for(cfg: Any, seq_len: int | None) -> int:
    """Resolve a language model batch length: None means `cfg.max_seq_len`.

    Raises:
        BatchError: not a positive int, or longer than the model supports (naming both numbers).
    """
    if seq_len is None:
        return cfg.max_seq_len
    if not _positive_int(seq_len):
        raise BatchError(
            f"sequence length {seq_len!r} for {cfg.family} {cfg.name!r}: use a sequence length "
            f"between 1 and max_seq_len={cfg.max_seq_len}"
        )
    if seq_len > cfg.max_seq_len:
        raise BatchError(
            f"sequence longer than the model supports: seq_len={seq_len} > "
            f"max_seq_len={cfg.max_seq_len} of {cfg.family} {cfg.name!r}; use a sequence length "
            f"<= {cfg.max_seq_len}"
        )
    return seq_len


def no_seq_len(cfg: Any, seq_len: int | None) -> None:
    """Families without a sequence axis accept only seq_len=None."""
    if seq_len is not None:
        raise BatchError(
            f"{cfg.family} batches have no sequence axis; got seq_len={seq_len}, pass None"
        )


def concrete(x: Any) -> np.ndarray | None:
    """`x` on the host, or None when it has no values here (traced, or on other hosts).

    The families check ids only on values they already have: inside `jit` the arrays are
    tracers and are never pulled back, so the compiled step stays free of host syncs.
    """
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return np.asarray(x)


def who(cfg: Any) -> str:
    """How messages name a model: family and size, e.g. "llama 'tiny'"."""
    return f"{cfg.family} {cfg.name!r}"


def check_ids(model: str, key: str, ids: np.ndarray, n: int, what: str) -> None:
    """Raise `BatchError` if an integer id in `ids` lies outside `[0, n)` (`model` names the
    model in the message, `what` the kind of id: "token", "label").

    Out-of-range ids do not fail in JAX: gathers fill NaN, so the loss would be NaN with no word.
    """
    if ids.size == 0:
        return
    if ids.dtype.kind not in "iu":
        raise BatchError(
            f"batch[{key!r}] has dtype {ids.dtype} for {model}; {what} ids must be integers (int32)"
        )
    bad = (ids < 0) | (ids >= n)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        value = int(ids[where])
        raise BatchError(
            f"batch[{key!r}] holds {what} id {value} (at {list(where)}; {int(bad.sum())} of "
            f"{ids.size} ids out of range), outside the {n} {what} ids 0..{n - 1} of {model}; "
            f"the ids were made for another model: encode them for this one, or use a model "
            f"with at least {value + 1} {what}s"
        )


def checked_ids(model: str, key: str, ids: Any, n: int, what: str) -> None:
    """`check_ids` on `ids` when their values are at hand (eager calls); a no-op under `jit`."""
    value = concrete(ids)
    if value is not None:
        check_ids(model, key, value, n, what)


def host_batch(cfg: Any, batch: Any, shapes_fn: Any, *, seq: bool) -> dict[str, np.ndarray]:
    """The entries of `batch` as host arrays, checked against `shapes_fn(cfg, B, S)` for the
    batch size B (and sequence length S) the batch has: entries, shapes, dtype kinds."""
    probe = shapes_fn(cfg, 1, 1 if seq else None)
    spec = ", ".join(f"{k!r}: {v.dtype}{list(v.shape)}" for k, v in probe.items())
    spec = spec.replace("[1, 1]", "[batch, seq]").replace("[1", "[batch")
    if not isinstance(batch, Mapping):
        raise BatchError(f"a {cfg.family} batch is a dict {{{spec}}}; got {type(batch).__name__}")
    missing = [k for k in probe if k not in batch]
    if missing:
        raise BatchError(
            f"{cfg.family} batch has no {', '.join(map(repr, missing))} (it holds "
            f"{sorted(map(str, batch))}); a {cfg.family} batch is {{{spec}}}"
        )
    arrays = {}
    for key in probe:
        value = concrete(batch[key])
        if value is None:
            raise BatchError(
                f"batch[{key!r}] has no values on this host (traced or spread over hosts); "
                f"check the host batch (numpy arrays) before placing it on devices"
            )
        arrays[key] = value
    lead = next(iter(probe))
    first = arrays[lead]
    if first.ndim < (2 if seq else 1):
        raise BatchError(f"batch[{lead!r}] is {first.dtype}{list(first.shape)}; expected {spec}")
    want = shapes_fn(cfg, batch_size_for(cfg, first.shape[0]), first.shape[1] if seq else None)
    for key, value in arrays.items():
        kind_ok = (value.dtype.kind in "iu") == (np.dtype(want[key].dtype).kind in "iu")
        if value.shape != want[key].shape or not kind_ok:
            given = f"batch[{key!r}] is {value.dtype}{list(value.shape)}"
            if key != lead:
                given += f" beside batch[{lead!r}] {first.dtype}{list(first.shape)}"
            raise BatchError(
                f"{given}; {who(cfg)} takes {want[key].dtype}{list(want[key].shape)} there "
                f"(a batch is {{{spec}}})"
            )
    return arrays
