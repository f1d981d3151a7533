"""Attention on one device's blocks: masked softmax attention, and the online (flash-style)
softmax's forward and backward block steps that ring attention chains round the context ring.

Grouped-query heads are kept grouped (q as ``[B, S, K, G, H]`` with G = N / K query heads per
key/value head) instead of repeating K and V G times: the blocks a ring passes round and the
gradients it accumulates stay K heads wide. Scores, softmax statistics and accumulators are
float32 whatever the compute dtype, as in `models.layers.causal_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
NEG = jnp.finfo(F32).min  # a masked score: exp(NEG - m) is 0 for any finite running max m


def grouped(q_BSNH: jax.Array, n_kv: int) -> jax.Array:
    """``[B, S, N, H] -> [B, S, K, G, H]``: query head n serves key/value head n // G."""
    b, s, n, h = q_BSNH.shape
    return q_BSNH.reshape(b, s, n_kv, n // n_kv, h)


def scores(q_BSKGH: jax.Array, k_BTKH: jax.Array) -> jax.Array:
    """Scaled float32 scores ``[B, K, G, S, T]``."""
    s = jnp.einsum("bskgh,btkh->bkgst", q_BSKGH, k_BTKH, preferred_element_type=F32)
    return s * (q_BSKGH.shape[-1] ** -0.5)


def masked_attention(q_BSNH, k_BTKH, v_BTKH, mask_ST: jax.Array | None) -> jax.Array:
    """Softmax attention of every query against every key where ``mask_ST`` holds."""
    q = grouped(q_BSNH, k_BTKH.shape[2])
    s = scores(q, k_BTKH)
    if mask_ST is not None:
        s = jnp.where(mask_ST, s, NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v_BTKH.dtype)
    out = jnp.einsum("bkgst,btkh->bskgh", p, v_BTKH)
    return out.reshape(q_BSNH.shape).astype(q_BSNH.dtype)


def causal_mask(s: int, t: int) -> jax.Array:
    """Query slot i sees key slots 0..i (S == T: the same positions in the same order)."""
    return jnp.tril(jnp.ones((s, t), dtype=bool))


def forward_block(acc, q_BSKGH, k_BTKH, v_BTKH, mask_ST=None):
    """One online-softmax step: fold keys ``k`` / values ``v`` into the running ``acc``.

    ``acc`` is ``(o [B,K,G,S,H], m [B,K,G,S], l [B,K,G,S])`` (unnormalised output, running max,
    running sum of exponentials, float32), or None to start from this block. Every query row
    must see at least one key in the first block (the ring starts on the diagonal block).
    """
    s = scores(q_BSKGH, k_BTKH)
    if mask_ST is not None:
        s = jnp.where(mask_ST, s, NEG)
    m_blk = s.max(axis=-1)
    m_new = m_blk if acc is None else jnp.maximum(acc[1], m_blk)
    p = jnp.exp(s - m_new[..., None])
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
    if mask_ST is not None:
        s = jnp.where(mask_ST, s, NEG)
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bkgst,bkgsh->btkh", p, do_BKGSH)
    dp = jnp.einsum("bkgsh,btkh->bkgst", do_BKGSH, v_BTKH.astype(F32))
    ds = p * (dp - delta[..., None]) * (q_BSKGH.shape[-1] ** -0.5)
    dq = jnp.einsum("bkgst,btkh->bskgh", ds, k_BTKH.astype(F32))
    dk = jnp.einsum("bkgst,bskgh->btkh", ds, q_BSKGH.astype(F32))
    return dq, dk, dv
