"""Megatron sequence parallelism's collectives in closed form (strategies tp_sp, fsdp_tp_sp).

Under SP the stack's activations are split over the sequence on ``tensor`` between the
tensor-parallel matmuls (`sharding.compile_train_step` pins them; see
``sharding._shardings.sequence_roles``). Against plain tensor parallelism, per layer and step:

- each input that column-parallel matmuls read (attention's, the MLP's) is all-gathered over the
  sequence before them, once however many kernels read it, and again when remat recomputes the
  layer's forward;
- each row-parallel output, all-reduced under tp, is reduce-scattered onto the sequence; XLA:CPU
  emits the reduce-scatter as an all-reduce plus a slice (no reduce-scatter creation pass), so
  the compiled program, like `tp`'s model, shows an all-reduce of the same operand, marked
  `SCATTERED` (XLA for GPU's ReduceScatterCreator makes the pair one reduce-scatter); its
  cotangent is all-gathered in backward;
- the column-parallel input gradients are all-reduced per kernel exactly as under tp (the
  partitioner sums the partial products after reducing each one) and then sliced; XLA for GPU
  sums them first (`input_gradients`);
- norm scales and biases see S/t of the sequence, so their gradients are partial sums, all-reduced
  over tensor once per layer (the biases of row-parallel modules are added to whole rows, after
  the gather, and need none);
- under remat the gathers before the column-parallel matmuls run again with the recomputed
  forward (the row-parallel outputs are recomputed as under tp, all but the layer's last);
- around the stack, the output is all-gathered to whole sequences for the vocabulary-split head,
  and the input's cotangent all-gathered back (the lookup itself is tp's, all-reduced).

Byte conventions are `sharding.inspection`'s (an all-gather moves its output). The terms are what
the compiled programs show (tests/test_sequence_parallel.py holds them within 2%).
"""

from __future__ import annotations

from typing import Any

from partition_rules import composition
from sharding.costmodel._passes import REASSOCIATED, SCATTERED


def sequence_axes(s: Any) -> tuple[str, ...]:
    """The mesh axes setup ``s``'s strategy splits the sequence over (its ``"sequence"``)."""
    entry = composition(s.strategy).axis_map.get("sequence")
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def splits_sequence_over_tensor(s: Any) -> bool:
    """Whether setup ``s``'s strategy splits the sequence over a ``tensor`` axis larger than 1."""
    return "tensor" in sequence_axes(s) and s.sizes.get("tensor", 1) > 1


def gathered_inputs(s: Any) -> int:
    """Distinct inputs read by column-parallel kernels per layer: one per parent module (q, k, v
    under attn read one input; gate and up under mlp another)."""
    return len({q.path.rsplit("/", 2)[0] for q in s.params if _kind(s, q) == "column"})


def _kind(s: Any, q: Any) -> str | None:
    """A layer kernel's kind as `sharding.compile_train_step` reads it from the layout (a module's
    widest parameter; its first dimension after the layer axis whole over tensor and a later one
    split: column; the first split and the last whole: row)."""
    if q.role != "layer" or len(q.shape) < 3 or "tensor" not in q.axes:
        return None
    module = q.path.rpartition("/")[0]
    widest = max(len(p.shape) for p in s.params if p.path.rpartition("/")[0] == module)
    if len(q.shape) < widest:  # a bias [L, N, H] beside its kernel [L, D, N, H]
        return None
    amap = composition(s.strategy).axis_map
    on = [e is not None and "tensor" in amap.mesh_axes(e) for e in q.logical[1:]]
    if not on[0] and any(on[1:]):
        return "column"
    return "row" if on[0] and not on[-1] else None


def row_outputs(s: Any, what: str) -> str:
    """``what`` of a row-parallel output reduction, marked `SCATTERED` under SP."""
    return f"{what}, {SCATTERED}" if splits_sequence_over_tensor(s) else what


def column_kernels(params: list) -> list:
    """The layer kernels that read d_model whole and write a width split over ``tensor`` (q, k,
    v, gate, up, fc): each one's input gradient is a partial sum over tensor."""
    return [q for q in params if q.role == "layer" and len(q.shape) >= 3
            and "tensor" in q.axes and q.logical[1] == "embed"]  # fmt: skip


def input_gradients(out: Any, s: Any, count: int, act: float,
                    what: str = "column-parallel input gradients") -> None:  # fmt: skip
    """Add ``count`` layers' column-parallel input-gradient all-reduces (one per column kernel,
    each of ``act`` bytes) to ``out``: one per module the kernels sit in (attn's q, k, v read
    one input), and the rest, which XLA for GPU sums into those, as `REASSOCIATED`."""
    kernels = column_kernels(s.params)
    col, kept = len(kernels), len({q.path.rsplit("/", 2)[0] for q in kernels})
    out.add("all-reduce", ("tensor",), count * kept * act, count * kept, what)
    out.add("all-reduce", ("tensor",), count * (col - kept) * act, count * (col - kept),
            REASSOCIATED)  # fmt: skip


def norm_vector_bytes(s: Any) -> float:
    """float32 gradient bytes per layer of the layer vectors that norms read on S/t of the
    sequence: every [L, D] parameter not split over tensor, less the biases of row-parallel
    modules (added to whole rows, after the gather)."""
    rows = {q.path.rpartition("/")[0] for q in s.params if _kind(s, q) == "row"}
    return sum(
        q.nbytes / s.cfg.n_layers  # whole even under fsdp: reduced over tensor before the scatter
        for q in s.params
        if q.role == "layer"
        and len(q.shape) == 2
        and "tensor" not in q.axes
        and q.path.rpartition("/")[0] not in rows
    )


def sequence_traffic(out: Any, s: Any, act: float) -> None:
    """Add SP's terms (module doc) to ``out`` (`_traffic`'s sink) for setup ``s``, where ``act``
    is one ``[rows, seq, d_model]`` activation per device in the compute dtype."""
    if not splits_sequence_over_tensor(s) or s.schedule is not None:
        return
    # Gathered over tensor only: what stays split over context (cp_tp_sp) is not moved, and
    # ``act`` already holds the device's S/c positions (`Setup.local_seq`).
    n_layers = s.cfg.n_layers
    groups = gathered_inputs(s)
    row = sum(1 for q in s.params if _kind(s, q) == "row")
    out.add("all-gather", ("tensor",), n_layers * groups * act, n_layers * groups,
            "sequence gathered before column-parallel matmuls")  # fmt: skip
    out.add("all-gather", ("tensor",), n_layers * row * act, n_layers * row,
            "row-parallel output cotangents gathered in backward")  # fmt: skip
    out.add("all-gather", ("tensor",), 2 * act, 2,
            "stack output to whole sequences, stack input cotangent")  # fmt: skip
    norms = norm_vector_bytes(s)
    split = tuple(a for a in sequence_axes(s) if s.sizes.get(a, 1) > 1)  # (context,) tensor
    out.add("all-reduce", split, n_layers * norms, n_layers,
            "norm gradients (norms see S/t of the sequence)")  # fmt: skip
    if s.remat != "none":
        out.add("all-gather", ("tensor",), n_layers * groups * act, n_layers * groups,
                "sequence gathered again when remat recomputes the forward")  # fmt: skip


__all__ = [
    "column_kernels",
    "gathered_inputs",
    "input_gradients",
    "norm_vector_bytes",
    "row_outputs",
    "sequence_axes",
    "sequence_traffic",
    "splits_sequence_over_tensor",
]
