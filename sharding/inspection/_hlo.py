"""Collectives and matmul FLOPs of a compiled program, read from its post-partitioning HLO text.

Every figure is read from the compiled program itself, so it is deterministic and testable:
collectives from the post-partitioning HLO text (`compiled.as_text()`, whose shapes are all
per-device shapes), memory from `compiled.memory_analysis()`, FLOPs from `cost_analysis()`.

Byte conventions, all per device:

* ``operand_bytes`` / ``output_bytes``: what one device feeds into / gets out of a collective.
* ``bytes``, the payload a device contributes: its operand for all-reduce, reduce-scatter,
  collective-permute and all-to-all; its *output* for all-gather, whose operand is only the
  device's own shard while the gathered whole is what the op is for. So data parallelism moves
  every gradient byte once per step, and FSDP every weight byte once per gather.
* ``count`` and the byte totals are per program run: an op in a ``lax.scan`` body counts once
  per iteration (its ``multiplicity``); ``static_count`` counts instructions.

`count_flops` counts the FLOPs of dots and convolutions per device per run the same way.
"""

from __future__ import annotations

import copy
import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sharding._mesh import mesh_sizes

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
# Free text (comments, metadata strings) may hold anything, "body=" included: drop it before
# reading attributes. The loop trip count lives in backend_config, read from the raw line.
_NOISE = re.compile(r'/\*.*?\*/|metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
# A GPU gemm custom-call keeps its dot dimensions in backend_config, as JSON lists of strings.
_CONTRACTING = re.compile(r'lhs_contracting_dims=\{([\d,]*)|"lhs_contracting_dimensions":\[([^]]*)')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction; bytes are per device per execution.

    ``groups`` are the replica groups as partition ids (for collective-permute the (source,
    target) pairs, and ``group_size`` is None). ``axes`` are the mesh axes along which the
    devices of a group vary: None without a mesh, or when no axis set explains the groups.
    ``exact`` is False inside a conditional branch (counted as if taken) or a while loop of
    unknown trip count (counted once).
    """

    name: str
    kind: str
    computation: str | None
    shape: str
    dtype: str
    operand_bytes: int
    output_bytes: int
    group_size: int | None
    groups: tuple[tuple[int, ...], ...] | None
    axes: tuple[str, ...] | None
    multiplicity: int = 1
    exact: bool = True

    @property
    def bytes(self) -> int:
        """Payload per execution: the output for all-gather, the operand otherwise."""
        return self.output_bytes if self.kind == "all-gather" else self.operand_bytes


@dataclass(frozen=True)
class CollectiveSummary:
    """Totals of a set of collectives, per device per program run (see the module doc)."""

    count: int = 0
    static_count: int = 0
    operand_bytes: int = 0
    output_bytes: int = 0
    bytes: int = 0


def _nbytes(type_text: str) -> int:
    """Bytes of every array in an HLO type; the width is in the dtype's name (bf16, f8e4m3fn)."""
    bits = sum(
        math.prod(int(d) for d in dims.split(",") if d)
        * (8 if dtype == "pred" else int(re.match(r"[a-z]+(\d*)", dtype).group(1) or 0))
        for dtype, dims in _ARRAY.findall(type_text)
    )
    return (bits + 7) // 8


def _close(text: str, start: int) -> int:
    """Index just past the bracket closing the one that opens at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] in "([{") - (text[i] in ")]}")
        if depth == 0:
            return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    """Split on the commas outside any bracket."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in [*parts, text[start:]] if p.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


def _iota(text: str) -> np.ndarray:
    """``[d0,d1]<=[r0,r1,r2]T(p)``: iota over the r dims, transposed by p, reshaped to d."""
    m = re.match(r"\s*\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    dims = _ints(m.group(2))
    perm = _ints(m.group(3)) if m.group(3) else list(range(len(dims)))
    return np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(_ints(m.group(1)))


def _mesh_groups(text: str) -> np.ndarray:
    """``mesh['a'=2,'b'=4][, device_ids=(...)] {'b'}``, sub-axes written ``'b':(pre)size``."""
    decl = re.findall(r"'?([^'=,\s]+)'?=(\d+)", text[5 : text.index("]")])
    names, sizes = [n for n, _ in decl], [int(s) for _, s in decl]
    devices = np.arange(math.prod(sizes))
    if (at := text.find("device_ids=(")) >= 0:
        ids = text[at + 12 : _close(text, at + 11) - 1]
        if "<=" in ids:
            devices = _iota(ids).ravel()
        elif ids.lstrip().startswith("["):  # "[2,2,2]T(2,1,0)": an iota laid out by a transpose
            m = re.match(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?", ids)
            dims = _ints(m.group(1))
            perm = _ints(m.group(2)) if m.group(2) else list(range(len(dims)))
            devices = np.arange(math.prod(dims)).reshape(dims).transpose(perm).ravel()
        else:
            devices = np.array(_ints(ids))
    listed = re.findall(r"'?([^'{},:\s]+)'?(?::\((\d+)\)(\d+))?", text[text.rindex("{") :])
    refs = [
        (names.index(n), int(pre or 1), int(sub or sizes[names.index(n)])) for n, pre, sub in listed
    ]
    # Split every mesh axis into the factors its sub-axes carve out, major to minor, then move
    # the grouped factors innermost in the order listed, as XLA's MeshAxesReplicaGroupList does.
    factors: list[int] = []
    slot: dict[int, int] = {}
    for d, size in enumerate(sizes):
        done = 1
        for pre, sub, i in sorted((pre, sub, i) for i, (a, pre, sub) in enumerate(refs) if a == d):
            if pre != done:
                factors.append(pre // done)
            slot[i], done = len(factors), pre * sub
            factors.append(sub)
        if done != size:
            factors.append(size // done)
    grouped = [slot[i] for i in range(len(refs))]
    order = [f for f in range(len(factors)) if f not in grouped] + grouped
    size = math.prod(factors[f] for f in grouped)
    return devices.reshape(factors).transpose(order).reshape(-1, size)


def _groups(attrs: str, kind: str, n_partitions: int | None) -> tuple | None:
    """Replica groups (or permute pairs) of an instruction, in any of XLA's three formats."""
    # An absent or empty group list means one group of every partition.
    everyone = ((*range(n_partitions),),) if n_partitions and kind != "collective-permute" else ()
    m = re.search(r"\b(replica_groups|source_target_pairs)=", attrs)
    if not m:
        return everyone or None
    text = attrs[m.end() :]
    if text.startswith("mesh["):
        groups = _mesh_groups(text[: _close(text, text.index("{", text.index("]")))]).tolist()
    elif text.startswith("["):
        groups = _iota(text).tolist()
    else:
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", text[1 : _close(text, 0) - 1])]
    return tuple(tuple(g) for g in groups) or everyone or None


def _axes(kind: str, groups: tuple | None, sizes: dict[str, int] | None) -> tuple[str, ...] | None:
    """The mesh axes along which the devices of every group vary, or None if none fit."""
    if groups is None or sizes is None:
        return None
    names, shape = list(sizes), tuple(sizes.values())
    if max((p for g in groups for p in g), default=0) >= math.prod(shape):
        return None
    permute = kind == "collective-permute"
    found: tuple[str, ...] | None = () if permute else None
    for g in groups:
        coords = np.unravel_index(list(g), shape)
        varying = tuple(n for n, c in zip(names, coords, strict=True) if (c != c[0]).any())
        if permute:  # a permute runs along every axis that some (source, target) pair crosses
            found = tuple(n for n in names if n in varying + found)
        elif len(set(g)) == math.prod(sizes[n] for n in varying) and found in (None, varying):
            found = varying
        else:  # a group must fill the sub-grid of its varying axes, and all groups vary alike
            return None
    return found


def _instruction(line: str) -> tuple[str, str, str, list[str], str] | None:
    """(name, result type, opcode, operands, attributes) of an instruction line, else None."""
    if not (m := _INSTR.match(line)):
        return None
    rest = line[m.end() :]
    end = _close(rest, 0) if rest.startswith("(") else re.match(r"\S*", rest).end()
    if not (op := _OPCODE.match(rest, end)):
        return None
    close = _close(rest, op.end() - 1)
    return m.group(1), rest[:end], op.group(1), _split_top(rest[op.end() : close - 1]), rest[close:]


def _start_results(elements: list[str], n_operands: int) -> list[str]:
    """The results of an async ``-start``, whose tuple also holds its operands and contexts."""
    if elements[0].startswith("("):  # ((operands...), results, contexts...)
        return _split_top(elements[1][1:-1]) if elements[1].startswith("(") else elements[1:2]
    if len(elements) > n_operands:  # (operands..., results..., u32[] contexts...)
        return [t for t in elements[n_operands:] if not re.match(r"[us]32\[\]", t)]
    return elements  # all-reduce-start: the results only


def _callees(attrs: str, raw: str) -> list[tuple[str, int, bool]]:
    """(computation, runs per run of the caller, exact) for each computation called."""
    trip = _TRIP.search(raw)
    calls = []
    for key, names in _CALLEE.findall(attrs):
        factor, exact = 1, key not in ("true_computation", "false_computation")
        exact &= key != "branch_computations"
        if key in ("body", "condition"):
            # The condition runs once more than the body; an unknown trip count counts once.
            factor = int(trip.group(1)) + (key == "condition") if trip else 1
            exact = trip is not None
        calls += [(name, factor, exact) for name in re.findall(r"[\w.\-]+", names)]
    return calls


class _Module:
    """The instructions of an HLO module, and how often each computation runs per program run.

    Computations run through ``calls`` (fusions), ``to_apply``, while ``body``/``condition``
    (``known_trip_count`` times, nested loops multiplying) and conditional branches (as if
    taken, inexact); a loop of unknown trip count counts once, inexact.
    """

    def __init__(self, hlo_text: str):
        self.instructions: list[tuple[str | None, str, str, str, list[str], str]] = []
        self.shapes: dict[str, str] = {}  # instruction names are unique in a module
        self.callers: dict[str, list[tuple[str | None, int, bool]]] = defaultdict(list)
        self.entry = comp = None
        self._memo: dict[str, tuple[int, bool]] = {}
        self.calling: dict[str, tuple[str | None, list]] = {}  # line -> (its computation, callees)
        for raw in hlo_text.splitlines():
            line = _NOISE.sub("", raw).strip()
            if (instruction := _instruction(line)) is None:
                if h := _HEADER.match(line):
                    comp, self.entry = h.group(2), h.group(2) if h.group(1) else self.entry
                continue
            name, type_text, opcode, _, attrs = instruction
            self.shapes[name] = type_text
            self.instructions.append((comp, *instruction))
            if not opcode.endswith(("-done", "-update")):  # an async pair runs its callee once
                self.calling[raw] = (comp, _callees(attrs, raw))
                for callee, factor, exact in self.calling[raw][1]:
                    self.callers[callee].append((comp, factor, exact))

    def edited(self, raw: str, edited: str) -> _Module:
        """This module with the calling instruction line ``raw`` replaced by ``edited`` (another
        trip count, another branch list): the runs of every computation follow, the instructions
        are shared. Parses one line, not the module."""
        comp, old = self.calling[raw]
        out = copy.copy(self)
        out.callers = defaultdict(list, {k: list(v) for k, v in self.callers.items()})
        out._memo = {}
        for callee, factor, exact in old:
            out.callers[callee].remove((comp, factor, exact))
        for callee, factor, exact in _callees(
            _instruction(_NOISE.sub("", edited).strip())[4], edited
        ):
            out.callers[callee].append((comp, factor, exact))
        return out

    def operand_type(self, operand: str) -> str:
        """Operands print as `%name` (jax 0.10) or, in some XLA versions, `f32[8]{0} %name`."""
        return operand if "[" in operand else self.shapes.get(operand.split()[-1].lstrip("%"), "")

    def runs(self, c: str | None) -> tuple[int, bool]:
        """(runs of computation ``c`` per program run, whether that count is exact)."""
        if c is None or self.entry is None or c == self.entry:
            return 1, True
        if c not in self.callers:  # called through an attribute this parser does not know
            return 1, False
        if c not in self._memo:
            self._memo[c] = (0, False)  # call graphs are acyclic; this guards malformed text
            total, exact = 0, True
            for caller, factor, edge_exact in self.callers[c]:
                n, e = self.runs(caller)
                total, exact = total + n * factor, exact and e and edge_exact
            self._memo[c] = (total, exact)
        return self._memo[c]


def parse_collectives(
    hlo_text: str, mesh: Any = None, *, narrow: Mapping[int, str] | None = None
) -> list[CollectiveOp]:
    """Every collective of a compiled (post-SPMD-partitioning) HLO module, with loop counts.

    Async pairs count at their ``-start``; a while body counts ``known_trip_count`` times per
    run of its loop (nested loops multiply); conditional branches count as if taken.

    Args:
        hlo_text: ``compiled.as_text()``.
        mesh: a `jax.sharding.Mesh` (or resolved MeshSpec); partition id p is position p of
            ``mesh.devices.flat``. Needed to name the ``axes`` of each collective.
        narrow: ``{channel_id: dtype}`` of the collectives SPMD partitioning made narrower than
            float32 (`partitioned_widths`): a float32 one of those channels is counted in that
            dtype (XLA:CPU's float normalisation widened it after partitioning).

    Example:
        >>> ops = parse_collectives(compiled.as_text(), mesh)  # doctest: +SKIP
        >>> [(op.kind, op.axes, op.bytes * op.multiplicity) for op in ops]  # doctest: +SKIP
        [('all-reduce', ('data',), 4194304)]
    """
    sizes = mesh_sizes(mesh) if mesh is not None else None
    m = re.search(r"\bnum_partitions=(\d+)", hlo_text)
    n_partitions = int(m.group(1)) if m else sizes and math.prod(sizes.values())
    module, ops = _Module(hlo_text), []
    for comp, name, type_text, opcode, operands, attrs in module.instructions:
        kind = opcode.removesuffix("-start")
        if kind not in COLLECTIVE_KINDS:
            continue
        types = [module.operand_type(o) for o in operands]
        outputs = _split_top(type_text[1:-1]) if type_text.startswith("(") else [type_text]
        if narrow and (ch := _CHANNEL.search(attrs)) and (to := narrow.get(int(ch.group(1)))):
            types, outputs = ([t.replace("f32[", f"{to}[") for t in ts] for ts in (types, outputs))
        if opcode.endswith("-start"):
            outputs = _start_results(outputs, len(operands))
        shape = ", ".join(re.sub(r"\{[^}]*\}", "", t) for t in outputs)
        groups = _groups(attrs, kind, n_partitions)
        multiplicity, exact = module.runs(comp)
        ops.append(
            CollectiveOp(
                name=name,
                kind=kind,
                computation=comp,
                shape=shape if len(outputs) == 1 else f"({shape})",
                dtype=next(iter(_ARRAY.findall(shape)), ("?",))[0],
                operand_bytes=sum(map(_nbytes, types)),
                output_bytes=sum(map(_nbytes, outputs)),
                group_size=len(groups[0]) if groups and kind != "collective-permute" else None,
                groups=groups,
                axes=_axes(kind, groups, sizes),
                multiplicity=multiplicity,
                exact=exact,
            )
        )
    return ops


def summarize(ops: list[CollectiveOp], *, by_axes: bool = False) -> dict[Any, CollectiveSummary]:
    """Totals per kind, or per ``(kind, axes)`` with ``by_axes``, in `COLLECTIVE_KINDS` order.

    Example:
        >>> summarize(ops, by_axes=True)[("all-reduce", ("data",))].bytes  # doctest: +SKIP
        4194304
    """
    totals: dict[Any, np.ndarray] = defaultdict(lambda: np.zeros(5, dtype=np.int64))
    for op in ops:
        n = op.multiplicity
        row = (n, 1, n * op.operand_bytes, n * op.output_bytes, n * op.bytes)
        totals[(op.kind, op.axes) if by_axes else op.kind] += row

    def order(key: Any) -> tuple:
        kind, axes = key if by_axes else (key, ())
        return COLLECTIVE_KINDS.index(kind), axes is None, axes or ()

    return {k: CollectiveSummary(*map(int, totals[k])) for k in sorted(totals, key=order)}
