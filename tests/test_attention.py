"""Attention kernels (`models.attention`): blockwise (flash-style) attention against the
materialising reference, forward and every gradient, for grouped heads and ragged blocks; its
memory linear in the sequence and its causal work skipped, as compiled; the refusals of kernels
this host cannot run; and the training step with each kernel against one device with the
reference, under the strategies that split attention differently.
"""

from __future__ import annotations

import math
import re
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from closeness import assert_close

import models
from models import attention
from models.attention import AttentionKernelError, blockwise_attention, xla_attention
from sharding import Workload, build_program, make_mesh
from sharding.inspection import inspect_compiled

B, H = 2, 16


def inputs(s: int, n: int, k: int, t: int | None = None):
    kq, kk, kv, kw = jax.random.split(jax.random.key(s * 100 + n * 10 + k), 4)
    t = s if t is None else t
    q = jax.random.normal(kq, (B, s, n, H))
    kk_, vv = (jax.random.normal(key, (B, t, k, H)) for key in (kk, kv))
    return q, kk_, vv, jax.random.normal(kw, (B, s, n, H))


def out_and_grads(attend, q, k, v, w):
    """The output and d(sum(out * w))/d(q, k, v), in one program."""
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(w)


# (sequence, query heads, kv heads, block): ratios 1, 4 and 8; multiples of the block and not
CASES = [(48, 8, 8, 16), (45, 8, 2, 16), (48, 8, 1, 16), (45, 8, 1, 16), (40, 4, 4, 64)]


@pytest.mark.parametrize(("s", "n", "k", "block"), CASES, ids=[str(c) for c in CASES])
def test_blockwise_equals_the_reference(s, n, k, block):
    args = inputs(s, n, k)
    kernel = lambda q, k, v: blockwise_attention(q, k, v, block_q=block, block_k=block)  # noqa: E731
    got = jax.jit(lambda *a: out_and_grads(kernel, *a))(*args)
    want = jax.jit(lambda *a: out_and_grads(xla_attention, *a))(*args)
    assert_close(got, want)


def test_blockwise_with_fewer_queries_than_keys_and_unequal_blocks():
    """Queries at the end of a longer key sequence (query i at position i + T - S)."""
    args = inputs(20, 4, 2, t=36)
    kernel = lambda q, k, v: blockwise_attention(q, k, v, block_q=8, block_k=12)  # noqa: E731
    got = jax.jit(lambda *a: out_and_grads(kernel, *a))(*args)
    want = jax.jit(lambda *a: out_and_grads(xla_attention, *a))(*args)
    assert_close(got, want)


def test_blockwise_with_positions_equals_the_masked_reference():
    """Any layout of the sequence (context parallelism's zigzag), blocks fully masked included."""
    q, k, v, w = inputs(40, 4, 2)
    pos = jnp.asarray(np.random.default_rng(0).permutation(40), jnp.int32)
    mask = pos[:, None] >= pos[None, :]

    def kernel(q, k, v):
        return blockwise_attention(q, k, v, q_positions=pos, k_positions=pos, block_q=16,
                                   block_k=16)  # fmt: skip

    got = jax.jit(lambda *a: out_and_grads(kernel, *a))(q, k, v, w)
    want = jax.jit(lambda *a: out_and_grads(
        lambda q, k, v: attention.masked_attention(q, k, v, mask), *a))(q, k, v, w)  # fmt: skip
    assert_close(got, want)


def test_blockwise_in_bfloat16_stays_near_the_float32_reference():
    q, k, v, _ = inputs(64, 4, 2)
    got = blockwise_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), block_q=16, block_k=16)
    assert got.dtype == jnp.bfloat16
    # bfloat16 inputs and output (8 bits of mantissa), float32 statistics: within 2**-7.
    np.testing.assert_allclose(np.asarray(got, np.float32), xla_attention(q, k, v), atol=2**-6,
                               rtol=2**-7)  # fmt: skip


def test_causal_blocks_above_the_diagonal_are_skipped_as_compiled():
    """16 query blocks: 136 of the 256 block pairs are computed, in the forward and the
    backward's recompute; the compiled matmul FLOPs say so."""
    assert attention.live_fraction(8192, block=512) == 136 / 256
    assert attention.live_fraction(100, block=512) == 1.0  # one block: the whole square
    s, n, h, blk = 256, 2, 16, 32
    q = jax.ShapeDtypeStruct((1, s, n, h), jnp.float32)

    def flops(kernel):
        fn = jax.jit(lambda q: jax.grad(lambda q: kernel(q, q[:, :, :1], q[:, :, :1]).sum())(q))
        return inspect_compiled(fn.lower(q).compile()).matmul_flops

    pairs = 8 * 9 // 2
    # Forward: scores and values (2 products); backward: scores again, dv, dp, dq, dk (5).
    per_pair = 7 * 2 * blk * blk * n * h
    got = flops(lambda q, k, v: blockwise_attention(q, k, v, block_q=blk, block_k=blk))
    assert got == pairs * per_pair
    # The reference computes the whole square (64 pairs' worth, 5 products as XLA fuses them).
    assert flops(xla_attention) == 5 * 2 * s * s * n * h > got


@cache
def temp_bytes(kernel: str, s: int) -> int:
    q = jax.ShapeDtypeStruct((1, s, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, s, 2, 64), jnp.bfloat16)
    attend = attention.KERNEL[kernel]

    def loss(q, k, v):
        return attend(q, k, v).astype(jnp.float32).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return inspect_compiled(compiled).memory.temp


def test_blockwise_memory_is_linear_in_the_sequence():
    """Forward and backward: 4x the sequence at most 4.5x the temporaries (the reference's
    score matrix grows 16x)."""
    assert temp_bytes("blockwise", 4096) <= 4.5 * temp_bytes("blockwise", 1024)
    assert temp_bytes("xla", 4096) >= 12 * temp_bytes("xla", 1024)


def test_no_mask_is_kept_for_every_block_pair_in_a_layer_stack():
    """In a scanned stack, a mask that depends only on positions is loop-invariant: autodiff
    would compute it once for every block pair and keep ``[pairs, B, K, G, bq, bk]`` through
    the backward (quadratic in the sequence). The kernel masks only the diagonal pairs, with
    one constant triangle: no compiled boolean array is larger than one block's mask."""
    b, s, n, k, h, blk, layers = 1, 256, 4, 2, 8, 32, 3

    def layer(x, w):
        q = x @ w
        return blockwise_attention(q, q[:, :, :k], q[:, :, :k], block_q=blk, block_k=blk) + x, None

    def loss(x, w):
        return jax.lax.scan(layer, x, w)[0].sum()

    x = jax.ShapeDtypeStruct((b, s, n, h), jnp.float32)
    w = jax.ShapeDtypeStruct((layers, h, h), jnp.float32)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    masks = {tuple(map(int, d.split(","))) for d in re.findall(r"pred\[([0-9,]+)\]", text)}
    assert masks and max(math.prod(m) for m in masks) == b * n * blk * blk  # K x G = N heads


def test_splash_in_the_pallas_interpreter_equals_the_reference():
    """The TPU kernel's wrapper (grouped heads, scaling, layout) checked on this host by running
    the Pallas kernel in its interpreter: forward and every gradient."""
    kq, kk, kv, kw = jax.random.split(jax.random.key(5), 4)
    q, w = jax.random.normal(kq, (1, 128, 4, 128)), jax.random.normal(kw, (1, 128, 4, 128))
    k, v = jax.random.normal(kk, (1, 128, 2, 128)), jax.random.normal(kv, (1, 128, 2, 128))

    def splash(q, k, v):
        return attention.splash_attention(q, k, v, interpret=True)

    assert_close(out_and_grads(splash, q, k, v, w), out_and_grads(xla_attention, q, k, v, w))


def test_auto_is_blockwise_on_cpu_beyond_one_block():
    def shapes(s):
        return jax.ShapeDtypeStruct((1, s, 8, 64), jnp.float32)

    assert attention.choose("auto", shapes(513), shapes(513)) == "blockwise"
    assert attention.choose("auto", shapes(512), shapes(512)) == "xla"  # one block: no scan
    assert attention.choose("blockwise", shapes(16), shapes(16)) == "blockwise"
    assert attention.kernel("auto") is attention.auto_attention


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("cudnn", r"attention='cudnn' runs on a GPU.*traced for 'cpu'.*blockwise"),
        ("splash", r"attention='splash' runs on a TPU.*traced for 'cpu'.*blockwise"),
        ("flash", r"attention='flash' is not a kernel; choose one of \['auto', 'blockwise'"),
    ],
)
def test_a_kernel_this_host_cannot_run_is_refused(kind, match):
    with pytest.raises(AttentionKernelError, match=match):
        attention.kernel(kind)


def test_cudnn_and_splash_refuse_shapes_they_cannot_take():
    q, k, v, _ = inputs(16, 4, 2)
    with pytest.raises(AttentionKernelError, match=r"cuDNN attention runs on a GPU"):
        attention.cudnn_attention(q, k, v)
    with pytest.raises(AttentionKernelError, match=r"multiple of 128; got S=16, T=16, H=16"):
        attention.splash_attention(q, k, v, interpret=True)
    with pytest.raises(AttentionKernelError, match=r"query heads must be a multiple"):
        blockwise_attention(q[:, :, :3], k, v)


# -- the training step with each kernel, against one device with the reference ------------------

BATCH, SEQ, LAYERS = 8, 40, 2


def workload() -> Workload:
    return Workload.from_family(models.llama, models.llama.config("tiny", n_layers=LAYERS))


def batch() -> dict:
    cfg = models.llama.config("tiny", n_layers=LAYERS)
    made = models.llama.make_batch(cfg, BATCH, SEQ, key=jax.random.key(3))
    return {k: np.asarray(v) for k, v in made.items()}


def loss_and_grads(strategy, mesh_spec, kind, **kw):
    if mesh_spec == "one device":
        mesh_spec = make_mesh("data=1", jax.devices()[:1])
    prog = build_program(workload(), strategy, mesh_spec, batch=BATCH, seq=SEQ, attention=kind,
                         **kw)  # fmt: skip
    # Every program starts from the one-device program's seed-0 parameters, placed in its own
    # shardings (born-sharded init is tested in test_presets and test_step).
    params = jax.device_put(init_params(), prog.param_shardings)
    loss, grads = prog.loss_and_grads(params, batch())
    return float(loss), jax.tree.leaves(grads)


@cache
def init_params():
    one = build_program(workload(), "dp", make_mesh("data=1", jax.devices()[:1]), batch=BATCH,
                        seq=SEQ)  # fmt: skip
    return jax.device_get(one.init(seed=0)["params"])


@cache
def reference():
    return loss_and_grads("dp", "one device", "xla")


STEPS = [
    ("dp", "data=8", {}),
    ("fsdp_tp", "data=2,fsdp=2,tensor=2", {}),
    ("tp_sp", "data=2,tensor=4", {}),
    ("pp_fsdp", "stage=2,data=2,fsdp=2", {"schedule": "1f1b", "microbatches": 2}),
]


@pytest.mark.parametrize(("strategy", "mesh_spec", "kw"), STEPS, ids=[s[0] for s in STEPS])
def test_step_with_blockwise_attention_equals_one_device_with_the_reference(strategy, mesh_spec,
                                                                            kw):  # fmt: skip
    loss, grads = loss_and_grads(strategy, mesh_spec, "blockwise", **kw)
    ref_loss, ref_grads = reference()
    np.testing.assert_allclose(loss, ref_loss, rtol=2**7 * np.finfo(np.float32).eps)
    assert_close(grads, ref_grads)


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_context_parallel_step_equals_one_device_with_the_reference(method):
    loss, grads = loss_and_grads("cp", "data=2,context=4", "auto", context_method=method)
    ref_loss, ref_grads = reference()
    np.testing.assert_allclose(loss, ref_loss, rtol=2**7 * np.finfo(np.float32).eps)
    assert_close(grads, ref_grads)


def test_a_kernel_the_step_cannot_substitute_is_refused():
    import dataclasses

    from sharding import AttentionChoiceError

    with pytest.raises(AttentionChoiceError, match=r"attention='xla' on a mesh with context=4: "
                       r"context parallelism runs its own attention.*use attention='auto'"):  # fmt: skip
        build_program(workload(), "cp", "data=2,context=4", batch=BATCH, seq=SEQ,
                      attention="xla")  # fmt: skip
    bare = dataclasses.replace(workload(), kernels=None)
    with pytest.raises(AttentionChoiceError, match=r"attention='blockwise': workload .* offers "
                       r"no attention kernels by name.*attention=models.attention.kernel"):  # fmt: skip
        build_program(bare, "dp", "data=8", batch=BATCH, seq=SEQ, attention="blockwise")
    with pytest.raises(AttentionChoiceError, match=r"attention='cudnn' runs on a GPU"):
        build_program(workload(), "dp", "data=8", batch=BATCH, seq=SEQ, attention="cudnn")


def test_the_library_prices_the_blockwise_kernel_the_model_runs():
    """The cost model's block and live share (`sharding.costmodel`) are the kernel's own."""
    from sharding.costmodel import live_fraction

    for s in (100, 512, 513, 4096, 8192, 8000):
        assert live_fraction(s) == attention.live_fraction(s)
