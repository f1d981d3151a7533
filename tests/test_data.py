"""The data module: embedded arithmetic text, token files, process-local rows and global arrays."""

import collections
import math
import re

import jax
import numpy as np
import pytest
from jax import sharding as jshard

from sharding.training import (
    ArithmeticText,
    DataError,
    DataFileNotFoundError,
    TokenFile,
    TokenFileFormatError,
    TokenFileTooShortError,
    TokenOutOfRangeError,
    VocabTooSmallError,
    dataset_from_arg,
    decode,
    encode,
    process_batch,
)

LINE = re.compile(r"^(\d+) ([-+*]) (\d+) = (-?\d+)$")


def token_file(tmp_path, tokens, name="train.u16", dtype=np.uint16):
    path = tmp_path / name
    np.asarray(tokens, dtype).tofile(path)
    return path


# Embedded arithmetic text.


def test_arithmetic_is_deterministic_across_instances_and_call_order():
    fresh = ArithmeticText(seed=3).batch(5, 4, 64)
    warm = ArithmeticText(seed=3)
    for step in range(5):
        warm.batch(step, 4, 64)
    np.testing.assert_array_equal(warm.batch(5, 4, 64), fresh)
    assert fresh.dtype == np.int32 and fresh.shape == (4, 65)


def test_arithmetic_is_pinned_across_machines():
    # PCG64 streams are platform-independent; this pins the generator and the line format.
    first = decode(ArithmeticText(seed=0).batch(0, 1, 40)[0]).splitlines()[0]
    assert first == "34 - 871 = -837"


def test_arithmetic_steps_seeds_and_rows_differ():
    data = ArithmeticText(seed=0)
    b0, b1 = data.batch(0, 4, 32), data.batch(1, 4, 32)
    assert not np.array_equal(b0, b1)
    assert not np.array_equal(b0, ArithmeticText(seed=1).batch(0, 4, 32))
    assert len({row.tobytes() for row in b0}) == 4


def test_arithmetic_rows_are_a_function_of_the_row_index():
    data = ArithmeticText(seed=2)
    np.testing.assert_array_equal(data.rows(7, 3, 6, 48), data.batch(7, 8, 48)[3:6])


def test_arithmetic_lines_are_correct():
    data = ArithmeticText(seed=0)
    ops = collections.Counter()
    for row in data.batch(0, 16, 256):
        lines = decode(row).split("\n")[:-1]  # the last line is cut by the window
        assert len(lines) >= 15
        for line in lines:
            m = LINE.match(line)
            assert m, line
            a, op, b, result = int(m[1]), m[2], int(m[3]), int(m[4])
            assert result == {"+": a + b, "-": a - b, "*": a * b}[op], line
            ops[op] += 1
    assert set(ops) == {"+", "-", "*"}


def test_arithmetic_is_learnable_from_short_context():
    # A count model over 3 bytes of context is already well below 2 nats: the format and digit
    # statistics are learnt fast; only the result digits need the arithmetic.
    stream = ArithmeticText(seed=0).batch(0, 64, 512).reshape(-1).tobytes()
    joint = collections.Counter(stream[i - 3 : i + 1] for i in range(3, len(stream)))
    ctx = collections.Counter(stream[i - 3 : i] for i in range(3, len(stream)))
    nats = -sum(c * math.log(c / ctx[k[:-1]]) for k, c in joint.items()) / sum(joint.values())
    assert nats < 1.7 < math.log(256)


def test_byte_round_trip():
    text = "12 + 30 = 42\nhéllo ✓"
    tokens = encode(text)
    assert tokens.dtype == np.int32 and tokens.max() < 256
    assert decode(tokens) == text
    assert decode(encode("✓")[:2]) == "\ufffd"  # cut UTF-8 decodes, as a model's samples must
    with pytest.raises(DataError, match=r"byte tokens in \[0, 256\), got ids from 0 to 300"):
        decode([0, 300])


# Token files.


@pytest.mark.parametrize(
    ("name", "dtype", "explicit"),
    [
        ("train.u16", np.uint16, None),
        ("train.bin", np.uint16, "uint16"),
        ("train.u32", np.uint32, None),
        ("tokens.dat", np.uint32, np.uint32),
    ],
)
def test_token_file_windows_are_the_file_at_the_drawn_offsets(tmp_path, name, dtype, explicit):
    high = 60_000 if dtype == np.uint16 else 1_000_000
    raw = np.random.default_rng(0).integers(0, high, 5000).astype(dtype)
    path = token_file(tmp_path, raw, name, dtype)
    data = TokenFile(path, dtype=explicit, vocab_size=high, seed=4)
    assert isinstance(data.tokens, np.memmap) and data.dtype == np.dtype(dtype)
    assert len(data) == 5000
    x = data.batch(9, 6, 32)
    assert x.dtype == np.int32 and x.shape == (6, 33)
    for row, off in zip(x, data.offsets(9, 6, 32), strict=True):
        np.testing.assert_array_equal(row, raw[off : off + 33].astype(np.int64))
    if dtype == np.uint32:
        assert x.max() > 65535


def test_token_file_is_deterministic_and_rows_do_not_depend_on_batch_size(tmp_path):
    path = token_file(tmp_path, np.arange(10_000) % 50_000)
    fresh = TokenFile(path, seed=1).batch(5, 8, 16)
    warm = TokenFile(path, seed=1)
    for step in range(5):
        warm.batch(step, 8, 16)
    np.testing.assert_array_equal(warm.batch(5, 8, 16), fresh)
    np.testing.assert_array_equal(warm.batch(5, 3, 16), fresh[:3])
    np.testing.assert_array_equal(warm.rows(5, 2, 6, 16), fresh[2:6])
    assert not np.array_equal(warm.batch(6, 8, 16), fresh)
    assert not np.array_equal(TokenFile(path, seed=2).batch(5, 8, 16), fresh)


def test_token_file_window_may_span_the_whole_file(tmp_path):
    data = TokenFile(token_file(tmp_path, np.arange(11)))
    np.testing.assert_array_equal(data.batch(0, 2, 10), np.tile(np.arange(11), (2, 1)))


def test_missing_token_file(tmp_path):
    path = tmp_path / "nope.u16"
    with pytest.raises(DataFileNotFoundError, match=r"nope\.u16.*does not exist.*tofile") as e:
        TokenFile(path)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)


def test_token_file_size_not_a_multiple_of_the_dtype(tmp_path):
    path = tmp_path / "odd.u16"
    path.write_bytes(b"\x00" * 5)
    with pytest.raises(TokenFileFormatError, match=r"5 bytes, not a multiple of 2 \(uint16\)"):
        TokenFile(path)


def test_token_file_dtype_errors(tmp_path):
    path = token_file(tmp_path, [1, 2, 3], "tokens.txt")
    with pytest.raises(TokenFileFormatError, match=r"suffix '\.txt'.*--data-dtype uint16"):
        TokenFile(path)
    with pytest.raises(TokenFileFormatError, match=r"dtype=float32 is not a token dtype"):
        TokenFile(path, dtype=np.float32)


def test_token_file_dtype_must_be_stated(tmp_path):
    """A .bin file may be uint16 (nanoGPT) or uint32: it must say, and a wrong guess is caught."""
    path = token_file(tmp_path, np.arange(1000) % 200, "train.bin")
    with pytest.raises(TokenFileFormatError, match=r"suffix '\.bin'.*--data-dtype uint16 or "
                       r"--data-dtype uint32"):  # fmt: skip
        TokenFile(path)
    assert TokenFile(path, dtype="uint16", vocab_size=256).dtype == np.uint16
    wide = token_file(tmp_path, np.arange(1000) % 200, "wide.u16", np.uint32)
    with pytest.raises(TokenFileFormatError, match=r"0 at every odd position.*--data-dtype uint32"):
        TokenFile(wide, vocab_size=256, scan_chunk_tokens=63)  # odd chunks: parity kept
    assert TokenFile(wide, dtype="uint32", vocab_size=256).batch(0, 2, 8).max() < 200
    with pytest.raises(TokenOutOfRangeError, match=r"uint16 file read as uint32.*--data-dtype "
                       r"uint16") as e:  # fmt: skip
        TokenFile(path, dtype="uint32", vocab_size=256)
    assert e.value.token_id >= 1 << 16
    with pytest.raises(TokenFileFormatError, match=r"dtype=int8 is not a token dtype"):
        TokenFile(path, dtype="int8")


def test_token_file_too_short(tmp_path):
    data = TokenFile(token_file(tmp_path, np.arange(10)))
    msg = r"holds 10 tokens, but seq_len=10 needs windows of 11.*seq_len <= 9"
    with pytest.raises(TokenFileTooShortError, match=msg):
        data.check(10)
    with pytest.raises(TokenFileTooShortError, match=msg):
        data.batch(0, 2, 10)
    (tmp_path / "empty.u16").write_bytes(b"")
    with pytest.raises(TokenFileTooShortError, match=r"empty\.u16.*is empty"):
        TokenFile(tmp_path / "empty.u16")


def test_token_out_of_range(tmp_path):
    tokens = np.zeros(20, np.uint16)
    tokens[7] = 300
    path = token_file(tmp_path, tokens)
    msg = r"token id 300 at position 7 \(1 of 20 tokens.*vocab_size=256.*vocab_size >= 301"
    with pytest.raises(TokenOutOfRangeError, match=msg):
        TokenFile(path, vocab_size=256)
    TokenFile(path, vocab_size=301)


def test_vocab_scan_is_chunked_and_finds_the_max_in_a_later_chunk(tmp_path):
    tokens = np.arange(10_000, dtype=np.uint32) % 1000
    tokens[[123, 4567]] = 5000
    tokens[9876] = 70_000  # the max, in the last of many 64-token chunks
    path = token_file(tmp_path, tokens, "big.u32", np.uint32)
    msg = r"token id 70000 at position 9876 \(3 of 10000 tokens are >= vocab_size\)"
    with pytest.raises(TokenOutOfRangeError, match=msg):
        TokenFile(path, vocab_size=4096, scan_chunk_tokens=64)
    TokenFile(path, vocab_size=70_001, scan_chunk_tokens=64)


@pytest.mark.parametrize(
    ("step", "rows", "seq_len", "bad"), [(-1, 2, 4, "step=-1"), (0, 2, 0, "seq_len=0")]
)
def test_bad_batch_arguments(step, rows, seq_len, bad):
    with pytest.raises(DataError, match=bad):
        ArithmeticText().batch(step, rows, seq_len)


# Process-local rows and global arrays.


@pytest.mark.parametrize("kind", ["arithmetic", "file"])
@pytest.mark.parametrize(
    "spec", [jshard.PartitionSpec(("data", "fsdp")), jshard.PartitionSpec()], ids=["split", "rep"]
)
def test_process_batch_is_the_global_batch(tmp_path, kind, spec):
    """Each device's rows of step 5, loaded from its own slice, form exactly `dataset.batch`."""
    if kind == "file":
        data = TokenFile(token_file(tmp_path, np.arange(3000) % 777), vocab_size=777)
    else:
        data = ArithmeticText(seed=3)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jshard.AxisType.Auto,) * 3)  # fmt: skip
    s = jshard.NamedSharding(mesh, spec)
    got = process_batch(data, 5, 8, 16, {"inputs": s, "targets": s})
    want = data.batch(5, 8, 16)
    for key, cols in (("inputs", slice(None, -1)), ("targets", slice(1, None))):
        assert got[key].sharding == s and got[key].dtype == np.int32
        np.testing.assert_array_equal(np.asarray(got[key]), want[:, cols])


# The --data argument.


def test_dataset_from_arg(tmp_path):
    assert dataset_from_arg(None, vocab_size=512, seed=3) == ArithmeticText(seed=3)
    with pytest.raises(VocabTooSmallError, match=r"model's vocab_size=100; use vocab_size >= 256"):
        dataset_from_arg(None, vocab_size=100, seed=0)
    path = token_file(tmp_path, [5, 1, 2, 3])
    data = dataset_from_arg(path, vocab_size=6, seed=1)
    assert isinstance(data, TokenFile) and data.seed == 1
    with pytest.raises(TokenOutOfRangeError, match=r"token id 5 at position 0.*vocab_size=5"):
        dataset_from_arg(path, vocab_size=5)
    with pytest.raises(TokenFileTooShortError, match=r"holds 4 tokens, but seq_len=8"):
        dataset_from_arg(path, vocab_size=6, seq_len=8)
