"""Grain-backed datasets: a seeded permutation per epoch over packed rows, addressed by step.

`GrainDataset` serves rows of ``seq_len + 1`` tokens through a ``grain.MapDataset``:
``source(rows).shuffle(seed).repeat()``, so sample ``g`` of the stream is a row of epoch
``g // N`` under that epoch's permutation (grain reseeds its shuffle each epoch). Row ``r`` of the
global batch at ``step`` is sample ``start_index + (step - start_step) * global_batch + r``: a pure
function of ``(seed, step, row)`` once the run's start is fixed, ``(0, 0)`` for a fresh run and
the checkpoint's position on resume. Each process reads only its rows (random access, no
iterator or worker state), all agree on the batch without talking, and a resumed run continues
the exact stream, also when ``--elastic`` changes the global batch from there on.

A checkpoint records the position (epoch, index within the epoch) and a fingerprint of dataset,
tokenizer, ``seq_len`` and seed (`GrainDataset.position`); `GrainDataset.resumed` refuses a
checkpoint of another dataset or tokenizer with a `DatasetMismatchError` naming both.

Two sources: ``hf:PATH``, a Hugging Face dataset on local disk tokenized and packed
(`sharding.training._hfdata`), and ``grain:FILE``, a flat token file cut into consecutive rows;
`dataset_from_arg` turns any ``--data`` value into its dataset.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sharding.training._checkpoint import CheckpointMismatchError
from sharding.training._data import (
    BYTE_VOCAB,
    ArithmeticText,
    DataError,
    TokenFile,
    VocabTooSmallError,
    _check_counts,
)
from sharding.training._hfdata import digest, load_texts, load_tokenizer, pack, text_column

# --data values read through Grain: a local Hugging Face dataset, a token file in rows.
HF_PREFIX, GRAIN_PREFIX = "hf:", "grain:"


class DatasetTooSmallError(DataError):
    """The dataset gives fewer rows than one global batch."""


class DatasetMismatchError(CheckpointMismatchError, DataError):
    """The checkpoint to resume was trained on another dataset or tokenizer."""


class GrainDataset:
    """Rows ``int32[N, seq_len + 1]`` served as a stream of seeded per-epoch permutations.

    ``source`` describes where the rows came from (``path``: the ``--data`` value, and the
    fingerprints of dataset and tokenizer) and is saved with every checkpoint.

    Example:
        >>> rows = np.arange(40).reshape(10, 4)
        >>> data = GrainDataset(rows, seed=0, global_batch=4, vocab_size=64,
        ...                     source={"path": "demo", "dataset_fingerprint": "-"})
        >>> epoch0 = np.concatenate([data.rows(s, 0, 4, 3)[:, 0] for s in (0, 1)])
        >>> sorted(np.concatenate([epoch0, data.rows(2, 0, 2, 3)[:, 0]]).tolist())
        [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]
        >>> data.position(3)["position"]
        {'epoch': 1, 'index': 2, 'samples_per_epoch': 10}
    """

    def __init__(
        self,
        rows: np.ndarray,
        *,
        seed: int,
        global_batch: int,
        vocab_size: int,
        source: Mapping[str, Any],
        start_step: int = 0,
        start_index: int = 0,
    ):
        import grain

        self.seed, self.global_batch, self.vocab_size = seed, global_batch, vocab_size
        self.source = dict(source)
        self.start_step, self.start_index = start_step, start_index
        self.seq_len = rows.shape[1] - 1
        self.samples_per_epoch = len(rows)
        self._rows = rows
        # Grain reseeds with seed + epoch: derive its seed so runs of seeds 0 and 1 do not share
        # every epoch but the first.
        grain_seed = int(np.random.SeedSequence([seed, len(rows)]).generate_state(1)[0])
        self._stream = grain.MapDataset.source(rows).shuffle(seed=grain_seed).repeat()
        self.fingerprint = digest(
            self.source.get("dataset_fingerprint"),
            self.source.get("tokenizer_fingerprint"),
            self.seq_len,
            seed,
        )

    def __repr__(self) -> str:
        return (f"GrainDataset({self.source.get('path')!r}, rows={self.samples_per_epoch}, "
                f"seq_len={self.seq_len}, seed={self.seed})")  # fmt: skip

    def check(self, seq_len: int) -> None:
        """Raise `DataError` unless the rows were packed for ``seq_len``."""
        _check_counts(0, 0, seq_len)
        if seq_len != self.seq_len:
            raise DataError(
                f"--data {self.source.get('path')} was packed into rows of seq_len="
                f"{self.seq_len}, not {seq_len}; build it again for --seq {seq_len}"
            )

    def sample(self, step: int, row: int) -> int:
        """The stream index of row ``row`` of the global batch at ``step``."""
        return self.start_index + (step - self.start_step) * self.global_batch + row

    def rows(self, step: int, start: int, stop: int, seq_len: int) -> np.ndarray:
        """Rows ``start:stop`` of the global batch at ``step``: int32 ``[stop - start, seq_len + 1]``."""
        _check_counts(step, stop - start, seq_len)
        self.check(seq_len)
        first = self.sample(step, start)
        if stop > self.global_batch or first < 0:
            raise DataError(
                f"rows {start}:{stop} of step {step}: the global batch has {self.global_batch} "
                f"rows and the stream starts at step {self.start_step} (sample "
                f"{self.start_index}); ask for rows within 0:{self.global_batch} of a later step"
            )
        out = np.empty((stop - start, seq_len + 1), np.int32)
        for i in range(stop - start):
            out[i] = self._stream[first + i]
        return out

    def batch(self, step: int, batch_size: int, seq_len: int) -> np.ndarray:
        """The first ``batch_size`` rows of the global batch at ``step``."""
        return self.rows(step, 0, batch_size, seq_len)

    def position(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` (steps done) records: where the stream stands, the
        fingerprint of dataset + tokenizer + seq_len + seed, and the source."""
        epoch, index = divmod(self.sample(step, 0), self.samples_per_epoch)
        return {
            "fingerprint": self.fingerprint,
            "source": self.source,
            "position": {"epoch": epoch, "index": index,
                         "samples_per_epoch": self.samples_per_epoch},
        }  # fmt: skip

    def resumed(self, step: int, data: Mapping[str, Any]) -> GrainDataset:
        """This dataset continuing at ``step`` from a checkpoint whose ``data`` metadata holds a
        `position`; `DatasetMismatchError` when it was trained on another dataset or tokenizer."""
        saved, pos = data.get("source") or {}, data.get("position")
        bad = []
        if pos is None:
            bad.append(f"--data {data.get('path') or 'none'}, which records no Grain position")
        for flag, name, key in (("--data", "path", "dataset_fingerprint"),
                                ("--tokenizer", "tokenizer", "tokenizer_fingerprint")):  # fmt: skip
            if pos is not None and saved.get(key) != self.source.get(key):
                bad.append(f"{flag} {saved.get(name) or 'none'} (fingerprint {saved.get(key)}), "
                           f"given {self.source.get(name) or 'none'} (fingerprint "
                           f"{self.source.get(key)})")  # fmt: skip
        if not bad and (data.get("fingerprint") != self.fingerprint
                        or pos["samples_per_epoch"] != self.samples_per_epoch):  # fmt: skip
            bad.append(f"fingerprint {data.get('fingerprint')} of dataset + tokenizer + seq + "
                       f"seed, given {self.fingerprint}")  # fmt: skip
        if bad:
            raise DatasetMismatchError(
                f"checkpoint step {step} was trained on another stream: {'; '.join(bad)}. The "
                f"rows would differ, so the run cannot continue; resume with the checkpoint's "
                f"--data and --tokenizer, or train the new data in another --checkpoint-dir"
            )
        start = pos["epoch"] * self.samples_per_epoch + pos["index"]
        return GrainDataset(self._rows, seed=self.seed, global_batch=self.global_batch,
                            vocab_size=self.vocab_size, source=self.source, start_step=step,
                            start_index=start)  # fmt: skip


def _too_small(shown: str, what: str, n_rows: int, batch: int, tokens: int) -> None:
    if n_rows >= batch:
        return
    longest = tokens // batch - 1
    seq = f", --seq {longest} or less" if longest >= 1 else ""
    raise DatasetTooSmallError(
        f"--data {shown} {what}, fewer than one batch of --batch {batch}; use --batch "
        f"{max(n_rows, 1)} or less{seq}, or more data"
    )


def hf_dataset(
    spec: str,
    tokenizer: str | os.PathLike | None,
    text_col: str | None,
    *,
    vocab_size: int,
    seed: int,
    seq_len: int,
    global_batch: int,
) -> GrainDataset:
    """``hf:PATH``: the local Hugging Face dataset at PATH, tokenized with ``tokenizer`` and
    packed into rows of ``seq_len + 1`` tokens (in memory; see `sharding.training._hfdata`)."""
    path = Path(spec[len(HF_PREFIX) :])
    if tokenizer is None:
        raise DataError(
            f"--data {spec} holds text: add --tokenizer PATH, a tokenizer.json (or its folder) "
            f"whose vocabulary fits the model"
        )
    tok, eos, tok_fp = load_tokenizer(tokenizer, vocab_size)
    ds = load_texts(path, spec)
    column = text_column(ds, text_col, spec)
    rows, facts = pack(ds, column, tok, eos, seq_len)
    _too_small(spec, f"packs into {len(rows)} rows of seq_len + 1 = {seq_len + 1} tokens "
               f"({facts['tokens']} tokens from {facts['documents']} documents of column "
               f"{column!r})", len(rows), global_batch, facts["tokens"])  # fmt: skip
    source = {"path": spec, "tokenizer": os.fspath(tokenizer), "text_column": column,
              "documents": facts["documents"], "tokens": facts["tokens"],
              "dataset_fingerprint": facts["fingerprint"], "tokenizer_fingerprint": tok_fp}  # fmt: skip
    return GrainDataset(rows, seed=seed, global_batch=global_batch, vocab_size=vocab_size,
                        source=source)  # fmt: skip


def _file_fingerprint(path: Path) -> str:
    """Size and 64 evenly spaced 64 KiB samples of the file (the whole of one under 4 MiB)."""
    size = path.stat().st_size
    h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=8)
    with path.open("rb") as f:
        for i in range(64):
            f.seek(size * i // 64)
            h.update(f.read(1 << 16))
    return h.hexdigest()


def grain_token_file(
    spec: str, dtype, *, vocab_size: int, seed: int, seq_len: int, global_batch: int
) -> GrainDataset:
    """``grain:FILE``: a flat token file (`TokenFile`, validated the same way) cut into
    consecutive rows of ``seq_len + 1`` tokens, memory-mapped, never read whole."""
    tokens = TokenFile(spec[len(GRAIN_PREFIX) :], dtype=dtype, vocab_size=vocab_size, seed=seed)
    tokens.check(seq_len)
    n = len(tokens) // (seq_len + 1)
    _too_small(spec, f"holds {len(tokens)} tokens, {n} rows of seq_len + 1 = {seq_len + 1}",
               n, global_batch, len(tokens))  # fmt: skip
    rows = tokens.tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)
    source = {"path": spec, "dtype": tokens.dtype.name, "tokens": len(tokens),
              "dataset_fingerprint": _file_fingerprint(tokens.path)}  # fmt: skip
    return GrainDataset(rows, seed=seed, global_batch=global_batch, vocab_size=vocab_size,
                        source=source)  # fmt: skip


def dataset_from_arg(
    path: str | os.PathLike | None,
    vocab_size: int,
    seed: int = 0,
    *,
    seq_len: int | None = None,
    dtype=None,
    tokenizer: str | os.PathLike | None = None,
    text_column: str | None = None,
    global_batch: int | None = None,
):
    """The dataset a ``--data`` argument names: the embedded arithmetic text when ``None``, a
    token file (random windows), or through Grain (`GrainDataset`, needs ``seq_len`` and
    ``global_batch``): ``"hf:PATH"`` a local Hugging Face dataset tokenized with ``tokenizer``
    (column ``text_column``, default ``"text"``), ``"grain:FILE"`` a token file in rows.

    Everything is validated now, before anything compiles: token ids against the model's
    ``vocab_size``, ``seq_len`` if given; ``dtype`` is ``--data-dtype`` (None: from the suffix).

    Example:
        >>> dataset_from_arg(None, vocab_size=256, seed=1)
        ArithmeticText(seed=1)
    """
    text = None if path is None else os.fspath(path)
    hf = text is not None and text.startswith(HF_PREFIX)
    if (tokenizer is not None or text_column is not None) and not hf:
        raise DataError(
            f"--tokenizer and --text-column tokenize a Hugging Face dataset, but --data is "
            f"{text or 'not given'}; pass --data hf:PATH, or drop them"
        )
    if text is not None and text.startswith((HF_PREFIX, GRAIN_PREFIX)):
        if seq_len is None or global_batch is None:
            raise DataError(f"--data {text}: pass seq_len and global_batch, rows are packed")
        kw = {"vocab_size": vocab_size, "seed": seed, "seq_len": seq_len,
              "global_batch": global_batch}  # fmt: skip
        if not hf:
            return grain_token_file(text, dtype, **kw)
        if dtype is not None:
            raise DataError(f"--data {text} is text, tokenized by --tokenizer; drop --data-dtype")
        return hf_dataset(text, tokenizer, text_column, **kw)
    if path is None:
        if vocab_size < BYTE_VOCAB:
            raise VocabTooSmallError(
                f"the embedded arithmetic text uses byte tokens (ids 0..255), but the model's "
                f"vocab_size={vocab_size}; use vocab_size >= {BYTE_VOCAB} (another --model or "
                f"--size) or pass --data with a token file whose ids fit"
            )
        data: ArithmeticText | TokenFile = ArithmeticText(seed=seed)
    else:
        data = TokenFile(path, dtype=dtype, vocab_size=vocab_size, seed=seed)
    if seq_len is not None:
        data.check(seq_len)
    return data
