"""An explicit pipeline schedule's work per action, priced in lock-step from its table.

The explicit schedules (1f1b, interleaved, zb-h1) run, per tick and stage, up to one forward (F),
one backward (B: zb-h1's input gradient only) and one weight gradient (W, zb-h1) of one
micro-batch through one chunk of layers, each under a `lax.cond` an idle stage skips; the last
virtual stage's forward adds the head and the loss with their VJP. `Lanes` holds those FLOPs
per device, read off a compiled program's HLO (`sharding.costmodel._stepwork`) or in closed form
(`sharding.costmodel._predict`); `price` turns them into the step's critical path and the
busiest stage's own work with `Schedule.tick_costs`, so both sides price alike.

`flops` is the closed form of every strategy's matmul FLOPs (`predict`'s): 2 FLOPs per
multiply-add; a backward twice its forward (an input and a weight gradient per matmul, the
attention's two products twice); remat full adds a forward. zb-h1 splits the backward: B is the
input-gradient chain (with remat full after the recomputed forward), W the weight gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sharding.costmodel._traffic import rows_over_stages, tied
from sharding.pipeline import Kind, Schedule, TickCosts


@dataclass(frozen=True)
class Lanes:
    """Matmul FLOPs per device of one action (one micro-batch through one chunk of layers).

    Attributes:
        forward: the chunk's forward (F), the head excluded.
        backward: its backward (B): input and weight gradients, zb-h1's input gradient only.
        weight: zb-h1's weight gradient (W); 0 for the others.
        head: the head and the loss with their VJP, run in the last virtual stage's forward
            (zb-h1: the forward and the input gradient only).
        head_weight: zb-h1's head weight gradient, run in the last virtual stage's W.
        per_tick: work every stage does every tick outside the three lanes.
        outside: work outside the tick loop, per step.
    """

    forward: float
    backward: float
    weight: float = 0.0
    head: float = 0.0
    head_weight: float = 0.0
    per_tick: float = 0.0
    outside: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def of(cls, data: dict[str, Any]) -> Lanes:
        return cls(**{k: float(v) for k, v in data.items()})


def tick_costs(
    schedule: Schedule,
    lanes: Lanes,
    stage_layers: Sequence[int] | None = None,
    *,
    lockstep: bool = False,
) -> TickCosts:
    """`Schedule.tick_costs` of the lanes, per stage: a stage's F, B and W for all its chunks
    (a chunk costs 1/repeats), the last stage's F adding the head once per micro-batch (exact
    for one chunk; with several, spread over the last stage's chunks).

    ``stage_layers`` (balanced stages, one count per virtual stage): the lanes were measured
    with every stage's ``max(stage_layers)`` layer slots, of which a stage runs its own count
    (``lockstep``: all of them, the spare ones computed and discarded; see `Schedule.tick_costs`).
    """
    p, r = schedule.stages, schedule.repeats
    share = [1.0] * p
    if stage_layers is not None and not lockstep:
        slots = r * max(stage_layers)
        share = [sum(stage_layers[c * p + s] for c in range(r)) / slots for s in range(p)]
    forward = [r * lanes.forward * x for x in share]
    forward[-1] += lanes.head
    weight = [r * lanes.weight * x for x in share]
    weight[-1] += lanes.head_weight
    return schedule.tick_costs(forward, [r * lanes.backward * x for x in share], weight,
                               lockstep=lockstep)  # fmt: skip


def price(
    schedule: Schedule,
    lanes: Lanes,
    stage_layers: Sequence[int] | None = None,
    *,
    lockstep: bool = False,
) -> tuple[float, float]:
    """(critical-path FLOPs, the busiest stage's own FLOPs) of one step per device: the tick
    loop in lock-step plus what every stage does every tick and outside the loop."""
    costs = tick_costs(schedule, lanes, stage_layers, lockstep=lockstep)
    fixed = lanes.outside + schedule.ticks * lanes.per_tick
    return fixed + costs.critical, fixed + costs.busiest


def flops(s: Any, rows: int) -> tuple[float, float, Lanes | None]:
    """(matmul FLOPs per device per step, those on the lock-step critical path, an explicit
    schedule's `Lanes`) of setup ``s`` (`sharding.costmodel._predict.Setup`), ``rows`` sequences
    per device."""
    cfg, sz = s.cfg, s.sizes
    t, p = sz["tensor"], sz["stage"]
    # An expert kernel [L, E, D, F] runs on its experts' capacity slots, C of S per sequence.
    layer_mm = sum(q.size * (s.expert_share if "experts" in q.logical else 1)
                   for q in s.params if q.role == "layer" and len(q.shape) >= 3)  # fmt: skip
    head_mm = sum(q.size for q in s.params
                  if q.role == "head" or (q.role == "table" and tied(s.params)))  # fmt: skip
    # The expert kernels [L, E, D, F]: einsums with an expert batch dimension, which remat dots
    # does not keep (they run again in the backward, with attention's products).
    expert_mm = sum(q.size * s.expert_share for q in s.params
                    if q.role == "layer" and len(q.shape) == 4 and "experts" in q.logical)  # fmt: skip
    # q.k and p.v per token per layer, forward, against the keys it is scored with
    attn = 4 * s.attention_keys * cfg.n_heads * cfg.head_dim
    tokens = rows * s.local_seq  # per device: the sequence is split over context

    def layer_fwd(tokens: int, layers: float, part: str = "all") -> float:
        per = {"all": 2 * layer_mm / cfg.n_layers + attn, "mm": 2 * layer_mm / cfg.n_layers,
               "attn": attn, "again": attn + 2 * expert_mm / cfg.n_layers}  # fmt: skip
        return tokens * layers * per[part] / t

    def layer_bwd(tokens: int, layers: float) -> float:
        """Every matmul's two gradients, the attention's products by its kernel."""
        mm = layer_fwd(tokens, layers, "mm")
        return 2 * mm + s.attention_backward * layer_fwd(tokens, layers, "attn")

    head = 6 * tokens * head_mm / t
    extra = s.remat == "full"
    again = s.remat == "dots"  # dots keeps the projections, recomputes attention and experts
    if s.schedule is None:
        fwd = layer_fwd(tokens, cfg.n_layers)
        total = (fwd * (1 + extra) + layer_bwd(tokens, cfg.n_layers) + head
                 + again * layer_fwd(tokens, cfg.n_layers, "again"))  # fmt: skip
        return total, total, None
    sched = s.schedule
    m, chunk = sched.microbatches, cfg.n_layers / p / sched.repeats
    stage, stage_bwd = layer_fwd(tokens // m, chunk), layer_bwd(tokens // m, chunk)
    stage_bwd += again * layer_fwd(tokens // m, chunk, "again")
    if not sched.explicit:
        # gpipe/circular: every tick runs (bubble ticks on zeros); remat full recomputes each
        # layer once in backward, dots its attention's products, none nothing. The head follows the
        # stack on 1/p of the rows per stage where they divide (no fsdp), else on all of them.
        total = (stage * (1 + extra) + stage_bwd) * sched.ticks + (
            head / p if rows_over_stages(s) else head
        )
        return total, total, None
    if sched.splits_backward:
        # B: the input-gradient chain (each matmul's input gradient, the attention's backward
        # products; remat full recomputes the forward first); W: each weight's gradient, once.
        weight = layer_fwd(tokens // m, chunk, "mm")
        backward = stage_bwd - weight + extra * stage
    else:
        backward, weight = stage_bwd + extra * stage, 0.0
    # zb-h1 leaves the head's weight gradient (a third of its work) to the last stage's W.
    head_w = head / 3 if sched.splits_backward else 0.0
    lanes = Lanes(stage, backward, weight, (head - head_w) / m, head_w / m)
    critical, busiest = price(sched, lanes, s.stage_layers, lockstep=lockstep(s))
    return busiest, critical, lanes


def lane_runs(schedule: Schedule, kind: Kind, lockstep: bool) -> int:
    """How often one device runs a lane of kind ``kind`` per step, the collectives inside it with
    it: once per micro-batch and chunk (m x repeats), or in lock-step on every tick in which any
    stage runs that kind (every stage executes the branch then; `sharding.pipeline._lockstep`)."""
    if not lockstep:
        return schedule.microbatches * schedule.repeats
    return schedule.active_ticks[kind]


def lockstep(s: Any) -> bool:
    """Whether setup ``s``'s explicit schedule runs its lanes in lock-step: a stage body
    partitioned over an automatic axis (tensor; fsdp is manual inside a pipeline) or holding ring
    attention's ppermute (`sharding.pipeline._explicit`)."""
    sz = s.sizes
    return sz["tensor"] > 1 or (sz["context"] > 1 and s.context_method == "ring")


__all__ = ["Lanes", "flops", "lane_runs", "lockstep", "price", "tick_costs"]
