"""Mixture-of-experts feed-forward layer: top-k routing, capacity, load-balancing loss, and the
``experts`` kernel through which spmdkit runs the experts expert-parallel.

One layer (`MoE`) holds a router ``router/kernel [D, E]`` and E SwiGLU experts stacked on a
leading expert axis: ``gate, up [E, D, F]`` and ``down [E, F, D]``. A token goes to its top-k
experts (softmax over the E router logits, the k largest kept and renormalised to sum to one, as
Mixtral) and its output is the weighted sum of those experts' outputs.

Capacity (GShard, Switch): each expert takes at most ``capacity`` tokens per *sequence*, with
``capacity = ceil(k * S / E * capacity_factor)`` (at most S). A sequence's assignments queue
choice-major: every token's first choice before any second choice, in sequence order within a
choice, and those past an expert's capacity are dropped (their weight is lost; the residual
connection around the layer carries the token on). Grouping by sequence, as MaxText's dropping
path does, makes the drops a function of the sequence alone: however the batch is split over
devices, the same tokens drop, so expert parallelism computes exactly the single-device numbers
with or without drops. ``capacity_factor=None`` is dropless: every assignment is computed, on one
device with `jax.lax.ragged_dot` over the assignments sorted by expert.

Load balancing (Switch Transformer): ``aux = E * sum_e f_e * p_e`` with ``f_e`` the fraction of
the B*S*k assignments routed to expert e (before capacity) and ``p_e`` the mean router
probability of e over the tokens; 1.0 when routing is uniform, E when every token picks one
expert. Gradients reach the router through ``p_e`` only.

The ``experts`` kernel (`models.kernels`) is everything after the routing decision:
``experts(x_BSD, expert_BSK, slot_BSK, weight_BSK, gate_EDF, up_EDF, down_EFD, capacity) ->
y_BSD`` (``capacity`` a Python int, or None for dropless). The default is `experts_local`; a
replacement must return the same numbers (spmdkit's expert-parallel kernel dispatches the same
``[B, E, C, D]`` buffers over the ``expert`` mesh axis with two all-to-alls).

Example:
    >>> layer = MoE(16, 32, n_experts=4, top_k=2, capacity_factor=2.0, std=0.02, out_std=0.02,
    ...             rngs=nnx.Rngs(0))
    >>> y, aux = layer(jnp.ones((2, 8, 16)))
    >>> y.shape, aux.shape
    ((2, 8, 16), ())
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import kernels
from models._errors import ModelConfigError
from models.layers import Dense, normal

__all__ = [
    "MoE",
    "Routing",
    "aux_loss",
    "capacity",
    "check_moe",
    "dispatch_masks",
    "expert_ffn",
    "experts_dropless",
    "experts_local",
    "route",
    "routing_stats",
]


def check_moe(who: str, n_experts: int, top_k: int, capacity_factor: float | None) -> None:
    """Raise `ModelConfigError` for a routing the layer cannot do (``who`` names the model)."""
    if not (isinstance(n_experts, int) and n_experts >= 1):
        raise ModelConfigError(f"{who}: n_experts={n_experts!r}; use a whole number >= 1")
    if not (isinstance(top_k, int) and 1 <= top_k <= n_experts):
        raise ModelConfigError(
            f"{who}: top_k={top_k!r} with n_experts={n_experts}; each token picks top_k distinct "
            f"experts, so use 1 <= top_k <= {n_experts} (or more experts)"
        )
    if capacity_factor is not None and not (
        isinstance(capacity_factor, int | float) and math.isfinite(capacity_factor)
        and capacity_factor > 0
    ):  # fmt: skip
        raise ModelConfigError(
            f"{who}: capacity_factor={capacity_factor!r}; use a number > 0 (1.25 is common), or "
            f"None for dropless routing"
        )


def capacity(seq_len: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Slots per expert per sequence: ``ceil(k * S / E * capacity_factor)``, at most S (an expert
    gets a token at most once), at least 1; None for dropless (``capacity_factor=None``).

    Example:
        >>> capacity(32, 4, 2, 1.25), capacity(32, 4, 2, 100.0), capacity(32, 4, 2, None)
        (20, 32, None)
    """
    if capacity_factor is None:
        return None
    return max(1, min(seq_len, math.ceil(top_k * seq_len / n_experts * capacity_factor)))


class Routing(NamedTuple):
    """A routing decision for a batch ``[B, S]``: expert, queue slot and weight of each of the k
    assignments per token, and the router probabilities (for the auxiliary loss)."""

    expert_BSK: jax.Array  # int32 expert of each assignment, choice-major per token
    slot_BSK: jax.Array  # int32 position in that expert's queue for this sequence
    weight_BSK: jax.Array  # float32, renormalised over the k choices
    probs_BSE: jax.Array  # float32 softmax over the experts


def route(logits_BSE: jax.Array, top_k: int) -> Routing:
    """Top-k routing of router logits: softmax, the k largest, renormalised; queue slots assigned
    choice-major within each sequence (every first choice before any second choice)."""
    probs_BSE = jax.nn.softmax(logits_BSE.astype(jnp.float32), axis=-1)
    top_BSK, expert_BSK = _top_k(probs_BSE, top_k)
    weight_BSK = top_BSK / jnp.sum(top_BSK, axis=-1, keepdims=True)
    b, s, k = expert_BSK.shape
    n_experts = logits_BSE.shape[-1]
    # [B, K*S, E]: assignment a = choice * S + position; its slot is how many earlier
    # assignments of the same sequence went to the same expert.
    onehot = jax.nn.one_hot(jnp.swapaxes(expert_BSK, 1, 2).reshape(b, k * s), n_experts,
                            dtype=jnp.int32)  # fmt: skip
    slot = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
    slot_BSK = jnp.swapaxes(slot.reshape(b, k, s), 1, 2)
    return Routing(expert_BSK.astype(jnp.int32), slot_BSK.astype(jnp.int32), weight_BSK, probs_BSE)


def _top_k(probs_BSE: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the experts as k argmax rounds (ties to the lower index, as top_k):
    an argmax splits over any batch sharding, where XLA's TopK gathers the whole batch first."""
    values, indices, left = [], [], probs_BSE
    for _ in range(k):
        i = jnp.argmax(left, axis=-1)
        values.append(jnp.take_along_axis(probs_BSE, i[..., None], axis=-1)[..., 0])
        indices.append(i)
        left = jnp.where(jax.nn.one_hot(i, left.shape[-1], dtype=bool), -jnp.inf, left)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def aux_loss(routing: Routing) -> jax.Array:
    """Switch's load-balancing loss ``E * sum_e f_e * p_e`` (1.0 for uniform routing)."""
    n_experts = routing.probs_BSE.shape[-1]
    counts_E = jnp.sum(jax.nn.one_hot(routing.expert_BSK, n_experts, dtype=jnp.float32),
                       axis=(0, 1, 2))  # fmt: skip
    f_E = counts_E / routing.expert_BSK.size
    p_E = jnp.mean(routing.probs_BSE, axis=(0, 1))
    return n_experts * jnp.sum(f_E * p_E)


def dispatch_masks(
    expert_BSK: jax.Array, slot_BSK: jax.Array, weight_BSK: jax.Array, n_experts: int, cap: int,
    dtype: jnp.dtype,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(dispatch, combine) ``[B, S, E, C]``: 1 where an assignment sits in an expert's slot (none
    for a slot past the capacity: `one_hot` of it is all zeros), and the same with its weight."""
    onehot_BSKEC = (jax.nn.one_hot(expert_BSK, n_experts, dtype=dtype)[..., None]
                    * jax.nn.one_hot(slot_BSK, cap, dtype=dtype)[..., None, :])  # fmt: skip
    dispatch = jnp.sum(onehot_BSKEC, axis=2)
    combine = jnp.einsum("bskec,bsk->bsec", onehot_BSKEC, weight_BSK.astype(dtype))
    return dispatch, combine


def expert_ffn(x_ECD: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array, down_EFD: jax.Array):
    """Each expert's SwiGLU on its own tokens: ``x_...ECD`` (any leading dims) -> same shape."""
    dt = x_ECD.dtype
    g = jnp.einsum("...ecd,edf->...ecf", x_ECD, gate_EDF.astype(dt))
    u = jnp.einsum("...ecd,edf->...ecf", x_ECD, up_EDF.astype(dt))
    return jnp.einsum("...ecf,efd->...ecd", jax.nn.silu(g) * u, down_EFD.astype(dt))


def experts_local(x_BSD, expert_BSK, slot_BSK, weight_BSK, gate_EDF, up_EDF, down_EFD, cap):
    """The default ``experts`` kernel, all experts on this device: tokens dispatched to
    ``[B, E, C, D]`` buffers (the assignments past ``cap`` slots dropped), each expert's FFN,
    outputs combined with the routing weights. ``cap=None``: `experts_dropless`."""
    if cap is None:
        return experts_dropless(x_BSD, expert_BSK, slot_BSK, weight_BSK, gate_EDF, up_EDF,
                                down_EFD, cap)  # fmt: skip
    dispatch, combine = dispatch_masks(expert_BSK, slot_BSK, weight_BSK, gate_EDF.shape[0], cap,
                                       x_BSD.dtype)  # fmt: skip
    x_BECD = jnp.einsum("bsd,bsec->becd", x_BSD, dispatch)
    return jnp.einsum("becd,bsec->bsd", expert_ffn(x_BECD, gate_EDF, up_EDF, down_EFD), combine)


def experts_dropless(x_BSD, expert_BSK, slot_BSK, weight_BSK, gate_EDF, up_EDF, down_EFD, cap):
    """Every assignment computed (no capacity): the B*S*k assignments sorted by expert, each
    expert's rows multiplied by its weights with `jax.lax.ragged_dot` (group sizes = tokens per
    expert), unsorted and combined. The sort spans the whole batch, so this suits a batch that
    is whole on each device (one device, or tensor parallelism); ``slot_BSK``, ``cap`` unused."""
    del slot_BSK, cap
    b, s, d = x_BSD.shape
    k, n_experts, dt = expert_BSK.shape[-1], gate_EDF.shape[0], x_BSD.dtype
    flat_expert = expert_BSK.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    rows_ND = x_BSD.reshape(b * s, d)[order // k]
    sizes_E = jnp.bincount(flat_expert, length=n_experts).astype(jnp.int32)
    g = jax.lax.ragged_dot(rows_ND, gate_EDF.astype(dt), sizes_E)
    u = jax.lax.ragged_dot(rows_ND, up_EDF.astype(dt), sizes_E)
    out_ND = jax.lax.ragged_dot(jax.nn.silu(g) * u, down_EFD.astype(dt), sizes_E)
    out_ND = jnp.zeros_like(out_ND).at[order].set(out_ND)  # back to assignment order
    out_BSKD = out_ND.reshape(b, s, k, d)
    return jnp.einsum("bskd,bsk->bsd", out_BSKD, weight_BSK.astype(dt))


class MoE(nnx.Module):
    """Top-k mixture of SwiGLU experts: ``x [B, S, D] -> (y [B, S, D], aux loss scalar)``.

    Parameters: ``router/kernel [D, E]``, ``gate [E, D, F]``, ``up [E, D, F]``,
    ``down [E, F, D]``. The experts run through the ``experts`` kernel seam.
    """

    def __init__(self, d_model: int, d_ff: int, *, n_experts: int, top_k: int,
                 capacity_factor: float | None, std: float, out_std: float, rngs: nnx.Rngs):  # fmt: skip
        check_moe("MoE", n_experts, top_k, capacity_factor)
        # The expert count, kept apart from the weights' shapes: a kernel may hand the layer a
        # device's own experts (E / expert of them) inside an expert-parallel region.
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = Dense((d_model,), (n_experts,), std=std, rngs=rngs)
        self.gate = nnx.Param(normal(rngs.params(), (n_experts, d_model, d_ff), std))
        self.up = nnx.Param(normal(rngs.params(), (n_experts, d_model, d_ff), std))
        self.down = nnx.Param(normal(rngs.params(), (n_experts, d_ff, d_model), out_std))

    def routing(self, x_BSD: jax.Array) -> Routing:
        """The routing decision for ``x`` (router logits in float32)."""
        return route(self.router(x_BSD.astype(jnp.float32)), self.top_k)

    def capacity(self, seq_len: int) -> int | None:
        return capacity(seq_len, self.n_experts, self.top_k, self.capacity_factor)

    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
        r = self.routing(x_BSD)
        run = kernels.resolve("experts", experts_local)
        y_BSD = run(x_BSD, r.expert_BSK, r.slot_BSK, r.weight_BSK, self.gate[...], self.up[...],
                    self.down[...], self.capacity(x_BSD.shape[1]))  # fmt: skip
        return y_BSD, aux_loss(r)


def routing_stats(expert_BSK, slot_BSK, n_experts: int, cap: int | None) -> dict:
    """Where the tokens went, on the host: assignments per expert (before capacity), those kept
    per expert, and the dropped fraction of all assignments (0.0 when dropless).

    Example:
        >>> r = route(jnp.array([[[2.0, 1.0, 0.0], [2.0, 0.0, 1.0]]]), 1)
        >>> routing_stats(r.expert_BSK, r.slot_BSK, 3, 1)
        {'tokens_per_expert': [2, 0, 0], 'kept_per_expert': [1, 0, 0], 'dropped_fraction': 0.5}
    """
    expert, slot = np.asarray(expert_BSK).reshape(-1), np.asarray(slot_BSK).reshape(-1)
    kept = np.ones_like(expert, bool) if cap is None else slot < cap
    per_expert = np.bincount(expert, minlength=n_experts)
    return {
        "tokens_per_expert": per_expert.tolist(),
        "kept_per_expert": np.bincount(expert[kept], minlength=n_experts).tolist(),
        "dropped_fraction": float(1.0 - kept.mean()) if expert.size else 0.0,
    }
