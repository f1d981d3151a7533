"""Collective bytes of a pipelined step whose stages split more than the batch, in closed form.

The explicit schedules (1f1b, zb-h1, interleaved: lanes per tick, the embedding and the head
inside the scan), and gpipe and circular under pp_cp, pp_tp_sp and pp_ep (and llama-moe under
any pipeline), run the attention and expert kernels per device inside each stage
(`sharding.pipeline` is manual over stage and the split's axes), so their collectives follow the
pipeline's ticks or lanes, not the layer count:

- under gpipe and circular every tick runs one chunk of the stage's layers (L / (p x repeats))
  on one micro-batch, bubble ticks included (they compute on zeros), so a kernel's collectives
  are ``ticks`` times those of one micro-batch through one chunk
  (`sharding.context.context_traffic`, the experts' all-to-alls, Megatron SP's gathers);
- under the explicit schedules a collective inside a lane runs as often as the lane does
  (`lane_runs`: m x repeats, or in lock-step every tick some stage runs that kind), forward
  terms with the F lanes and backward ones with the B lanes; the head's once per micro-batch;
- the stage weights' gradients are summed over the batch axes and ``context`` in one all-reduce
  (the shard_map's psum over both), an expert's own over the batch axes it is not split on;
  with fsdp the stage weights (and, under the explicit schedules, the head-side weights) are
  gathered whole over fsdp once per step and their gradients summed whole;
- the weights outside the stack (table, final norm, head) are reduced as in a plain pipeline and
  then again over ``context`` (each sequence shard's partial gradient);
- the activations cross stages split over ``tensor`` (1/t of a micro-batch per shift): under SP
  over the sequence already, else, where tensor divides the sequence or d_model, each tensor
  rank sends its share and the next stage gathers it whole (`stage_shifts`);
- a mixture of experts whose hidden width is split over tensor (llama-moe under pp_tp) sums its
  [E, rows, C, D] expert buffers over tensor, not d_model-wide activations.

Not modelled: the zigzag reorder's token ids (ring and allgather with data > 1: an all-gather
over stage and a permute, under 0.1% of the step), and the stage weights' psum over a size-1
data axis, which XLA keeps (pp_ep, pp_tp_sp with data = 1): the inspector lists it as an
all-reduce over no mesh axis; it moves nothing between devices.

Terms are what jax 0.10's partitioner emits for spmdkit's step on XLA:CPU, measured on the
programs tests/test_pipeline_split_costs.py compiles; byte conventions are `_traffic`'s. An
explicit schedule with the expert split is not modelled and raises `CostModelError` before
anything is computed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from sharding._mesh import BATCH_AXES
from sharding.context import DEFAULT_METHOD, context_traffic
from sharding.costmodel._lanes import lane_runs, lockstep
from sharding.costmodel._sequence import (
    gathered_inputs,
    input_gradients,
    norm_vector_bytes,
    row_outputs,
    splits_sequence_over_tensor,
)
from sharding.costmodel._setup import CostModelError
from sharding.costmodel._traffic import (
    HEAD_STAT_REDUCTIONS,
    Param,
    Traffic,
    _fsdp_gather,
    _layers,
    _Sink,
    _table,
    chunk_regroup,
    head_side_gathers,
    matmul_kinds,
    rows_over_stages,
    stage_gather,
    stage_shifts,
    tied,
)
from sharding.experts import ALL_TO_ALLS_PER_LAYER, expert_slots
from sharding.pipeline import Kind


def splits_inside_stages(s: Any) -> bool:
    """Whether setup ``s`` pipelines a step under an explicit schedule, or one whose stages split
    the sequence (context, or SP on tensor) or route tokens to experts (an expert axis, or a MoE
    config): the setups `split_pipeline_traffic` prices."""
    if s.schedule is None:
        return False
    sz = s.sizes
    return (
        s.schedule.explicit
        or sz.get("context", 1) > 1
        or splits_sequence_over_tensor(s)
        or sz.get("expert", 1) > 1
        or bool(getattr(s.cfg, "n_experts", None))
    )


def split_pipeline_traffic(s: Any) -> list[Traffic]:
    """Every collective of one training step of setup ``s`` (see `splits_inside_stages`).

    Raises:
        CostModelError: ``s`` is not such a setup (`splits_inside_stages`), or pipelines it in a
            way not modelled in closed form: an explicit schedule with experts; experts over
            fsdp, or over tensor with remat or an expert axis.
    """
    if not splits_inside_stages(s):
        raise CostModelError(
            f"split_pipeline_traffic: strategy {s.strategy!r} with schedule "
            f"{getattr(s.schedule, 'name', None)!r} on mesh {_mesh_text(s.sizes)} neither runs an "
            f"explicit schedule nor pipelines a sequence or expert split (context, SP on tensor, "
            f"experts); price it with "
            f"sharding.costmodel.predict"
        )
    sched, sz = s.schedule, s.sizes
    moe = sz.get("expert", 1) > 1 or bool(getattr(s.cfg, "n_experts", None))
    if sched.explicit and moe:
        raise CostModelError(
            f"schedule {sched.name!r} with strategy {s.strategy!r} on mesh "
            f"{_mesh_text(sz)}: an explicit schedule with the expert split "
            f"inside its stages is not modelled in closed form; use schedule "
            f"'gpipe' or 'circular', or price it from the compiled program with `spmdkit "
            f"compare --strategies {s.strategy} --schedule {sched.name}`"
        )
    experts = [q for q in s.params if q.role == "layer" and "experts" in q.logical]
    if experts and (sz["fsdp"] > 1 or (sz["tensor"] > 1 and (s.remat != "none" or _moe_ep(s)))):
        raise CostModelError(
            f"strategy {s.strategy!r} on mesh {_mesh_text(sz)} (remat {s.remat!r}) with "
            f"{s.cfg.n_experts} experts: a pipeline over a mixture of experts split over fsdp, "
            f"or over tensor with remat or the expert axis, is not modelled in closed form; "
            f"price it from the compiled program with `spmdkit compare --strategies "
            f"{s.strategy} --schedule {sched.name}`"
        )
    out = _Sink()
    act = s.rows * s.local_seq * s.cfg.d_model * s.act_bytes  # one [rows, seq/c, d_model]
    _gradients(out, s, act)
    if sched.explicit:
        _explicit_tensor(out, s, act)
        stage_gather(out, s)
    else:
        # Tensor-parallel reductions per tick, pp_fsdp's gathers, of the dense kernels (the
        # experts': `_kernels`). Under SP a remat backward recomputes all but the layer's last
        # row-parallel output (its carry), as tp_sp's.
        sp_remat = s.remat == "full" and splits_sequence_over_tensor(s)
        dense = [q for q in s.params if q not in experts]
        _layers(out, replace(s, params=dense, remat="none" if sp_remat else s.remat), act, s.rows)
        _heads(out, s, act)
    _stages(out, s, act)
    _kernels(out, s)
    return list(out)


def _moe_ep(s: Any) -> bool:
    """Whether setup ``s`` spreads a mixture of experts over an expert axis."""
    return bool(getattr(s.cfg, "n_experts", None)) and s.sizes.get("expert", 1) > 1


def _mesh_text(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "1 device"


def _gradients(out: _Sink, s: Any, act: float) -> None:
    """The gradient reductions and the lookup (`_traffic.traffic`'s, with ``context`` joined to
    the stage weights' reduction and added after every other weight's)."""
    sz = s.sizes
    batch_axes = tuple(a for a in BATCH_AXES if sz.get(a, 1) > 1)
    c, f = sz.get("context", 1), sz.get("fsdp", 1)
    head_extra = ("stage",) if rows_over_stages(s) else ()

    def grad_bytes(q: Param) -> float:
        g = q.nbytes / math.prod(sz[a] for a in q.axes if a in ("tensor", "stage", "expert"))
        return g * s.seq / q.shape[0] if q.role == "positions" else g

    def reduce(q: Param, what: str, extra: tuple[str, ...] = ()) -> None:
        g = grad_bytes(q)
        over = tuple(a for a in batch_axes if a not in q.axes or a == "fsdp")
        if q.role == "layer":  # inside the stages: one psum over the batch axes and context
            over += ("context",) if c > 1 else ()
        kind = "reduce-scatter" if "fsdp" in q.axes else "all-reduce"
        out.add(kind, (*extra, *over), g, 1, what)
        if c > 1 and q.role != "layer":  # each sequence shard's partial gradient, summed after
            shard = g / f if "fsdp" in q.axes else g
            out.add("all-reduce", ("context",), shard, 1, f"{what} over the sequence")

    if s.schedule.explicit:
        # The lanes differentiate the embedding at the first stage and the head at the last,
        # inside the scan: each gradient is summed once, over stage too outside the stack, and
        # over context with the rest (measured, pp_cp and pp_tp_sp under 1f1b, zb-h1,
        # interleaved).
        for q in s.params:
            g = q.nbytes / math.prod(sz[a] for a in q.axes if a in ("tensor", "stage"))
            over = (*(() if q.role == "layer" else ("stage",)), *batch_axes)
            out.add("all-reduce", (*over, *(("context",) if c > 1 else ())), g, 1,
                    f"gradient reduction ({q.role}), in one")  # fmt: skip
            if q.role != "layer" and f > 1:  # gathered whole once, for the lanes
                _fsdp_gather(out, s, q, 1, f"{q.role} weights, whole for the lanes")
        return
    for q in s.params:
        if q.role == "table":
            if "tensor" in q.axes and "fsdp" not in q.axes and sz["data"] > 1:
                _stage_lookup(out, s, q, act, batch_axes, grad_bytes(q))
            else:
                _table(out, s, q, act, s.rows, batch_axes, grad_bytes(q))
            if c > 1:
                shard = grad_bytes(q) / (f if "fsdp" in q.axes else 1)
                out.add("all-reduce", ("context",), shard, 1, "gradient of the token table "
                        "over the sequence")  # fmt: skip
            if tied(s.params):
                reduce(q, "gradient of the tied head", head_extra)
                _fsdp_gather(out, s, q, 1 if "tensor" not in q.axes else 2, "tied head weights")
            continue
        extra = head_extra if q.role in ("head", "vector", "other") else ()
        reduce(q, f"gradient reduction ({'layers' if q.role == 'layer' else q.role})", extra)
        head_side_gathers(out, s, q)


def _stage_lookup(out: _Sink, s: Any, q: Param, act: float, batch_axes, grad: float) -> None:
    """A vocabulary-split table in a pipelined step with data > 1 (measured, pp_tp and
    pp_tp_sp): XLA moves the table's shard from the tensor split to a stage split, looks the ids
    up there, and sums the partial lookups over stage; the gradient's shard moves back. With
    data = 1 it keeps tensor parallelism's lookup (`_table`: partial sums over tensor)."""
    shard = q.nbytes / s.sizes["tensor"]
    over = ("stage", "data", *(("context",) if s.sizes.get("context", 1) > 1 else ()), "tensor")
    out.add("collective-permute", over, 2 * shard, 2,
            "token table to a stage split and its gradient back")  # fmt: skip
    out.add("all-reduce", ("stage",), act, 1, "lookup partial sums (vocab split over stage)")
    out.add("all-reduce", batch_axes, grad, 1, "gradient of the token table")


def _explicit_tensor(out: _Sink, s: Any, act: float) -> None:
    """Tensor parallelism (with or without Megatron SP) under an explicit schedule: a layer's
    reductions run with the lane that holds them (`lane_runs`: row-parallel outputs and the
    lookup with the F lanes, input gradients and recomputed outputs with the B lanes), the
    head's once per micro-batch, each on one micro-batch (measured, 1f1b, zb-h1, interleaved)."""
    sz, sched = s.sizes, s.schedule
    if sz.get("tensor", 1) == 1:
        return
    sp = splits_sequence_over_tensor(s)
    fwd, bwd = _runs(s, Kind.FORWARD), _runs(s, Kind.BACKWARD)
    chunk = s.cfg.n_layers // (sz["stage"] * sched.repeats)
    mb = act / sched.microbatches  # whole sequences (under SP: gathered before the matmuls)
    row = matmul_kinds(s.params, sz)[1]  # SP's gathers and norm sums: `_kernels`
    out.add("all-reduce", ("tensor",), chunk * fwd * row * mb, chunk * fwd * row,
            row_outputs(s, "row-parallel outputs (F lanes)"))  # fmt: skip
    input_gradients(out, s, chunk * bwd, mb, "column-parallel input gradients (B lanes)")
    if s.remat == "full" and not sp:  # SP's recomputed reductions: `_kernels`
        # All but the layer's last: its output is the carry the next layer's recompute reads.
        out.add("all-reduce", ("tensor",), chunk * bwd * (row - 1) * mb, chunk * bwd * (row - 1),
                "row-parallel outputs recomputed in the B lanes")  # fmt: skip
    if sp:
        out.add("all-gather", ("tensor",), (fwd + bwd) * mb, fwd + bwd,
                "stack output to whole sequences (F lanes), input cotangent (B lanes)")  # fmt: skip
    if any(q.role == "table" and "tensor" in q.axes for q in s.params):
        out.add("all-reduce", ("tensor",), fwd * mb, fwd, "lookup partial sums, F lanes")
    heads = [q for q in s.params if q.role == "head" or (q.role == "table" and tied(s.params))]
    if any("tensor" in q.axes for q in heads):
        m = sched.microbatches  # the head runs once per micro-batch, on the last stage
        stats = HEAD_STAT_REDUCTIONS * s.rows / m * s.seq * 4
        if sp:
            out.add("all-gather", ("tensor",), m * mb, m, "head input, per micro-batch")
        out.add("all-reduce", ("tensor",), m * (mb + stats), m * (1 + HEAD_STAT_REDUCTIONS),
                "head input gradient and softmax statistics, per micro-batch")  # fmt: skip


def _runs(s: Any, kind: Kind) -> int:
    """How often a device runs one chunk's lane of ``kind`` per step (`lane_runs`); gpipe and
    circular run every layer on every tick."""
    sched = s.schedule
    return lane_runs(sched, kind, lockstep(s)) if sched.explicit else sched.ticks


def _heads(out: _Sink, s: Any, act: float) -> None:
    """A vocabulary-split head's reductions over tensor: on each stage's 1/p of the rows where
    gpipe/circular scatter the stack's output over stage."""
    heads = [q for q in s.params if q.role == "head" or (q.role == "table" and tied(s.params))]
    if not any("tensor" in q.axes for q in heads):
        return
    share = s.sizes["stage"] if rows_over_stages(s) else 1
    out.add("all-reduce", ("tensor",), act / share, 1, "head input gradient (vocab split)")
    stats = HEAD_STAT_REDUCTIONS * s.rows / share * s.seq * 4
    out.add("all-reduce", ("tensor",), stats, HEAD_STAT_REDUCTIONS, "softmax statistics")


def _stages(out: _Sink, s: Any, act: float) -> None:
    """Shifts between stages per tick, the stack's output and input cotangent around them, and
    circular's regrouping of the stack into chunks."""
    sched, p = s.schedule, s.sizes["stage"]
    sp = splits_sequence_over_tensor(s)
    t = s.sizes["tensor"] if sp else 1
    stage_shifts(out, s, act)
    if sched.explicit:
        pass  # the head and the embedding run inside the scan: nothing leaves it
    elif rows_over_stages(s):
        out.add("reduce-scatter", ("stage",), act, 1, "pipeline outputs to every stage")
        out.add("all-gather", ("stage",), act, 1, "output cotangents to the last stage")
        out.add("all-reduce", ("stage",), act / t, 1, "input cotangents to the embedding")
    else:
        out.add("all-reduce", ("stage",), act + act / t, 2, "pipeline outputs + input cotangents")
    if sp and not sched.explicit:
        # Measured (pp_tp_sp): the sequence-split stack output and its cotangent are gathered
        # over tensor on whole rows and again on each stage's rows, and the output cotangents
        # gathered over stage twice more, around the sequence relayout.
        share = p if rows_over_stages(s) else 1
        out.add("all-gather", ("tensor",), 2 * act + 2 * act / share, 4,
                "stack output and input cotangent to whole sequences")  # fmt: skip
        out.add("all-gather", ("stage",), 2 * act, 2, "output cotangents around the relayout")
    chunk_regroup(out, s)


def _kernels(out: _Sink, s: Any) -> None:
    """What the kernels inside a stage move: one micro-batch through one chunk, per tick
    (gpipe, circular) or per run of the lane that holds them (the explicit schedules)."""
    sched, sz, cfg = s.schedule, s.sizes, s.cfg
    ticks, m = sched.ticks, sched.microbatches
    fwd, bwd = _runs(s, Kind.FORWARD), _runs(s, Kind.BACKWARD)
    chunk = cfg.n_layers // (sz["stage"] * sched.repeats)
    shards = math.prod(sz[a] for a in BATCH_AXES)
    mb = s.batch // m  # sequences per micro-batch (global)
    if splits_sequence_over_tensor(s):  # Megatron SP inside each chunk
        a = s.rows * s.local_seq * cfg.d_model * s.act_bytes / m  # local_seq: over context
        groups, row = gathered_inputs(s), matmul_kinds(s.params, sz)[1]
        f, b = fwd * chunk, bwd * chunk
        out.add("all-gather", ("tensor",), f * groups * a, f * groups,
                "sequence gathered before column-parallel matmuls")  # fmt: skip
        out.add("all-gather", ("tensor",), b * row * a, b * row,
                "row-parallel output cotangents gathered in backward")  # fmt: skip
        out.add("all-reduce", ("tensor",), b * norm_vector_bytes(s), b,
                "norm gradients (norms see S/t of the sequence)")  # fmt: skip
        if s.remat != "none":  # dots keeps the matmul outputs, not the gathered inputs
            out.add("all-gather", ("tensor",), b * groups * a, b * groups,
                    "sequence gathered again when remat recomputes the forward")  # fmt: skip
        if s.remat == "full":
            again = row - 1
            out.add("all-reduce", ("tensor",), b * again * a, b * again,
                    row_outputs(s, "row-parallel outputs recomputed in backward, all but "
                                   "the carry"))  # fmt: skip
    experts = [q for q in s.params if q.role == "layer" and "experts" in q.logical]
    if sz.get("tensor", 1) > 1 and any("tensor" in q.axes for q in experts):
        # Each expert's hidden width split over tensor (pp_tp): the [E, rows, C, D] buffers are
        # partial sums, all-reduced after each kernel that writes d_model (down: forward) and
        # before each that reads it (gate, up: their input gradients, backward).
        slots = expert_slots(s.seq, cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        buffer = s.rows / m * cfg.n_experts * slots * cfg.d_model * s.act_bytes
        kinds = sum(q.logical[-1] == "embed" or q.logical[2] == "embed" for q in experts)
        runs = ticks * chunk * kinds
        out.add("all-reduce", ("tensor",), runs * buffer, runs,
                "expert buffers' partial sums over the split hidden width, per tick")  # fmt: skip
    if _moe_ep(s):
        # The capacity counts every expert (the layer keeps its expert count apart from the
        # E/e local experts' weights it is handed inside the stage).
        slots = expert_slots(s.seq, cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        per_device = mb // shards * cfg.n_experts * slots * cfg.d_model * s.act_bytes
        # Two there and back, two transposed in backward; remat runs the forward's two again.
        runs = ticks * chunk * (ALL_TO_ALLS_PER_LAYER + (2 if s.remat == "full" else 0))
        out.add("all-to-all", ("expert",), runs * per_device, runs, "expert tokens, per tick")
    if sz.get("context", 1) > 1:
        terms = context_traffic(s.context_method or DEFAULT_METHOD, batch=mb, seq=s.seq,
                                heads=cfg.n_heads,
                                kv_heads=getattr(cfg, "n_kv_heads", cfg.n_heads),
                                head_dim=cfg.head_dim, layers=chunk, context=sz["context"],
                                tensor=sz.get("tensor", 1), batch_shards=shards,
                                dtype="float32" if s.act_bytes == 4 else "bfloat16",
                                remat=s.remat != "none", batch_over_context=False)  # fmt: skip
        for x in terms:  # the backward's terms run with the B lanes, the rest with the F lanes
            n = bwd if x.backward else fwd
            out.add(x.kind, x.axes, n * x.bytes, n * x.count, x.what)


__all__ = ["split_pipeline_traffic", "splits_inside_stages"]
