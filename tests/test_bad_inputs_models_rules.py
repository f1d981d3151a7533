"""Bad input to `models` and `partition_rules`, refused up front with a typed error that names the
value and the fix, and nothing created or changed on disk (issue 11, library side).

One table: each row builds what it needs under ``tmp_path`` (a copied checkpoint, a damaged file)
and returns the call to refuse; the call then runs inside ``unchanged()``.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil
from functools import partial

import numpy as np
import pytest
from flax import nnx

from models import (
    BatchError,
    HFCheckpointNotFoundError,
    HFCorruptFileError,
    HFError,
    HFExportError,
    ModelConfigError,
    UnknownFamilyError,
    get_family,
    gpt2,
    llama,
    mlp,
)
from partition_rules import AxisMap, MalformedRuleError, Rule, Rules, UnknownPresetError, preset
from sharding import make_mesh

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
LLAMA_TINY = llama.config("tiny")
TOKENS = np.zeros((2, 8), np.int32)


@functools.cache
def gpt2_fixture():
    return gpt2.from_hf(FIXTURES / "gpt2")


def copied(family: str, tmp: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(FIXTURES / family, tmp / family))


def truncated(tmp: pathlib.Path, family: str, shard: str) -> pathlib.Path:
    path = copied(family, tmp)
    data = (path / shard).read_bytes()
    (path / shard).write_bytes(data[: len(data) // 2])
    return path


def broken_json(tmp: pathlib.Path, family: str, name: str) -> pathlib.Path:
    path = copied(family, tmp)
    text = (path / name).read_text()
    (path / name).write_text(text.replace(",", "", 1))  # a missing comma on line 2 or 3
    return path


def without_shard(tmp: pathlib.Path) -> pathlib.Path:
    path = copied("llama", tmp)
    (path / "model-00002-of-00003.safetensors").unlink()
    return path


def shard_mismatch(tmp: pathlib.Path) -> pathlib.Path:
    """The index says a tensor is in shard 3; shard 3 (from another download) lacks it."""
    path = copied("llama", tmp)
    index = path / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["model.extra.weight"] = "model-00003-of-00003.safetensors"
    index.write_text(json.dumps(content))
    return path


def not_empty(tmp: pathlib.Path) -> pathlib.Path:
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("mine")
    return tmp / "out"


def a_file(tmp: pathlib.Path) -> pathlib.Path:
    (tmp / "out").write_text("not a directory")
    return tmp / "out"


def out_of_vocab_loss():
    cfg, model = gpt2_fixture()
    batch = {"inputs": TOKENS, "targets": TOKENS + cfg.vocab_size}
    return lambda: gpt2.loss(model, batch)


# (row id, make(tmp_path) -> the call to refuse, error type, message regex)
CASES = [
    # --- partition rules ------------------------------------------------------------------------
    ("rule-not-a-pair", lambda t: lambda: Rules([("x",)]), MalformedRuleError,
     r"rule 0 is \('x',\), not a \(regex, axes\) pair; write e\.g\. \(r'layers/mlp"),
    ("rules-a-string", lambda t: lambda: Rules("layers/.*"), MalformedRuleError,
     r"Rules takes a list of \(regex, axes\) pairs, got a str 'layers/\.\*'"),
    ("rules-a-dict", lambda t: lambda: Rules({"x": None}), MalformedRuleError,
     r"got a dict \{'x': None\}.*for a dict write Rules\(d\.items\(\)\)"),
    ("rule-bad-regex", lambda t: lambda: Rules([("(", None)]), MalformedRuleError,
     r"rule pattern '\(' is not a valid regex: missing \).*escape literal"),
    ("rule-pattern-not-str", lambda t: lambda: Rule(3, None), MalformedRuleError,
     r"rule pattern 3 is a int; a pattern is a regex string"),
    ("rule-axes-an-int", lambda t: lambda: Rule("x", 3), MalformedRuleError,
     r"rule 'x': axes must be a tuple .* got 3; write e\.g\. \('embed', 'mlp'\) for a matrix"),
    ("rule-axes-a-str", lambda t: lambda: Rule("x/bias", "mlp"), MalformedRuleError,
     r"got 'mlp'; write e\.g\. \('mlp',\) for a vector"),
    ("rule-name-not-str", lambda t: lambda: Rule("x", ("embed", 3)), MalformedRuleError,
     r"rule 'x': each dimension must be an axis name, a tuple of axis names, or None.*got 3"),
    ("rule-name-empty", lambda t: lambda: Rule("x", ("embed", "")), MalformedRuleError,
     r"rule 'x': each dimension must be an axis name.*got ''"),
    ("axis-map-mesh-axis-int", lambda t: lambda: AxisMap({"embed": 3}), MalformedRuleError,
     r"axis map entry 'embed': each dimension must be an axis name.*got 3"),
    ("axis-map-key-not-str", lambda t: lambda: AxisMap({3: "fsdp"}), MalformedRuleError,
     r"axis map key 3 is not a logical axis name; keys are the names rules use"),
    ("axis-map-a-list", lambda t: lambda: AxisMap([("embed", "fsdp")]), MalformedRuleError,
     r"AxisMap takes a dict of logical axis -> mesh axes, got a list"),
    ("preset-unknown-family", lambda t: lambda: preset("bert", "dp"), UnknownPresetError,
     r"no partition rules for model family 'bert'; known families: cnn, gpt2, llama, llama-moe, mlp\. "
     r"For a model of your own, write its Rules table"),
    ("preset-unknown-strategy", lambda t: lambda: preset("llama", "zero"), UnknownPresetError,
     r"unknown strategy 'zero'; strategies that exist: dp, fsdp, tp, fsdp_tp, dp_tp, pp"),
    # --- model configs --------------------------------------------------------------------------
    ("family-unknown", lambda t: lambda: get_family("bert"), UnknownFamilyError,
     r"unknown model family 'bert'; known families: 'llama', 'gpt2', 'mlp', 'cnn'"),
    ("size-unknown", lambda t: lambda: llama.config("huge"), ModelConfigError,
     r"unknown llama size 'huge'; known sizes: 'tiny', 'maxtext-tiny', '1b', '7b', '8b', '8b-128k', "
     r"'70b', '3-8b', '3-70b', '3.1-405b'$"),
    ("layers-zero", lambda t: lambda: llama.config("tiny", n_layers=0), ModelConfigError,
     r"llama config 'tiny': must be positive ints: n_layers=0; use whole numbers >= 1"),
    ("sizes-negative", lambda t: lambda: gpt2.config("tiny", d_model=-64, d_ff=-1),
     ModelConfigError, r"must be positive ints: d_model=-64, d_ff=-1"),
    ("override-unknown", lambda t: lambda: llama.config("tiny", layers=2), ModelConfigError,
     r"unknown llama config field\(s\) layers; fields: name, vocab_size, d_model, n_layers"),
    ("norm-eps-zero", lambda t: lambda: llama.config("tiny", norm_eps=0.0), ModelConfigError,
     r"must be finite numbers > 0: norm_eps=0\.0"),
    ("rope-theta-nan", lambda t: lambda: llama.config("tiny", rope_theta=float("nan")),
     ModelConfigError, r"must be finite numbers > 0: rope_theta=nan"),
    # --- batches --------------------------------------------------------------------------------
    ("seq-over-max", lambda t: lambda: llama.batch_shapes(LLAMA_TINY, 2, 4097), BatchError,
     r"seq_len=4097 > max_seq_len=4096 of llama 'tiny'; use a sequence length <= 4096$"),
    ("batch-size-zero", lambda t: lambda: llama.make_batch(LLAMA_TINY, 0, 16), BatchError,
     r"batch size 0 for llama 'tiny': .*use a batch size >= 1"),
    ("tokens-past-vocab", lambda t: lambda: llama.check_batch(
        LLAMA_TINY, {"inputs": TOKENS, "targets": TOKENS + 300}), BatchError,
     r"batch\['targets'\] holds token id 300 \(at \[0, 0\]; 16 of 16 .* 256 token ids 0\.\.255 "
     r"of llama 'tiny'"),
    ("tokens-negative", lambda t: lambda: llama.check_batch(
        LLAMA_TINY, {"inputs": TOKENS - 1, "targets": TOKENS}), BatchError,
     r"batch\['inputs'\] holds token id -1"),
    ("batch-missing-targets", lambda t: lambda: llama.check_batch(LLAMA_TINY, {"inputs": TOKENS}),
     BatchError, r"llama batch has no 'targets' \(it holds \['inputs'\]\); a llama batch is"),
    ("labels-past-classes", lambda t: lambda: mlp.check_batch(mlp.config("tiny"), {
        "x": np.zeros((2, 32), np.float32), "labels": np.array([3, 16], np.int32)}), BatchError,
     r"batch\['labels'\] holds label id 16 \(at \[1\]; .* 16 label ids 0\.\.15 of mlp 'tiny'"),
    ("eager-loss-past-vocab", lambda t: out_of_vocab_loss(), BatchError,
     r"batch\['targets'\] holds token id 256 .* of gpt2"),
    # --- Hugging Face import / export -----------------------------------------------------------
    ("hf-config-not-json", lambda t: partial(gpt2.from_hf, broken_json(t, "gpt2", "config.json")),
     HFCorruptFileError, r"gpt2/config\.json: not valid JSON \(Expecting .* at line \d+, column"),
    ("hf-index-not-json", lambda t: partial(
        llama.from_hf, broken_json(t, "llama", "model.safetensors.index.json")), HFCorruptFileError,
     r"model\.safetensors\.index\.json: not valid JSON \(.* at line \d+"),
    ("hf-shard-truncated", lambda t: partial(
        llama.from_hf, truncated(t, "llama", "model-00002-of-00003.safetensors")),
     HFCorruptFileError,
     r"model-00002-of-00003\.safetensors: not a readable safetensors file .* fetch it again"),
    ("hf-single-file-truncated", lambda t: partial(
        gpt2.from_hf, truncated(t, "gpt2", "model.safetensors")), HFCorruptFileError,
     r"gpt2/model\.safetensors: not a readable safetensors file"),
    ("hf-shard-lacks-indexed-tensor", lambda t: partial(llama.from_hf, shard_mismatch(t)),
     HFCorruptFileError, r"model-00003-of-00003\.safetensors: lacks 1 tensor\(s\) .* "
     r"\(first: model\.extra\.weight\)"),
    ("hf-shard-missing", lambda t: partial(llama.from_hf, without_shard(t)),
     HFCheckpointNotFoundError, r"lists shard\(s\) that are not in .*: "
     r"model-00002-of-00003\.safetensors; copy every shard"),
    ("hf-folder-missing", lambda t: lambda: llama.from_hf(t / "no" / "such"),
     HFCheckpointNotFoundError, r"no/such: not a Hugging Face checkpoint directory"),
    ("hf-shardings-a-mesh", lambda t: partial(
        gpt2.from_hf, FIXTURES / "gpt2", shardings=make_mesh("fsdp=8")), HFError,
     r"shardings is a Mesh \{.*'fsdp': 8.*\}; a mesh does not say .* "
     r"e\.g\. shardings=lambda state: sharding\.resolve"),
    ("to-hf-not-empty", lambda t: partial(gpt2.to_hf, *gpt2_fixture(), not_empty(t)),
     HFExportError, r"out: already holds notes\.txt; .* Write into an empty directory, or call "
     r"to_hf\(\.\.\., overwrite=True\)"),
    ("to-hf-onto-a-file", lambda t: partial(gpt2.to_hf, *gpt2_fixture(), a_file(t)),
     HFExportError, r"out: is a file; to_hf writes a directory"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make", "error", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_refused_with_a_typed_error_and_nothing_written(make, error, match, unchanged, tmp_path):
    call = make(tmp_path)
    with unchanged(), pytest.raises(error, match=match):
        call()
    assert issubclass(error, ValueError)


def test_check_batch_accepts_what_make_batch_makes():
    """The guard refuses only bad batches: every family's own batches pass it."""
    for name in ("llama", "gpt2", "mlp", "cnn"):
        fam = get_family(name)
        cfg = fam.config("tiny")
        batch = fam.make_batch(cfg, 2, 16 if fam.INPUT == "inputs" else None)
        fam.check_batch(cfg, {k: np.asarray(v) for k, v in batch.items()})
    model = llama.Model(LLAMA_TINY, rngs=nnx.Rngs(0))
    assert np.isfinite(float(llama.loss(model, {"inputs": TOKENS, "targets": TOKENS + 255})))
