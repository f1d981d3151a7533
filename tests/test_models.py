"""Model families: parameter-path contract, closed-form counts, scan == loop, attention oracles.

Single device, tiny sizes; real sizes only through `nnx.eval_shape` (no allocation).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from closeness import assert_close
from flax import nnx

import models
from models import FAMILIES, build_config, get_family, gpt2, llama, scan_layers
from models.layers import causal_attention, layer, rope

NAMES = ["llama", "gpt2", "mlp", "cnn"]
LMS = ["llama", "gpt2"]
SEQ = 16  # tiny LM batches use 16 of the 128 positions
BATCH = 2


def contract(name: str, c) -> dict[str, tuple[int, ...]]:
    """The parameter paths and shapes partition rules rely on, written out from the spec."""
    L = c.n_layers
    if name == "llama":
        D, N, K, H, F, V = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
        return {
            "embed/embedding": (V, D),
            "layers/attn_norm/scale": (L, D),
            "layers/attn/q/kernel": (L, D, N, H),
            "layers/attn/k/kernel": (L, D, K, H),
            "layers/attn/v/kernel": (L, D, K, H),
            "layers/attn/o/kernel": (L, N, H, D),
            "layers/mlp_norm/scale": (L, D),
            "layers/mlp/gate/kernel": (L, D, F),
            "layers/mlp/up/kernel": (L, D, F),
            "layers/mlp/down/kernel": (L, F, D),
            "final_norm/scale": (D,),
            "lm_head/kernel": (D, V),
        }
    if name == "gpt2":
        D, N, H, F, V, S = c.d_model, c.n_heads, c.head_dim, c.d_ff, c.vocab_size, c.max_seq_len
        qkv = {}
        for p in "qkv":
            qkv[f"layers/attn/{p}/kernel"] = (L, D, N, H)
            qkv[f"layers/attn/{p}/bias"] = (L, N, H)
        return {
            "wte/embedding": (V, D),
            "wpe/embedding": (S, D),
            "layers/ln1/scale": (L, D),
            "layers/ln1/bias": (L, D),
            **qkv,
            "layers/attn/o/kernel": (L, N, H, D),
            "layers/attn/o/bias": (L, D),
            "layers/ln2/scale": (L, D),
            "layers/ln2/bias": (L, D),
            "layers/mlp/fc/kernel": (L, D, F),
            "layers/mlp/fc/bias": (L, F),
            "layers/mlp/proj/kernel": (L, F, D),
            "layers/mlp/proj/bias": (L, D),
            "ln_f/scale": (D,),
            "ln_f/bias": (D,),
        }
    if name == "mlp":
        D, F = c.d_model, c.d_ff
        return {
            "input/kernel": (c.d_in, D),
            "input/bias": (D,),
            "layers/fc1/kernel": (L, D, F),
            "layers/fc1/bias": (L, F),
            "layers/fc2/kernel": (L, F, D),
            "layers/fc2/bias": (L, D),
            "output/kernel": (D, c.n_classes),
            "output/bias": (c.n_classes,),
        }
    C, P, W = c.channels, c.n_features, c.head_width
    return {
        "stem/kernel": (3, 3, c.in_channels, C),
        "stem/bias": (C,),
        "layers/norm/scale": (L, C),
        "layers/conv1/kernel": (L, 3, 3, C, C),
        "layers/conv1/bias": (L, C),
        "layers/conv2/kernel": (L, 3, 3, C, C),
        "layers/conv2/bias": (L, C),
        "head/fc1/kernel": (P, W),
        "head/fc1/bias": (W,),
        "head/fc2/kernel": (W, c.n_classes),
        "head/fc2/bias": (c.n_classes,),
    }


def param_shapes(model) -> dict[str, tuple[int, ...]]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): tuple(v.get_value().shape) for path, v in flat}


def param_dtypes(model) -> set:
    return {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}


def seq_len(name: str) -> int | None:
    return SEQ if name in LMS else None


def first_input(name: str, batch: dict) -> jax.Array:
    return batch[{"llama": "inputs", "gpt2": "inputs", "mlp": "x", "cnn": "images"}[name]]


@functools.cache
def tiny(name: str):
    """(family, cfg, model, batch), built once per family."""
    fam = get_family(name)
    cfg = fam.config("tiny")
    model = fam.Model(cfg, rngs=nnx.Rngs(0))
    return fam, cfg, model, fam.make_batch(cfg, BATCH, seq_len(name), key=jax.random.key(1))


@functools.cache
def forward(name: str):
    """Jitted `(state, batch) -> (logits, reference logits, loss)` for the tiny model.

    The reference is a pipeline-style cut (scan over the first half of the stacked layers) then a
    Python loop applying each remaining block: any scan bug breaks the two differently. Cached so
    tests with the same shapes share one compilation.
    """
    fam, cfg, model, _ = tiny(name)
    graphdef, _ = nnx.split(model)
    L = cfg.n_layers

    @jax.jit
    def run(state, batch):
        m = nnx.merge(graphdef, state)
        x = first_input(name, batch)
        logits = m(x)
        layer_def, layer_state = nnx.split(m.layers)
        first_half = nnx.merge(layer_def, jax.tree.map(lambda a: a[: L // 2], layer_state))
        h = scan_layers(first_half, m.embed(x))
        for i in range(L // 2, L):
            h = layer(m.layers, i)(h)
        return logits, m.head(h), fam.loss_from_logits(logits, batch)

    return run


@pytest.mark.parametrize("name", NAMES)
def test_param_tree_matches_contract(name):
    _, cfg, model, _ = tiny(name)
    assert param_shapes(model) == contract(name, cfg)
    assert param_dtypes(model) == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("name", NAMES)
def test_param_count_closed_form_every_size(name):
    fam, cfg, model, _ = tiny(name)
    assert fam.param_count(cfg) == sum(math.prod(s) for s in param_shapes(model).values())
    for size in fam.SIZES:
        c = fam.config(size)
        abstract = nnx.eval_shape(lambda c=c: fam.Model(c, rngs=nnx.Rngs(0)))
        shapes = param_shapes(abstract)
        assert shapes == contract(name, c), size
        assert fam.param_count(c) == sum(math.prod(s) for s in shapes.values()), size


def test_param_counts_of_known_models():
    # Llama-2 7B/70B and GPT-2 124M (vocabulary padded to 50304; 124,439,808 with 50257 rows).
    assert llama.param_count(llama.config("7b")) == 6_738_415_616
    assert llama.param_count(llama.config("70b")) == 68_976_648_192
    assert gpt2.param_count(gpt2.config("124m")) == 124_439_808 + 47 * 768


# The published models people plan for, with the totals their papers give (Llama 3: Dubey et
# al. 2024, Table 3 and the model cards; GPT-3: Brown et al. 2020, Table 2.1).
PUBLISHED = [(llama, "3-8b", 8.03e9), (llama, "3-70b", 70.6e9), (llama, "3.1-405b", 405.9e9),
             (gpt2, "gpt3-125m", 125e6), (gpt2, "gpt3-350m", 350e6), (gpt2, "gpt3-760m", 760e6),
             (gpt2, "gpt3-1.3b", 1.3e9), (gpt2, "gpt3-2.7b", 2.7e9), (gpt2, "gpt3-6.7b", 6.7e9),
             (gpt2, "gpt3-13b", 13e9), (gpt2, "gpt3-175b", 175e9)]  # fmt: skip


@pytest.mark.parametrize(("fam", "size", "total"), PUBLISHED, ids=[p[1] for p in PUBLISHED])
def test_published_sizes_have_their_papers_parameter_counts(fam, size, total):
    """Within 2% of the published total (GPT-3's are rounded to two figures, its vocabulary
    padded here), and each names its source for --help."""
    cfg = fam.config(size)
    assert fam.param_count(cfg) == pytest.approx(total, rel=0.02)
    assert fam.SOURCES[size].split(",")[0] in ("Llama 3 8B", "Llama 3 70B", "Llama 3.1 405B",
                                               "GPT-3")  # fmt: skip
    if fam is llama:
        assert (cfg.vocab_size, cfg.n_kv_heads, cfg.rope_theta) == (128_256, 8, 500_000.0)
    else:
        assert (cfg.max_seq_len, cfg.d_ff) == (2048, 4 * cfg.d_model)


@pytest.mark.parametrize("name", NAMES)
def test_forward_shape_loss_and_scan_equals_layer_loop(name):
    _, cfg, model, batch = tiny(name)
    logits, reference, loss = forward(name)(nnx.state(model), batch)
    n_out = cfg.vocab_size if name in LMS else cfg.n_classes
    lead = (BATCH, SEQ) if name in LMS else (BATCH,)
    assert logits.shape == (*lead, n_out)
    assert logits.dtype == jnp.float32
    assert_close(logits, reference)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert np.isfinite(loss)
    # Near-uniform predictions at init: the loss is close to log(#classes).
    assert abs(float(loss) - math.log(n_out)) < 1.0


@pytest.mark.parametrize("name", NAMES)
def test_batch_shapes_describe_make_batch(name):
    fam, cfg, _, batch = tiny(name)
    shapes = fam.batch_shapes(cfg, BATCH, seq_len(name))
    assert {k: (v.shape, v.dtype) for k, v in shapes.items()} == {
        k: (v.shape, v.dtype) for k, v in batch.items()
    }
    if name in LMS:
        assert fam.batch_shapes(cfg, 3)["inputs"].shape == (3, cfg.max_seq_len)
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


@pytest.mark.parametrize("name", NAMES)
def test_init_is_deterministic_in_the_seed(name):
    fam, cfg, model, _ = tiny(name)

    def values(m) -> dict[str, np.ndarray]:
        flat = nnx.to_flat_state(nnx.state(m, nnx.Param))
        return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in flat}

    ref = values(model)
    same = values(fam.Model(cfg, rngs=nnx.Rngs(0)))
    other = values(fam.Model(cfg, rngs=nnx.Rngs(1)))
    assert all(np.array_equal(ref[p], same[p]) for p in ref)
    random = [p for p in ref if p.endswith(("kernel", "embedding"))]
    assert random and not any(np.array_equal(ref[p], other[p]) for p in random)
    # Layers of one stack are initialised independently.
    for p in random:
        if p.startswith("layers/"):
            assert not np.array_equal(ref[p][0], ref[p][1]), p


def test_remat_gives_same_loss_and_grads():
    fam, _, model, batch = tiny("mlp")
    graphdef, state = nnx.split(model)

    def loss_fn(state, remat):
        return fam.loss(nnx.merge(graphdef, state), batch, remat=remat)

    @jax.jit
    def both(state):
        return (
            jax.value_and_grad(loss_fn)(state, None),
            jax.value_and_grad(loss_fn)(state, jax.checkpoint),
        )

    (l0, g0), (l1, g1) = both(state)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    assert_close(g1, g0)
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(g0))


def matmul_operand_dtypes(jaxpr) -> set:
    """dtypes of every dot_general / convolution operand, sub-jaxprs (scan bodies) included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            found |= {v.aval.dtype for v in eqn.invars}
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= matmul_operand_dtypes(inner)
    return found


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_params_give_bfloat16_compute_and_float32_loss(name):
    fam, _, model, batch = tiny(name)
    graphdef, state = nnx.split(model)
    state16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state)

    def run(state, batch):
        m = nnx.merge(graphdef, state)
        return m(first_input(name, batch)), fam.loss(m, batch)

    logits, loss = jax.eval_shape(run, state16, batch)  # traced only, nothing compiles
    assert (logits.dtype, loss.dtype) == (jnp.bfloat16, jnp.float32)
    assert matmul_operand_dtypes(jax.make_jaxpr(run)(state16, batch).jaxpr) == {
        jnp.dtype(jnp.bfloat16)
    }
    assert matmul_operand_dtypes(jax.make_jaxpr(run)(state, batch).jaxpr) == {
        jnp.dtype(jnp.float32)
    }


def test_gqa_attention_equals_naive_per_head_attention():
    B, S, N, K, H = 2, 5, 6, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s, np.float32) for s in [(B, S, N, H), *[(B, S, K, H)] * 2])
    out = np.asarray(jax.jit(causal_attention)(q, k, v))
    group = N // K
    for b in range(B):
        for n in range(N):
            scores = q[b, :, n] @ k[b, :, n // group].T / math.sqrt(H)
            scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            assert_close(out[b, :, n], p @ v[b, :, n // group])


def test_gqa_rejects_heads_not_divisible():
    x = jnp.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of kv heads \(2\)"):
        causal_attention(x, x[:, :, :2], x[:, :, :2])
    with pytest.raises(ValueError, match="n_heads=8 must be a multiple of n_kv_heads=3"):
        llama.config("tiny", n_kv_heads=3)


def test_rope_scores_depend_only_on_relative_position():
    S, H = 12, 16
    rng = np.random.default_rng(0)
    # The same query and key vector at every position: x[0, s, :, :] is placed at position s.
    q, k = (np.broadcast_to(rng.standard_normal(H, np.float32), (2, S, 1, H)) for _ in range(2))
    rope_jit = jax.jit(rope, static_argnums=2)
    rq, rk = (np.asarray(rope_jit(x, np.arange(S), 10_000.0))[0, :, 0] for x in (q, k))
    scores = rq @ rk.T  # scores[m, n] = <rope(q, m), rope(k, n)>
    np.testing.assert_allclose(scores[1:, 1:], scores[:-1, :-1], rtol=1e-4, atol=1e-4)
    assert not np.allclose(scores[0, 0], scores[0, 1])
    np.testing.assert_allclose(rq[0], q[0, 0, 0], rtol=1e-6)  # position 0: identity
    np.testing.assert_allclose(
        np.linalg.norm(rq, axis=-1), np.linalg.norm(q[0, :, 0], axis=-1), rtol=1e-5
    )


@pytest.mark.parametrize("name", LMS)
def test_causal_future_tokens_do_not_change_earlier_logits(name):
    _, cfg, model, batch = tiny(name)
    state = nnx.state(model)
    x = batch["inputs"]
    t = SEQ // 2
    x2 = x.at[:, t].set((x[:, t] + 1) % cfg.vocab_size)
    y = forward(name)(state, batch)[0]
    y2 = forward(name)(state, {**batch, "inputs": x2})[0]
    np.testing.assert_array_equal(y[:, :t], y2[:, :t])
    assert not np.allclose(y[:, t:], y2[:, t:])


def test_gpt2_head_is_tied_to_token_embedding():
    _, cfg, model, _ = tiny("gpt2")
    assert [p for p in param_shapes(model) if p.startswith(("wte", "lm_head", "head"))] == [
        "wte/embedding"
    ]
    h = np.random.default_rng(0).standard_normal((BATCH, 3, cfg.d_model)).astype(np.float32)
    logits = nnx.jit(lambda m, h: m.head(h))(model, h)
    normed = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + cfg.norm_eps)
    scale, bias, wte = (
        np.asarray(v[...]) for v in (model.ln_f.scale, model.ln_f.bias, model.wte.embedding)
    )
    np.testing.assert_allclose(logits, (normed * scale + bias) @ wte.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", LMS)
def test_sequence_longer_than_max_is_rejected(name):
    fam, cfg, model, _ = tiny(name)
    over = cfg.max_seq_len + 1
    msg = rf"sequence longer than the model supports: seq_len={over} > max_seq_len={over - 1}"
    with pytest.raises(ValueError, match=msg):
        fam.batch_shapes(cfg, 2, over)
    with pytest.raises(ValueError, match=msg):
        fam.make_batch(cfg, 2, over)
    if name == "gpt2":  # learned positions: the forward itself cannot run past max_seq_len
        with pytest.raises(ValueError, match=msg):
            model.embed(jnp.zeros((1, over), jnp.int32))


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_seq_len_rejected_without_sequence_axis(name):
    fam, cfg, _, _ = tiny(name)
    with pytest.raises(ValueError, match=f"{name} batches have no sequence axis; got seq_len=8"):
        fam.batch_shapes(cfg, 2, 8)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_size_and_field_errors(name):
    fam = get_family(name)
    known = re.escape(", ".join(repr(s) for s in fam.SIZES))
    with pytest.raises(ValueError, match=rf"unknown {name} size 'huge'; known sizes: {known}$"):
        fam.config("huge")
    with pytest.raises(ValueError, match=rf"unknown {name} config field\(s\) n_layrs"):
        fam.config("tiny", n_layrs=2)
    with pytest.raises(ValueError, match="must be positive ints: n_layers=0"):
        fam.config("tiny", n_layers=0)


def test_registry():
    assert set(FAMILIES) == {*NAMES, "llama-moe"}  # llama-moe's own tests: tests/test_moe.py
    assert set(models.__all__) >= {"FAMILIES", "build_config", "get_family", "llama_moe", *NAMES}
    assert get_family("gpt2") is gpt2
    cfg = build_config("llama", "tiny", n_layers=2, rope_theta=500_000.0)
    assert (cfg.n_layers, cfg.rope_theta, cfg.name) == (2, 500_000.0, "tiny")
    with pytest.raises(
        ValueError,
        match="unknown model family 'bert'; known families: 'llama', 'gpt2', 'mlp', 'cnn', "
        "'llama-moe'",
    ):
        get_family("bert")
    with pytest.raises(ValueError, match="unknown cnn size"):
        build_config("cnn", "7b")


def test_configs_are_frozen_and_named():
    for name, fam in FAMILIES.items():
        for size, cfg in fam.SIZES.items():
            assert cfg.name == size and cfg.family == name
            with pytest.raises(AttributeError):
                cfg.name = "x"  # type: ignore[misc]


def test_doc_examples(doctests):
    """The examples in the docstrings of `models`' public names (families, layers, hf) run."""
    assert doctests(models) > 10
