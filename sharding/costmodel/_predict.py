"""Closed-form predictions of what one training step costs per device, for any size and mesh.

`predict` gives the figures `ProgramReport` measures on a compiled step (collective bytes by
kind and mesh axes, parameter / optimizer / gradient memory, matmul FLOPs, pipeline bubble)
without compiling anything: parameter placement comes from the abstract parameter tree and the
preset's rules (as `explain` does), so a 70B model on 512 devices is answered in milliseconds.
Collectives are in `sharding.costmodel._traffic`; tests/test_costmodel.py holds every figure
against compiled programs.

Memory beyond the train state is an estimate: activations saved for backward (per token per
layer: 6 d_model-wide tensors, 2.4x the column-parallel matmul outputs, and attention's
float32 log-sum-exp per head under a flash kernel, or its scores and probabilities under the
materialising reference; coefficients measured on XLA:CPU's buffer assignment for llama 7b
blocks), one layer's backward transients, FSDP-gathered layer weights, and the float32 logits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from sharding._mesh import mesh_text
from sharding._units import fmt_bytes, fmt_count
from sharding.costmodel import _lanes
from sharding.costmodel._batching import accumulated, rows_per_pass
from sharding.costmodel._elementwise import elementwise_bytes
from sharding.costmodel._pipesplits import split_pipeline_traffic, splits_inside_stages
from sharding.costmodel._setup import LM_FAMILIES, CostModelError, Setup, setup
from sharding.costmodel._traffic import Traffic, traffic
from sharding.costmodel._zero import optimizer_share, split_params, updated_weight_gathers
from sharding.inspection import COLLECTIVE_KINDS

OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0}  # float32 moments per parameter
# Saved-for-backward coefficients (see the module doc), per token per layer.
SAVED_MODEL_WIDTHS, SAVED_COLUMN_OUTPUTS = 6, 2.4
SAVED_SCORE_COPIES = 2  # scores + probs
# The loss's float32 logits and their cotangent (`models.layers.cross_entropy` takes the
# log-sum-exp and the target's logit, keeping no log-softmax), beside the head's output in the
# compute dtype where that is narrower.
LOGIT_F32_COPIES = 2
PIPELINE_FIELDS = ("name", "microbatches", "repeats", "ticks")


@dataclass
class Prediction:
    """Predicted per-device, per-step figures of one (model, strategy, mesh, batch) setup.

    Byte conventions follow `ProgramReport`: ``collective_bytes`` is comparable to
    ``report.collective_bytes()``, ``argument_bytes`` to ``report.memory.argument`` and
    ``memory_bytes`` to ``argument + temp`` of the compiled step.
    """

    family: str
    size: str
    strategy: str
    mesh: dict[str, int]
    batch: int
    seq: int
    dtype: str
    optimizer: str
    remat: str
    pipeline: dict[str, Any] | None
    traffic: list[Traffic]
    n_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    batch_bytes: int
    activation_bytes: int
    working_bytes: int
    matmul_flops: float
    critical_flops: float
    bubble_fraction: float
    notes: list[str] = field(default_factory=list)
    attention: str = "auto"
    accum: int = 1  # micro-steps per step (gradient accumulation), each of batch / accum
    elementwise_bytes: float = 0.0  # HBM bytes of the non-matmul work per device per step

    @property
    def micro_batch(self) -> int:
        """Rows each device runs per forward pass: batch / (accum x batch shards), and / m
        inside a pipeline's micro-batches (Megatron's micro-batch size)."""
        m = self.pipeline["microbatches"] if self.pipeline else None
        return rows_per_pass(self.batch, self.mesh, self.accum, m)

    def collective_bytes(self, kind: str | None = None, axes: str | tuple | None = None) -> int:
        """Bytes per device per step, of ``kind`` and over exactly ``axes`` if given."""
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise CostModelError(f"unknown collective kind {kind!r}; kinds: {COLLECTIVE_KINDS}")
        axes = (axes,) if isinstance(axes, str) else axes
        return sum(
            x.bytes
            for x in self.traffic
            if kind in (None, x.kind) and (axes is None or x.axes == tuple(axes))
        )

    def bytes_by_kind(self) -> dict[str, int]:
        """Collective bytes per kind, in `COLLECTIVE_KINDS` order (kinds with none left out)."""
        return {k: b for k in COLLECTIVE_KINDS if (b := self.collective_bytes(k))}

    @property
    def argument_bytes(self) -> int:
        """Train state + batch: parameters, optimizer state, step counter, token ids."""
        return self.param_bytes + self.optimizer_bytes + self.batch_bytes + 4

    @property
    def memory_bytes(self) -> int:
        """Estimated peak per device: arguments + gradients + activations + working set."""
        return self.argument_bytes + self.grad_bytes + self.activation_bytes + self.working_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["traffic"] = [{**asdict(x), "axes": list(x.axes)} for x in self.traffic]
        data.update(
            collective_bytes=self.collective_bytes(),
            bytes_by_kind=self.bytes_by_kind(),
            argument_bytes=self.argument_bytes,
            memory_bytes=self.memory_bytes,
        )
        return data

    def __rich__(self) -> Group:
        mesh = mesh_text(self.mesh)
        pipe = ""
        if self.pipeline:
            pipe = f", {self.pipeline['name']} m={self.pipeline['microbatches']}"
        head = Text(
            f"predicted: {self.family} {self.size} / {self.strategy}{pipe} on {mesh}, batch "
            f"{self.batch} x seq {self.seq}, {self.dtype}, {self.optimizer}, remat {self.remat}",
            style="bold",
        )
        table = Table()
        for col in ("collective", "axes", "what", "count", "bytes/device"):
            table.add_column(col, justify="right" if col in ("count", "bytes/device") else "left")
        groups: dict[tuple, list[int]] = {}
        for x in self.traffic:
            g = groups.setdefault((x.kind, x.axes, x.what), [0, 0])
            g[0], g[1] = g[0] + x.count, g[1] + x.bytes
        for (kind, axes, what), (count, nbytes) in sorted(
            groups.items(), key=lambda kv: (COLLECTIVE_KINDS.index(kv[0][0]), kv[0][1])
        ):
            table.add_row(kind, ",".join(axes), what, str(count), fmt_bytes(nbytes))
        table.add_row("total", "", "", "", fmt_bytes(self.collective_bytes()), style="bold")
        mem = Table.grid(padding=(0, 2))
        rows = (
            ("parameters", f"{fmt_count(self.n_params)}, {fmt_bytes(self.param_bytes)}/device"),
            ("gradients / device", fmt_bytes(self.grad_bytes)),
            ("optimizer state / device", fmt_bytes(self.optimizer_bytes)),
            ("activations / device", fmt_bytes(self.activation_bytes)),
            ("working set / device", fmt_bytes(self.working_bytes)),
            ("memory / device (est.)", fmt_bytes(self.memory_bytes)),
            ("matmul FLOPs / device", fmt_count(self.matmul_flops)),
            ("pipeline bubble", f"{self.bubble_fraction:.1%}"))  # fmt: skip
        for name, value in rows:
            mem.add_row(name, value)
        return Group(head, table, mem, *(Text(n, style="dim") for n in self.notes))


def _column_width(s: Setup, experts: bool = True) -> float:
    """Per device and token, the summed output widths of the layer kernels that read d_model
    (an expert kernel ``[L, E, D, F]`` counts the experts' slots a token fills on average;
    ``experts=False``: the dense kernels alone)."""
    n_layers, d = s.cfg.n_layers, s.cfg.d_model
    dense = sum(
        q.size / (n_layers * d) / (s.sizes["tensor"] if "tensor" in q.axes else 1)
        for q in s.params
        if q.role == "layer" and len(q.shape) >= 3 and q.logical[1] == "embed"
    )
    expert = sum(
        q.size / (n_layers * d * q.shape[1]) / (s.sizes["tensor"] if "tensor" in q.axes else 1)
        for q in s.params
        if q.role == "layer" and len(q.shape) == 4 and q.logical[1:3] == ("experts", "embed")
    )
    return dense + expert * s.cfg.n_experts * s.expert_share if experts and expert else dense


def _dots_saved(s: Setup, tokens: int) -> float:
    """Bytes one layer saves for backward under remat dots (``dots_with_no_batch_dims_saveable``)
    for ``tokens`` tokens on one device: its input, and the outputs of its matmuls against
    weights that the backward reads, every column output (q, k, v, gate, up: `_column_width`'s
    dense kernels) and every d_model-wide output but the layer's last (o: the residual stream
    between attention and MLP is recomputed from it; the last, down, only feeds the next layer).
    Attention's products and the experts' einsums (an expert batch dimension) are recomputed.
    Measured on llama tiny (8 layers, 2048 tokens, float32): the compiled step's temporaries
    under dots exceed full remat's by 28.5 MB, this by 29.4 MB."""
    d = s.cfg.d_model
    layer = [q for q in s.params if q.role == "layer" and len(q.shape) >= 3]
    rows = sum(1 for q in layer if q.logical[-1] == "embed" and len(q.shape) < 4)
    expert_last = any(len(q.shape) == 4 and q.logical[-1] == "embed" for q in layer)
    kept_rows = rows if expert_last else max(rows - 1, 0)  # the layer's last output is not kept
    return tokens * s.act_bytes * (d + _column_width(s, experts=False) + kept_rows * d)


def _layer_activations(s: Setup, tokens: int) -> float:
    """Bytes one layer saves for backward for ``tokens`` tokens on one device, without remat."""
    heads = s.cfg.n_heads / s.split("heads")
    per_token = s.act_bytes * (
        SAVED_MODEL_WIDTHS * s.cfg.d_model + SAVED_COLUMN_OUTPUTS * _column_width(s)
    )
    # The reference kernel keeps scores and probabilities against every key; a flash kernel
    # (blockwise, cuDNN, splash, ring) keeps only the float32 log-sum-exp per head and
    # recomputes the rest block by block in the backward.
    attention = 4 * heads * (1 if s.flash else SAVED_SCORE_COPIES * s.seq)
    return tokens * (per_token + attention)


def predict(
    family: Any,
    cfg: Any,
    strategy: str,
    mesh_sizes: dict[str, int],
    batch: int,
    seq: int,
    *,
    pipeline: Any = None,
    dtype: str = "float32",
    optimizer: str = "adamw",
    remat: str = "none",
    context_method: str = "ring",
    attention: str = "auto",
    accum: int = 1,
) -> Prediction:
    """Predict one training step's per-device costs, without devices or compilation.

    Args:
        family, cfg: a language-model family (the module `models.llama` or `models.gpt2`, or any
            object with the same `NAME`, `Model` and `config`) and its Config (or size name).
        strategy: a preset name (`partition_rules.STRATEGIES`).
        mesh_sizes: axis sizes, e.g. ``{"fsdp": 64, "tensor": 8}`` (missing axes are 1).
        batch, seq: global batch (sequences per step) and sequence length.
        pipeline: ``(schedule, microbatches, repeats[, stage_layers])`` or a `PipelineSpec`, for
            pipeline strategies. ``stage_layers``: the layers of each virtual stage, or
            ``"auto"`` for counts as even as the stack allows (126 layers on 16 stages).
        dtype: compute dtype ("float32", "bfloat16"); master weights stay float32.
        optimizer: "adamw", "adam" or "sgd" (state bytes).
        remat: "none", "dots" (each layer keeps its input and the outputs of its matmuls
            against weights, recomputing the rest: attention's products once more) or "full"
            (each layer recomputed in backward from its input).
        context_method: attention over a ``context`` axis: "ring", "allgather", "ulysses".
        attention: the attention kernel (`models.attention.KINDS`): "xla" materialises the
            scores (memory and FLOPs of the whole square); the others are flash-style (causal
            blocks skipped, the backward recomputing, no score matrix kept).
        accum: micro-steps per step (gradient accumulation, `accumulated`): the step runs
            ``accum`` micro-steps of ``batch / accum`` rows each (``pipeline``'s micro-batches
            split each micro-step).

    Example:
        >>> pred = predict(models.llama, "70b", "fsdp_tp", {"fsdp": 64, "tensor": 8}, 512, 4096,
        ...                dtype="bfloat16", remat="full")  # doctest: +SKIP
        >>> fmt_bytes(pred.memory_bytes), fmt_bytes(pred.collective_bytes())  # doctest: +SKIP
    """
    if optimizer not in OPTIMIZER_MOMENTS:
        raise CostModelError(
            f"unknown optimizer {optimizer!r}; choose one of {list(OPTIMIZER_MOMENTS)}"
        )
    if accum != 1:
        if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1 or batch % accum:
            raise CostModelError(
                f"accum={accum!r}: the accumulation steps must be a whole number >= 1 that "
                f"divides the global batch {batch}; e.g. accum=1 or {_divisor(batch)}"
            )
        micro = predict(family, cfg, strategy, mesh_sizes, batch // accum, seq,
                        pipeline=pipeline, dtype=dtype, optimizer=optimizer, remat=remat,
                        context_method=context_method, attention=attention)  # fmt: skip
        return accumulated(micro, accum)
    s = setup(family, cfg, strategy, mesh_sizes, batch, seq, pipeline=pipeline, dtype=dtype,
              remat=remat, context_method=context_method, attention=attention)  # fmt: skip
    sz, cfg = s.sizes, s.cfg
    rows, seq = s.rows, s.local_seq  # per device: the sequence is split over context
    # float32 master weights, one shard per device
    param_bytes = sum(q.nbytes // math.prod(sz[a] for a in q.axes) for q in s.params)
    moments = OPTIMIZER_MOMENTS[optimizer]
    zero1 = split_params(s) if moments else []  # no state to split: nothing to gather
    layer_act = _layer_activations(s, rows * seq)
    p = sz["stage"]

    def saved(tokens: int) -> float:
        """What one layer keeps for backward, by the remat policy: everything (none), its
        input (full), its input and the matmul outputs the backward reads (dots)."""
        if remat == "full":
            return tokens * cfg.d_model * s.act_bytes
        return _dots_saved(s, tokens) if remat == "dots" else _layer_activations(s, tokens)

    if s.schedule is None:
        activations, transient = cfg.n_layers * saved(rows * seq), layer_act
    else:
        sched = s.schedule
        mb_tokens = rows * seq // sched.microbatches
        mb_act = _layer_activations(s, mb_tokens)
        mb_in = mb_tokens * cfg.d_model * s.act_bytes
        tick_layers = cfg.n_layers // (p * sched.repeats)
        if sched.explicit:  # a ring of residual slots, each one chunk's of one micro-batch
            chunk = tick_layers * saved(mb_tokens)
            wct = sched.slots.weight_cotangents * tick_layers * mb_in  # zb-h1: layer out-grads
            activations = sched.slots.residuals * chunk + wct
            transient = mb_act * (2 if remat == "full" else 1)
        else:  # per tick: the stage's input (remat full), else what its layers keep
            if remat == "full":
                activations, transient = sched.ticks * mb_in, tick_layers * mb_act + mb_act
            else:
                activations, transient = sched.ticks * tick_layers * saved(mb_tokens), mb_act
    gathered = 0.0
    if sz["fsdp"] > 1:  # one layer's weights gathered whole over fsdp at a time
        gathered = s.act_bytes * sum(
            q.size / cfg.n_layers / math.prod(sz[a] for a in q.axes if a != "fsdp")
            for q in s.params
            if q.role == "layer"
        )
    narrow = s.act_bytes if s.act_bytes < 4 else 0  # the head's bfloat16 output, kept too
    logits = rows * seq * s.vocab * (LOGIT_F32_COPIES * 4 + narrow)
    sched = s.schedule
    if sched is not None and sched.explicit:  # the head runs per micro-batch, in the F lane
        logits /= sched.microbatches
    flops, critical, lanes = _lanes.flops(s, rows)
    notes = []
    pipe = None if sched is None else {k: getattr(sched, k) for k in PIPELINE_FIELDS}
    if s.stage_layers is not None:
        pipe["stage_layers"] = list(s.stage_layers)
        notes.append(f"uneven stages {list(s.stage_layers)}: memory and traffic priced at the "
                     f"largest stage's {max(s.stage_layers)} layers; FLOPs at each stage's own "
                     f"where the schedule table prices them (1f1b, interleaved, zb-h1), else "
                     f"at the largest's")  # fmt: skip
    if lanes is not None:
        pipe["lanes"] = lanes.to_dict()
        pipe["lockstep"] = _lanes.lockstep(s)
        notes.append(f"{sched.name}: FLOPs count what the busiest stage runs (a compiled count "
                     f"charges every lane of every tick); the critical path prices the table")  # fmt: skip
    return Prediction(
        family=family.NAME,
        size=getattr(cfg, "name", "?"),
        strategy=strategy,
        mesh=dict(sz),
        batch=batch,
        seq=s.seq,
        dtype=dtype,
        optimizer=optimizer,
        remat=remat,
        pipeline=pipe,
        traffic=(split_pipeline_traffic(s) if splits_inside_stages(s) else traffic(s))
        + updated_weight_gathers(s, zero1),
        n_params=s.n_params,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=round(moments * param_bytes * optimizer_share(s, zero1))
        + (4 if moments else 0),
        batch_bytes=2 * rows * seq * 4,
        activation_bytes=int(activations),
        working_bytes=int(transient + gathered + logits),
        matmul_flops=flops,
        critical_flops=critical,
        bubble_fraction=0.0 if sched is None else sched.bubble_fraction,
        notes=notes,
        attention=attention,
        elementwise_bytes=elementwise_bytes(s, rows),
    )


def _divisor(n: int) -> int:
    return next((d for d in (2, 3, 5, 7) if n % d == 0), n)


__all__ = [
    "LM_FAMILIES",
    "CostModelError",
    "Prediction",
    "Setup",
    "Traffic",
    "accumulated",
    "predict",
    "setup",
]
