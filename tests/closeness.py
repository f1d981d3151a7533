"""How close two float32 computations of the same quantity must be, derived from their magnitude.

Two programs that compute the same loss or gradient in float32 differ only in the order they
sum: a sharded matmul adds its partial sums in another order, an all-reduce adds the devices'
contributions in ring order, a pipeline adds micro-batches in tick order. Reordering a sum of
``n`` terms ``x_i`` moves the result by at most ``(n - 1) * eps * sum |x_i|`` and in practice by
about ``sqrt(n) * eps * max |x_i|`` (eps = 2**-23, float32's unit roundoff times 2). A gradient
element that is small because its terms cancel keeps the error of the terms, not of itself: the
yardstick for every element of an array is the array's own largest magnitude, never 1e-6 on its
own.

`assert_close` allows ``RTOL = 2**7 eps`` (1.5e-5, the error of summing ~16k terms of equal size
in a random order) relative to each element, plus the same relative to the largest magnitude of
its array for elements whose terms cancelled. A whole array can cancel to zero in exact
arithmetic (the gradient of a key bias: softmax ignores a constant added to every score) and
hold only reordering noise: an array whose largest magnitude is below ``RTOL`` times the largest
of the whole tree compared (its sibling gradients, made of the same cotangents) is checked
against that tree's magnitude, i.e. as zero. The suite's reductions are over at most a few
thousand terms (batch x sequence x width), so a real error (a missing micro-batch, a wrong
shard, a dropped term) is orders of magnitude larger: a micro-batch of 4 missing moves a gradient
by ~25%.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

EPS = float(np.finfo(np.float32).eps)
RTOL = 2**7 * EPS


def assert_close(got: Any, want: Any, *, rtol: float = RTOL, err_msg: str = "") -> None:
    """Every leaf of ``got`` equals the same leaf of ``want`` (in flattening order; the trees
    may differ in kind, a dict against a list) up to float32 reordering: per element
    ``|got - want| <= rtol * (|want| + scale)``, ``scale`` the leaf's largest magnitude, or the
    tree's where the leaf is reordering noise itself (see the module doc)."""
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(got)]
    got_leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(got)]
    want_leaves = [np.asarray(w, np.float64) for w in jax.tree.leaves(want)]
    assert len(got_leaves) == len(want_leaves), f"{len(got_leaves)} leaves != {len(want_leaves)}"
    tree = max((float(np.max(np.abs(w))) for w in want_leaves if w.size), default=0.0)
    for path, g, w in zip(paths, got_leaves, want_leaves, strict=True):
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        if scale < rtol * tree:
            scale = tree
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale,
                                   err_msg=f"{err_msg} {path}".strip())  # fmt: skip


__all__ = ["EPS", "RTOL", "assert_close"]
