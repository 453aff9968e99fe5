"""The data plane's frames: round trips, and every malformed input refused with a clear error."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import cellswarm
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


# -- the handshake: each link proves its own key, both ways (swarm/auth.py, issue 56) ------


async def _handshake(listener_keys: dict[str, bytes], dial_key: bytes, name: str,
                     forge_welcome: bool = False) -> str:  # fmt: skip
    """A listener holding `listener_keys` (or, forging, one that holds none and answers every
    proof with a welcome of its own making) and a dialer proving `dial_key` as `name`: what
    the listener admitted, and what the dialer concluded."""
    from cellswarm.swarm.auth import new_nonce, prove
    from cellswarm.swarm.ring.frames import accept, connect, write_frame

    admitted: list[str | None] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if forge_welcome:  # a stranger at the address the wiring named
            await write_frame(writer, Frame("challenge", {"nonce": new_nonce()}))
            await read_frame(reader)
            await write_frame(writer, Frame("welcome", {"mac": prove(b"x" * 32, "n", name)}))
        else:
            admitted.append(await accept(reader, writer, listener_keys))
        await asyncio.sleep(0.1)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        _, writer = await connect("127.0.0.1", port, dial_key, name)
        writer.close()
        said = "connected"
    except ProtocolError as exc:
        said = str(exc)
    await asyncio.sleep(0.05)
    server.close()
    return f"{admitted} {said}"


def test_a_link_admits_only_the_name_its_key_is_for_and_proves_itself_back() -> None:
    mine, other = b"k" * 32, b"o" * 32
    keys = {"stage-1": mine, "coordinator": other}
    assert asyncio.run(_handshake(keys, mine, "stage-1")) == "['stage-1'] connected"
    # the right key under another name, another key under the right name: refused, and told
    for key, name in ((mine, "coordinator"), (other, "stage-1"), (mine, "stage-7")):
        said = asyncio.run(_handshake(keys, key, name))
        assert said.startswith("[None]") and "refused us" in said, said
    # a listener that cannot prove the link's key back is not our peer
    said = asyncio.run(_handshake({}, mine, "stage-1", forge_welcome=True))
    assert "did not prove the link's key" in said, said


def test_sealed_link_keys_open_only_with_their_node_key_and_label() -> None:
    from cellswarm.swarm.auth import new_link_key, open_key, seal_key

    node, link = new_link_key(), new_link_key()
    sealed = seal_key(node, "7|prev", link)
    assert bytes.fromhex(sealed) != link and open_key(node, "7|prev", sealed) == link
    assert open_key(node, "8|prev", sealed) != link  # another epoch's label
    assert open_key(new_link_key(), "7|prev", sealed) != link  # another node's key
    with pytest.raises(cellswarm.RequestError, match="is not 32 bytes in hex"):
        open_key(node, "7|prev", "zz")


def test_each_role_on_a_link_sends_only_its_own_frames() -> None:
    from cellswarm.swarm.protocol.dataplane import (
        End,
        Failed,
        Generate,
        Hidden,
        Prefix,
        Reset,
        Scored,
        Stats,
        Token,
    )  # fmt: skip
    from cellswarm.swarm.ring.stage import sends

    ring = [Hidden(seq=1, pos=0, ep=1), Prefix(seq=1, ep=1), Token(seq=1, token=2, ep=1, at=3),
            Scored(seq=1, ep=1, logprobs=[]), End(seq=1, ep=1), Failed(seq=1, ep=1)]  # fmt: skip
    control = [Reset(epoch=2), Stats()]
    start = Generate(req="r", max_tokens=1)
    assert all(sends("stage-3", m) for m in ring)
    assert not any(sends("stage-3", m) for m in [*control, start])  # a stage cannot reset
    assert all(sends("coordinator", m) for m in control)
    assert not any(sends("coordinator", m) for m in [*ring, start])  # nor play a stage
    assert sends("client", start) and not any(sends("client", m) for m in ring)
