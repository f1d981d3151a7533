"""``--model hf:PATH``: a Hugging Face config.json alone (no weights) planned, compared, explained
and trained as the shipped family it describes; unsupported model types and keys refused by name.
"""

from __future__ import annotations

import json

import pytest

import models
from models.hf import UnsupportedHFConfigError, read_config
from sharding.cli import main

# Llama 3 8B as Hugging Face writes it (GQA: 8 key/value heads for 32 query heads).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
# Mixtral 8x7B's config.json.
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
    "vocab_size": 32000,
}  # fmt: skip


def write(tmp_path, config: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def ranking(capsys, *model_flags: str) -> tuple[list, str]:
    assert main(["plan", *model_flags, "--target", "h100:8x8", "--aot", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    return [(c["label"], c["mesh"], c["step_s"], c["memory_bytes"])
            for c in result["candidates"]], result["train_command"]  # fmt: skip


def test_a_llama_config_json_reads_as_the_shipped_size(tmp_path):
    family, cfg = read_config(write(tmp_path, LLAMA3_8B))
    shipped = models.llama.config("3-8b")
    assert family is models.llama
    assert {**vars(cfg), "name": None} == {**vars(shipped), "name": None}


@pytest.mark.parametrize(("config", "shipped"), [
    (LLAMA3_8B, ["--model", "llama", "--size", "3-8b"]),
    (MIXTRAL, ["--model", "llama-moe", "--size", "mixtral-8x7b"]),
], ids=["llama-gqa", "mixtral"])  # fmt: skip
def test_plan_ranks_a_config_json_as_its_shipped_size(tmp_path, capsys, config, shipped):
    folder = write(tmp_path, config)
    got, command = ranking(capsys, "--model", f"hf:{folder}")
    want, _ = ranking(capsys, *shipped)
    assert got == want and len(got) > 3
    assert command.startswith(f"spmdkit train --model hf:{folder} --strategy")


def test_the_file_itself_may_be_named(tmp_path):
    folder = write(tmp_path, LLAMA3_8B)
    assert read_config(folder / "config.json")[1] == read_config(folder)[1]


def test_compare_explain_and_train_take_a_config_json(tmp_path, capsys):
    tiny = models.hf.LLAMA.config_to_hf(models.llama.config("tiny"))
    model = f"hf:{write(tmp_path, tiny)}"
    assert main(["explain", "--model", model, "--strategy", "fsdp", "--mesh", "fsdp=8"]) == 0
    assert "llama" in capsys.readouterr().out
    assert main(["train", "--model", model, "--strategy", "fsdp", "--mesh", "fsdp=8", "--steps",
                 "1", "--batch", "8", "--seq", "32"]) == 0  # fmt: skip
    capsys.readouterr()
    assert (
        main(
            [
                "compare",
                "--model",
                model,
                "--strategies",
                "dp,fsdp",
                "--batch",
                "8",
                "--seq",
                "32",
                "--out",
                str(tmp_path / "out"),
                "--compiler",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Recommendation" in out and "data=8" in out and "fsdp=8" in out


def test_an_unknown_model_type_is_refused_naming_the_supported_ones(tmp_path, capsys):
    folder = write(tmp_path, {**LLAMA3_8B, "model_type": "qwen2"})
    with pytest.raises(UnsupportedHFConfigError,
                       match=r"model_type='qwen2' is not one spmdkit computes; supported model "
                             r"types: llama, mistral, gpt2, mixtral"):  # fmt: skip
        read_config(folder)
    assert main(["plan", "--model", f"hf:{folder}"]) == 2
    assert "supported model types: llama, mistral, gpt2, mixtral" in capsys.readouterr().err


def test_keys_that_change_the_model_are_refused_by_name(tmp_path):
    mistral = {**LLAMA3_8B, "model_type": "mistral", "sliding_window": 4096}
    with pytest.raises(UnsupportedHFConfigError, match=r"sliding_window=4096 is not supported"):
        read_config(write(tmp_path, mistral, "mistral"))
    family, cfg = read_config(write(tmp_path, {**mistral, "sliding_window": None}, "full"))
    assert family is models.llama and cfg.n_kv_heads == 8
    with pytest.raises(UnsupportedHFConfigError, match=r"router_jitter_noise=0.1"):
        read_config(write(tmp_path, {**MIXTRAL, "router_jitter_noise": 0.1}, "jitter"))
    with pytest.raises(UnsupportedHFConfigError, match=r"unsupported field\(s\) qk_norm"):
        read_config(write(tmp_path, {**LLAMA3_8B, "qk_norm": True}, "qk"))
    missing = {k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}
    with pytest.raises(UnsupportedHFConfigError, match=r"'num_local_experts' is missing"):
        read_config(write(tmp_path, missing, "missing"))


def test_size_is_refused_beside_a_config_json(tmp_path, capsys):
    folder = write(tmp_path, LLAMA3_8B)
    assert main(["plan", "--model", f"hf:{folder}", "--size", "8b"]) == 2
    assert f"--size 8b: --model hf:{folder} gives the sizes; leave --size out" in (
        capsys.readouterr().err)  # fmt: skip
    assert main(["plan", "--model", f"hf:{tmp_path / 'nowhere'}"]) == 2
    assert "no such file; give a Hugging Face config.json" in capsys.readouterr().err
