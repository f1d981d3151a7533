"""What XLA:CPU's float normalisation adds to a bfloat16 program's memory (`widened_bytes`).

XLA:CPU runs no dynamic-slice or dynamic-update-slice in bfloat16: its float normalisation
(``float-normalization-bf16``, right after SPMD partitioning) runs them in float32 with converts
around, and the simplifier then moves the converts out of the loops, so whole bfloat16 arrays
are carried as float32 copies from one loop to the next. A layer stack's saved activations are
the large case: ``[L, B, S, F]`` stacked in bfloat16 by the forward loop, converted whole to
float32 after it and read by the backward loop in float32 (Llama-3-8B at 8192 x 2 per device
under fsdp=8 and remat dots: 42 GiB of its 124 GiB). A GPU or TPU, whose slices take bfloat16,
keeps those arrays in bfloat16.

`widened_bytes` finds the copies in the optimized HLO text: a ``convert`` (or a loop fusion that
is only a convert) from bfloat16 to float32 of the same dims whose result enters a tuple (the
operands of a while loop), and returns what they add over their bfloat16 originals: half of each
float32 copy. Zero for a program without such copies (float32 programs, other backends).
"""

from __future__ import annotations

import math
import re

# A computation that only converts its one bfloat16 parameter to float32 of the same dims.
_CONVERT_ONLY = re.compile(
    r"^%(\S+) \(\S+: bf16\[([0-9,]*)\]\) -> f32\[\2\] \{\n"
    r"\s*%\S+ = bf16\[\2\]\S* parameter\(0\)\n\s*ROOT %\S+ = f32\[\2\]\S* convert\(%\S+\)\n\}",
    re.M,
)
_FUSION = re.compile(r"^\s*%(\S+) = f32\[([0-9,]*)\]\S* fusion\([^\n]*?calls=%([^,\s]+)", re.M)
_CONVERT = re.compile(r"^\s*%(\S+) = f32\[([0-9,]*)\]\S* convert\(%(\S+?)\)", re.M)
_BF16 = re.compile(r"^\s*%(\S+) = bf16\[([0-9,]*)\]", re.M)
_TUPLE = re.compile(r" tuple\(([^\n]*)\)")


def widened_bytes(hlo_text: str) -> int:
    """Bytes per device the float32 copies of whole bfloat16 arrays add (see the module doc).

    Example:
        >>> widened_bytes(compiled.as_text())  # doctest: +SKIP
        45097156608
    """
    convert_only = {name for name, _ in _CONVERT_ONLY.findall(hlo_text)}
    bf16 = {name: dims for name, dims in _BF16.findall(hlo_text)}
    copies = {name: dims for name, dims, called in _FUSION.findall(hlo_text)
              if called in convert_only}  # fmt: skip
    copies.update({name: dims for name, dims, src in _CONVERT.findall(hlo_text)
                   if bf16.get(src) == dims})  # fmt: skip
    carried: set[str] = set()
    for operands in _TUPLE.findall(hlo_text):
        carried.update(re.findall(r"%([^,\s)]+)", operands))
    return sum(2 * math.prod(int(d) for d in dims.split(",") if d)
               for name, dims in copies.items() if name in carried)  # fmt: skip


__all__ = ["widened_bytes"]
