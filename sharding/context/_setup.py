"""What a train step needs for context parallelism on a mesh: the kernels that replace the
model's attention and positions, and the batch reorder, or a typed refusal before compiling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import sharding as jshard

from sharding.context._errors import ContextParallelError
from sharding.context._kernels import AXIS, BALANCED, FACTORIES, METHODS, check_ulysses_heads
from sharding.context._layout import batch_reorder, check_balanced_seq, positions_kernel

# Ring by default: it is the method whose attention memory per device stays flat when the
# context axis grows with the sequence (what splitting a 32k-128k sequence is for), moving the
# same forward bytes as the all-gather ((c-1)/c of K and V) without ever holding all of them;
# the all-gather is the simpler choice at small context, Ulysses where heads divide.
DEFAULT_METHOD = "ring"


def check_method(method: str | None, context: int) -> str:
    """The method to run (the default when None); unknown names and a method asked of a mesh
    without a context axis are refused."""
    if method is not None and method not in METHODS:
        raise ContextParallelError(
            f"context_method={method!r} is not a context-parallel method; choose one of "
            f"{list(METHODS)}"
        )
    if method is not None and context < 2:
        raise ContextParallelError(
            f"context_method={method!r} splits attention over the '{AXIS}' mesh axis, but the "
            f"mesh has {AXIS}={context}; add {AXIS}=N (N >= 2) to the mesh, e.g. "
            f"'data=2,{AXIS}=4', or drop context_method"
        )
    return method or DEFAULT_METHOD


def seam_calls(work: Any, seq: int) -> dict[str, Any]:
    """Which kernels the workload's loss asks for, traced abstractly (nothing runs) on one row:
    ``{"attention": (heads, kv_heads), "positions": True}``, each key only if asked for."""
    seen: dict[str, Any] = {}

    def attention(q, k, v):
        seen["attention"] = (q.shape[2], k.shape[2])
        return q  # the output's shape; values do not matter to an abstract trace

    def positions(seq_len: int):
        seen["positions"] = True
        return jnp.arange(seq_len, dtype=jnp.int32)

    def loss(batch: dict) -> jax.Array:
        with work.kernels(attention=attention, positions=positions):
            return work.loss(work.model(nnx.Rngs(0)), batch)

    jax.eval_shape(loss, work.batch_shapes(1, seq))
    return seen


def context_kernels(
    work: Any,
    mesh: jshard.Mesh,
    method: str | None = None,
    seq: int | None = None,
    schedule: str | None = None,
) -> tuple[dict[str, Callable], Callable[[dict], dict] | None]:
    """``({name: kernel}, batch_order)`` for a `sharding.Workload` on ``mesh`` (``({}, None)``
    without a context axis).

    Raises `ContextParallelError` for a model whose attention cannot be substituted (no
    ``kernels`` hook, or a loss that never asks for the attention kernel: `seam_calls`), a
    workload without a sequence, heads Ulysses cannot split, a reordering method for a model
    whose positions do not come from the ``positions`` kernel, or a sequence the zigzag layout
    cannot cut into 2 x context chunks.

    ``schedule``: the pipeline schedule when the step also pipelines over ``stage`` (None
    otherwise). Its stages are manual over context (`sharding.pipeline`), so every layer sees
    its own slice of the sequence: the positions must come from the ``positions`` kernel
    whatever the method, and ring attention runs only under gpipe and circular, whose stages all
    compute at every tick (see `check_pipelined`).
    """
    c = dict(mesh.shape).get(AXIS, 1)
    method = check_method(method, c)
    if c < 2:
        return {}, None
    name = getattr(work, "name", "the model")
    if getattr(work, "kernels", None) is None:
        raise ContextParallelError(
            f"this model's attention cannot be split over context: workload {name!r} has no "
            f"kernels hook (Workload(kernels=models.kernels.use) for a model whose attention "
            f"calls models.kernels.resolve, as models.layers.SelfAttention does); run it on a "
            f"mesh with {AXIS}=1"
        )
    if not seq:
        raise ContextParallelError(
            f"workload {name!r} has no sequence (seq={seq!r}) to split over {AXIS}={c}; give "
            f"seq=, or run on a mesh with {AXIS}=1"
        )
    seam = seam_calls(work, seq)
    if "attention" not in seam:
        raise ContextParallelError(
            f"this model's attention cannot be split over context: workload {name!r} has a "
            f"kernels hook, but its loss never asked for the attention kernel (its attention "
            f"must call models.kernels.resolve('attention', default), as "
            f"models.layers.SelfAttention does); run it on a mesh with {AXIS}=1"
        )
    core = getattr(work, "attention_core", None)
    if core is None:
        raise ContextParallelError(
            f"context parallelism runs the model's own online softmax on the blocks each "
            f"device holds, and workload {name!r} gives none; pass "
            f"attention_core=models.attention.ONLINE_SOFTMAX in its Workload (as "
            f"Workload.from_family does for the shipped models), or run it on a mesh with "
            f"{AXIS}=1"
        )
    if method == "ulysses":
        check_ulysses_heads(*seam["attention"], c, dict(mesh.shape).get("tensor", 1))
    check_pipelined(name, method, schedule, seam)
    if method in BALANCED and "positions" not in seam:
        raise ContextParallelError(
            f"context_method={method!r} reorders the sequence (zigzag load balancing), and "
            f"workload {name!r} takes its positions elsewhere than the positions kernel, so "
            f"they would be wrong; make the model call models.kernels.resolve('positions', "
            f"default) (models.layers.SelfAttention does, for RoPE), or use "
            f"context_method='ulysses', which keeps the written order"
        )
    kernels = {"attention": FACTORIES[method](mesh, core)}
    if method not in BALANCED:
        if seq % c:
            raise ContextParallelError(
                f"seq={seq} does not split over {AXIS}={c}; pick --seq a multiple of {c}"
            )
        if schedule is not None:
            kernels["positions"] = positions_kernel(c, zigzag=False)
        return kernels, None
    check_balanced_seq(seq, c, who=f"context_method={method!r}")
    kernels["positions"] = positions_kernel(c)
    return kernels, batch_reorder(seq, c)


def check_pipelined(name: str, method: str, schedule: str | None, seam: dict) -> None:
    """Refuse what context parallelism inside a pipeline cannot run exactly.

    Ring attention's ``ppermute`` inside 1f1b, interleaved and zb-h1 is taken care of there:
    a stage body that sends makes the schedule's lanes run in lock-step
    (`sharding.pipeline._explicit`), so every stage reaches each collective-permute together.
    """
    if schedule is None:
        return
    if "positions" not in seam:
        raise ContextParallelError(
            f"a pipeline with context parallelism runs each layer on its device's slice of the "
            f"sequence, and workload {name!r} takes its positions elsewhere than the positions "
            f"kernel, so they would be those of the slice; make the model call "
            f"models.kernels.resolve('positions', default) (models.layers.SelfAttention does), "
            f"or use a mesh with stage=1 or {AXIS}=1"
        )
