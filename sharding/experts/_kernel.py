"""Expert parallelism: the ``experts`` kernel (`models.kernels`) run over the ``expert`` mesh axis.

The batch is split over ``expert`` like data (`sharding.BATCH_AXES`) and each expert's weights
live on one ``expert`` device (the ep strategies map the logical ``"experts"`` axis there). Inside
a `jax.shard_map` that is manual over the batch axes (data, fsdp, expert) and ``tensor`` (only
a ``context`` axis stays automatic), each device:

1. dispatches its own sequences' assignments into ``[G, E, C, D]`` buffers (G its sequences, C
   the capacity per expert per sequence), from the routing the model already decided;
2. all-to-all over ``expert``: the E/ep experts' slices go to the device holding them, which
   receives ``[G, ep, E/ep, C, D]``, its experts' tokens from every device;
3. runs its local experts (SwiGLU), all-to-all back, and combines with the routing weights.

Capacity is counted per sequence (`models.moe`), and a device holds whole sequences, so the drops
are the single-device drops and the numbers are the single-device numbers. Dropless routing
(``capacity=None``) runs with C = S, where nothing can drop: exact, at E/k times the bytes of
``capacity_factor=1``. The backward pass transposes the two all-to-alls into two more.

Why manual over data and fsdp too: left automatic, XLA all-gathers the data-split sequences
before each all-to-all (a partial-manual all-to-all replicates its automatic dims), doubling the
bytes on data=2. Manual, the expert weights enter replicated over data and fsdp (under fsdp_ep
that is the all-gather FSDP does before any use) and their gradients leave summed over them. Over
``tensor`` (ep_tp) each device holds F/t of every local expert's hidden width, as in Megatron's
MLP, and the combined outputs are summed over tensor (one all-reduce of ``[G, S, D]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax import sharding as jshard

from sharding._errors import SpmdkitError
from sharding._manual import manual_axes
from sharding._mesh import BATCH_AXES

AXIS = "expert"
TENSOR = "tensor"
P = jshard.PartitionSpec


class ExpertParallelError(SpmdkitError):
    """The experts, the batch or the mesh cannot be split as expert parallelism needs."""


def expert_parallel(mesh: jshard.Mesh) -> Callable:
    """The ``experts`` kernel for ``mesh``: same signature and numbers as the model's own
    (`models.moe.experts_local`), experts spread over the ``expert`` axis by all-to-all.

    Raises (when traced, so before anything compiles):
        ExpertParallelError: the expert count is not a multiple of the ``expert`` axis, or the
            batch rows do not split over the batch axes.

    Example:
        >>> kernels = {"experts": expert_parallel(make_mesh("expert=4,data=2"))}  # doctest: +SKIP
        >>> compile_train_step(..., kernels=kernels, use_kernels=models.kernels.use)  # doctest: +SKIP
    """
    sizes = dict(mesh.shape)
    ep = sizes.get(AXIS, 1)
    shards = math.prod(sizes.get(a, 1) for a in BATCH_AXES)
    # Manual over everything but a context axis that splits the sequence: the batch axes (see
    # the module docstring), tensor (each expert's hidden width, as Megatron's MLP), and the
    # size-1 axes, which cost nothing and, left automatic, crash XLA:CPU's compiler on a
    # bfloat16 backward (jax 0.10.2).
    manual = set(BATCH_AXES) | {a for a, n in sizes.items() if n == 1 or a == TENSOR}
    tensor = TENSOR if sizes.get(TENSOR, 1) > 1 else None

    def experts(x_BSD, expert_BSK, slot_BSK, weight_BSK, gate_EDF, up_EDF, down_EFD, cap):
        if AXIS in manual_axes():  # a pipeline's stages, manual over expert: this device's
            # tokens and experts already (the step checked the split and the mesh).
            cap = x_BSD.shape[1] if cap is None else cap
            return _dispatch_ffn_combine(x_BSD, expert_BSK, slot_BSK, weight_BSK, gate_EDF,
                                         up_EDF, down_EFD, cap, ep, gate_EDF.shape[0] * ep)  # fmt: skip
        n_experts = gate_EDF.shape[0]
        check_split(n_experts, ep, x_BSD.shape[0], shards)
        cap = x_BSD.shape[1] if cap is None else cap  # dropless: each token once per expert

        def local(x, e, sl, w, gate, up, down):
            y = _dispatch_ffn_combine(x, e, sl, w, gate, up, down, cap, ep, n_experts)
            return y if tensor is None else lax.psum(y, tensor)  # the F shards' partial sums

        batch, cols, rows = P(BATCH_AXES), P(AXIS, None, tensor), P(AXIS, tensor, None)
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(batch, batch, batch, batch, cols, cols, rows),
            out_specs=batch,
            axis_names=manual,
        )(x_BSD, expert_BSK, slot_BSK, weight_BSK, gate_EDF, up_EDF, down_EFD)

    return experts


def expert_kernels(work: Any, mesh: jshard.Mesh) -> dict[str, Callable]:
    """``{"experts": expert_parallel(mesh)}`` when the mesh has ``expert > 1`` and the workload
    has the kernel hook (``work.kernels``); empty otherwise (a model without the hook runs its
    own layer, and XLA places it from the shardings alone)."""
    if dict(mesh.shape).get(AXIS, 1) < 2 or getattr(work, "kernels", None) is None:
        return {}
    return {"experts": expert_parallel(mesh)}


def check_split(n_experts: int, ep: int, batch: int, shards: int) -> None:
    """Refuse an expert count or a batch that the ``expert`` axis does not divide."""
    if n_experts % ep:
        fits = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        raise ExpertParallelError(
            f"expert parallelism: n_experts={n_experts} is not a multiple of the mesh's "
            f"expert={ep}; each expert device holds n_experts/expert experts. Use expert in "
            f"{fits} in --mesh, or a model with a multiple of {ep} experts"
        )
    if batch % shards:
        raise ExpertParallelError(
            f"expert parallelism: batch {batch} does not split into {shards} shards (the batch "
            f"axes {'x'.join(BATCH_AXES)}, expert={ep} among them); use a batch that is a "
            f"multiple of {shards}"
        )


def _dispatch_ffn_combine(x_GSD, e_GSK, slot_GSK, w_GSK, gate, up, down, cap, ep, n_experts):
    """One expert device's part: its sequences in, their expert outputs combined, out."""
    dt = x_GSD.dtype
    onehot = (
        jax.nn.one_hot(e_GSK, n_experts, dtype=dt)[..., None]
        * jax.nn.one_hot(slot_GSK, cap, dtype=dt)[..., None, :]
    )  # [G, S, K, E, C] fmt: skip
    dispatch_GSEC = jnp.sum(onehot, axis=2)
    combine_GSEC = jnp.einsum("gskec,gsk->gsec", onehot, w_GSK.astype(dt))
    x_GECD = jnp.einsum("gsd,gsec->gecd", x_GSD, dispatch_GSEC)
    g, _, c, d = x_GECD.shape
    # [G, ep, E/ep, C, D]: dim 1 = the device holding those experts -> the device they came from.
    x_GPECD = lax.all_to_all(x_GECD.reshape(g, ep, n_experts // ep, c, d), AXIS, 1, 1)
    y_GPECD = _swiglu(x_GPECD, gate.astype(dt), up.astype(dt), down.astype(dt))
    y_GECD = lax.all_to_all(y_GPECD, AXIS, 1, 1).reshape(g, n_experts, c, d)
    return jnp.einsum("gecd,gsec->gsd", y_GECD, combine_GSEC)


def _swiglu(x_ECD, gate_EDF, up_EDF, down_EFD):
    """Each local expert's SwiGLU (`models.moe.expert_ffn`, the same einsums)."""
    g = jnp.einsum("...ecd,edf->...ecf", x_ECD, gate_EDF)
    u = jnp.einsum("...ecd,edf->...ecf", x_ECD, up_EDF)
    return jnp.einsum("...ecf,efd->...ecd", jax.nn.silu(g) * u, down_EFD)
