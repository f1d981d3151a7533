"""Ring attention: key/value blocks passed round the ``context`` ring with ``lax.ppermute``,
each device folding every block into its own queries' online softmax (float32).

Forward: c - 1 shifts of (K, V), each sent on before the block it carries is folded in (so
the transfer can overlap the block's work); no device ever holds more than two blocks, so the memory of
attention per device stays that of S/c queries against S/c keys however long the sequence.
Backward (a `jax.custom_vjp`, FlashAttention-2 style): the blocks go round again with their
gradient accumulators dK, dV (float32) travelling alongside, c - 1 shifts of (K, V, dK, dV)
and one last shift that brings each dK, dV home; probabilities are recomputed from the saved
log-sum-exp, so only q, k, v, the output and the log-sum-exp are kept between the passes
(autodiff through the scan would keep every block's K, V and probabilities: the all-gather's
memory).

Causal, in the zigzag layout (`sharding.context.zigzag_positions`): device i holds chunks i and
2c-1-i. At ring step r it holds device j = i - r's chunks j and 2c-1-j, and exactly half of the
(query, key) pairs are live: for j < i all its queries see chunk j (and none of 2c-1-j), for
j > i only its tail chunk sees both of j's chunks. The fully masked half is skipped (a
`lax.cond` on r <= i picks the live half-block), so every step costs every device the same half
block of work: the load balance the layout exists for. Step 0 (its own block) is the only masked
one: in slot order it is plain causal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _shift(axis: str, c: int, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Every array to the next device on the ring (i -> i + 1)."""
    perm = [(j, (j + 1) % c) for j in range(c)]
    return tuple(lax.ppermute(x, axis, perm) for x in xs)


def _halves(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    half = x.shape[axis] // 2
    return lax.slice_in_dim(x, 0, half, axis=axis), lax.slice_in_dim(x, half, None, axis=axis)


def _fold(core, acc, q, k, v, r, i, causal: bool):
    """Fold the block received at ring step ``r`` into ``acc`` (only its live half if causal)."""
    forward_block = core.forward_block
    if not causal:
        return forward_block(acc, q, k, v)

    def all_queries_head_keys(acc, q, k, v):  # r <= i: the block's head chunk, every query
        return forward_block(acc, q, _halves(k, 1)[0], _halves(v, 1)[0])

    def tail_queries_all_keys(acc, q, k, v):  # r > i: the tail queries, both chunks
        # o [B,K,G,S,H], m and l [B,K,G,S]: the query axis is 3 in all three
        heads, tails = zip(*(_halves(a, 3) for a in acc), strict=True)
        tails = forward_block(tails, _halves(q, 1)[1], k, v)
        return tuple(jnp.concatenate([h, t], axis=3) for h, t in zip(heads, tails, strict=True))

    return lax.cond(r <= i, all_queries_head_keys, tail_queries_all_keys, acc, q, k, v)


def _forward(axis: str, c: int, causal: bool, core, q, k, v):
    qg, i = core.grouped(q, k.shape[2]), lax.axis_index(axis)
    # Each step sends the block it holds on before folding it in: the shift and the block's
    # work are independent, so the transfer can run under the compute.
    nxt = _shift(axis, c, k, v)
    mask = core.causal_mask(q.shape[1], k.shape[1]) if causal else None
    acc = core.forward_block(None, qg, k, v, mask)

    def step(carry, r):
        acc, k, v = carry  # the block of ring step r
        nxt = _shift(axis, c, k, v)
        return (_fold(core, acc, qg, k, v, r, i, causal), *nxt), None

    (acc, k, v), _ = lax.scan(step, (acc, *nxt), jnp.arange(1, c - 1))
    return core.finish(_fold(core, acc, qg, k, v, c - 1, i, causal), q.shape, q.dtype)


def _backward(axis: str, c: int, causal: bool, core, res, d_out):
    q, k, v, out, lse = res
    grouped, backward_block = core.grouped, core.backward_block
    qg, i = grouped(q, k.shape[2]), lax.axis_index(axis)
    s, kh = qg.shape[1], qg.shape[2]
    as_bkgsh = lambda x: jnp.einsum("bskgh->bkgsh", grouped(x, kh).astype(F32))  # noqa: E731
    do, o = as_bkgsh(d_out), as_bkgsh(out)
    delta = jnp.sum(do * o, axis=-1)

    def live(dq, k, v, dk, dv, r):
        """Add block r's gradients: dq here, dk and dv to the accumulators travelling with it."""
        if not causal:
            dq_, dk_, dv_ = backward_block(qg, k, v, do, lse, delta)
            return dq + dq_, dk + dk_, dv + dv_

        def head_keys(dq, k, v, dk, dv):
            dq_, dk_, dv_ = backward_block(qg, _halves(k, 1)[0], _halves(v, 1)[0], do, lse,
                                           delta)  # fmt: skip
            pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)  # noqa: E731
            return dq + dq_, dk + pad(dk_), dv + pad(dv_)

        def tail_queries(dq, k, v, dk, dv):
            tail = lambda x: _halves(x, 3)[1]  # noqa: E731
            dq_, dk_, dv_ = backward_block(_halves(qg, 1)[1], k, v, tail(do), tail(lse),
                                           tail(delta))  # fmt: skip
            return dq + jnp.concatenate([jnp.zeros_like(dq_), dq_], axis=1), dk + dk_, dv + dv_

        return lax.cond(r <= i, head_keys, tail_queries, dq, k, v, dk, dv)

    nxt = _shift(axis, c, k, v)
    dq, dk, dv = backward_block(qg, k, v, do, lse, delta,
                                core.causal_mask(s, k.shape[1]) if causal else None)  # fmt: skip
    dk, dv = _shift(axis, c, dk, dv)  # each accumulator follows its block one step behind

    def step(carry, r):
        dq, k, v, dk, dv = carry  # the block of ring step r and its accumulators
        nxt = _shift(axis, c, k, v)
        dq, dk, dv = live(dq, k, v, dk, dv, r)
        return (dq, *nxt, *_shift(axis, c, dk, dv)), None

    (dq, k, v, dk, dv), _ = lax.scan(step, (dq, *nxt, dk, dv), jnp.arange(1, c - 1))
    dq, dk, dv = live(dq, k, v, dk, dv, c - 1)
    dk, dv = _shift(axis, c, dk, dv)  # home: block j's accumulators end on device j
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def ring_local(axis: str, c: int, causal: bool, core, q, k, v):
    """Ring attention on one device's slice ``[B, S/c, ...]`` (call inside a shard_map), its
    blocks folded by ``core`` (the model's online softmax, `Workload.attention_core`)."""
    return _forward(axis, c, causal, core, q, k, v)[0]


def _ring_fwd(axis, c, causal, core, q, k, v):
    out, lse = _forward(axis, c, causal, core, q, k, v)
    return out, (q, k, v, out, lse)


ring_local.defvjp(_ring_fwd, _backward)
