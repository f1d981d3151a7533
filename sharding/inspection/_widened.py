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

The same pass widens the collectives: a bfloat16 all-reduce or all-gather that the partitioner
placed runs in float32 between converts, so the final module doubles its bytes. The module as
partitioned has the true dtypes: `compile_partitioned` compiles a program keeping that module's
text (XLA's dump of the ``spmd-partitioning`` pass, in a temporary folder, on XLA:CPU only) and
`partitioned_widths` reads from it the channels the partitioner made narrower than float32, which
`parse_collectives` then counts in their own dtype. Channel ids survive the backend's passes.
"""

from __future__ import annotations

import glob
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import jax

from sharding.inspection._hlo import _ARRAY, _CHANNEL, COLLECTIVE_KINDS, _Module
from sharding.inspection._overlap import overlap_options

_NARROW_FLOATS = ("bf16", "f16")

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


def compile_partitioned(
    lowered: Any, platform: str | None = None, *, unroll_loops: bool = True
) -> tuple[Any, str | None]:
    """``(lowered.compile(), the module's HLO text right after SPMD partitioning)``, compiled
    with XLA's overlap options on a GPU (`overlap_options`); the text is
    None where no float narrower than float32 is in the program or the backend is not XLA:CPU
    (whose final module keeps the partitioner's dtypes), or where this XLA names the dump
    otherwise. ``platform``: the devices the program was lowered for ("cpu", "gpu", "tpu"; a
    compile-only target's, which is not this process's backend); default: the backend's.
    ``unroll_loops=False`` leaves out XLA:GPU's loop double buffering (a pipeline's tick scan
    stays one tick per iteration, as its schedule's accounting reads it)."""
    text, platform = lowered.as_text(), platform or jax.default_backend()
    options = overlap_options(platform)  # XLA's GPU overlap options; none elsewhere
    if not unroll_loops:
        options.pop("xla_gpu_enable_while_loop_double_buffering", None)
    if platform != "cpu" or not any(f"{t}>" in text or f"x{t}" in text for t in _NARROW_FLOATS):
        return _compile_dropping_unknown(lowered, options), None
    with tempfile.TemporaryDirectory(prefix="spmdkit-partitioned-") as folder:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": folder, "xla_dump_hlo_pass_re": "spmd-partitioning"})  # fmt: skip
        found = sorted(glob.glob(f"{folder}/*after_spmd-partitioning*.txt"))
        partitioned = Path(found[-1]).read_text() if found else None
    return compiled, partitioned


def _compile_dropping_unknown(lowered: Any, options: dict[str, Any]) -> Any:
    """``lowered.compile`` with ``options``, leaving out any this XLA does not know (an option
    another jaxlib renamed or made the default), which it refuses by name."""
    while True:
        try:
            return lowered.compile(compiler_options=options or None)
        except Exception as e:  # jax.errors.JaxRuntimeError: INVALID_ARGUMENT
            unknown = re.search(r"No such compile option: '(\w+)'", str(e))
            if not unknown or unknown.group(1) not in options:
                raise
            options = {k: v for k, v in options.items() if k != unknown.group(1)}


def partitioned_widths(partitioned: str | None) -> dict[int, str]:
    """``{channel_id: dtype}`` of the collectives in the module as partitioned whose arrays are
    all of one float type narrower than float32 (``bf16``, ``f16``); empty for None.

    Example:
        >>> partitioned_widths(text)  # doctest: +SKIP
        {1: 'bf16', 2: 'bf16'}
    """
    out: dict[int, str] = {}
    for _, _, type_text, opcode, _, attrs in _Module(partitioned or "").instructions:
        if opcode.removesuffix("-start") not in COLLECTIVE_KINDS:
            continue
        dtypes = {d for d, _ in _ARRAY.findall(type_text)}
        ch = _CHANNEL.search(attrs)
        if ch and len(dtypes) == 1 and (d := dtypes.pop()) in _NARROW_FLOATS:
            out[int(ch.group(1))] = d
    return out


__all__ = ["compile_partitioned", "partitioned_widths", "widened_bytes"]
