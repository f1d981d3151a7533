"""Byte and count formatting/parsing shared by explain, reports and the CLI."""

from __future__ import annotations

import re

from sharding._errors import SpmdkitError


class SizeFormatError(SpmdkitError):
    """A size such as '80GB' that cannot be read."""


_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30,
          "TI": 2**40}  # fmt: skip


def fmt_bytes(n: float) -> str:
    """Binary units, 3 significant digits: 1536 -> '1.50 KiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale >= 100 else f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    """Decimal units: 6_738_415_616 -> '6.74B'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def parse_bytes(text: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '512MB', '1.5T', '1024' (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*((?:[kKmMgGtT][iI]?)?)[bB]?\s*", str(text))
    if not m:
        raise SizeFormatError(
            f"cannot read {text!r} as a size; write a number with an optional unit, e.g. '80GB', "
            f"'80GiB', '512MB' or '1024' (bytes)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
