"""argparse types: each parses one flag's text or raises `argparse.ArgumentTypeError` (argparse then
names the flag and exits 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from partition_rules import PARTS, STRATEGIES, CompositionError, composition


def stage_layers_arg(text: str) -> tuple[int, ...] | str:
    """argparse type of --stage-layers: 'auto', or comma-separated whole numbers >= 1."""
    if text == "auto":
        return text
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give layers per stage as whole numbers separated by commas, e.g. 3,5, "
            f"or 'auto'"
        ) from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: every stage needs >= 1 layer")
    return counts


def _whole_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse


# argparse types: a whole number >= 1 / >= 0 (argparse names the flag and exits 2 otherwise).
positive_int = _whole_at_least(1)
non_negative_int = _whole_at_least(0)


def resume_step(text: str) -> int | str:
    """argparse type of --resume: a step >= 1, or "latest" (argparse converts the const too)."""
    return text if text == "latest" else positive_int(text)


def data_arg(text: str) -> str | Path:
    """argparse type of --data: ``hf:PATH`` and ``grain:FILE`` as given, else a token file."""
    if text.startswith(("hf:", "grain:")):
        kind, _, path = text.partition(":")
        if not path:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a path after {kind}:, e.g. {kind}:data"
            )
        return text
    return Path(text)


def strategy_arg(text: str) -> str:
    try:
        composition(text)
    except CompositionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text  # kept as written: the library reads either


strategy_arg.__doc__ = (f"a name ({', '.join(STRATEGIES)}) or parts ({'+'.join(PARTS)}) joined "
                        f"by '+', e.g. fsdp+tp+sp+cp+pp")  # fmt: skip
