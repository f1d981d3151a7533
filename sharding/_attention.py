"""The attention kernel a step asks of its model, by name (``build_program(..., attention=)``,
``--attention``): which names exist, which this host can run, and the kernel itself, taken from
the workload (``Workload.attention``, `models.attention.kernel` for the shipped families).

The kernels are the model's (`models.attention`); the library knows only their names, where each
runs, and what the closed form needs of the blockwise kernel (its block, the share of causal
blocks it computes).
"""

from __future__ import annotations

from typing import Any

import jax

from sharding._errors import SpmdkitError

KINDS = ("auto", "blockwise", "xla", "cudnn", "splash")
BLOCK = 512  # the blockwise kernel's query and key block (models.attention.BLOCK)
_NEEDS = {"cudnn": "gpu", "splash": "tpu"}


class AttentionChoiceError(SpmdkitError):
    """An attention kernel that is not one, cannot run here, or cannot be substituted."""


def check_kind(kind: str) -> str:
    """``kind`` if it names a kernel, else an `AttentionChoiceError` listing them."""
    if kind not in KINDS:
        raise AttentionChoiceError(
            f"attention={kind!r} is not a kernel; choose one of {list(KINDS)}"
        )
    return kind


def runs_here(kind: str, platform: str | None = None) -> bool:
    """Whether programs for ``platform`` (default: this host's backend; a compile-only
    target's, "gpu" or "tpu") can hold the kernel ``kind`` ("auto" always can)."""
    check_kind(kind)
    platform = platform or jax.default_backend()
    return _NEEDS.get(kind, platform) == platform


def check_runs_here(kind: str, platform: str | None = None) -> str:
    """Refuse, before anything compiles, a kernel the programs' platform cannot run (default:
    this host's backend; the target's where its compiler compiles them)."""
    platform = platform or jax.default_backend()
    if not runs_here(kind, platform):
        raise AttentionChoiceError(
            f"attention={kind!r} runs on a {_NEEDS[kind].upper()} and the programs are compiled "
            f"for {platform!r}; use --attention blockwise (any backend) or auto, or install "
            f"the target's compiler (pip install 'spmdkit[{_NEEDS[kind]}]') to compile for it"
        )
    return kind


def live_fraction(s: int, block: int = BLOCK) -> float:
    """The share of the ``S x S`` score blocks causal blockwise attention computes: with n
    blocks a side, the n(n+1)/2 on or below the diagonal (the last one ragged).

    Example:
        >>> live_fraction(8192)  # 16 blocks a side: 136 of 256 pairs
        0.53125
    """
    b = min(block, s)
    n = -(-s // b)
    return n * (n + 1) / 2 * b * b / (s * s) if s else 0.0


def attention_kernels(
    work: Any,
    kind: str | None,
    seq: int | None,
    context: int,
    seam: dict[str, Any],
    platform: str | None = None,
) -> dict[str, Any]:
    """``{"attention": kernel}`` substituting the model's attention with the ``kind`` asked for
    (``{}`` for None or "auto": the model's own default).

    ``seam`` is `sharding.context.seam_calls` of the workload (what its loss asks for). Refused
    before compiling: a kernel this host cannot run, context parallelism (its methods run their
    own attention), a model that offers no kernels by name or never asks for attention.
    """
    if kind is None or check_kind(kind) == "auto":
        return {}
    check_runs_here(kind, platform)
    name = getattr(work, "name", "the model")
    if context > 1:
        raise AttentionChoiceError(
            f"attention={kind!r} on a mesh with context={context}: context parallelism runs its "
            f"own attention over the split sequence (--context-method); use attention='auto' "
            f"there, or a mesh with context=1"
        )
    if work.attention is None or work.kernels is None or "attention" not in seam:
        raise AttentionChoiceError(
            f"attention={kind!r}: workload {name!r} offers no attention kernels by name; its "
            f"attention must call models.kernels.resolve('attention', default) and the Workload "
            f"pass kernels=models.kernels.use and attention=models.attention.kernel (as the "
            f"shipped models do), or leave attention unset"
        )
    return {"attention": work.attention(kind)}


__all__ = [
    "BLOCK",
    "KINDS",
    "AttentionChoiceError",
    "attention_kernels",
    "check_kind",
    "check_runs_here",
    "live_fraction",
    "runs_here",
]
