"""What a closed-form prediction is computed from: a validated `Setup` (model, strategy, mesh,
batch, placed parameters, pipeline schedule), built by `setup` without devices or compilation."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from flax import nnx
from jax.sharding import AbstractMesh

from partition_rules import PIPELINE_STRATEGIES, composition, preset
from sharding._attention import BLOCK, check_kind, live_fraction
from sharding._errors import SpmdkitError
from sharding._init import abstract_params
from sharding._mesh import BATCH_AXES, MeshSpec
from sharding._resolve import place
from sharding.costmodel._traffic import Param, classify
from sharding.experts import expert_slots
from sharding.pipeline import (
    LayerCountError,
    PipelineSpec,
    Schedule,
    balance_layers,
    check_pipeline,
    check_stage_layers,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
LM_FAMILIES = ("llama", "gpt2", "llama-moe")


class CostModelError(SpmdkitError):
    """Arguments the cost model cannot predict for."""


@dataclass(frozen=True)
class Setup:
    """Everything a prediction is computed from (built by `predict`)."""

    family: str
    cfg: Any
    strategy: str
    sizes: dict[str, int]
    batch: int
    seq: int
    act_bytes: int
    params: list[Param]
    schedule: Schedule | None
    remat: str
    context_method: str = "ring"
    attention: str = "auto"
    # Uneven stages: the layers of each virtual stage (None: equal). ``cfg`` then holds
    # ``stages x repeats x max(stage_layers)`` layers, every stage's chunk sized as the largest
    # (what the busiest stage holds and runs each tick); ``layers`` is the model's own count.
    stage_layers: tuple[int, ...] | None = None
    layers: int = 0

    @property
    def n_params(self) -> int:
        """The model's parameters (without the padding of uneven stages)."""
        pad = self.cfg.n_layers / self.layers if self.layers else 1.0
        return int(sum(q.size / (pad if q.role == "layer" else 1) for q in self.params))

    def split(self, logical_name: str) -> int:
        """The tensor split of a logical axis of the layer kernels (1 when unsplit)."""
        hit = any(logical_name in q.logical and "tensor" in q.axes for q in self.params)
        return self.sizes["tensor"] if hit else 1

    @property
    def vocab(self) -> float:
        """Vocabulary entries per device: split over tensor where the head or table is."""
        split = any("tensor" in q.axes for q in self.params if q.role in ("head", "table"))
        return self.cfg.vocab_size / (self.sizes["tensor"] if split else 1)

    @property
    def rows(self) -> int:
        """Sequences per device: the batch over its axes (data, fsdp, expert)."""
        return self.batch // math.prod(self.sizes[a] for a in BATCH_AXES)

    @property
    def local_seq(self) -> int:
        """Positions per device: the sequence over ``context`` (all of it without one)."""
        return self.seq // self.sizes["context"]

    @property
    def flash(self) -> bool:
        """Whether attention runs flash-style (blockwise, cuDNN, splash, ring attention): no
        score matrix kept, the backward recomputing each block's probabilities."""
        if self.sizes["context"] > 1:  # its own kernels: only the ring is blockwise
            return self.context_method == "ring"
        # "auto" on one block is the reference (`models.attention.choose`); on a GPU cuDNN's
        # flash kernel would keep a little less than that one block's scores.
        return self.attention != "xla" and (self.attention != "auto" or self.seq > BLOCK)

    @property
    def attention_keys(self) -> float:
        """Keys each local query is scored against, in FLOPs terms: ring attention skips the
        fully masked half-blocks of the zigzag layout (step 0 is a whole masked block, each of
        the c - 1 others half of one); all-gather and Ulysses attention score every key; a flash
        kernel on the whole sequence skips the key
        blocks above the diagonal (`sharding._attention.live_fraction`); the reference all keys."""
        c = self.sizes["context"]
        if c > 1 and self.context_method == "ring":
            return self.local_seq * (c + 1) / 2
        if c > 1 or not self.flash:
            return self.seq
        return self.seq * live_fraction(self.seq)

    @property
    def attention_backward(self) -> float:
        """The attention backward's products per forward product: 4 against 2 (dP, dS.K,
        dS.Q, P.dO) with the probabilities kept; flash kernels recompute the scores first (5)."""
        return 2.5 if self.flash else 2.0

    @property
    def expert_share(self) -> float:
        """Per token, how many experts' worth of FFN runs (E x capacity slots per sequence / S;
        1 for a dense model): the multiplier of the expert kernels' matmul FLOPs."""
        cfg = self.cfg
        if not getattr(cfg, "n_experts", None):
            return 1.0
        slots = expert_slots(self.seq, cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        return slots / self.seq


@functools.lru_cache(maxsize=32)
def _abstract(family: Any, cfg: Any) -> Any:
    return abstract_params(lambda: family.Model(cfg, rngs=nnx.Rngs(0)))[1]


def _pipeline_args(pipeline: Any) -> tuple[str, int, int, Any] | None:
    """``(schedule, microbatches, repeats, stage_layers)`` of a `PipelineSpec` or a tuple of
    the first two, three or four."""
    if pipeline is None:
        return None
    if hasattr(pipeline, "schedule"):  # a PipelineSpec
        return (pipeline.schedule, pipeline.microbatches, pipeline.repeats,
                pipeline.stage_layers)  # fmt: skip
    schedule, microbatches, *rest = pipeline
    return schedule, microbatches, rest[0] if rest else 1, rest[1] if len(rest) > 1 else None


@functools.lru_cache(maxsize=1024)
def _balanced(n_layers: int, stages: int, repeats: int) -> tuple[int, ...]:
    return balance_layers(n_layers, stages, repeats=repeats)


@functools.lru_cache(maxsize=8192)
def _placed(family: Any, cfg: Any, strategy: str, sizes: tuple) -> tuple[Param, ...]:
    """The parameters placed by the strategy's rules on a mesh (``sizes``: its items), once per
    (model, strategy, mesh): a search predicts each layout under several remat policies and
    accumulations."""
    rules, axis_map = preset(family.NAME, strategy)
    placements = place(rules, axis_map, _abstract(family, cfg), MeshSpec(**dict(sizes)))
    return tuple(classify(placements.placements, dict(sizes)))


def _uneven(cfg: Any, stage_layers: Any, stages: int, repeats: int) -> tuple[int, ...] | None:
    """The layers of each virtual stage where they differ, None for equal stages. ``"auto"``:
    `sharding.pipeline.balance_layers` (as even as the count allows, the extra layers on the
    last stages); a sequence: checked (`check_stage_layers`)."""
    if stage_layers is None:
        return None
    if stage_layers == "auto":
        counts = _balanced(cfg.n_layers, stages, repeats)
    else:
        counts = check_stage_layers(stage_layers, cfg.n_layers, stages, repeats)
    return None if len(set(counts)) == 1 else counts


def setup(
    family: Any,
    cfg: Any,
    strategy: str,
    mesh_sizes: dict[str, int],
    batch: int,
    seq: int,
    *,
    pipeline: Any = None,
    dtype: str = "float32",
    remat: str = "none",
    context_method: str = "ring",
    attention: str = "auto",
) -> Setup:
    """Validate the arguments and place the parameters; see `predict`."""
    if isinstance(family, str):
        raise CostModelError(
            f"family {family!r}: pass the family module itself (e.g. models.{family}), not its name"
        )
    name = family.NAME
    if name not in LM_FAMILIES:
        raise CostModelError(
            f"the cost model covers the language-model families {LM_FAMILIES}, not {name!r}"
        )
    if isinstance(cfg, str):
        cfg = family.config(cfg)
    if dtype not in DTYPE_BYTES:
        raise CostModelError(f"unknown dtype {dtype!r}; choose one of {list(DTYPE_BYTES)}")
    if remat not in ("none", "dots", "full"):
        raise CostModelError(f"remat {remat!r} is not modelled; choose 'none', 'dots' or 'full'")
    sizes = MeshSpec.of(dict(mesh_sizes)).sizes
    if -1 in sizes.values():
        raise CostModelError(f"mesh sizes {mesh_sizes} have a -1 axis; give every size")
    p, split = sizes["stage"], math.prod(sizes[a] for a in BATCH_AXES)
    c = sizes["context"]
    if c > 1 and seq % (2 * c if context_method in ("ring", "allgather") else c):
        raise CostModelError(
            f"seq {seq} does not split over context={c} for {context_method} attention (it "
            f"needs a multiple of {2 * c if context_method != 'ulysses' else c}); use another "
            f"--seq or context size"
        )
    pipelined = composition(strategy).pipelined
    args = _pipeline_args(pipeline)
    if pipelined != (args is not None) or (pipelined and p < 2) or (p > 1 and not pipelined):
        raise CostModelError(
            f"strategy {strategy!r} with stage={p} and pipeline={args}: pipeline strategies "
            f"({', '.join(sorted(PIPELINE_STRATEGIES))}, any composition with pp) need stage >= "
            f"2 and a pipeline "
            f"(schedule, microbatches, repeats); the others need stage=1 and pipeline=None"
        )
    if batch % split:
        raise CostModelError(
            f"global batch {batch} is not divisible by data x fsdp x expert = {split}; use a "
            f"multiple of {split}"
        )
    if pipelined and getattr(cfg, "n_experts", None) and args[0] not in ("gpipe", "circular"):
        raise CostModelError(
            f"{name} {cfg.name} carries its load-balancing loss through the layer stack beside "
            f"the activations, which only the gpipe and circular schedules pipeline; plan it "
            f"with one of those, or a strategy without 'stage' (dp, fsdp, tp, ep, fsdp_ep, "
            f"ep_tp)"
        )
    preset(name, strategy)  # a strategy the family has no rules for raises here, first
    schedule, layers = None, cfg.n_layers
    uneven = None if args is None else _uneven(cfg, args[3], p, args[2])
    if uneven is not None:  # every stage's chunk as large as the largest
        cfg = dataclasses.replace(cfg, n_layers=p * args[2] * max(uneven))
    if args is not None:  # the very checks compile_train_step makes
        mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
        try:
            schedule = check_pipeline(PipelineSpec(*args[:3]), mesh, cfg.n_layers, batch)
        except LayerCountError as e:
            raise LayerCountError(
                f"{e}; or give the stages uneven layer counts: pipeline=({args[0]!r}, "
                f"{args[1]}, {args[2]}, 'auto') or a PipelineSpec with stage_layers"
            ) from None
    params = list(_placed(family, cfg, strategy, tuple(sizes.items())))
    return Setup(name, cfg, strategy, sizes, batch, seq, DTYPE_BYTES[dtype], params, schedule,
                 remat, context_method, check_kind(attention), uneven, layers)  # fmt: skip


__all__ = ["DTYPE_BYTES", "LM_FAMILIES", "CostModelError", "Setup", "setup"]
