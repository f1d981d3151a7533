"""Training data: an embedded arithmetic byte language, flat token files, and process-local rows.

Every dataset here is addressed by ``(seed, step, row)``: row ``r`` of the global batch at step
``s`` is a pure function of those three numbers. So each process computes only its own rows,
every process agrees on the global batch without communicating, and resuming at any step gives
exactly the batches an uninterrupted run would have seen (no iterator state to checkpoint).

A dataset is anything with ``vocab_size``, ``check(seq_len)`` and
``rows(step, start, stop, seq_len) -> int32[stop - start, seq_len + 1]``; ``batch`` is
``rows(step, 0, batch_size, seq_len)``. The Grain-backed datasets (``hf:PATH``, ``grain:FILE``)
and `dataset_from_arg`, which turns a ``--data`` value into its dataset, are in ``_grain``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np

from sharding.training._errors import TrainingError

BYTE_VOCAB = 256
# Only suffixes that say the dtype; a ".bin" file (nanoGPT writes uint16, others uint32) must say.
_SUFFIX_DTYPES = {".u16": np.dtype("<u2"), ".u32": np.dtype("<u4")}
_CHOOSE = "pass --data-dtype uint16 or --data-dtype uint32"
_OPS = np.array(["+", "-", "*"])


class DataError(TrainingError):
    """Data that cannot feed training as asked."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """The token file does not exist (also a `FileNotFoundError`)."""


class TokenFileFormatError(DataError):
    """The token file's dtype is unknown or its size is not a whole number of tokens."""


class TokenFileTooShortError(DataError):
    """The token file holds fewer than ``seq_len + 1`` tokens."""


class TokenOutOfRangeError(DataError):
    """The token file holds an id the model's embedding has no row for (``token_id``: the largest)."""

    def __init__(self, message: str, token_id: int = -1):
        super().__init__(message)
        self.token_id = token_id


class VocabTooSmallError(DataError):
    """The model's vocabulary cannot hold the dataset's tokens."""


def _check_counts(step: int, n_rows: int, seq_len: int) -> None:
    least = {"step": (step, 0), "rows": (n_rows, 0), "seq_len": (seq_len, 1)}
    bad = {k: v for k, (v, lo) in least.items() if not isinstance(v, int | np.integer) or v < lo}
    if bad:
        raise DataError(
            "batch arguments must be integers with step >= 0, rows >= 0 and seq_len >= 1, got "
            + ", ".join(f"{k}={v!r}" for k, v in bad.items())
        )


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 token ids in ``[0, 256)``.

    Example:
        >>> encode("1+2").tolist()
        [49, 43, 50]
    """
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Text of byte tokens; invalid UTF-8 (a model's early samples) shows as U+FFFD, not an error.

    Example:
        >>> decode(encode("12 + 30 = 42\\n"))
        '12 + 30 = 42\\n'
    """
    ids = np.asarray(tokens).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= BYTE_VOCAB):
        raise DataError(
            f"decode takes byte tokens in [0, {BYTE_VOCAB}), got ids from {ids.min()} to "
            f"{ids.max()}; decode a token file's ids with its own tokenizer"
        )
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ArithmeticText:
    """An embedded byte "language" of arithmetic lines such as ``"37 + 485 = 522\\n"``.

    Half the lines add, a quarter subtract (results may be negative), a quarter multiply; sum and
    difference operands have 1 to 3 digits, products 1 to 2. Format and digit statistics are
    learnt fast, arithmetic slowly: a 2-layer, 128-wide byte transformer (AdamW 3e-3, batch
    32 x 128) falls from ln 256 ~ 5.6 to ~1.4 nats per byte in 200 steps, 1.33 by step 600;
    exact arithmetic would reach ~0.86. Each row starts a stream of lines drawn by numpy's PCG64
    from ``(seed, step, row)``: identical on every machine, no download.

    Example:
        >>> data = ArithmeticText(seed=0)
        >>> data.batch(step=0, batch_size=2, seq_len=15).shape
        (2, 16)
        >>> decode(data.batch(0, 1, 40)[0]).splitlines()[0]
        '34 - 871 = -837'
    """

    seed: int = 0
    vocab_size: ClassVar[int] = BYTE_VOCAB

    def check(self, seq_len: int) -> None:
        """Every ``seq_len`` fits: the stream is unbounded."""
        _check_counts(0, 0, seq_len)

    def line_text(self, step: int, row: int, n_lines: int) -> str:
        """The first ``n_lines`` lines of the stream of ``(seed, step, row)``."""
        rng = np.random.default_rng([self.seed, step, row])
        op = rng.choice(3, size=n_lines, p=[0.5, 0.25, 0.25])
        most = np.where(op == 2, 3, 4)
        # Draw the digit count first, then a value with that many digits: short operands stay
        # common, and leading zeros never appear.
        digits = rng.integers(1, most, (2, n_lines))
        a, b = rng.integers(np.where(digits == 1, 0, 10 ** (digits - 1)), 10**digits)
        result = np.select([op == 0, op == 1], [a + b, a - b], a * b)
        return "".join(
            f"{x} {o} {y} = {r}\n" for x, o, y, r in zip(a, _OPS[op], b, result, strict=True)
        )

    def rows(self, step: int, start: int, stop: int, seq_len: int) -> np.ndarray:
        """Rows ``start:stop`` of the global batch at ``step``: int32 ``[stop - start, seq_len + 1]``."""
        _check_counts(step, stop - start, seq_len)
        # The shortest line, "0 + 0 = 0\n", has 10 bytes: this many lines fill the window.
        n_lines = (seq_len + 1) // 10 + 1
        out = np.empty((stop - start, seq_len + 1), np.int32)
        for i, row in enumerate(range(start, stop)):
            out[i] = encode(self.line_text(step, row, n_lines))[: seq_len + 1]
        return out

    def batch(self, step: int, batch_size: int, seq_len: int) -> np.ndarray:
        """``batch_size`` rows of ``seq_len + 1`` tokens for ``step``, int32 ``[B, S + 1]``."""
        return self.rows(step, 0, batch_size, seq_len)


class TokenFile:
    """A flat binary file of token ids (nanoGPT / levanter: raw little-endian, no header).

    The file is memory-mapped, never read whole. ``dtype`` is the explicit argument (``"uint16"``,
    ``"uint32"`` or a numpy dtype), or else from the suffix: ``.u16`` is uint16, ``.u32`` uint32;
    any other suffix (``.bin`` too) must pass it. With ``vocab_size`` the file is scanned once at
    construction, ``scan_chunk_tokens`` at a time, so a bad id fails here, not as a silent clamp
    or NaN inside a compiled step (without ``vocab_size``, uint32 ids over 2**31 - 1 would wrap in
    the int32 batch); the scan also refuses a uint32 file read as uint16 (every odd uint16 is 0).
    Row ``r`` at ``step`` is the window at the ``r``-th offset drawn by
    ``np.random.default_rng([seed, step])``.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "train.u16")
        >>> np.arange(100, dtype=np.uint16).tofile(path)
        >>> data = TokenFile(path, vocab_size=128)
        >>> x = data.batch(step=0, batch_size=4, seq_len=8)
        >>> x.shape, bool((np.diff(x, axis=1) == 1).all())
        ((4, 9), True)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        dtype=None,
        vocab_size: int | None = None,
        seed: int = 0,
        *,
        scan_chunk_tokens: int = 1 << 21,
    ):
        self.path = Path(path)
        self.seed = seed
        self.vocab_size = vocab_size
        if not self.path.is_file():
            raise DataFileNotFoundError(
                f"token file {str(self.path)!r} does not exist. Write one as raw little-endian "
                f"uint16 (or uint32 for vocabularies over 65536), no header, e.g. "
                f"np.array(tokens, np.uint16).tofile({str(self.path)!r}); or pass no data path "
                f"to train on the embedded arithmetic text"
            )
        self.dtype = self._dtype(dtype)
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise TokenFileFormatError(
                f"token file {str(self.path)!r} has {size} bytes, not a multiple of "
                f"{self.dtype.itemsize} ({self.dtype.name}); it is not a flat {self.dtype.name} "
                f"token file. Pass the dtype it was written with (--data-dtype uint16 or uint32) "
                f"or rewrite it"
            )
        if size == 0:
            raise TokenFileTooShortError(
                f"token file {str(self.path)!r} is empty (0 tokens); write at least --seq + 1 "
                f"tokens (seq_len + 1)"
            )
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        if vocab_size is not None:
            self._check_vocab(vocab_size, scan_chunk_tokens)

    def _dtype(self, dtype) -> np.dtype:
        if dtype is None:
            suffix = self.path.suffix.lower()
            if suffix not in _SUFFIX_DTYPES:
                raise TokenFileFormatError(
                    f"token file {str(self.path)!r}: the suffix {suffix!r} does not say how the "
                    f"tokens are stored; {_CHOOSE}, or name the file .u16 or .u32"
                )
            return _SUFFIX_DTYPES[suffix]
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt is None or dt.kind != "u" or dt.itemsize not in (2, 4):
            name = dtype if dt is None else dt.name
            raise TokenFileFormatError(
                f"token file {str(self.path)!r}: dtype={name} is not a token dtype; {_CHOOSE}"
            )
        return dt.newbyteorder("<")

    def _check_vocab(self, vocab_size: int, chunk: int) -> None:
        if int(vocab_size) != vocab_size or vocab_size < 1 or chunk < 1:
            raise DataError(
                f"vocab_size={vocab_size!r} and scan_chunk_tokens={chunk!r} must be positive ints"
            )
        top, where, n_bad = -1, -1, 0
        odd_nonzero = even_nonzero = False
        # Chunked so a many-GB file costs a few MB of memory; argmax gives the max and its place.
        for lo in range(0, len(self.tokens), chunk):
            part = np.asarray(self.tokens[lo : lo + chunk])
            i = int(part.argmax())
            if int(part[i]) > top:
                top, where = int(part[i]), lo + i
            if top >= vocab_size:
                n_bad += int(np.count_nonzero(part >= vocab_size))
            odd, even = part[1 - lo % 2 :: 2], part[lo % 2 :: 2]
            odd_nonzero = odd_nonzero or bool(odd.any())
            even_nonzero = even_nonzero or bool(even.any())
        n = len(self.tokens)
        if self.dtype.itemsize == 2 and n >= 16 and n % 2 == 0 and even_nonzero and not odd_nonzero:
            # Little-endian uint32 ids below 65536 read as uint16: every high half is 0.
            raise TokenFileFormatError(
                f"token file {str(self.path)!r} read as uint16 has token id 0 at every odd "
                f"position ({n} tokens): it looks like a uint32 file; pass --data-dtype uint32, "
                f"or name it .u32"
            )
        if top >= vocab_size:
            wide = ""
            if self.dtype.itemsize == 4 and top >= 1 << 16:
                wide = (" (read as uint32: a uint16 file read as uint32 gives ids this large; "
                        "if it is one, pass --data-dtype uint16)")  # fmt: skip
            raise TokenOutOfRangeError(
                f"token file {str(self.path)!r} holds token id {top} at position {where} "
                f"({n_bad} of {n} tokens are >= vocab_size), but the model's "
                f"vocab_size={vocab_size} only has ids 0..{vocab_size - 1}{wide}. Use a model "
                f"whose vocabulary covers the ids (vocab_size >= {top + 1}: another --model or "
                f"--size), check --data-dtype, or re-tokenize with the model's tokenizer",
                token_id=top,
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def check(self, seq_len: int) -> None:
        """Raise `TokenFileTooShortError` unless a window of ``seq_len + 1`` tokens fits."""
        _check_counts(0, 0, seq_len)
        if len(self.tokens) < seq_len + 1:
            raise TokenFileTooShortError(
                f"token file {str(self.path)!r} holds {len(self.tokens)} tokens, but seq_len="
                f"{seq_len} needs windows of {seq_len + 1} (inputs plus the shifted target). "
                f"Use --seq {len(self.tokens) - 1} or less (seq_len <= {len(self.tokens) - 1}), "
                f"or a longer file"
            )

    def offsets(self, step: int, stop: int, seq_len: int) -> np.ndarray:
        """Start offsets of rows ``0:stop`` at ``step``; row ``r``'s offset does not depend on ``stop``."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - seq_len, size=stop)

    def rows(self, step: int, start: int, stop: int, seq_len: int) -> np.ndarray:
        """Rows ``start:stop`` of the global batch at ``step``: int32 ``[stop - start, seq_len + 1]``."""
        _check_counts(step, stop - start, seq_len)
        self.check(seq_len)
        out = np.empty((stop - start, seq_len + 1), np.int32)
        for i, off in enumerate(self.offsets(step, stop, seq_len)[start:]):
            out[i] = self.tokens[off : off + seq_len + 1]
        return out

    def batch(self, step: int, batch_size: int, seq_len: int) -> np.ndarray:
        """``batch_size`` random windows of ``seq_len + 1`` tokens, int32 ``[B, S + 1]``."""
        return self.rows(step, 0, batch_size, seq_len)


def process_batch(
    dataset, step: int, global_batch: int, seq_len: int, shardings: Mapping[str, Any]
) -> dict[str, Any]:
    """Step ``step``'s global ``{"inputs", "targets"}`` batch, loading only this process's rows.

    The rows come from what this process's devices hold under ``shardings`` (``[global_batch,
    seq_len]`` each), so any layout works: a batch split over processes loads a slice, a batch
    replicated over processes (e.g. processes split along ``tensor``) loads all of it. ``dataset``
    is any dataset of this module.

    Example:
        >>> import jax
        >>> from jax import sharding as jshard
        >>> from sharding.training import ArithmeticText
        >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jshard.AxisType.Auto,))
        >>> s = jshard.NamedSharding(mesh, jshard.PartitionSpec("data"))
        >>> process_batch(ArithmeticText(), 0, 2, 4, {"inputs": s, "targets": s})["inputs"].shape
        (2, 4)
    """
    shape = (global_batch, seq_len)
    spans = [
        idx[0].indices(global_batch)[:2]
        for s in shardings.values()
        for idx in s.addressable_devices_indices_map(shape).values()
    ]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    window = dataset.rows(step, lo, hi, seq_len)
    local = {"inputs": window[:, :-1], "targets": window[:, 1:]}

    def shard(key: str, idx: tuple) -> np.ndarray:
        start, stop = idx[0].indices(global_batch)[:2]
        return local[key][start - lo : stop - lo][(slice(None), *idx[1:])]

    return {
        k: jax.make_array_from_callback(shape, s, functools.partial(shard, k))
        for k, s in shardings.items()
    }
