"""Swappable compute kernels: the seam through which a model's attention (and, for mixtures of
experts, its expert layer) can run distributed without the model knowing.

A model asks for a kernel by name with its own single-device computation as the default::

    attend = kernels.resolve("attention", attention.auto_attention)
    out = attend(q_BSNH, k_BTKH, v_BTKH)

and gets that default unless a caller is tracing it inside ``kernels.use(attention=fn)``. A
training toolkit (spmdkit's step compiler, when the mesh splits the sequence over ``context`` or
the experts over ``expert``) substitutes a distributed version with the same signature and the
same numbers; the model carries no device logic and never learns who did it. Overrides live in a
context variable, so they apply to tracing in this thread only and end with the ``with`` block.

The kernels a model may ask for, and the signature a replacement must keep:

- ``attention(q_BSNH, k_BTKH, v_BTKH) -> out_BSNH``: causal softmax attention with grouped
  query heads (`models.attention`: the backend's flash kernel, a pure-JAX blockwise one, or the
  materialising reference), positions taken from ``positions`` below;
- ``positions(seq_len) -> [S] int32``: the position of each sequence slot, ``arange(S)`` unless
  the caller laid the sequence out in another order (context parallelism balances the causal
  work across devices by reordering the sequence; RoPE and the causal mask then follow these);
- ``experts(x_BSD, expert_BSK, slot_BSK, weight_BSK, gate_EDF, up_EDF, down_EFD, capacity) ->
  y_BSD``: a mixture-of-experts layer after its routing (`models.moe`): each token's k experts,
  its slot in each expert's per-sequence queue and its renormalised weights; the assignments
  with ``slot >= capacity`` (a Python int) are dropped, ``capacity=None`` drops none. Returns
  the weighted sum of the kept assignments' SwiGLU expert outputs (default:
  `models.moe.experts_local`; spmdkit's expert-parallel one sends the tokens to their experts'
  devices by all-to-all).

A user model opts in by calling `resolve` the same way; `Workload(kernels=models.kernels.use)`
tells spmdkit it may substitute.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable, Iterator, Mapping

import jax.numpy as jnp

from models._errors import ModelConfigError

KERNELS = ("attention", "positions", "experts")

_OVERRIDES: contextvars.ContextVar[Mapping[str, Callable]] = contextvars.ContextVar(
    "models_kernels", default=types.MappingProxyType({})
)


@contextlib.contextmanager
def use(**overrides: Callable) -> Iterator[None]:
    """Run the ``with`` block with the named kernels replaced (nested blocks stack).

    Example:
        >>> import jax.numpy as jnp
        >>> with use(positions=lambda s: jnp.arange(s)[::-1]):
        ...     resolve("positions", default_positions)(3).tolist()
        [2, 1, 0]
        >>> resolve("positions", default_positions)(3).tolist()
        [0, 1, 2]
    """
    unknown = sorted(set(overrides) - set(KERNELS))
    if unknown:
        raise ModelConfigError(
            f"models.kernels.use: unknown kernel(s) {unknown}; the kernels are {list(KERNELS)}"
        )
    bad = [name for name, fn in overrides.items() if not callable(fn)]
    if bad:
        raise ModelConfigError(
            f"models.kernels.use: {bad[0]}={overrides[bad[0]]!r} is not a function; give a "
            f"callable with the default kernel's signature"
        )
    token = _OVERRIDES.set({**_OVERRIDES.get(), **overrides})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def resolve(name: str, default: Callable) -> Callable:
    """The kernel in use for ``name``: the innermost `use` override, else ``default``."""
    if name not in KERNELS:
        raise ModelConfigError(f"unknown kernel {name!r}; the kernels are {list(KERNELS)}")
    return _OVERRIDES.get().get(name, default)


def default_positions(seq_len: int) -> jnp.ndarray:
    """``arange(seq_len)``: the sequence in its written order."""
    return jnp.arange(seq_len, dtype=jnp.int32)


__all__ = ["KERNELS", "default_positions", "resolve", "use"]
