"""Hugging Face weights: logits equal to transformers' under every preset, exact round trips.

The fixtures (tests/fixtures/hf, made once by make_fixtures.py with torch + transformers) are a
tiny LlamaForCausalLM (2 layers, 8 query / 4 kv heads, sharded index) and a tiny GPT2LMHeadModel
(2 layers, one file), with the reference logits transformers computed for fixed inputs.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from models import gpt2, hf, llama
from models.hf import (
    HFCheckpointNotFoundError,
    HFError,
    HFExportError,
    HFTensorMismatchError,
    PickleCheckpointError,
    Source,
    UnsupportedHFConfigError,
)
from partition_rules import preset
from partition_rules.strategies import EXAMPLE_MESHES_8, PIPELINE_STRATEGIES, STRATEGIES
from sharding import make_mesh, resolve

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
FROM_HF = {"llama": llama.from_hf, "gpt2": gpt2.from_hf}
TO_HF = {"llama": llama.to_hf, "gpt2": gpt2.to_hf}
# The fixtures have 2 layers, so the 4-stage example mesh becomes 2 stages.
MESHES = {s: m.replace("stage=4,data=2", "stage=2,data=4") for s, m in EXAMPLE_MESHES_8.items()}


def placed(family: str, strategy: str, mesh: str):
    """`shardings` for `from_hf`: spmdkit's placement of the family's preset on `mesh`."""
    rules, axis_map, mesh_ = *preset(family, strategy), make_mesh(mesh)
    return lambda state: resolve(rules, axis_map, state, mesh_)


def reference(family: str) -> dict[str, np.ndarray]:
    return load_file(FIXTURES / f"{family}.reference.safetensors")


def forward(model: nnx.Module, inputs: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, inputs))


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in flat}


def tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def copy_fixture(family: str, dst: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(FIXTURES / family, dst / family))


def edit_config(directory: pathlib.Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_fixtures_are_tiny_and_llama_is_sharded():
    size = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert size < 1_000_000
    index = json.loads((FIXTURES / "llama" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not list(FIXTURES.rglob("*.bin"))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_single_device_logits_match_transformers(family):
    ref = reference(family)
    cfg, model = FROM_HF[family](FIXTURES / family)
    np.testing.assert_allclose(model(ref["inputs"]), ref["logits"], atol=1e-4, rtol=0)
    assert cfg.n_layers == 2 and cfg.vocab_size == 256 and cfg.d_model == 64
    if family == "llama":
        assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps) == (8, 4, 8, 1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_logits_match_transformers_under_every_preset(family, strategy):
    """Born sharded (each device reads its slice), same logits as transformers at 1e-4."""
    rules, axis_map = preset(family, strategy)
    mesh = make_mesh(MESHES[strategy])
    _, model = FROM_HF[family](
        FIXTURES / family, shardings=lambda state: resolve(rules, axis_map, state, mesh)
    )
    state = nnx.state(model, nnx.Param)
    want = resolve(rules, axis_map, state, mesh)
    for got, expected in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        assert got.sharding == expected
    if strategy in PIPELINE_STRATEGIES:
        assert mesh.shape["stage"] == 2
    ref = reference(family)
    np.testing.assert_allclose(forward(model, ref["inputs"]), ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_to_hf_then_from_hf_round_trips_exactly(family, tmp_path):
    cfg, model = FROM_HF[family](FIXTURES / family, shardings=placed(family, "fsdp", "fsdp=8"))
    out = TO_HF[family](cfg, model, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    # The tensors written are the original checkpoint's, bit for bit, under the same names.
    original, written = tensors(FIXTURES / family), tensors(out)
    assert sorted(original) == sorted(written)
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    cfg2, model2 = FROM_HF[family](out)
    assert cfg2 == cfg
    before, after = params(model), params(model2)
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_weights_are_refused_unopened(name, tmp_path):
    shutil.copy(FIXTURES / "llama" / "config.json", tmp_path / "config.json")
    (tmp_path / name).write_bytes(b"\x80\x04not a pickle; opening it would fail differently")
    with pytest.raises(PickleCheckpointError, match=rf"{name}.*never loaded.*safetensors"):
        llama.from_hf(tmp_path)
    with pytest.raises(PickleCheckpointError, match="never loaded"):
        gpt2.from_hf(tmp_path / name)


def test_safetensors_are_used_when_pickle_weights_sit_beside_them(tmp_path):
    path = copy_fixture("gpt2", tmp_path)
    (path / "pytorch_model.bin").write_bytes(b"never read")
    ref = reference("gpt2")
    _, model = gpt2.from_hf(path)
    np.testing.assert_allclose(model(ref["inputs"]), ref["logits"], atol=1e-4, rtol=0)


def test_sharded_index_missing_shard_is_named(tmp_path):
    path = copy_fixture("llama", tmp_path)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(HFCheckpointNotFoundError, match=r"model-00002-of-00003\.safetensors"):
        llama.from_hf(path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(HFCheckpointNotFoundError, match="not a Hugging Face checkpoint"):
        llama.from_hf(tmp_path / "nope")
    with pytest.raises(HFCheckpointNotFoundError, match=r"no config\.json"):
        llama.from_hf(tmp_path)
    shutil.copy(FIXTURES / "gpt2" / "config.json", tmp_path / "config.json")
    with pytest.raises(HFCheckpointNotFoundError, match=r"no model\.safetensors"):
        gpt2.from_hf(tmp_path)
    with pytest.raises(UnsupportedHFConfigError, match="model_type='gpt2', expected 'llama'"):
        llama.from_hf(FIXTURES / "gpt2")


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters"),
        ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ("llama", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'.*'silu'"),
        ("llama", {"sliding_window": 4096}, "unsupported field.*sliding_window"),
        ("llama", {"hidden_size": ...}, "required field 'hidden_size' is missing"),
        ("gpt2", {"tie_word_embeddings": False}, "tie_word_embeddings=False"),
        ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ],
)
def test_unsupported_config_is_refused(family, changes, match, tmp_path):
    path = copy_fixture(family, tmp_path)
    edit_config(path, **changes)
    with pytest.raises(UnsupportedHFConfigError, match=match):
        FROM_HF[family](path)


def test_tensor_problems_are_listed_together(tmp_path):
    path = copy_fixture("gpt2", tmp_path)
    weights = load_file(path / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.bias"]
    weights["transformer.ln_f.weight"] = np.ones(32, np.float32)
    weights["transformer.h.0.adapter.weight"] = np.ones(3, np.float32)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(HFTensorMismatchError, match=r"3 problem") as info:
        gpt2.from_hf(path)
    text = str(info.value)
    assert "missing transformer.h.1.mlp.c_fc.bias [128]" in text
    assert "unexpected transformer.h.0.adapter.weight" in text
    assert "transformer.ln_f.weight: shape [32], config.json implies [64]" in text


def test_gpt2_hub_layout_without_prefix_and_with_mask_buffers(tmp_path):
    """The original hub files: no `transformer.` prefix, causal-mask buffers, bfloat16 copy."""
    import ml_dtypes

    path = copy_fixture("gpt2", tmp_path)
    weights = {
        k.removeprefix("transformer."): v for k, v in load_file(path / "model.safetensors").items()
    }
    weights["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    save_file(weights, path / "model.safetensors")
    ref = reference("gpt2")
    _, model = gpt2.from_hf(path)
    np.testing.assert_allclose(model(ref["inputs"]), ref["logits"], atol=1e-4, rtol=0)

    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}
    save_file(bf16, path / "model.safetensors")
    _, model = gpt2.from_hf(path)
    got = params(model)["wte/embedding"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, bf16["wte.weight"].astype(np.float32))


def test_llama_tied_embeddings_load_as_a_copy(tmp_path):
    path = copy_fixture("llama", tmp_path)
    edit_config(path, tie_word_embeddings=True)
    cfg, model = llama.from_hf(path)  # lm_head.weight is still in the files: ignored, as HF does
    embed = load_file(path / "model-00001-of-00003.safetensors")["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), embed.T)
    out = llama.to_hf(cfg, model, tmp_path / "untied")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    np.testing.assert_array_equal(tensors(out)["lm_head.weight"], embed)


def test_shardings_must_place_every_parameter_and_export_checks(tmp_path):
    with pytest.raises(HFError, match=r"shardings is a Mesh.*sharding\.resolve\(rules, axis_map"):
        llama.from_hf(FIXTURES / "llama", shardings=make_mesh("fsdp=8"))
    with pytest.raises(HFError, match=r"\(state\) gave a tree of 0 leaves, not one .*Sharding per"):
        llama.from_hf(FIXTURES / "llama", shardings=lambda state: [None, None])
    cfg, model = gpt2.from_hf(FIXTURES / "gpt2")
    with pytest.raises(HFExportError, match="needs a llama Config and Model"):
        llama.to_hf(cfg, model, tmp_path / "x")
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(HFExportError, match=r"model-00001-of-00002\.safetensors.*empty directory"):
        gpt2.to_hf(cfg, model, stale)


def test_config_mapping_round_trips_for_real_sizes():
    """config_to_hf then config_from_hf is the identity on the shipped sizes (no weights)."""
    for cfg in llama.SIZES.values():
        assert hf.LLAMA.config_from_hf(hf.LLAMA.config_to_hf(cfg), pathlib.Path("x")) == cfg
    for cfg in gpt2.SIZES.values():
        assert hf.GPT2.config_from_hf(hf.GPT2.config_to_hf(cfg), pathlib.Path("x")) == cfg


@pytest.mark.parametrize(
    "index",
    [
        (slice(0, 64), slice(0, 4), slice(0, 16)),
        (slice(16, 32), slice(1, 3), slice(0, 16)),
        (slice(0, 64), slice(2, 4), slice(4, 12)),
        (slice(63, 64), slice(3, 4), slice(15, 16)),
    ],
)
@pytest.mark.parametrize("slot", [0, 1, 2])
def test_source_reads_the_same_as_slicing_the_whole_tensor(index, slot):
    """A fused, viewed, transposed source: reading a slice equals slicing the full mapping."""
    d, n, h = 64, 4, 16
    fused = np.arange(d * 3 * d, dtype=np.float32).reshape(d, 3 * d)
    src = Source("c_attn", (d, 3 * d), (d, 3, n, h), (0, 1, 2), fixed=((1, slot),))
    whole = fused.reshape(d, 3, n, h)[:, slot]
    np.testing.assert_array_equal(src.read(fused, index), whole[index])
    o = Source("o_proj", (d, n * h), (d, n, h), (1, 2, 0))  # llama o: [D, N*H] -> [N, H, D]
    o_full = np.arange(d * n * h, dtype=np.float32).reshape(d, n * h)
    o_index = (index[1], index[2], index[0])
    np.testing.assert_array_equal(
        o.read(o_full, o_index), o_full.reshape(d, n, h).transpose(1, 2, 0)[o_index]
    )
    buffer = np.zeros((d, 3, n, h), np.float32)
    src.write(buffer, whole)
    np.testing.assert_array_equal(buffer[:, slot], whole)


def test_each_device_reads_only_its_slice(monkeypatch):
    """Under fsdp=8 every read of the token table is 1/8 of it, and together they read it once."""
    reads: dict[str, list[int]] = {}
    tensor = hf.Checkpoint.tensor

    class Recorder:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def __getitem__(self, index):
            block = self.inner[index]
            reads.setdefault(self.name, []).append(block.size)
            return block

        def get_shape(self):
            return self.inner.get_shape()

    monkeypatch.setattr(hf.Checkpoint, "tensor", lambda self, n: Recorder(n, tensor(self, n)))
    llama.from_hf(FIXTURES / "llama", shardings=placed("llama", "fsdp", "fsdp=8"))
    table = reads["model.embed_tokens.weight"]
    assert max(table) == 256 * 64 // 8
    assert sum(table) == 256 * 64


def test_to_hf_overwrite_replaces_the_checkpoint_and_keeps_other_files(tmp_path):
    cfg, model = gpt2.from_hf(FIXTURES / "gpt2")
    out = copy_fixture("llama", tmp_path)  # a sharded checkpoint of another model
    (out / "tokenizer.json").write_text("{}")
    gpt2.to_hf(cfg, model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"
    ]  # fmt: skip
    cfg2, model2 = gpt2.from_hf(out)
    assert cfg2 == cfg
    for name, value in params(model).items():
        np.testing.assert_array_equal(params(model2)[name], value, err_msg=name)


def test_shardings_as_one_sharding_or_a_tree():
    """`shardings` may be one Sharding for every parameter, or a tree shaped like the state."""
    mesh = make_mesh("fsdp=8")
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    _, model = gpt2.from_hf(FIXTURES / "gpt2", shardings=replicated)
    assert {leaf.sharding for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {replicated}
    rules, axis_map = preset("gpt2", "fsdp")
    abstract = nnx.eval_shape(lambda: gpt2.Model(gpt2.config("tiny", n_layers=2), rngs=nnx.Rngs(0)))
    tree = resolve(rules, axis_map, nnx.split(abstract)[1], mesh)
    _, model = gpt2.from_hf(FIXTURES / "gpt2", shardings=tree)
    got = [leaf.sharding for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert got == jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
