"""The arguments `compare` checks before anything compiles: the model, the sequence, the counts,
the comma lists of dtypes and remat policies, the memory budget. Every refusal is a
`CompareArgumentError` naming the flag."""

from __future__ import annotations

import math
from typing import Any

from sharding._units import SizeFormatError, parse_bytes
from sharding._workload import Workload
from sharding.comparison._errors import CompareArgumentError

DEFAULT_SEQ = 128  # tokens per sequence when a model with a sequence axis is compared without --seq


def choices(flag: str, value: Any, known: tuple[str, ...]) -> tuple[str, ...] | None:
    if value is None:
        return known if flag == "--dtype" else None
    asked = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    bad = [v for v in asked if v not in known]
    if bad or not asked:
        raise CompareArgumentError(
            f"{flag} {','.join(map(str, asked))!r}: choose from {', '.join(known)} (a comma list)"
        )
    return tuple(dict.fromkeys(asked))


def workload_of(model: Any, size: str | None, cfg: Any) -> Workload:
    if isinstance(model, Workload):
        if size is not None or cfg is not None:
            raise CompareArgumentError(
                f"--size/cfg configure a shipped family; {model.name!r} is a Workload: build it "
                f"at the size you want instead"
            )
        return model
    if not all(hasattr(model, a) for a in ("NAME", "Model", "loss", "config", "SIZES")):
        raise CompareArgumentError(
            f"--model {model!r}: compare takes a sharding.Workload or a model family module "
            f"(e.g. models.llama, models.cnn)"
        )
    if cfg is None:
        if (size or "tiny") not in model.SIZES:
            raise CompareArgumentError(
                f"--size {size!r}: unknown {model.NAME} size; sizes: {', '.join(model.SIZES)}"
            )
        cfg = model.config(size or "tiny")
    return Workload.from_family(model, cfg)


def names(work: Workload) -> tuple[str, str]:
    """(model, size) for tables and JSON: the family and its size, or the workload's name."""
    if work.family is not None:
        return work.family.NAME, work.config.name
    return work.name, "-"


def check_counts(work: Workload, batch, seq, timed_steps, warmup_steps) -> int | None:
    sequences = work.seq is not None
    if not sequences and seq is not None:
        raise CompareArgumentError(
            f"--seq {seq!r}: {' '.join(names(work)).rstrip(' -')} has no sequence axis (its batch is "
            f"{', '.join(work.batch_shapes(1, None))}); drop --seq"
        )
    seq = (DEFAULT_SEQ if seq is None else seq) if sequences else None
    counts = (
        ("--batch", batch, 1),
        ("--timed-steps", timed_steps, 1),
        ("--warmup-steps", warmup_steps, 0),
    ) + ((("--seq", seq, 1),) if sequences else ())
    for flag, value, low in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CompareArgumentError(f"{flag} {value!r}: give a whole number >= {low}")
    too_long = work.seq_refusal(seq) if sequences else None
    if too_long:
        raise CompareArgumentError(too_long)
    return seq


def _positive(value: Any) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value) and value > 0


def budget_bytes(memory: int | str) -> int:
    try:
        value = parse_bytes(memory) if isinstance(memory, str) else memory
    except SizeFormatError as e:
        raise CompareArgumentError(f"--memory {memory!r}: {e}") from None
    if not _positive(value):
        raise CompareArgumentError(
            f"--memory {memory!r}: give the memory per device, more than 0 bytes, e.g. "
            f"--memory 80GB"
        )
    return int(value)


__all__ = ["DEFAULT_SEQ", "budget_bytes", "check_counts", "choices", "names", "workload_of"]
