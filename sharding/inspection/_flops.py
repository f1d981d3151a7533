"""Matmul FLOPs of a compiled program, loop-aware, from its post-partitioning HLO text.

``compiled.cost_analysis()`` counts a while loop's body once per program, so a ``lax.scan`` over
layers or pipeline ticks is under-counted; `count_flops` multiplies every dot and convolution by
the runs of its computation, parsed with the same module reader as the collectives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from sharding.inspection._hlo import _ARRAY, _CONTRACTING, _ints, _Module

MATMUL_KINDS = ("dot", "convolution")


@dataclass(frozen=True)
class FlopCount:
    """Matmul FLOPs per device per program run (see `count_flops`).

    ``by_op`` splits ``total`` by kind, every one of `MATMUL_KINDS` present. ``exact`` is False
    when some of it ran inside a conditional branch (counted as if every branch were taken) or a
    while loop of unknown trip count (counted once).
    """

    total: int
    by_op: dict[str, int]
    exact: bool = True


def _dims(type_text: str) -> list[int]:
    """The dimensions of the first array in an HLO type (a tuple's first element)."""
    m = _ARRAY.search(type_text)
    return _ints(m.group(2)) if m else []


def _matmul_flops(module: _Module, type_text: str, opcode: str, operands: list, attrs: str) -> int:
    """2 x the multiply-adds of one dot or convolution; 0 where its attributes are missing."""
    out = math.prod(_dims(type_text))
    if opcode == "dot":  # each output element sums over the contracting dims of the lhs
        lhs = _dims(module.operand_type(operands[0]))
        m = _CONTRACTING.search(attrs)
        return 2 * out * math.prod(lhs[d] for d in _ints(m.group(m.lastindex))) if m else 0
    # A convolution output element sums over the kernel window and the input features of its
    # group: every kernel dimension but the output feature one ('o' in `dim_labels=b01f_01io->`),
    # padding taps included (XLA's cost_analysis leaves those out).
    m, kernel = re.search(r"dim_labels=\w*_(\w+)->", attrs), _dims(module.operand_type(operands[1]))
    if not m or len(m.group(1)) != len(kernel):
        return 0
    return 2 * out * math.prod(kernel) // kernel[m.group(1).index("o")]


_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
_SCORES = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
_FIRST_DIMS = re.compile(r"\w+\[([0-9,]+)\]")


def _fmha_flops(type_text: str, attrs: str) -> int:
    """The matmul FLOPs of one cuDNN fused attention call (XLA:GPU's ``__cudnn$fmha*``), 0 for
    any other custom call. Its scores are ``[B, N, S, T]`` (the backend config's
    ``intermediate_tensor_shape``), its first output ``[B, N, S, H]``: the forward runs two
    matmuls of ``2 B N S T H`` (Q K^T, then P V), the backward five (the scores again, dP, dV,
    dQ, dK: FlashAttention-2, Dao 2023, section 3.1.2), and a causal mask skips the tiles
    above the diagonal, leaving ``(T + 1) / 2T`` of them (S = T)."""
    kind = _FMHA.search(attrs)
    scores, out = _SCORES.search(attrs), _FIRST_DIMS.search(type_text)
    if not (kind and scores and out):
        return 0
    b, n, s, t = (int(x.strip().strip('"')) for x in scores.group(1).split(","))
    h = int(out.group(1).split(",")[-1])
    share = (t + 1) / (2 * t) if '"mask_type": "CAUSAL"' in attrs else 1.0
    matmuls = 5 if "Backward" in kind.group(1) else 2
    return round(matmuls * 2 * b * n * s * t * h * share)


def count_flops(hlo_text: str) -> FlopCount:
    """Matmul FLOPs per device of one run of a compiled (post-partitioning) HLO module.

    Counts 2 x the multiply-adds of every ``dot`` (fused ones too, and GPU gemm custom-calls,
    which carry ``dot_dimension_numbers``) and ``convolution``, times the runs of its
    computation, unlike ``compiled.cost_analysis()``, which counts a while body once per
    program: a ``lax.scan`` over layers counts every layer here. Conditional branches all
    count, as if each were taken (``exact`` False; one run of a cond costs at most its
    dearest branch). cuDNN's fused attention counts its matmuls (`_fmha_flops`). Elementwise
    and reduction work, and other custom-calls (cuDNN convolutions), are not counted; nor are dots XLA rewrites to multiplies (outer products,
    vector dot products).

    Example:
        >>> count_flops(jax.jit(jnp.dot).lower(a, b).compile().as_text())  # doctest: +SKIP
        FlopCount(total=4194304, by_op={'dot': 4194304, 'convolution': 0}, exact=True)
    """
    return FlopCounter(hlo_text).count()


class FlopCounter:
    """`count_flops` of one module, parsed once, and of the same module with one calling
    instruction edited (a loop's trip count, a conditional's branch list): what one more
    iteration or one more run of a branch adds, without parsing the module again.

    Example:
        >>> counter = FlopCounter(compiled.as_text())  # doctest: +SKIP
        >>> counter.count(edit=(while_line, while_line_with_trip_count_plus_one))  # doctest: +SKIP
    """

    def __init__(self, hlo_text: str):
        self._module = _Module(hlo_text)
        self._local: dict[str | None, dict[str, int]] = {}  # per computation, one run, by kind
        for comp, _, type_text, opcode, operands, attrs in self._module.instructions:
            if opcode == "custom-call" and '"dot_dimension_numbers"' in attrs:  # cuBLAS, rocBLAS
                opcode = "dot"
            if opcode in MATMUL_KINDS:
                flops = _matmul_flops(self._module, type_text, opcode, operands, attrs)
                self._local.setdefault(comp, dict.fromkeys(MATMUL_KINDS, 0))[opcode] += flops
            elif opcode == "custom-call" and (flops := _fmha_flops(type_text, attrs)):
                self._local.setdefault(comp, dict.fromkeys(MATMUL_KINDS, 0))["dot"] += flops

    def count(self, edit: tuple[str, str] | None = None) -> FlopCount:
        """The module's FLOPs; with ``edit=(line, new_line)``, those of the module in which the
        calling instruction ``line`` (as printed) reads ``new_line``."""
        module = self._module.edited(*edit) if edit else self._module
        by_op, exact = dict.fromkeys(MATMUL_KINDS, 0), True
        for comp, local in self._local.items():
            n, e = module.runs(comp)
            exact &= e
            for kind, flops in local.items():
                by_op[kind] += n * flops
        return FlopCount(sum(by_op.values()), by_op, exact)
