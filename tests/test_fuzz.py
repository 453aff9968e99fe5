"""Fuzzing, bounded and seeded: the data plane's frame decoder (bytes split across reads, as a
socket delivers them) and the GGUF header walker. Whatever the bytes, the only outcomes are a
value or one of the project's typed errors (cellswarm/errors.py) — no other exception, and
no hang: every read has an end of stream behind it and a timeout around it.

Hypothesis runs derandomized (the same examples every run) with explicit example counts, so
the suite stays a few seconds; raise FUZZ_EXAMPLES (and set FUZZ_RANDOM=1) to search longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cellswarm.errors import CellswarmError, ModelFileError, ProtocolError
from cellswarm.io.gguf_file import GGUFFile, parse_header, read_header
from cellswarm.io.gguf_write import write_gguf
from cellswarm.swarm.ring.frames import (
    MAGIC,
    PREFIX,
    Frame,
    decode,
    encode,
    read_frame,
    read_frame_sync,
)
from cellswarm.verify import verify

pytestmark = pytest.mark.slow  # Hypothesis fuzzing: the full lane

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
FUZZ = settings(  # FUZZ_RANDOM=1: other examples each run (a search, not a regression test)
    max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
MAX_PAYLOAD = 1 << 16  # small limits: the fuzzer reaches them


# -- frames --------------------------------------------------------------------------------

fields = st.dictionaries(
    st.text(max_size=8).filter(lambda k: k not in ("type", "dtype", "shape")),
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
        | st.text(max_size=20) | st.binary(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                     max_size=4),
        max_leaves=10,
    ),
    max_size=5,
)  # fmt: skip
arrays = st.none() | st.builds(
    lambda dtype, shape, seed: np.random.default_rng(seed).integers(-9, 9, shape).astype(dtype),
    st.sampled_from([np.float32, np.int64]),
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
    st.integers(0, 9),
)
frames = st.builds(Frame, st.text(min_size=1, max_size=12), fields, arrays)


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the given offsets (taken modulo its length): what successive reads get."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def read_all_async(chunks: list[bytes]) -> list[Frame]:
    """Every frame of a stream that arrives in `chunks`, one per event-loop turn, then EOF."""

    async def go() -> list[Frame]:
        reader = asyncio.StreamReader()

        async def feed() -> None:
            for c in chunks:
                reader.feed_data(c)
                await asyncio.sleep(0)
            reader.feed_eof()

        task = asyncio.get_running_loop().create_task(feed())
        out = []
        try:
            while (f := await asyncio.wait_for(read_frame(reader, MAX_PAYLOAD), 5)) is not None:
                out.append(f)
        finally:
            await task
        return out

    return asyncio.run(go())


def read_all_sync(chunks: list[bytes]) -> list[Frame]:
    """The same through a blocking socket, a thread sending the chunks, then closing."""
    a, b = socket.socketpair()
    b.settimeout(5)

    def send() -> None:
        for c in chunks:
            a.sendall(c)
        a.close()

    sender = threading.Thread(target=send)
    sender.start()
    out: list[Frame] = []
    try:
        while True:
            try:
                out.append(read_frame_sync(b, MAX_PAYLOAD))
            except ConnectionError as exc:  # the documented end of stream (or a cut frame)
                if isinstance(exc, TimeoutError):
                    raise AssertionError("a read hung") from exc
                return out
    finally:
        sender.join(5)
        b.close()


def same(a: Frame, b: Frame) -> bool:
    if a.type != b.type or a.fields != b.fields or (a.array is None) != (b.array is None):
        return False
    return a.array is None or (a.array.dtype == b.array.dtype and np.array_equal(a.array, b.array))


def _nan_free(frame: Frame) -> bool:
    return msgpack.unpackb(msgpack.packb(frame.fields)) == frame.fields  # NaN != NaN


@FUZZ
@given(st.lists(frames, min_size=1, max_size=4), st.lists(st.integers(0, 1 << 20), max_size=12))
def test_frames_split_anywhere_read_back_whole(batch: list[Frame], cuts: list[int]) -> None:
    batch = [f for f in batch if _nan_free(f)]
    data = b"".join(encode(f, MAX_PAYLOAD) for f in batch)
    for read in (read_all_async, read_all_sync):
        got = read(splits(data, cuts))
        assert len(got) == len(batch) and all(same(a, b) for a, b in zip(got, batch, strict=True))


def _outcome(read: Any, chunks: list[bytes]) -> None:
    with contextlib.suppress(ProtocolError):
        read(chunks)


@FUZZ
@given(st.binary(max_size=300), st.lists(st.integers(0, 1 << 10), max_size=6))
def test_any_bytes_are_frames_or_a_protocol_error(data: bytes, cuts: list[int]) -> None:
    for read in (read_all_async, read_all_sync):
        _outcome(read, splits(data, cuts))


@FUZZ
@given(frames, st.data())
def test_a_damaged_frame_is_a_protocol_error(frame: Frame, data: st.DataObject) -> None:
    """Flipped bytes, cuts and insertions anywhere in valid frames, read split anywhere."""
    raw = bytearray(encode(frame, MAX_PAYLOAD) + encode(Frame("token", {"seq": 1}), MAX_PAYLOAD))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip" and at < len(raw):
            raw[at] ^= data.draw(st.integers(1, 255))
        elif how == "cut":
            del raw[at : at + data.draw(st.integers(1, 16))]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    cuts = data.draw(st.lists(st.integers(0, 1 << 12), max_size=6))
    for read in (read_all_async, read_all_sync):
        _outcome(read, splits(bytes(raw), cuts))


def _frame_with_header(header: Any, payload: bytes) -> bytes:
    """A frame whose checksum is right, so the decoder gets as far as the header's content."""
    head = msgpack.packb(header, use_bin_type=True)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return PREFIX.pack(MAGIC, len(head), len(payload), crc) + head + payload


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=6) | st.binary(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=8,
)  # fmt: skip


@FUZZ
@given(
    st.one_of(
        json_like,
        st.fixed_dictionaries(
            {"type": st.text(max_size=6) | json_like},
            optional={"dtype": st.sampled_from(["f32", "i64", "f16"]) | json_like,
                      "shape": st.lists(st.integers(-(2**63), 2**64 - 1) | json_like,
                                        max_size=4) | json_like},
        ),
    ),
    st.binary(max_size=64),
)
@example({"type": "x", "dtype": ["f32"], "shape": [1]}, b"")  # found: TypeError, unhashable
@example({"type": "x", "dtype": "f32", "shape": [0, 2**63]}, b"")  # found: numpy ValueError
@example({"type": "x", "dtype": "f32", "shape": [2.0]}, b"\0" * 8)  # a float size
@example({"type": "x", "dtype": "i64", "shape": [True]}, b"\0" * 8)  # a bool size
@example({"type": "x", "dtype": "f32", "shape": [-1, -1]}, b"\0" * 4)  # numpy's "infer"
@example({"type": "x", "dtype": "f32", "shape": [2**64 - 1, 2**64 - 1]}, b"\0" * 4)
@example({"type": "x", "dtype": "f32", "shape": [3]}, b"\0" * 13)  # not whole values
def test_any_header_is_a_frame_or_a_protocol_error(header: Any, payload: bytes) -> None:
    """Checksummed frames whose msgpack header is anything: the decoder's own checks of the
    type, dtype and shape are all that stands between the header and numpy."""
    raw = _frame_with_header(header, payload)
    try:
        f = decode(raw[: PREFIX.size], raw[PREFIX.size :])
    except ProtocolError:
        return
    assert isinstance(f.type, str)
    if f.array is not None:
        assert f.array.nbytes == len(payload)


# -- the GGUF header walker -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A valid little GGUF file: every metadata value type, nested arrays, four tensors."""
    path = tmp_path_factory.mktemp("fuzz") / "model.gguf"
    rng = np.random.default_rng(0)
    meta = {
        "general.architecture": "llama", "llama.block_count": 1, "llama.context_length": 64,
        "llama.embedding_length": 32, "llama.feed_forward_length": 64,
        "llama.attention.head_count": 2, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "general.name": "fuzz",
        "tokenizer.ggml.tokens": ["a", "bb", "ccc"], "tokenizer.ggml.scores": [0.0, -1.0, -2.0],
        "tokenizer.ggml.token_type": [1, 1, 3], "general.flag": True, "general.neg": -7,
    }  # fmt: skip
    tensors = {
        "token_embd.weight": rng.standard_normal((8, 32)).astype(np.float32),
        "output_norm.weight": np.ones(32, np.float32),
        "blk.0.attn_norm.weight": np.ones(32, np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((64, 32)).astype(np.float32),
    }
    write_gguf(path, meta, tensors)
    return path.read_bytes()


def _walk(data: bytes, tmp: Path) -> None:
    """Every reader of a header over `data`: the prefix parser, the file parser (full and
    skimmed), GGUFFile with every tensor handed out (only ModelFileError may escape), and
    `cellswarm verify` (a CellswarmError)."""
    with contextlib.suppress(ModelFileError):
        parse_header(data, len(data), "model.gguf")
    path = tmp / "model.gguf"
    path.write_bytes(data)
    for skim in (False, True):
        with contextlib.suppress(ModelFileError):
            read_header(path, skim=skim)
    try:
        f = GGUFFile(path)
        f.weights()
    except ModelFileError:
        pass
    with contextlib.suppress(CellswarmError):  # the config too: a missing tensor, a bad value
        verify(path)


@FUZZ
@given(tail=st.binary(max_size=200))
def test_any_bytes_after_the_magic_are_a_header_or_a_model_file_error(
    tail: bytes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _walk(b"GGUF" + tail, tmp_path_factory.mktemp("walk"))


@FUZZ
@given(data=st.data())
def test_a_damaged_header_is_a_model_file_error(
    small_gguf: bytes, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Byte flips, cuts, insertions and planted integers (counts, lengths, types, offsets)
    in a valid file's header."""
    raw = bytearray(small_gguf)
    end = min(len(raw), 1024)  # the header and the start of the data
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(4, end))
        how = data.draw(st.sampled_from(["flip", "cut", "insert", "u32", "u64"]))
        if how == "flip" and at < len(raw):
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "cut":
            del raw[at : at + data.draw(st.integers(1, 64))]
        elif how == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            fmt, top = ("<I", 2**32 - 1) if how == "u32" else ("<Q", 2**64 - 1)
            value = data.draw(st.sampled_from([0, 1, 13, 255, 2**31, top]) | st.integers(0, top))
            raw[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    _walk(bytes(raw), tmp_path_factory.mktemp("walk"))


def test_the_fuzzed_readers_accept_the_valid_file(small_gguf: bytes, tmp_path: Path) -> None:
    """The property above is not vacuous: the undamaged file parses and loads."""
    header = parse_header(small_gguf, len(small_gguf), "model.gguf")
    assert header.metadata["tokenizer.ggml.tokens"] == ["a", "bb", "ccc"]
    path = tmp_path / "model.gguf"
    path.write_bytes(small_gguf)
    assert set(GGUFFile(path).weights()) == {
        "token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_up.weight"
    }  # fmt: skip
    assert issubclass(ModelFileError, CellswarmError)


def test_a_tensor_with_a_zero_dimension_is_refused(tmp_path: Path) -> None:
    """Found by the fuzzer: dimensions (0, 32, 2**62) make a tensor of 0 bytes, which fits
    any file, and numpy then cannot shape the bytes (ValueError)."""
    import gguf

    path = tmp_path / "model.gguf"
    write_gguf(path, {"general.architecture": "llama"},
               {"blk.0.ffn_up_exps.weight": np.ones((2, 4, 32), np.float32)})  # fmt: skip
    t = gguf.GGUFReader(path).tensors[0]
    at = t.field.offset + 8 + len(t.name) + 4  # name length, name, n_dims: the dims
    data = bytearray(path.read_bytes())
    data[at : at + 24] = struct.pack("<3Q", 0, 32, 2**62)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"is corrupt: it says tensor blk\.0\.ffn_up_exps\."
                       r"weight has dimensions \[0, 32, 4611686018427387904\], one of them 0"):
        GGUFFile(path).weights()  # fmt: skip
