"""The Grain input pipeline: a Hugging Face dataset on local disk, tokenized, packed and served by
(seed, step, row), so each process reads only its rows and a resumed run continues the exact stream.

Everything is made here in tmp folders: a `datasets.Dataset` saved to disk and a BPE tokenizer
trained on its text with `tokenizers`; nothing is downloaded.
"""

from __future__ import annotations

import json
import random

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers, trainers
from tokenizers import models as tok_models

import models
from sharding.cli import main
from sharding.training import (
    DataError,
    DataFileNotFoundError,
    DatasetFormatError,
    DatasetMismatchError,
    DatasetTooSmallError,
    GrainDataset,
    TextColumnError,
    TokenizerError,
    TrainConfig,
    VocabTooSmallError,
    dataset_from_arg,
    fit,
)

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "while",
         "birds", "sang", "in", "tall", "green", "trees", "near", "one", "old", "house", "by",
         "river"]  # fmt: skip
B, SEQ = 8, 16
TRAIN = ["train", "--mesh", "data=8", "--strategy", "dp", "--batch", str(B), "--seq", str(SEQ),
         "--warmup", "1"]  # fmt: skip


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(5, 30))) for _ in range(n)]


def bpe(texts: list[str], path, vocab_size: int = 120) -> None:
    tok = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<unk>", "<|endoftext|>"])  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """30 documents (25 to 47 packed rows of 17 tokens: 6 steps of 8 cross an epoch) and a
    tokenizer trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    texts = documents(30)
    datasets.Dataset.from_dict({"text": texts, "id": list(range(30))}).save_to_disk(root / "ds")
    bpe(texts, root / "tokenizer.json")
    return root


def hf(corpus, **kw) -> GrainDataset:
    args = {"seq_len": SEQ, "global_batch": B, "tokenizer": corpus / "tokenizer.json", **kw}
    return dataset_from_arg(f"hf:{corpus / 'ds'}", 256, 0, **args)


def train(*args: str) -> None:
    assert main([*TRAIN, *map(str, args)]) == 0


def files(root) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*")}


def losses(path) -> list[tuple[int, float, float]]:
    lines = path.read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]


class Interrupted(Exception):
    """Stands for a run killed between steps."""


@pytest.mark.slow
def test_train_on_a_local_dataset_and_resume_bit_for_bit(corpus, tmp_path):
    data = ["--data", f"hf:{corpus / 'ds'}", "--tokenizer", corpus / "tokenizer.json"]
    before = files(corpus)
    train(*data, "--steps", 6, "--checkpoint-dir", tmp_path / "a", "--save-every", 3,
          "--metrics", tmp_path / "full.jsonl")  # fmt: skip
    # The same 6-step run (the learning-rate schedule spans --steps), stopped after step 3 ...
    config = TrainConfig(mesh="data=8", strategy="dp", steps=6, batch=B, seq=SEQ, warmup=1,
                         data=f"hf:{corpus / 'ds'}", tokenizer=corpus / "tokenizer.json",
                         checkpoint_dir=tmp_path / "b", save_every=3,
                         metrics=tmp_path / "first.jsonl")  # fmt: skip

    def stop(record: dict) -> None:
        if record["step"] == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        fit(models.llama, config, on_step=stop)
    # ... and resumed by a fresh process of the command line.
    train(*data, "--steps", 6, "--checkpoint-dir", tmp_path / "b", "--save-every", 3,
          "--resume", "--metrics", tmp_path / "rest.jsonl")  # fmt: skip
    full = losses(tmp_path / "full.jsonl")
    assert [s for s, *_ in full] == [1, 2, 3, 4, 5, 6]
    assert full[-1][1] < full[0][1]  # it learns
    assert losses(tmp_path / "first.jsonl") + losses(tmp_path / "rest.jsonl") == full
    # The resume point lies mid-epoch, and both runs saved the same positions.
    for step in (3, 6):
        saved = [json.loads((tmp_path / r / str(step) / "meta" / "metadata").read_text())["data"]
                 for r in "ab"]  # fmt: skip
        assert saved[0] == saved[1]
        n = saved[0]["position"]["samples_per_epoch"]
        assert divmod(step * B, n) == (saved[0]["position"]["epoch"], saved[0]["position"]["index"])
    assert 3 * B < n < 6 * B  # step 3 is inside epoch 0, step 6 inside epoch 1
    assert files(corpus) == before  # tokenized in memory: no cache beside the dataset

    # Another dataset (or tokenizer) at the checkpoint's path is refused before any file is
    # written, naming both.
    other = tmp_path / "other"
    datasets.Dataset.from_dict({"text": documents(30, seed=1)}).save_to_disk(other)
    config = TrainConfig(mesh="data=8", strategy="dp", steps=9, seq=SEQ, data=f"hf:{other}",
                         tokenizer=corpus / "tokenizer.json", checkpoint_dir=tmp_path / "b",
                         resume="latest")  # fmt: skip
    with pytest.raises(DatasetMismatchError, match=rf"--data hf:{corpus / 'ds'} \(fingerprint "
                       rf"\w+\), given hf:{other} \(fingerprint \w+\)"):  # fmt: skip
        fit(models.llama, config)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["3", "6"]


def test_resume_mid_epoch_gives_the_batches_of_the_uninterrupted_run(corpus):
    data = hf(corpus)
    n = data.samples_per_epoch
    assert 3 * B < n < 6 * B and data.position(3)["position"] == {
        "epoch": 0, "index": 3 * B, "samples_per_epoch": n}  # fmt: skip
    resumed = data.resumed(3, data.position(3))
    for step in range(3, 9):  # across the epoch boundary
        np.testing.assert_array_equal(resumed.batch(step, B, SEQ), data.batch(step, B, SEQ))
    # Every packed row once per epoch, in another order each epoch.
    epochs = np.concatenate([data.batch(s, B, SEQ) for s in range(12)])[: 2 * n]
    first, second = epochs[:n], epochs[n:]
    key = lambda rows: sorted(map(bytes, rows))  # noqa: E731
    assert key(first) == key(second) and not np.array_equal(first, second)
    # Packed documents: the end-of-text token separates them.
    eos = Tokenizer.from_file(str(corpus / "tokenizer.json")).token_to_id("<|endoftext|>")
    assert (first == eos).sum() >= 25 and first.max() < 120


def test_two_processes_read_disjoint_rows_whose_union_is_the_global_batch(corpus, tmp_path):
    path = tmp_path / "tokens.u16"
    np.arange(500, dtype=np.uint16).tofile(path)  # rows of grain:FILE are identifiable
    for data in (hf(corpus), dataset_from_arg(f"grain:{path}", 512, 0, seq_len=SEQ,
                                              global_batch=B)):  # fmt: skip
        for step in (0, 4):
            # Process p of 2 holds rows p*B/2 .. (p+1)*B/2 of a batch split over processes.
            halves = [data.rows(step, p * B // 2, (p + 1) * B // 2, SEQ) for p in (0, 1)]
            samples = [{data.sample(step, r) for r in range(p * B // 2, (p + 1) * B // 2)}
                       for p in (0, 1)]  # fmt: skip
            assert not samples[0] & samples[1]
            np.testing.assert_array_equal(np.concatenate(halves), data.batch(step, B, SEQ))
    rows = np.concatenate([data.batch(s, B, SEQ) for s in range(3)])  # of 500 // 17 = 29 rows
    starts = set(rows[:, 0].tolist())  # 24 distinct consecutive windows of epoch 0
    assert len(starts) == 24 and starts <= set(range(0, 17 * 29, 17))
    assert (np.diff(rows, axis=1) == 1).all()


def test_other_sources_and_columns(tmp_path):
    (tmp_path / "json").mkdir()
    for i in range(2):
        lines = [json.dumps({"body": t, "n": j}) for j, t in enumerate(documents(10, seed=i))]
        (tmp_path / "json" / f"part{i}.jsonl").write_text("\n".join(lines))
    bpe(documents(20), tmp_path / "tok.json")
    args = {"seq_len": SEQ, "global_batch": B, "tokenizer": tmp_path / "tok.json"}
    data = dataset_from_arg(f"hf:{tmp_path / 'json'}", 256, 0, text_column="body", **args)
    assert data.source["documents"] == 20 and data.batch(0, B, SEQ).shape == (B, SEQ + 1)
    with pytest.raises(TextColumnError, match=r"has no 'text' column; its columns are body "
                       r"\(Value\('string'\)\), n \(Value\('int64'\)\)\. .*--text-column body"):  # fmt: skip
        dataset_from_arg(f"hf:{tmp_path / 'json'}", 256, 0, **args)
    with pytest.raises(TextColumnError, match=r"--text-column n: the column holds .*int64.*not "
                       r"strings; string columns .*: body"):  # fmt: skip
        dataset_from_arg(f"hf:{tmp_path / 'json'}", 256, 0, text_column="n", **args)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("\n".join(documents(40)))
    data = dataset_from_arg(f"hf:{tmp_path / 'text'}", 256, 0, **args)
    assert data.source["documents"] == 40 and data.source["text_column"] == "text"


def test_bad_inputs_are_refused_with_the_flag_the_value_and_the_fix(corpus, tmp_path):
    tok = corpus / "tokenizer.json"
    with pytest.raises(DataFileNotFoundError, match=r"--data hf:.*nowhere: .*does not exist; "
                       r"give the folder of a dataset saved with"):  # fmt: skip
        dataset_from_arg(f"hf:{tmp_path / 'nowhere'}", 256, seq_len=SEQ, global_batch=B,
                         tokenizer=tok)  # fmt: skip
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetFormatError, match=r"holds neither a saved dataset .* nor any "
                       r"\.parquet"):  # fmt: skip
        dataset_from_arg(f"hf:{tmp_path / 'empty'}", 256, seq_len=SEQ, global_batch=B,
                         tokenizer=tok)  # fmt: skip
    with pytest.raises(DataFileNotFoundError, match=r"--tokenizer .*nope.json: .* does not exist"):
        hf(corpus, tokenizer=tmp_path / "nope.json")
    words = Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))
    words.save(str(tmp_path / "big.json"))
    with pytest.raises(VocabTooSmallError, match=r"--tokenizer .*big.json has 300 tokens \(ids "
                       r"0..299\), but the model's vocab_size=256 .*vocab_size >= 300"):  # fmt: skip
        hf(corpus, tokenizer=tmp_path / "big.json")
    small = Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
    small.save(str(tmp_path / "noeos.json"))
    with pytest.raises(TokenizerError, match=r"has none of the end-of-text tokens <\|endoftext"):
        hf(corpus, tokenizer=tmp_path / "noeos.json")
    with pytest.raises(DatasetTooSmallError, match=r"packs into \d+ rows of seq_len \+ 1 = 17 "
                       r"tokens \(\d+ tokens from 30 documents .*fewer than one batch of --batch "
                       r"64; use --batch \d+ or less, --seq \d+ or less, or more data"):  # fmt: skip
        hf(corpus, global_batch=64)
    with pytest.raises(DataError, match=r"--tokenizer and --text-column tokenize a Hugging Face "
                       r"dataset, but --data is not given"):  # fmt: skip
        dataset_from_arg(None, 256, tokenizer=tok)


def test_the_cli_refuses_before_writing_anything(corpus, refused):
    data = f"hf:{corpus / 'ds'}"
    base = [*TRAIN, "--steps", "2", "--metrics", "m.jsonl", "--checkpoint-dir", "ck"]
    refused([*base, "--data", data], rf"--data {data} holds text, which needs --tokenizer PATH")
    refused([*base, "--tokenizer", str(corpus / "tokenizer.json")],
            r"--tokenizer tokenize a Hugging Face dataset, but --data is not given")  # fmt: skip
    refused([*base, "--data", data, "--tokenizer", str(corpus / "tokenizer.json"),
             "--text-column", "body"],
            r"--text-column body: --data hf:.* has no such column; its columns are text "
            r"\(Value\('string'\)\), id")  # fmt: skip
    refused([*base, "--data", "hf:"], r"argument --data: 'hf:': give a path after hf:")
