"""Causal attention kernels, one signature, the same numbers on every backend.

Every kernel here is ``(q_BSNH, k_BTKH, v_BTKH) -> out_BSNH``: causal softmax attention with
grouped query heads (each of the K key/value heads serves G = N / K consecutive query heads),
query slot i at position ``i + T - S`` seeing keys ``0 .. i + T - S``. Scores, softmax statistics
and accumulators are float32 whatever the compute dtype.

- ``blockwise``: pure JAX, any backend. FlashAttention-2 written as a `lax.scan` over the (query
  block, key block) pairs the causal mask leaves live (blocks above the diagonal are never
  visited), an online softmax over each query block's key blocks, and a `jax.custom_vjp` whose
  backward recomputes each block's probabilities from the saved log-sum-exp. Nothing
  ``S x T`` is ever held: memory is linear in the sequence. Grouped heads stay grouped (queries
  reshaped to ``[B, S, K, G, H]``, K and V never repeated); a sequence that is not a multiple of
  the block is padded to one (padded keys are never seen by a real query).
- ``xla``: the reference: the full ``[B, K, G, S, T]`` score matrix, softmax, product. For small
  shapes and for checking the others.
- ``cudnn``: `jax.nn.dot_product_attention` with cuDNN's fused flash kernel (GPU; bfloat16 or
  float16; head width a multiple of 8 up to 256).
- ``splash``: JAX's Pallas splash attention (TPU), one grouped-query kernel per key/value head.
- ``auto``: cudnn on a GPU where it takes the shapes, splash on a TPU, blockwise elsewhere (the CPU
  programs that `spmdkit compare` and `plan` price therefore hold what a flash kernel holds), the
  reference where the whole sequence fits one block of 512 (`choose`).

The block steps (`forward_block`, `backward_block`, `finish`) are public for kernels that chain
the online softmax another way (over a ring of devices, say).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from models._errors import AttentionKernelError
from models._flash import (
    BLOCK,
    F32,
    NEG,
    backward_block,
    blockwise_attention,
    check_heads,
    finish,
    forward_block,
    grouped,
    live_fraction,
    scores,
)

KINDS = ("auto", "blockwise", "xla", "cudnn", "splash")


# -- the reference ------------------------------------------------------------------------------


def masked_attention(q_BSNH, k_BTKH, v_BTKH, mask_ST: jax.Array | None) -> jax.Array:
    """Softmax attention of every query against every key where ``mask_ST`` holds, the whole
    ``[B, K, G, S, T]`` score matrix at once."""
    q = grouped(q_BSNH, k_BTKH.shape[2])
    s = scores(q, k_BTKH)
    if mask_ST is not None:
        s = jnp.where(mask_ST, s, NEG)
    p = jax.nn.softmax(s, axis=-1).astype(v_BTKH.dtype)
    out = jnp.einsum("bkgst,btkh->bskgh", p, v_BTKH)
    return out.reshape(q_BSNH.shape).astype(q_BSNH.dtype)


def causal_mask(s: int, t: int) -> jax.Array:
    """``[S, T]``: query slot i sees key slots ``0 .. i + t - s`` (the last query sees all)."""
    return jnp.tril(jnp.ones((s, t), dtype=bool), k=t - s)


def xla_attention(q_BSNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """Causal attention materialising the whole score matrix (the reference kernel)."""
    check_heads(q_BSNH, k_BTKH, "xla")
    return masked_attention(q_BSNH, k_BTKH, v_BTKH, causal_mask(q_BSNH.shape[1], k_BTKH.shape[1]))


# -- the backends' fused kernels ----------------------------------------------------------------


def _platform() -> str:
    """The platform the program is traced for: the mesh in context's (a compile-only target's
    devices, e.g. H100s on a CPU host, when the caller traces under the mesh), else this
    host's backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def cudnn_problem(q, k) -> str | None:
    """Why cuDNN's flash kernel cannot take these shapes here (None when it can)."""
    if _platform() != "gpu":
        return f"cuDNN attention runs on a GPU and the program is traced for {_platform()!r}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN flash attention takes bfloat16 or float16, not {q.dtype}"
    h = q.shape[-1]
    if h % 8 or h > 256:
        return (
            f"cuDNN flash attention takes a head width that is a multiple of 8 up to 256, not {h}"
        )
    if q.shape[1] != k.shape[1]:
        return (
            f"cuDNN's causal mask needs S == T (self-attention), not {q.shape[1]} and {k.shape[1]}"
        )
    return None


def cudnn_attention(q_BSNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """cuDNN's fused flash attention (`jax.nn.dot_product_attention`, causal, grouped heads)."""
    check_heads(q_BSNH, k_BTKH, "cudnn")
    problem = cudnn_problem(q_BSNH, k_BTKH)
    if problem:
        raise AttentionKernelError(
            f"attention='cudnn': {problem}; use attention='blockwise' (any backend) or 'auto'"
        )
    return jax.nn.dot_product_attention(q_BSNH, k_BTKH, v_BTKH, is_causal=True,
                                        implementation="cudnn")  # fmt: skip


def splash_attention(
    q_BSNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """JAX's Pallas splash attention (TPU): a grouped-query kernel per key/value head, vmapped
    over rows and key/value heads. ``interpret=True`` runs the Pallas interpreter (any backend,
    slow: for checking the numbers)."""
    check_heads(q_BSNH, k_BTKH, "splash")
    if _platform() != "tpu" and not interpret:
        raise AttentionKernelError(
            f"attention='splash': the Pallas splash kernel runs on a TPU and this host's backend "
            f"is {_platform()!r}; use attention='blockwise' (any backend) or 'auto'"
        )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    b, s, n, h = q_BSNH.shape
    t, n_kv = k_BTKH.shape[1], k_BTKH.shape[2]
    g = n // n_kv
    if s != t or s % 128 or h % 128:
        raise AttentionKernelError(
            f"attention='splash' takes S == T, a multiple of 128, and a head width that is a "
            f"multiple of 128; got S={s}, T={t}, H={h}; use attention='blockwise'"
        )
    block = math.gcd(s, BLOCK)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)  # fmt: skip
    mask = sm.MultiHeadMask([sm.CausalMask((s, t)) for _ in range(g)])
    kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
    q = jnp.einsum("bskgh->bkgsh", grouped(q_BSNH, n_kv)) * (h**-0.5)
    k, v = jnp.einsum("btkh->bkth", k_BTKH), jnp.einsum("btkh->bkth", v_BTKH)
    out = jax.vmap(jax.vmap(kernel))(q.astype(k.dtype), k, v)  # [B, K, G, S, H]
    return jnp.einsum("bkgsh->bskgh", out).reshape(b, s, n, h).astype(q_BSNH.dtype)


def auto_attention(q_BSNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """The backend's flash kernel where it takes the shapes, blockwise elsewhere (`choose`)."""
    return KERNEL[choose("auto", q_BSNH, k_BTKH)](q_BSNH, k_BTKH, v_BTKH)


def choose(kind: str, q, k) -> str:
    """The concrete kernel ``kind`` runs on these shapes on this host ("auto" resolved).

    "auto": cuDNN on a GPU and splash on a TPU where they take the shapes; elsewhere blockwise,
    except where both sequences fit one block (`BLOCK`): there the blockwise kernel would hold
    the same one block of scores, and the reference computes it in one product, without a scan.
    Inside a partially manual ``shard_map`` (a pipeline's stages) not cuDNN: jax's partitioning
    rule for it fails there (jax 0.10.2: an assertion in ``custom_partitioning``). Splash only
    on TPUs this process runs: traced for compile-only TPUs on another host, its Pallas kernel
    fails to lower (jax 0.10.2, libtpu 0.0.42: a KeyError in its ``closed_call``).
    """
    check_kind(kind)
    if kind != "auto":
        return kind
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    if _platform() == "gpu" and not manual and cudnn_problem(q, k) is None:
        return "cudnn"
    if jax.default_backend() == "tpu" and q.shape[1] == k.shape[1] and q.shape[1] % 128 == 0 \
            and q.shape[-1] % 128 == 0:  # fmt: skip
        return "splash"
    return "blockwise" if max(q.shape[1], k.shape[1]) > BLOCK else "xla"


def check_kind(kind: str) -> str:
    """``kind`` if it names a kernel, else an `AttentionKernelError` listing them."""
    if kind not in KINDS:
        raise AttentionKernelError(
            f"attention={kind!r} is not a kernel; choose one of {list(KINDS)}"
        )
    return kind


def check_runs_here(kind: str) -> None:
    """Refuse, before anything compiles, a kernel this host's backend cannot run."""
    check_kind(kind)
    need = {"cudnn": "gpu", "splash": "tpu"}.get(kind)
    if need and _platform() != need:
        raise AttentionKernelError(
            f"attention={kind!r} runs on a {need.upper()} and the program is traced for "
            f"{_platform()!r}; use --attention blockwise (any backend) or auto"
        )


def runs_here(kind: str) -> bool:
    """Whether this host's backend can run the kernel ``kind`` ("auto" always can)."""
    check_kind(kind)
    return {"cudnn": "gpu", "splash": "tpu"}.get(kind, _platform()) == _platform()


KERNEL = {
    "blockwise": blockwise_attention,
    "xla": xla_attention,
    "cudnn": cudnn_attention,
    "splash": splash_attention,
    "auto": auto_attention,
}


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """The online (flash) softmax one block at a time, with the whole-matrix reference: what
    `blockwise_attention` is built from and what context parallelism's kernels run on the
    blocks they hold (`sharding.context`, given as ``Workload(attention_core=ONLINE_SOFTMAX)``),
    so one implementation serves both."""

    grouped: Callable
    scores: Callable
    forward_block: Callable
    finish: Callable
    backward_block: Callable
    masked_attention: Callable
    causal_mask: Callable


ONLINE_SOFTMAX = OnlineSoftmax(grouped, scores, forward_block, finish, backward_block,
                               masked_attention, causal_mask)  # fmt: skip


def kernel(kind: str = "auto"):
    """The attention kernel named ``kind`` (see the module doc), checked to run on this host.

    Example:
        >>> kernel("blockwise") is blockwise_attention
        True
    """
    check_runs_here(kind)
    return KERNEL[kind]


__all__ = [
    "BLOCK",
    "F32",
    "KINDS",
    "NEG",
    "ONLINE_SOFTMAX",
    "AttentionKernelError",
    "OnlineSoftmax",
    "auto_attention",
    "backward_block",
    "blockwise_attention",
    "causal_mask",
    "check_heads",
    "check_kind",
    "check_runs_here",
    "choose",
    "cudnn_attention",
    "finish",
    "forward_block",
    "grouped",
    "kernel",
    "live_fraction",
    "masked_attention",
    "runs_here",
    "scores",
    "splash_attention",
    "xla_attention",
]
