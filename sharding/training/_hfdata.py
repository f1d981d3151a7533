"""Hugging Face datasets on local disk, tokenized and packed into training rows (``hf:PATH``).

`load_texts` reads a dataset saved with ``Dataset.save_to_disk`` (``datasets.load_from_disk``;
of a ``DatasetDict``, the ``train`` split) or a folder of ``.parquet``, ``.json``/``.jsonl`` or
``.txt`` files, read with pyarrow as the ``datasets`` builders read them (one row per record,
one per text line) but without writing their cache. Nothing is downloaded, nothing written.

`pack` tokenizes every document with a ``tokenizers.Tokenizer`` (a ``tokenizer.json``, without
the tokenizer's own special tokens), puts the end-of-text token after each, concatenates them
and cuts rows of ``seq_len + 1`` tokens; the tail shorter than a row and empty documents are
dropped. The rows are held in memory (4 bytes a token), made once per run by each process:
right for the small and medium sets this is for. For a corpus of many GB, tokenize it once
ahead into a flat token file and train on ``grain:FILE``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from sharding.training._data import DataError, DataFileNotFoundError, VocabTooSmallError

# End-of-text tokens of common tokenizers, in the order they are looked for.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
_KINDS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text"}


class DatasetFormatError(DataError):
    """An ``hf:`` folder that holds no dataset this can read (or one file it cannot parse)."""


class TextColumnError(DataError):
    """The dataset has no text column as asked: ``--text-column`` names the one to use."""


class TokenizerError(DataError):
    """A ``--tokenizer`` that cannot be read, or one without an end-of-text token to pack with."""


def digest(*parts: Any) -> str:
    """A short hex fingerprint of JSON-able ``parts``."""
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).hexdigest()


def load_texts(path: Path, shown: str):
    """The ``datasets.Dataset`` at ``path`` (``shown``: the ``--data`` value, for messages)."""
    import datasets

    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise DataFileNotFoundError(
            f"--data {shown}: {path} {what}; give the folder of a dataset saved with "
            f"datasets.Dataset.save_to_disk(PATH), or a folder of .parquet, .json/.jsonl or "
            f".txt files (nothing is downloaded: hub names are not read)"
        )
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DatasetFormatError(
                    f"--data {shown} is a DatasetDict with the splits {sorted(loaded)} but no "
                    f"'train'; point at one split, e.g. --data hf:{path / sorted(loaded)[0]}"
                )
            loaded = loaded["train"]
        return loaded
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _KINDS)
    if not files:
        raise DatasetFormatError(
            f"--data {shown}: {path} holds neither a saved dataset (state.json, written by "
            f"Dataset.save_to_disk) nor any .parquet, .json, .jsonl or .txt file; save the "
            f"dataset there or put its files there"
        )
    kinds = sorted({_KINDS[p.suffix.lower()] for p in files})
    if len(kinds) > 1:
        raise DatasetFormatError(
            f"--data {shown}: {path} mixes {' and '.join(kinds)} files; keep one kind in the "
            f"folder (a dataset's files share one format)"
        )
    import pyarrow as pa

    tables = [_read(p, kinds[0], shown) for p in files]
    return datasets.Dataset(pa.concat_tables(tables, promote_options="default"))


def _read(path: Path, kind: str, shown: str):
    import pyarrow as pa
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            return pq.read_table(path)
        if kind == "text":  # one row per line, as datasets' "text" builder
            return pa.table({"text": path.read_text(encoding="utf-8").splitlines()})
        try:
            return pj.read_json(path)  # JSON Lines
        except pa.ArrowInvalid:
            records = json.loads(path.read_text(encoding="utf-8"))  # one JSON array of records
            if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
                raise ValueError("neither JSON Lines nor a JSON array of objects") from None
            return pa.Table.from_pylist(records)
    except (ValueError, OSError, pa.ArrowException) as e:
        raise DatasetFormatError(
            f"--data {shown}: cannot read {path} as {kind} ({e}); fix or remove the file"
        ) from None


def text_column(ds, column: str | None, shown: str) -> str:
    """The column of ``ds`` to tokenize: ``column``, or ``"text"`` when None."""
    import datasets

    def is_text(name: str) -> bool:
        f = ds.features[name]
        return isinstance(f, datasets.Value) and f.dtype in ("string", "large_string")

    texts = [n for n in ds.column_names if is_text(n)]
    listed = ", ".join(f"{n} ({ds.features[n]})" for n in ds.column_names) or "none"
    if column is None and "text" not in ds.column_names:
        hint = f"e.g. --text-column {texts[0]}" if texts else "none of them holds strings"
        raise TextColumnError(
            f"--data {shown} has no 'text' column; its columns are {listed}. Name the column "
            f"of documents with --text-column NAME ({hint})"
        )
    column = "text" if column is None else column
    if column not in ds.column_names:
        raise TextColumnError(
            f"--text-column {column}: --data {shown} has no such column; its columns are {listed}"
        )
    if not is_text(column):
        raise TextColumnError(
            f"--text-column {column}: the column holds {ds.features[column]}, not strings; "
            f"string columns of --data {shown}: {', '.join(texts) or 'none'}"
        )
    return column


def load_tokenizer(path: str | Path, vocab_size: int) -> tuple[Any, int, str]:
    """``(tokenizer, end-of-text id, fingerprint)`` of a ``tokenizer.json`` (or its folder),
    refused when its vocabulary does not fit the model's ``vocab_size``."""
    from tokenizers import Tokenizer

    given = Path(path)
    file = given / "tokenizer.json" if given.is_dir() else given
    if not file.is_file():
        what = "has no tokenizer.json" if given.is_dir() else "does not exist"
        raise DataFileNotFoundError(
            f"--tokenizer {path}: {given} {what}; give a tokenizer.json (written by "
            f"tokenizers.Tokenizer.save or a Hugging Face tokenizer's save_pretrained) or the "
            f"folder that holds it"
        )
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise TokenizerError(
            f"--tokenizer {path}: {file} is not a tokenizers tokenizer.json ({e}); give the "
            f"tokenizer.json of a Hugging Face fast tokenizer"
        ) from None
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise VocabTooSmallError(
            f"--tokenizer {path} has {n} tokens (ids 0..{n - 1}), but the model's "
            f"vocab_size={vocab_size} only has ids 0..{vocab_size - 1}; use a model whose "
            f"vocabulary holds them (vocab_size >= {n}: another --model or --size) or a "
            f"tokenizer of at most {vocab_size} tokens"
        )
    eos = next((i for t in EOS_TOKENS if (i := tok.token_to_id(t)) is not None), None)
    if eos is None:
        raise TokenizerError(
            f"--tokenizer {path} has none of the end-of-text tokens {', '.join(EOS_TOKENS)} that "
            f"separate packed documents; add one as a special token (e.g. "
            f"tokenizer.add_special_tokens(['<|endoftext|>'])) and save it again"
        )
    return tok, eos, digest(tok.to_str())


def pack(ds, column: str, tok, eos: int, seq_len: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Rows ``int32[N, seq_len + 1]`` of the documents of ``column``, each followed by ``eos``,
    and facts of the dataset: documents, tokens, and a fingerprint of the texts."""
    h = hashlib.blake2b(digest_size=8)
    pieces: list[np.ndarray] = []
    n_docs = 0
    for chunk in ds.iter(batch_size=1024):
        texts = [t for t in chunk[column] if t]
        for t in texts:
            raw = t.encode("utf-8")
            h.update(len(raw).to_bytes(8, "little") + raw)
        n_docs += len(texts)
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            pieces.append(np.asarray([*enc.ids, eos], np.int32))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    n = len(stream) // (seq_len + 1)
    rows = stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)
    return rows, {"documents": n_docs, "tokens": len(stream), "fingerprint": h.hexdigest()}
