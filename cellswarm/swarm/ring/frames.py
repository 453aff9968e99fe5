"""The data plane's wire format: one typed frame = a small msgpack header + a raw array buffer.

    magic b"CSF1" | header bytes (u32) | payload bytes (u64) | crc32 of header+payload (u32)
    | header (msgpack map: "type" and fields) | payload (the array's bytes, C order)

No pickle: a header is plain data and a payload is raw numbers whose dtype and shape the
header names, so a peer can never make us run code. Sizes are checked against limits before
anything is read, and the checksum before anything is used.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import socket
import ssl
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict

import msgpack
import numpy as np

from cellswarm.errors import ProtocolError
from cellswarm.swarm.auth import new_nonce, prove, verify
from cellswarm.swarm.protocol.dataplane import DataMessage, PartReset, Reset, ResetDone, fields
from cellswarm.swarm.tls import widen_tls_reads

MAGIC = b"CSF1"
PREFIX = struct.Struct("<4sIQI")  # magic, header bytes, payload bytes, crc32
MAX_HEADER_BYTES = 1 << 16
MAX_PAYLOAD_BYTES = 64 << 20  # one frame; an activation batch is far smaller
# Before a peer has proved the cluster token, the handshake's frames carry no payload: a
# stranger gets a header's worth of our memory, not MAX_PAYLOAD_BYTES per connection.
HANDSHAKE_PAYLOAD_BYTES = 0
DTYPES = {"f32": np.float32, "i64": np.int64}
DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
WIDTHS = {k: np.dtype(v).itemsize for k, v in DTYPES.items()}
MAX_DIMS = 8  # an array's dimensions in a frame (activations are 2-D)


@dataclass(frozen=True)
class Frame:
    """A frame as it travels: its type, its header's other fields (as msgpack decoded them:
    a handler reads them as a typed message, protocol/dataplane.read), maybe an array."""

    type: str
    fields: dict[str, object] = field(default_factory=dict)
    array: np.ndarray | None = None

    @classmethod
    def of(cls, message: DataMessage, array: np.ndarray | None = None) -> Frame:
        """The frame a typed message travels as (its fields at their default left out)."""
        return cls(message.kind, fields(message), array)


def encode(frame: Frame, max_payload: int = MAX_PAYLOAD_BYTES) -> bytes:
    head, payload = encode_parts(frame, max_payload)
    return head if payload is None else b"".join((head, payload))  # the one copy it costs


def encode_parts(
    frame: Frame, max_payload: int = MAX_PAYLOAD_BYTES
) -> tuple[bytes, memoryview | None]:
    """A frame as its prefix and header, and its array's own buffer (not a copy): written
    one after the other, a first step's rows are never copied whole into a frame (a stage
    counts what they take: costs.py FIRST_STEP_COPIES)."""
    header: dict[str, object] = {"type": frame.type}
    header.update(frame.fields)
    a = frame.array
    if a is None:
        head = msgpack.packb(header, use_bin_type=True)
        _check_sizes(len(head), 0, max_payload)
        return PREFIX.pack(MAGIC, len(head), 0, zlib.crc32(head)) + head, None
    dtype = DTYPE_NAMES.get(a.dtype)
    if dtype is None:
        raise ProtocolError(f"array dtype {a.dtype} cannot be sent; use f32 or i64")
    header["dtype"], header["shape"] = dtype, list(a.shape)
    payload = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
    head = msgpack.packb(header, use_bin_type=True)
    _check_sizes(len(head), payload.nbytes, max_payload)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return PREFIX.pack(MAGIC, len(head), payload.nbytes, crc) + head, payload


def _check_sizes(header: int, payload: int, max_payload: int) -> None:
    if header > MAX_HEADER_BYTES:
        raise ProtocolError(f"frame header of {header:,} bytes exceeds {MAX_HEADER_BYTES:,}")
    if payload > max_payload:
        raise ProtocolError(
            f"frame payload of {payload:,} bytes exceeds the limit of {max_payload:,}; "
            "send smaller batches or raise the frame limit"
        )


def decode(prefix: bytes, body: bytes) -> Frame:
    """prefix: PREFIX.size bytes; body: header + payload as the prefix announced."""
    _magic, n_head, _n_payload, crc = PREFIX.unpack(prefix)
    if zlib.crc32(body) != crc:
        raise ProtocolError(f"frame checksum mismatch ({len(body):,} bytes); dropped")
    try:
        header = msgpack.unpackb(memoryview(body)[:n_head], raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"frame header is not valid msgpack ({exc})") from exc
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("frame header is not a map with a string 'type'")
    return Frame(header.pop("type"), header, _array(header, body, n_head))


def _array(header: dict[str, object], body: bytes, offset: int) -> np.ndarray | None:
    """The payload (body[offset:]) as the array the header names, a view of `body`."""
    dtype, shape = header.pop("dtype", None), header.pop("shape", None)
    n_payload = len(body) - offset
    if dtype is None:
        if n_payload:
            raise ProtocolError("frame carries a payload but names no dtype")
        return None
    # Anything may stand here (msgpack decodes lists, maps, floats, huge ints): only a known
    # dtype name and a list of non-negative int sizes reach numpy.
    if (not isinstance(dtype, str) or dtype not in DTYPES or not isinstance(shape, list)
            or not all(type(n) is int and n >= 0 for n in shape) or len(shape) > MAX_DIMS):
        raise ProtocolError(
            f"frame names dtype {_short(dtype)} / shape {_short(shape)}; expected f32|i64 and a "
            f"list of at most {MAX_DIMS} sizes"
        )
    width = WIDTHS[dtype]
    # an empty array's other sizes are bounded too: (0, 2**62) is no array numpy can make
    if math.prod(max(n, 1) for n in shape) * width > max(n_payload, MAX_PAYLOAD_BYTES):
        raise ProtocolError(f"frame names shape {_short(shape)}, larger than any frame holds")
    count = math.prod(shape)  # exact ints: no overflow
    if n_payload != width * count:
        raise ProtocolError(
            f"frame payload of {n_payload} bytes does not fill shape {_short(shape)} of {dtype}"
        )
    return np.ndarray(shape, DTYPES[dtype], body, offset)  # a view of `body`, read-only


def _short(value: object) -> str:
    """A header value for a one-line message, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


async def read_raw(
    reader: asyncio.StreamReader, max_payload: int = MAX_PAYLOAD_BYTES
) -> tuple[bytes, bytes] | None:
    """The next frame's prefix and body, not yet decoded (`decode`); None at a clean end of
    stream. Sizes are checked before a byte of the body is read."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("connection closed inside a frame prefix") from exc
    magic, n_head, n_payload, _ = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"not a cellswarm frame (magic {magic!r})")
    _check_sizes(n_head, n_payload, max_payload)  # before reading a byte of the body
    try:
        body = await reader.readexactly(n_head + n_payload)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("connection closed inside a frame body") from exc
    return prefix, body


async def read_frame(
    reader: asyncio.StreamReader, max_payload: int = MAX_PAYLOAD_BYTES
) -> Frame | None:
    """The next frame, or None at a clean end of stream."""
    raw = await read_raw(reader, max_payload)
    return None if raw is None else decode(*raw)


async def write_frame(writer: asyncio.StreamWriter, frame: Frame) -> None:
    writer.write(encode(frame))
    await writer.drain()


# How long a connection waits for the listener's challenge (a busy peer sends it late).
CHALLENGE_TIMEOUT_S = 30.0


def no_delay(writer: asyncio.StreamWriter) -> None:
    """Send small frames at once: with Nagle's algorithm a one-token frame waits for the
    peer's delayed ACK (~40 ms on Linux), which made every pipeline hop cost that much."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _proof(key: bytes, challenge: Frame | None, peer: str, where: str,
           why: str = "") -> tuple[Frame, str]:  # fmt: skip
    """The answer to a listener's challenge — our proof of the link's key under our name,
    and a nonce of ours for the listener's proof back — and that nonce."""
    if challenge is None or challenge.type != "challenge":
        raise ProtocolError(f"{where} sent no challenge; is it part of this swarm?{why}")
    mine = new_nonce()
    return Frame("proof", {"peer": peer, "mac": prove(key, str(challenge.fields.get("nonce")),
                                                      peer), "nonce": mine}), mine  # fmt: skip


def _check_welcome(key: bytes, answer: Frame | None, nonce: str, peer: str, where: str) -> None:
    """The listener's proof back: it holds the link's key too (a stranger at the address a
    wiring named, or one that refused us, is not our peer)."""
    if answer is not None and answer.type == "denied":
        reason = str(answer.fields.get("reason"))[:200]
        raise ProtocolError(f"{where} refused us as {peer!r}: {reason}")
    mac = str(answer.fields.get("mac", "")) if answer is not None else ""
    if answer is None or answer.type != "welcome" or not verify(key, nonce, f"welcome|{peer}",
                                                                 mac):  # fmt: skip
        raise ProtocolError(f"{where} did not prove the link's key: not the peer we were sent to")


async def connect(
    host: str, port: int, key: bytes | None = None, peer: str = "client",
    tls: ssl.SSLContext | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:  # fmt: skip
    """Open a frame connection (over TLS with a context, swarm/tls.py); with a key (the
    link's, swarm/auth.py; a local pipeline's cluster token), prove it under our name
    `peer` and have the listener prove it back."""
    reader, writer = await asyncio.open_connection(host, port, ssl=tls)
    no_delay(writer)
    if key is None:
        return reader, writer
    where = f"{host}:{port}"
    try:  # bounded: a listener that accepts and says nothing must not hold us for ever
        challenge = await asyncio.wait_for(read_frame(reader, HANDSHAKE_PAYLOAD_BYTES),
                                           CHALLENGE_TIMEOUT_S)  # fmt: skip
        proof, nonce = _proof(key, challenge, peer, where,
                              " (or it refused our TLS certificate)" if tls else "")
        await write_frame(writer, proof)
        answer = await asyncio.wait_for(read_frame(reader, HANDSHAKE_PAYLOAD_BYTES),
                                        CHALLENGE_TIMEOUT_S)  # fmt: skip
        _check_welcome(key, answer, nonce, peer, where)
        widen_tls_reads(writer)
    except TimeoutError:
        writer.close()
        raise ProtocolError(f"{where} did not finish the handshake in {CHALLENGE_TIMEOUT_S:g} s; "
                            "is it part of this swarm, and not stuck?") from None
    except BaseException:
        writer.close()
        raise
    return reader, writer


# Connections of this process that have not proved the token yet, at most (the oldest is
# closed for a newcomer), and how long one may take to: members prove theirs at once, so a
# stranger holding many idle ones costs neither memory nor the members their connections.
MAX_UNPROVEN = 64
PROOF_TIMEOUT_S = 10.0
# A TLS handshake (before our own challenge) gets as long: asyncio's default is 60 s.
TLS_HANDSHAKE_TIMEOUT_S = 10.0
_unproven: collections.OrderedDict[int, asyncio.StreamWriter] = collections.OrderedDict()


class TlsOptions(TypedDict, total=False):
    ssl: ssl.SSLContext
    ssl_handshake_timeout: float


def listen_tls(tls: ssl.SSLContext | None) -> TlsOptions:
    """asyncio.start_server's TLS options: the context, and a bounded handshake with it."""
    return {"ssl": tls, "ssl_handshake_timeout": TLS_HANDSHAKE_TIMEOUT_S} if tls else {}


async def accept(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keys: Mapping[str, bytes],
) -> str | None:  # fmt: skip
    """Challenge a connecting peer; its name when it proved the key `keys` holds for that
    name (after proving it back), else None (after telling it why, in one frame). Its
    answer may not announce a payload: nothing beyond a header is read from a peer before
    it has proved its key."""
    if len(_unproven) >= MAX_UNPROVEN:  # a flood: the oldest unproven goes (a member
        _unproven.popitem(last=False)[1].close()  # proves at once, a stranger never does)
    handle = id(writer)
    _unproven[handle] = writer
    try:
        nonce = new_nonce()
        await write_frame(writer, Frame("challenge", {"nonce": nonce}))
        try:
            answer = await asyncio.wait_for(read_frame(reader, HANDSHAKE_PAYLOAD_BYTES),
                                            PROOF_TIMEOUT_S)  # fmt: skip
        except (TimeoutError, ProtocolError):
            answer = None
    finally:
        _unproven.pop(handle, None)
    peer = str(answer.fields.get("peer", "")) if answer is not None else ""
    key = keys.get(peer)
    theirs = str(answer.fields.get("nonce", "")) if answer is not None else ""
    ok = (
        answer is not None and answer.type == "proof" and key is not None and theirs != ""
        and verify(key, nonce, peer, str(answer.fields.get("mac", "")))
    )  # fmt: skip
    with contextlib.suppress(OSError):  # (gone already, or closed for a newcomer)
        if not ok:
            await write_frame(writer, Frame("denied", {"reason": "no valid proof of a key "
                                                                 "this node holds for that name"}))
            return None
        assert key is not None
        await write_frame(writer, Frame("welcome", {"mac": prove(key, theirs, f"welcome|{peer}")}))
        widen_tls_reads(writer)  # proven: a link's frames come in megabytes (tls.py)
        return peer
    return None


# -- blocking sockets: for calls made from inside a (synchronous) forward pass -------------


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"peer closed the connection ({len(buf)} of {n} bytes read)")
        buf += chunk
    return bytes(buf)


def read_frame_sync(sock: socket.socket, max_payload: int = MAX_PAYLOAD_BYTES) -> Frame:
    """The next frame from a blocking socket; ConnectionError at end of stream."""
    prefix = _recv_exactly(sock, PREFIX.size)
    magic, n_head, n_payload, _ = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"not a cellswarm frame (magic {magic!r})")
    _check_sizes(n_head, n_payload, max_payload)  # before reading a byte of the body
    return decode(prefix, _recv_exactly(sock, n_head + n_payload))


def write_frame_sync(sock: socket.socket, frame: Frame) -> None:
    sock.sendall(encode(frame))


def connect_sync(
    host: str, port: int, key: bytes | None = None, peer: str = "client",
    timeout_s: float = 30.0, tls: ssl.SSLContext | None = None,
) -> socket.socket:  # fmt: skip
    """A blocking frame connection (the same handshakes as `connect`). The timeout bounds
    every later read too, so a hung peer fails a step instead of freezing it."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=host)
        except OSError:
            sock.close()
            raise
    if key is not None:
        where = f"{host}:{port}"
        try:
            proof, nonce = _proof(key, read_frame_sync(sock, HANDSHAKE_PAYLOAD_BYTES), peer, where)
            write_frame_sync(sock, proof)
            _check_welcome(key, read_frame_sync(sock, HANDSHAKE_PAYLOAD_BYTES), nonce, peer, where)
        except BaseException:
            sock.close()
            raise
    return sock


async def reset_stage(
    host: str, port: int, reset: Reset | PartReset, key: bytes | None,
    peer: str = "client",
    timeout_s: float = 5.0, tls: ssl.SSLContext | None = None,
) -> bool:  # fmt: skip
    """Send a stage (or part server) a `reset` frame — a new epoch, and with a coordinator
    the ring's new wiring — and wait for `reset_done`; False if it is silent or gone.
    `reset`: its message (a Reset, a part server's PartReset); `key`: the one the node knows
    us by (a coordinator's: the node's own key, swarm/auth.py node_key)."""
    frame = Frame.of(reset)
    try:
        reader, writer = await asyncio.wait_for(connect(host, port, key, peer, tls), timeout_s)
        await write_frame(writer, frame)
        answer = await asyncio.wait_for(read_frame(reader), timeout_s)
        writer.close()
        return answer is not None and answer.type == ResetDone.kind
    except (OSError, TimeoutError, ConnectionError, ProtocolError):
        return False
