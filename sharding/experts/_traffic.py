"""Expert parallelism's bytes per device per step, in closed form.

Per MoE layer the forward pass sends each device's ``[G, E, C, D]`` dispatch buffer to the expert
devices and the outputs back (two all-to-alls over ``expert``); the backward pass sends their
cotangents the same two ways. G is the sequences a device holds, C the slots per expert per
sequence (`models.moe.capacity`; S when dropless). Counted as `sharding.inspection` counts an
all-to-all: the operand one device feeds in (``(ep - 1) / ep`` of it leaves the device).
"""

from __future__ import annotations

import math

from sharding.experts._kernel import ExpertParallelError

ALL_TO_ALLS_PER_LAYER = 4  # forward dispatch + combine, and their two transposes in backward


def expert_slots(seq_len: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert per sequence: ``ceil(k * S / E * capacity_factor)`` in [1, S]; S when
    dropless (``capacity_factor=None``). The same rule as `models.moe.capacity`."""
    if capacity_factor is None:
        return seq_len
    return max(1, min(seq_len, math.ceil(top_k * seq_len / n_experts * capacity_factor)))


def ep_all_to_all_bytes(
    tokens: int,
    d_model: int,
    n_experts: int,
    top_k: int,
    capacity_factor: float | None,
    expert: int,
    dtype_bytes: int,
    layers: int,
    *,
    seq_len: int,
    batch_shards: int | None = None,
) -> int:
    """All-to-all bytes per device per training step of expert parallelism (no remat).

    Args:
        tokens: tokens in the global batch (batch x seq_len).
        d_model, n_experts, top_k, capacity_factor: the MoE layer (None: dropless).
        expert: the ``expert`` mesh axis size.
        dtype_bytes: bytes per activation element (4 float32, 2 bfloat16).
        layers: MoE layers.
        seq_len: tokens per sequence (capacity is counted per sequence).
        batch_shards: devices the batch is split over (data x fsdp x expert); default expert.

    Example:
        >>> ep_all_to_all_bytes(8 * 32, 64, 4, 2, 1.25, 4, 4, 2, seq_len=32, batch_shards=8)
        163840
    """
    shards = expert if batch_shards is None else batch_shards
    if expert < 2:
        return 0
    if n_experts % expert:
        raise ExpertParallelError(
            f"n_experts={n_experts} is not a multiple of expert={expert}; use an expert axis "
            f"that divides the experts"
        )
    sequences = tokens // seq_len
    if sequences % shards:
        raise ExpertParallelError(
            f"{sequences} sequences do not split over {shards} batch shards; use a batch that is "
            f"a multiple of {shards}"
        )
    per_device = sequences // shards * n_experts
    slots = expert_slots(seq_len, n_experts, top_k, capacity_factor)
    return ALL_TO_ALLS_PER_LAYER * layers * per_device * slots * d_model * dtype_bytes


__all__ = ["ALL_TO_ALLS_PER_LAYER", "ep_all_to_all_bytes", "expert_slots"]
