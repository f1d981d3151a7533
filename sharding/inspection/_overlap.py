"""XLA's GPU options for overlapping collectives with compute, given to every compile on a GPU.

The step-time model (`sharding.costmodel.step_time`) hides a collective behind the compute that
does not depend on it. On a GPU XLA does that only with its latency-hiding scheduler, and hides
the fsdp gathers and gradient reduce-scatters of a layer stack behind the neighbouring layers'
compute only when it pipelines them out of the loop: the options MaxText and JAX's GPU
performance guide set. spmdkit passes them to each compile (``compiler_options``, so nothing
depends on when the backend started), on GPU only, and leaves out any the user set in
``XLA_FLAGS``: their own value wins.
"""

from __future__ import annotations

import os
import re

GPU_OVERLAP_OPTIONS: dict[str, bool] = {
    # Schedule collectives asynchronously, as early as their operands allow, overlapping the
    # compute that does not depend on them.
    "xla_gpu_enable_latency_hiding_scheduler": True,
    # Move a layer loop's fsdp gathers one iteration ahead and its gradient reductions one
    # behind, so each overlaps the next (previous) layer's compute.
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    # Unroll loops by two so that the pipelined collectives have a whole iteration to hide in.
    "xla_gpu_enable_while_loop_double_buffering": True,
}


def overlap_options(platform: str, xla_flags: str | None = None) -> dict[str, bool]:
    """The options `GPU_OVERLAP_OPTIONS` adds to a compile on ``platform`` ("gpu" or "cuda":
    all of them but those ``xla_flags`` (default: the environment's ``XLA_FLAGS``) sets; any
    other platform: none).

    Example:
        >>> sorted(overlap_options("gpu", "--xla_gpu_enable_pipelined_all_reduce=false"))[:2]
        ['xla_gpu_enable_latency_hiding_scheduler', 'xla_gpu_enable_pipelined_all_gather']
        >>> overlap_options("cpu")
        {}
    """
    if platform not in ("gpu", "cuda", "rocm"):
        return {}
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    user = set(re.findall(r"--(\w+)", flags))
    return {k: v for k, v in GPU_OVERLAP_OPTIONS.items() if k not in user}


def overlap_text(platform: str) -> str:
    """One line naming the overlap options a compile on ``platform`` gets (for summaries)."""
    given = overlap_options(platform)
    if not given:
        return f"XLA overlap options: none ({platform} compiles as XLA's defaults)"
    return "XLA overlap options: " + " ".join(f"--{k}=true" for k in given)


__all__ = ["GPU_OVERLAP_OPTIONS", "overlap_options", "overlap_text"]
