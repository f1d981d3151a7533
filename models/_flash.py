"""Flash attention in pure JAX: the online softmax one block at a time, and the blockwise
causal kernel built from it (`models.attention.blockwise_attention`, where its contract is).

Grouped-query heads stay grouped (q as ``[B, S, K, G, H]``, G = N / K query heads per
key/value head): K and V are never repeated. Scores, softmax statistics and accumulators are
float32 whatever the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from models._errors import AttentionKernelError

F32 = jnp.float32
NEG = jnp.finfo(F32).min  # a masked score: exp(NEG - m) is 0 for any finite running max m
BLOCK = 512  # query and key block of `blockwise`: 512 x 512 float32 scores per (row, head)
_FAR = np.iinfo(np.int32).max  # the position of a padding slot: sees every key, seen by none


def check_heads(q, k, kind: str) -> None:
    if q.shape[2] % k.shape[2] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise AttentionKernelError(
            f"attention={kind!r}: q {tuple(q.shape)} and k {tuple(k.shape)} are not [B, S, N, H] "
            f"and [B, T, K, H] with N a multiple of K; query heads must be a multiple of "
            f"key/value heads"
        )


# -- the online softmax, one block at a time ----------------------------------------------------


def grouped(q_BSNH: jax.Array, n_kv: int) -> jax.Array:
    """``[B, S, N, H] -> [B, S, K, G, H]``: query head n serves key/value head n // G."""
    b, s, n, h = q_BSNH.shape
    return q_BSNH.reshape(b, s, n_kv, n // n_kv, h)


def scores(q_BSKGH: jax.Array, k_BTKH: jax.Array) -> jax.Array:
    """Scaled float32 scores ``[B, K, G, S, T]``."""
    s = jnp.einsum("bskgh,btkh->bkgst", q_BSKGH, k_BTKH, preferred_element_type=F32)
    return s * (q_BSKGH.shape[-1] ** -0.5)


def forward_block(acc, q_BSKGH, k_BTKH, v_BTKH, mask_ST=None):
    """One online-softmax step: fold keys ``k`` / values ``v`` into the running ``acc``.

    ``acc`` is ``(o [B,K,G,S,H], m [B,K,G,S], l [B,K,G,S])`` (unnormalised output, running max,
    running sum of exponentials, float32), or None to start from this block. A row this block
    masks whole adds nothing (its probabilities are zeroed, not ``exp(0)``).
    """
    s = scores(q_BSKGH, k_BTKH)
    if mask_ST is not None:
        s = jnp.where(mask_ST, s, NEG)
    m_blk = s.max(axis=-1)
    m_new = m_blk if acc is None else jnp.maximum(acc[1], m_blk)
    p = jnp.exp(s - m_new[..., None])
    if mask_ST is not None:
        p = jnp.where(mask_ST, p, 0.0)
    pv = jnp.einsum("bkgst,btkh->bkgsh", p.astype(v_BTKH.dtype), v_BTKH,
                    preferred_element_type=F32)  # fmt: skip
    if acc is None:
        return pv, m_new, p.sum(axis=-1)
    o, m, total = acc
    corr = jnp.exp(m - m_new)
    return o * corr[..., None] + pv, m_new, total * corr + p.sum(axis=-1)


def finish(acc, shape, dtype) -> tuple[jax.Array, jax.Array]:
    """``(out [B, S, N, H], lse [B, K, G, S])`` from a finished accumulator."""
    o, m, total = acc
    out = jnp.einsum("bkgsh->bskgh", o / total[..., None]).reshape(shape).astype(dtype)
    return out, m + jnp.log(total)


def backward_block(q_BSKGH, k_BTKH, v_BTKH, do_BKGSH, lse, delta, mask_ST=None):
    """Gradients ``(dq [B,S,K,G,H], dk [B,T,K,H], dv [B,T,K,H])`` (float32) of one block, the
    probabilities recomputed from the saved log-sum-exp (FlashAttention-2's backward).

    ``delta`` is ``sum(do * out)`` per query row: the softmax Jacobian's row term.
    """
    s = scores(q_BSKGH, k_BTKH)
    p = jnp.exp(s - lse[..., None])
    if mask_ST is not None:
        p = jnp.where(mask_ST, p, 0.0)
    dv = jnp.einsum("bkgst,bkgsh->btkh", p, do_BKGSH)
    dp = jnp.einsum("bkgsh,btkh->bkgst", do_BKGSH, v_BTKH.astype(F32))
    ds = p * (dp - delta[..., None]) * (q_BSKGH.shape[-1] ** -0.5)
    dq = jnp.einsum("bkgst,btkh->bskgh", ds, k_BTKH.astype(F32))
    dk = jnp.einsum("bkgst,bskgh->btkh", ds, q_BSKGH.astype(F32))
    return dq, dk, dv


# -- blockwise (flash) attention in pure JAX ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of one blockwise call: block sizes, padded lengths and the live pairs.

    ``whole``: the pairs every query of which sees every key (no mask); ``pairs``: the rest,
    masked. With ``diagonal`` the masked pairs are the diagonal blocks of a plain causal mask,
    each masked by the same constant lower triangle; otherwise each pair's mask is compared
    from the positions. Masks that depend only on positions would otherwise be computed once
    for every pair and kept whole through the backward (autodiff hoists them out of the
    layer stack's loop as constants): ``[pairs, B, K, G, bq, bk]``, quadratic in the sequence.
    """

    bq: int
    bk: int
    s_pad: int
    t_pad: int
    pairs: tuple[tuple[int, int], ...]  # (query block, key block), each query block's in order
    whole: tuple[tuple[int, int], ...] = ()
    diagonal: bool = False


def _plan(s: int, t: int, block_q: int, block_k: int, causal_offset: int | None) -> _Plan:
    bq, bk = min(block_q, s), min(block_k, t)
    nq, nk = -(-s // bq), -(-t // bk)
    if causal_offset is None:  # positions given at run time: every pair, masked in the block
        pairs = tuple((i, j) for i in range(nq) for j in range(nk))
        return _Plan(bq, bk, nq * bq, nk * bk, pairs)
    # Key block j is live for query block i when its first key <= the block's last query, and
    # whole when its last key <= the block's first query (the last key block's padding slots
    # are never whole: they lie past every query).
    first_q = [i * bq + causal_offset for i in range(nq)]
    last_q = [min((i + 1) * bq, s) - 1 + causal_offset for i in range(nq)]
    live = [(i, j) for i in range(nq) for j in range(nk) if j * bk <= last_q[i]]
    seen_all = [(j + 1) * bk - 1 <= first_q[i] and (j + 1) * bk <= t for i, j in live]
    whole = tuple(ij for ij, w in zip(live, seen_all, strict=True) if w)
    pairs = tuple(ij for ij, w in zip(live, seen_all, strict=True) if not w)
    diagonal = bq == bk and causal_offset == 0 and all(i == j for i, j in pairs)
    return _Plan(bq, bk, nq * bq, nk * bk, pairs, whole, diagonal)


def _pad(x: jax.Array, axis: int, length: int, value=0) -> jax.Array:
    extra = length - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _add_at(x, update, start, axis):
    return lax.dynamic_update_slice_in_dim(x, _slice(x, start, update.shape[axis], axis) + update,
                                           start, axis=axis)  # fmt: skip


def _like(*xs: jax.Array) -> jax.Array:
    """A float32 scalar varying over every manual mesh axis any of ``xs`` varies over (inside a
    `jax.shard_map`), so the scans' accumulators start with the type their updates have."""
    return sum(x.reshape(-1)[0].astype(F32) for x in xs)


def _over_pairs(step, init, plan: _Plan, q_pos, k_pos):
    """``init`` folded through ``step(carry, (qs, ks), mask)`` over the whole pairs (mask
    None), then the masked ones."""
    tril = jnp.tril(jnp.ones((plan.bq, plan.bk), bool))  # one constant for every diagonal pair

    def scan(pairs, mask_of, carry):
        def body(carry, ij):
            qs, ks = ij[0] * plan.bq, ij[1] * plan.bk
            return step(carry, qs, ks, mask_of(qs, ks)), None

        if not pairs:
            return carry
        return lax.scan(body, carry, jnp.asarray(np.asarray(pairs, np.int32).reshape(-1, 2)))[0]

    def by_position(qs, ks):
        return _slice(q_pos, qs, plan.bq, 0)[:, None] >= _slice(k_pos, ks, plan.bk, 0)[None, :]

    carry = scan(plan.whole, lambda qs, ks: None, init)
    return scan(plan.pairs, (lambda qs, ks: tril) if plan.diagonal else by_position, carry)


def _forward(plan: _Plan, q, k, v, q_pos, k_pos):
    """``(out [B, S, N, H], lse [B, K, G, S_pad])``."""
    b, s, n, h = q.shape
    n_kv = k.shape[2]
    qg = grouped(_pad(q, 1, plan.s_pad), n_kv)
    k, v = _pad(k, 1, plan.t_pad), _pad(v, 1, plan.t_pad)
    g = n // n_kv
    like = _like(q, k, v)
    init = (lax.full_like(like, 0, F32, (b, n_kv, g, plan.s_pad, h)),
            lax.full_like(like, NEG, F32, (b, n_kv, g, plan.s_pad)),
            lax.full_like(like, 0, F32, (b, n_kv, g, plan.s_pad)))  # fmt: skip

    def step(acc, qs, ks, mask):
        blk = tuple(_slice(a, qs, plan.bq, 3) for a in acc)
        blk = forward_block(blk, _slice(qg, qs, plan.bq, 1), _slice(k, ks, plan.bk, 1),
                            _slice(v, ks, plan.bk, 1), mask)  # fmt: skip
        return tuple(lax.dynamic_update_slice_in_dim(a, x, qs, axis=3)
                     for a, x in zip(acc, blk, strict=True))  # fmt: skip

    acc = _over_pairs(step, init, plan, q_pos, k_pos)
    out, lse = finish(acc, (b, plan.s_pad, n, h), q.dtype)
    return out[:, :s], lse


def _backward(plan: _Plan, res, d_out):
    q, k, v, q_pos, k_pos, out, lse = res
    s, t, n_kv = q.shape[1], k.shape[1], k.shape[2]
    qg = grouped(_pad(q, 1, plan.s_pad), n_kv)
    kp, vp = _pad(k, 1, plan.t_pad), _pad(v, 1, plan.t_pad)
    as_bkgsh = lambda x: jnp.einsum("bskgh->bkgsh", grouped(_pad(x, 1, plan.s_pad), n_kv)  # noqa: E731
                                    .astype(F32))  # fmt: skip
    do, o = as_bkgsh(d_out), as_bkgsh(out)
    delta = jnp.sum(do * o, axis=-1)
    like = _like(q, k, v, d_out)
    init = tuple(lax.full_like(like, 0, F32, x.shape) for x in (qg, kp, vp))

    def step(grads, qs, ks, mask):
        row = lambda x: _slice(x, qs, plan.bq, 3)  # noqa: E731
        dq, dk, dv = backward_block(_slice(qg, qs, plan.bq, 1), _slice(kp, ks, plan.bk, 1),
                                    _slice(vp, ks, plan.bk, 1), row(do), row(lse), row(delta),
                                    mask)  # fmt: skip
        gq, gk, gv = grads
        return _add_at(gq, dq, qs, 1), _add_at(gk, dk, ks, 1), _add_at(gv, dv, ks, 1)

    dq, dk, dv = _over_pairs(step, init, plan, q_pos, k_pos)
    dq = dq[:, :s].reshape(q.shape).astype(q.dtype)
    return dq, dk[:, :t].astype(k.dtype), dv[:, :t].astype(v.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(plan: _Plan, q, k, v, q_pos, k_pos):
    return _forward(plan, q, k, v, q_pos, k_pos)[0]


def _blockwise_fwd(plan, q, k, v, q_pos, k_pos):
    out, lse = _forward(plan, q, k, v, q_pos, k_pos)
    return out, (q, k, v, q_pos, k_pos, out, lse)


_blockwise.defvjp(_blockwise_fwd, _backward)


def blockwise_attention(
    q_BSNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    *,
    q_positions: jax.Array | None = None,
    k_positions: jax.Array | None = None,
    block_q: int = BLOCK,
    block_k: int = BLOCK,
) -> jax.Array:
    """Flash-style causal attention in pure JAX; memory linear in the sequence.

    Args:
        q_BSNH, k_BTKH, v_BTKH: queries, keys, values (N a multiple of K).
        q_positions, k_positions: ``[S]`` and ``[T]`` integer positions, query i seeing key j
            where ``q_positions[i] >= k_positions[j]`` (context parallelism's reordered
            layouts). Both or neither; without them the mask is plain causal and the key blocks
            above the diagonal are skipped.
        block_q, block_k: block sizes (capped at the sequence lengths).

    Example:
        >>> q = jnp.ones((1, 10, 4, 8)); kv = jnp.ones((1, 10, 2, 8))
        >>> blockwise_attention(q, kv, kv, block_q=4, block_k=4).shape
        (1, 10, 4, 8)
    """
    check_heads(q_BSNH, k_BTKH, "blockwise")
    s, t = q_BSNH.shape[1], k_BTKH.shape[1]
    if (q_positions is None) != (k_positions is None):
        raise AttentionKernelError(
            "blockwise_attention: give both q_positions and k_positions, or neither"
        )
    if min(block_q, block_k) < 1:
        raise AttentionKernelError(f"blockwise_attention: blocks {block_q}x{block_k} must be >= 1")
    if q_positions is None:
        plan = _plan(s, t, block_q, block_k, causal_offset=t - s)
        q_positions = jnp.arange(s, dtype=jnp.int32) + (t - s)
        k_positions = jnp.arange(t, dtype=jnp.int32)
    else:
        plan = _plan(s, t, block_q, block_k, causal_offset=None)
    q_pos = _pad(jnp.asarray(q_positions, jnp.int32), 0, plan.s_pad, _FAR)
    k_pos = _pad(jnp.asarray(k_positions, jnp.int32), 0, plan.t_pad, _FAR)
    return _blockwise(plan, q_BSNH, k_BTKH, v_BTKH, q_pos, k_pos)


def live_fraction(s: int, t: int | None = None, block: int = BLOCK) -> float:
    """The share of the ``S x T`` score blocks that causal `blockwise_attention` computes.

    Example:
        >>> live_fraction(8192, block=512)  # 16 blocks a side: 136 of 256 pairs
        0.53125
    """
    t = s if t is None else t
    plan = _plan(s, t, block, block, causal_offset=t - s)
    return len(plan.pairs + plan.whole) * plan.bq * plan.bk / (s * t) if s and t else 0.0
