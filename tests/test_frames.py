"""The data plane's frames: round trips, and every malformed input refused with a clear error."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cellswarm.errors import ProtocolError
from cellswarm.swarm.ring.frames import PREFIX, Frame, decode, encode, read_frame


@pytest.mark.parametrize(
    "array",
    [None, np.arange(6, dtype=np.int64), np.ones((3, 5), np.float32), np.zeros((0, 4), np.float32),
     np.arange(15, dtype=np.float32).reshape(3, 5).T, np.arange(12, dtype=np.int64)[::3]],
)  # fmt: skip
def test_round_trip(array: np.ndarray | None) -> None:
    raw = encode(Frame("hidden", {"seq": 7, "pos": 3, "first": {"prompt": [1, 2]}}, array))
    f = decode(raw[: PREFIX.size], raw[PREFIX.size :])
    assert f.type == "hidden" and f.fields == {"seq": 7, "pos": 3, "first": {"prompt": [1, 2]}}
    if array is None:
        assert f.array is None
    else:
        np.testing.assert_array_equal(f.array, array)
        assert f.array.dtype == array.dtype


def _read(raw: bytes, max_payload: int = 1 << 20) -> Frame | None:
    async def go() -> Frame | None:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return await read_frame(reader, max_payload)

    return asyncio.run(go())


def test_stream_reading_and_clean_end() -> None:
    raw = encode(Frame("token", {"seq": 1, "token": 5}))
    assert _read(raw) == Frame("token", {"seq": 1, "token": 5})
    assert _read(b"") is None


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda r: r[:-1], "closed inside a frame body"),
        (lambda r: r[:5], "closed inside a frame prefix"),
        (lambda r: b"XXXX" + r[4:], "not a cellswarm frame"),
        (lambda r: r[:-2] + bytes([r[-2] ^ 0xFF]) + r[-1:], "checksum mismatch"),
    ],
)
def test_malformed_frames_are_refused(mangle, message: str) -> None:  # type: ignore[no-untyped-def]
    raw = encode(Frame("hidden", {"seq": 1}, np.ones(8, np.float32)))
    with pytest.raises(ProtocolError, match=message):
        _read(mangle(raw))


def test_oversized_frames_are_refused_before_reading_them() -> None:
    raw = encode(Frame("hidden", {}, np.ones(1000, np.float32)))
    with pytest.raises(ProtocolError, match=r"payload of 4,000 bytes exceeds the limit of 1,000"):
        _read(raw, max_payload=1000)
    with pytest.raises(ProtocolError, match="cannot be sent"):
        encode(Frame("hidden", {}, np.ones(3, np.complex64)))


def test_a_payload_that_does_not_fill_its_shape_is_refused() -> None:
    import msgpack

    head = msgpack.packb({"type": "hidden", "dtype": "f32", "shape": [4]})
    payload = np.ones(3, np.float32).tobytes()
    import zlib

    crc = zlib.crc32(payload, zlib.crc32(head))
    raw = PREFIX.pack(b"CSF1", len(head), len(payload), crc) + head + payload
    with pytest.raises(ProtocolError, match="does not fill shape"):
        _read(raw)
