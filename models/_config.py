"""Config helpers shared by the families: size lookup with overrides, validation, batch length."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

C = TypeVar("C")


def pick(family: str, sizes: Mapping[str, C], size: str, overrides: Mapping[str, Any]) -> C:
    """`sizes[size]` with `overrides` replaced; ValueError naming what is unknown."""
    if size not in sizes:
        raise ValueError(
            f"unknown {family} size {size!r}; known sizes: {', '.join(repr(s) for s in sizes)}"
        )
    cfg = sizes[size]
    fields = [f.name for f in dataclasses.fields(cfg)]  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown {family} config field(s) {', '.join(unknown)}; fields: {', '.join(fields)}"
        )
    return dataclasses.replace(cfg, **overrides)  # type: ignore[type-var]


def check_positive(cfg: Any, *names: str) -> None:
    """Raise one ValueError listing every named field of `cfg` that is not a positive int."""
    bad = [f"{n}={getattr(cfg, n)!r}" for n in names if not _positive_int(getattr(cfg, n))]
    if bad:
        raise ValueError(
            f"{cfg.family} config {cfg.name!r}: must be positive ints: {', '.join(bad)}"
        )


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def seq_len_for(cfg: Any, seq_len: int | None) -> int:
    """Resolve a language model batch length: None means `cfg.max_seq_len`.

    Raises:
        ValueError: the sequence is longer than the model supports (naming both numbers).
    """
    if seq_len is None:
        return cfg.max_seq_len
    if not _positive_int(seq_len):
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if seq_len > cfg.max_seq_len:
        raise ValueError(
            f"sequence longer than the model supports: seq_len={seq_len} > "
            f"max_seq_len={cfg.max_seq_len} ({cfg.family} {cfg.name!r}); "
            f"use seq_len <= {cfg.max_seq_len} or override max_seq_len"
        )
    return seq_len


def no_seq_len(cfg: Any, seq_len: int | None) -> None:
    """Families without a sequence axis accept only seq_len=None."""
    if seq_len is not None:
        raise ValueError(
            f"{cfg.family} batches have no sequence axis; got seq_len={seq_len}, pass None"
        )
