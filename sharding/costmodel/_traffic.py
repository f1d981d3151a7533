"""Collective bytes per device per step, in closed form from the placed parameter tree.

The conventions are `sharding.inspection._hlo`'s: an all-gather moves its *output*, every other collective
its *operand*; a collective inside the layer scan runs once per layer. The terms follow what the
SPMD partitioner emits for spmdkit's step (jax 0.10, measured on the tests' programs, checked by
tests/test_costmodel.py), not an idealised Megatron/ZeRO count; where the two differ the term
says so. Gradients are float32 (master weights); activations and gathered weights move in the
compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sharding._mesh import AXES, BATCH_AXES
from sharding.context import DEFAULT_METHOD, context_traffic
from sharding.costmodel._sequence import (
    column_kernels,
    input_gradients,
    row_outputs,
    sequence_traffic,
    splits_sequence_over_tensor,
)
from sharding.experts import ALL_TO_ALLS_PER_LAYER, ep_all_to_all_bytes, expert_slots

# Per-row softmax statistics a vocabulary-split head all-reduces over tensor (max, sum of exps,
# the target logit, and the backward's sum), each float32 [rows, seq].
HEAD_STAT_REDUCTIONS = 4


@dataclass(frozen=True)
class Traffic:
    """One modelled collective: bytes per device per step (summed over ``count`` runs)."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    count: int
    what: str


@dataclass(frozen=True)
class Param:
    """A placed parameter and its role in the step (from its logical axes)."""

    path: str
    shape: tuple[int, ...]
    logical: tuple[Any, ...]
    axes: frozenset[str]  # mesh axes of size > 1 that split it
    nbytes: int  # whole parameter, float32
    role: str  # layer | table | positions | head | vector | other
    local: tuple[int, ...] = ()  # its shape on one device (the placement's)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def classify(placements: list, sizes: dict[str, int]) -> list[Param]:
    """`Param`s from `sharding._resolve.plan` placements (family tables' logical names)."""
    params = []
    for pl in placements:
        logical = tuple(pl.logical or (None,) * len(pl.shape))
        axes = frozenset(
            a
            for entry in pl.spec
            for a in ((entry,) if isinstance(entry, str) else (entry or ()))
            if sizes.get(a, 1) > 1
        )
        first, last = logical[0] if logical else None, logical[-1] if logical else None
        if first == "layers":
            role = "layer"
        elif first == "vocab" and len(logical) == 2:
            role = "table"
        elif first == "positions":
            role = "positions"
        elif last == "vocab":
            role = "head"
        elif len(logical) == 1:
            role = "vector"
        else:
            role = "other"
        params.append(Param(pl.path, tuple(pl.shape), logical, axes, pl.bytes_total, role,
                            tuple(pl.per_device_shape)))  # fmt: skip
    return params


def tied(params: list[Param]) -> bool:
    """The token table is also the output head (GPT-2) when no parameter ends in 'vocab'."""
    return any(p.role == "table" for p in params) and not any(p.role == "head" for p in params)


def matmul_kinds(params: list[Param], sizes: dict[str, int]) -> tuple[int, int]:
    """(column-parallel, row-parallel) kernels per layer under the tensor axis.

    Column: reads d_model, writes a tensor-split width (q, k, v, gate, up, fc): its input's
    gradient is a partial sum, all-reduced in backward. Row: reads a tensor-split width, writes
    d_model (o, down, proj): its output is all-reduced in forward.
    """
    if sizes.get("tensor", 1) == 1:
        return 0, 0
    row = sum(p.role == "layer" and len(p.shape) >= 3 and "tensor" in p.axes
              and p.logical[-1] == "embed" for p in params)  # fmt: skip
    col = len(column_kernels(params))
    return col, row


class _Sink(list):
    def add(self, kind: str, axes: tuple[str, ...], nbytes: float, count: int, what: str) -> None:
        if axes and nbytes > 0 and count > 0:
            self.append(Traffic(kind, axes, round(nbytes), count, what))


def vector_like(q: Param) -> bool:
    """Whether ``q``'s gradient is reduced whole over every batch axis even where fsdp splits it
    (measured, fsdp_cp and fsdp_ep): a vector per layer (norm scales) or in all (the final
    norm). The token table, once its lookup gathers it, is reduced the same way (`_table`)."""
    return q.role == "vector" or (q.role == "layer" and len(q.shape) == 2)


def rows_over_stages(s: Any) -> bool:
    """Whether gpipe/circular hand the stack's output to what follows it split over ``stage``
    (each stage the head and loss on 1/p of the rows: `sharding.pipeline`), which they do where
    a batch shard's rows (data x fsdp x expert) divide by the stages."""
    sched, sz = s.schedule, s.sizes
    if sched is None or sched.explicit:
        return False
    return (s.batch // math.prod(sz[a] for a in BATCH_AXES)) % sz["stage"] == 0


def traffic(s: Any) -> list[Traffic]:
    """Every collective of one training step of setup ``s`` (a `sharding.costmodel._predict.Setup`)."""
    out = _Sink()
    sz = s.sizes
    d, f = sz.get("data", 1), sz.get("fsdp", 1)
    batch_axes = tuple(a for a in BATCH_AXES if sz.get(a, 1) > 1)
    c = sz.get("context", 1)
    rows = s.rows  # sequences per device (whole step)
    act = rows * s.local_seq * s.cfg.d_model * s.act_bytes  # one [rows, seq/c, d_model]
    sched, n_layers = s.schedule, s.cfg.n_layers  # gpipe, circular (explicit ones: _pipesplits)
    if sched is not None and sched.explicit:
        raise ValueError("the explicit schedules' traffic is split_pipeline_traffic's")
    # gpipe/circular with the head on 1/p of the rows per stage: its gradients add over stage too
    head_extra = ("stage",) if rows_over_stages(s) else ()

    # Every gradient is summed in the compute dtype, before the cast of the float32 weights is
    # transposed (as partitioned: XLA:CPU widens bfloat16 sums to float32 after partitioning,
    # and the pipelines' float32 psums of bfloat16 values are narrowed before it).
    grad_width = s.act_bytes / 4

    def grad_bytes(q: Param, full_rows: bool = False) -> float:
        g = q.nbytes / math.prod(sz[a] for a in q.axes if a in ("tensor", "stage", "expert"))
        g *= grad_width
        if q.role == "positions" and not full_rows:  # only the first `seq` rows are used
            g *= s.seq / q.shape[0]
        return g

    def reduce_grad(q: Param, what: str, *, full_rows: bool = False, extra=()) -> None:
        g, count = grad_bytes(q, full_rows), (n_layers if q.role == "layer" and not sched else 1)
        # Not over an axis that splits the parameter itself (an expert's own, on expert); fsdp
        # splits both, and its reduction scatters over it.
        over = tuple(a for a in batch_axes if a not in q.axes or a == "fsdp")
        whole = vector_like(q)
        if "fsdp" in q.axes and "tensor" in q.axes:
            # Reduce-scatter over fsdp, then the shard over data. XLA:CPU emits an all-reduce
            # plus a slice for the scatter; its operand, hence its bytes, is the same.
            out.add("reduce-scatter", ("fsdp",), g, count, what)
            out.add("all-reduce", ("data",) if d > 1 else (), g / f, count, what)
        elif "fsdp" in q.axes and not whole and (c > 1 or "expert" in over):
            # Measured (fsdp_cp, fsdp_ep): a matrix's gradient, partial over fsdp and a batch
            # axis that is not data (context's sequence shards, expert's batch rows), is
            # reduce-scattered over fsdp alone, then its shard summed over the rest at once
            # (data joins that second reduction, not the first).
            out.add("reduce-scatter", ("fsdp",), g, count, what)
            rest = {*extra, *over, *(("context",) if c > 1 else ())} - {"fsdp"}
            out.add("all-reduce", tuple(a for a in AXES if a in rest), g / f, count,
                    f"{what}, the fsdp shard over the other batch axes")  # fmt: skip
            return
        elif "fsdp" in q.axes:  # measured: one reduction over data and fsdp together
            out.add("reduce-scatter", (*extra, *over), g, count, what)
        else:
            out.add("all-reduce", (*extra, *over), g, count, what)
        if c > 1:  # the sequence shards' gradients: a second reduction, over context (measured)
            # A vector's (a norm scale) is summed over context whole, before its fsdp
            # reduction, not after it (measured, fsdp_cp).
            shard = g / f if "fsdp" in q.axes and not whole else g
            out.add("all-reduce", ("context",), shard, count, f"{what} over the sequence")

    for q in s.params:
        if q.role == "table":
            _table(out, s, q, act, rows, batch_axes, grad_bytes(q))
            if c > 1:  # its gradient over the sequence shards, whole (measured, cp and fsdp_cp)
                out.add("all-reduce", ("context",), grad_bytes(q), 1,
                        "gradient of the token table over the sequence")  # fmt: skip
            if tied(s.params):
                reduce_grad(q, "gradient of the tied head", extra=head_extra)
                _fsdp_gather(out, s, q, 1 if "tensor" not in q.axes else 2, "tied head weights")
        else:
            extra = head_extra if q.role in ("head", "vector", "other") else ()
            reduce_grad(q, f"gradient reduction ({'layers' if q.role == 'layer' else q.role})",
                        extra=extra)  # fmt: skip
        head_side_gathers(out, s, q)
    _layers(out, s, act, rows)
    heads = [q for q in s.params if q.role == "head" or (q.role == "table" and tied(s.params))]
    if any("tensor" in q.axes for q in heads):
        out.add("all-reduce", ("tensor",), act, 1, "head input gradient (vocab split)")
        stats = HEAD_STAT_REDUCTIONS * rows * s.local_seq * 4
        out.add("all-reduce", ("tensor",), stats, HEAD_STAT_REDUCTIONS, "softmax statistics")
    if sched is not None:
        _pipeline(out, s, act, rows)
    if getattr(s.cfg, "n_experts", None) and sz.get("expert", 1) > 1:  # expert parallelism
        a2a = ep_all_to_all_bytes(s.batch * s.seq, s.cfg.d_model, s.cfg.n_experts, s.cfg.top_k,
                                  s.cfg.capacity_factor, sz["expert"], s.act_bytes, n_layers,
                                  seq_len=s.seq, batch_shards=d * f * sz["expert"])  # fmt: skip
        out.add("all-to-all", ("expert",), a2a, ALL_TO_ALLS_PER_LAYER * n_layers, "expert tokens")
        if any(q.role == "layer" and {"expert", "tensor"} <= q.axes for q in s.params):
            # ep_tp: the kernel's expert buffers hold partial sums over the split hidden width;
            # backward all-reduces, per layer, the cotangents of the dispatched tokens [G, E, C,
            # D] (once for gate's read, once for up's) and of the combine weights [G, S, E, C]
            # over tensor (measured; the forward's psum of the output is a row-parallel
            # all-reduce, counted in `_layers`).
            cfg = s.cfg
            slots = expert_slots(s.seq, cfg.n_experts, cfg.top_k, cfg.capacity_factor)
            per_layer = rows * cfg.n_experts * slots * (2 * cfg.d_model + s.seq) * s.act_bytes
            out.add("all-reduce", ("tensor",), n_layers * per_layer, n_layers,
                    "expert buffers' cotangents over the split hidden width")  # fmt: skip
    if sz.get("context", 1) > 1:  # attention over a split sequence (sharding.context)
        cfg = s.cfg
        for x in context_traffic(getattr(s, "context_method", None) or DEFAULT_METHOD,
                                 batch=s.batch, seq=s.seq, heads=cfg.n_heads,
                                 kv_heads=getattr(cfg, "n_kv_heads", cfg.n_heads),
                                 head_dim=cfg.head_dim, layers=n_layers, context=sz["context"],
                                 tensor=sz.get("tensor", 1),
                                 batch_shards=math.prod(sz[a] for a in BATCH_AXES),
                                 dtype="float32" if s.act_bytes == 4 else "bfloat16",
                                 remat=s.remat != "none"):  # fmt: skip
            out.add(x.kind, x.axes, x.bytes, x.count, x.what)
    return list(out)


def head_side_gathers(out: _Sink, s: Any, q: Param) -> None:
    """The fsdp gathers of a parameter outside the stack: the head's weights (twice with the
    vocabulary split: forward and backward), the position table's used rows, the final norm."""
    if q.role == "head":
        _fsdp_gather(out, s, q, 1 if "tensor" not in q.axes else 2, "head weights")
    elif q.role == "positions":
        _fsdp_gather(out, s, q, 1, "position table", rows_used=s.seq)
    elif q.role in ("vector", "other"):
        _fsdp_gather(out, s, q, 2, "final norm")


def whole_over_fsdp(s: Any, q: Param) -> float:
    """Elements of ``q`` one device holds once gathered whole over fsdp (still split over its
    other axes)."""
    return q.size / math.prod(s.sizes[a] for a in q.axes if a != "fsdp")


def _fsdp_gather(out: _Sink, s: Any, q: Param, times: int, what: str, rows_used=None) -> None:
    if "fsdp" not in q.axes:
        return
    nbytes = whole_over_fsdp(s, q) * s.act_bytes * (rows_used / q.shape[0] if rows_used else 1)
    out.add("all-gather", ("fsdp",), times * nbytes, times, what)


def _table(out, s, q: Param, act: float, rows: int, batch_axes, grad: float) -> None:
    """The token lookup: the cheapest resharding XLA finds for each placement of the table."""
    d, f, t = (s.sizes.get(a, 1) for a in ("data", "fsdp", "tensor"))
    split_v, split_d = "tensor" in q.axes, "fsdp" in q.axes
    if split_v and split_d and d > 1:
        # Measured (data > 1): XLA reshards the [V/t, D/f] table to [V, D/t] (a permute and a gather; it
        # warns of "involuntary full rematerialization"), looks up locally, gathers the result
        # over tensor; backward reduces the [V, D/t] gradient and permutes it back.
        shard = q.nbytes / (t * f)
        out.add("collective-permute", ("data", "fsdp", "tensor"), 2 * shard, 2, "table reshard")
        out.add("all-gather", ("data",) if d > 1 else ("fsdp",), q.nbytes / t, 1, "table gather")
        out.add("all-gather", ("tensor",), act, 1, "looked-up activations")
        out.add("all-reduce", batch_axes, q.nbytes / t, 1, "gradient of the token table")
    elif split_d and not split_v and max(s.sizes.get(a, 1) for a in ("context", "expert")) > 1:
        # Measured (fsdp_cp, fsdp_ep): with the tokens split over context or expert besides
        # fsdp, XLA gathers the [V, D/f] table whole over fsdp and looks up locally instead; the
        # gradient, whole on every device, is summed over fsdp and the batch axes whole, like a
        # vector's (`vector_like`; over context, in `traffic`).
        out.add("all-gather", ("fsdp",), q.size * s.act_bytes, 1, "token table")
        out.add("all-reduce", batch_axes, grad, 1, "gradient of the token table")
    elif split_d:
        # Rows stay put: the token ids are gathered over fsdp, looked up in the local column
        # slice, and the activations all-to-all'd to batch-split (and back in backward); with
        # the vocabulary split too, the lookups are partial sums over tensor.
        out.add("all-gather", ("fsdp",), rows * f * s.seq * 4, 1, "token ids")
        out.add("all-to-all", ("fsdp",), 2 * act, 2, "looked-up activations")
        if split_v:
            out.add("all-reduce", ("tensor",), act, 1, "lookup partial sums (vocab split)")
    else:
        if split_v:  # each device looks up its vocabulary slice; partial sums all-reduced
            out.add("all-reduce", ("tensor",), act, 1, "lookup partial sums (vocab split)")
        out.add("all-reduce", batch_axes, grad, 1, "gradient of the token table")  # 0: none


def _layers(out: _Sink, s: Any, act: float, rows: int) -> None:
    """FSDP weight gathers and tensor-parallel activation reductions of the layer stack."""
    sz, sched, n_layers = s.sizes, s.schedule, s.cfg.n_layers
    p, t = sz.get("stage", 1), sz.get("tensor", 1)
    col, row = matmul_kinds(s.params, sz)
    remat = s.remat != "none"
    if sched is None:
        passes, per_pass_layers, a = 1, n_layers, act
    else:  # every tick runs one chunk of the stage's layers on one micro-batch
        passes, per_pass_layers = sched.ticks, n_layers // (p * sched.repeats)
        a = act / sched.microbatches
        remat = s.remat == "full"  # a backward recomputes a forward only under remat full

    def gathered(q: Param) -> float:  # elements of q one device holds once gathered over fsdp
        return whole_over_fsdp(s, q) if "fsdp" in q.axes else 0

    layer_gathered = sum(gathered(q) for q in s.params if q.role == "layer")
    if layer_gathered and sz.get("fsdp", 1) > 1 and sched is not None:
        stage_gather(out, s)
    elif layer_gathered and sz.get("fsdp", 1) > 1:
        # ZeRO-3: each layer's weights gathered for its forward and again for its backward.
        # Not the experts' (fsdp_ep): they are gathered at the expert kernel's shard_map
        # boundary, which backward does not recompute, so its backward reads the forward's
        # gathered copies (measured; they stay live through the step).
        once = sum(gathered(q) for q in s.params if q.role == "layer" and "expert" in q.axes)
        nbytes = (layer_gathered - once) / n_layers * per_pass_layers * s.act_bytes
        out.add("all-gather", ("fsdp",), 2 * passes * nbytes, 2 * passes * per_pass_layers,
                "layer weights (forward + backward)")  # fmt: skip
        out.add("all-gather", ("fsdp",), once / n_layers * per_pass_layers * s.act_bytes,
                passes * per_pass_layers, "expert weights (forward only)")  # fmt: skip
    if t > 1 and (col or row):
        count = passes * per_pass_layers
        out.add("all-reduce", ("tensor",), count * row * a, count * row,
                row_outputs(s, "row-parallel outputs"))  # fmt: skip
        if remat:
            # All but the layer's last: its output is the carry, saved at the layer boundary,
            # and nothing in backward reads it again (measured, tp and tp_sp, llama and gpt2).
            again = row - 1 if sched is None else row
            out.add("all-reduce", ("tensor",), count * again * a, count * again,
                    row_outputs(s, "row-parallel outputs (recomputed in backward)"))  # fmt: skip
        input_gradients(out, s, count, a)  # one per input on GPU
        sequence_traffic(out, s, act)  # Megatron SP's gathers (strategies tp_sp, fsdp_tp_sp)


def stage_gather(out: _Sink, s: Any) -> None:
    """A pipeline over fsdp: each stage gathers its own layers' weights whole over fsdp once per
    step, before the ticks (a stage holds 1/p of the stack), in the compute dtype."""
    sz = s.sizes
    fsdp = [q for q in s.params if q.role == "layer" and "fsdp" in q.axes]
    if fsdp and sz.get("fsdp", 1) > 1:
        held = sum(whole_over_fsdp(s, q) for q in fsdp)
        out.add("all-gather", ("fsdp",), held * s.act_bytes, len(fsdp),
                "stage weights, once per step")  # fmt: skip


def _pipeline(out: _Sink, s: Any, act: float, rows: int) -> None:
    """Stage-to-stage shifts per tick and the stage reductions around the pipelined region."""
    stage_shifts(out, s, act)
    if rows_over_stages(s):
        # The last stage's outputs are scattered over stage (each its share of the rows)
        # and their cotangents gathered back; the input cotangent is summed over stage.
        out.add("reduce-scatter", ("stage",), act, 1, "pipeline outputs to every stage")
        out.add("all-gather", ("stage",), act, 1, "output cotangents to the last stage")
        out.add("all-reduce", ("stage",), act, 1, "input cotangents to the embedding")
    else:  # the outputs summed over stage to leave the pipeline, the input cotangent too
        out.add("all-reduce", ("stage",), 2 * act, 2, "pipeline outputs + input cotangents")
    chunk_regroup(out, s)


SHIFT_GATHERS = "shifted activations and cotangents, whole over tensor"  # `stage_shifts`


def stage_shifts(out: _Sink, s: Any, act: float) -> None:
    """The shifts between stages, two per tick: a micro-batch's activations (``act`` is the
    batch's on this device, whole over tensor) forward and its cotangents backward. Each tensor
    rank sends its share where tensor divides the sequence or d_model, gathered whole over tensor
    on arrival (`shift_spread`); under SP they cross split already."""
    sched, t = s.schedule, s.sizes.get("tensor", 1)
    t = t if s.local_seq % t == 0 or s.cfg.d_model % t == 0 else 1
    mb, shifts = act / sched.microbatches, 2 * sched.ticks
    out.add("collective-permute", ("stage",), shifts * mb / t, shifts,
            "activations forward, cotangents backward" + (f", 1/{t} per tensor rank" if t > 1
                                                          else ""))  # fmt: skip
    if t > 1 and not splits_sequence_over_tensor(s):
        out.add("all-gather", ("tensor",), shifts * mb, shifts, SHIFT_GATHERS)


def chunk_regroup(out: _Sink, s: Any) -> None:
    """Circular and interleaved: stage s holds chunks c*p + s, so the stack, laid out over
    stage in layer order, is regrouped by an all-to-all each step, and its gradients by another."""
    if s.schedule.repeats > 1:
        layer = [q for q in s.params if q.role == "layer"]
        nbytes = sum(q.nbytes / math.prod(s.sizes[a] for a in q.axes) for q in layer)
        if s.sizes.get("fsdp", 1) > 1:
            # The stages regroup their weights once gathered whole over fsdp, in the compute
            # dtype (`stage_gather`), and their gradients before the reduction.
            nbytes = sum(whole_over_fsdp(s, q) for q in layer) * s.act_bytes
        out.add("all-to-all", ("stage",), 2 * nbytes, 2 * len(layer),
                "layer weights to chunks, their gradients back")  # fmt: skip
