"""Proving membership of a swarm: HMAC challenge-response over a shared cluster token.

On every connection the listening side sends a fresh random nonce; the connecting side
answers HMAC-SHA256(token, nonce | its peer id). The token never crosses the wire, a proof
is bound to one nonce (so replaying a recorded proof fails), and the peer id it names must
be one the listener expects (so a node outside the current placement is refused).
The token comes from a file, never from the command line (where `ps` would show it).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cellswarm.errors import RequestError

NONCE_BYTES = 32

OPERATOR = "operator"  # the peer id an operator (the CLI, doctor) proves the cluster token under


def load_token(path: str | os.PathLike[str]) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise RequestError(f"token file {p} does not exist; create one with 32+ random bytes")
    token = p.read_bytes().strip()
    if len(token) < 16:
        raise RequestError(f"token file {p} holds {len(token)} bytes; use at least 16")
    return token


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def prove(token: bytes, nonce: str, peer: str) -> str:
    return hmac.new(token, f"{nonce}|{peer}".encode(), hashlib.sha256).hexdigest()


def verify(token: bytes, nonce: str, peer: str, proof: str) -> bool:
    return hmac.compare_digest(prove(token, nonce, peer), proof)


def digest(secret: str) -> str:
    """What a database keeps of a secret it must recognise (a node's session): its sha256."""
    return hashlib.sha256(secret.encode()).hexdigest()


def node_binding(folder: Path, node_id: str) -> str:
    """What binds a node id to this node's home: the sha256 of a secret made at its first
    start and kept there (0600). A process started again from the same home re-joins under
    its id; another that holds the cluster token but not this file cannot take the id over
    (issue 56: a member re-joining as a ring's node had its work dropped and its place)."""
    path = folder / f"{hashlib.sha256(node_id.encode()).hexdigest()[:32]}.key"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # two starts at once: one secret wins
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_secret(path: str | os.PathLike[str], data: str | bytes) -> None:
    """A secret file (a token), readable by its owner only from its first byte, replaced
    atomically: written to a 0600 file beside it, fsynced, renamed over it."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- a node's own keys on the data plane ----------------------------------------------------
# Every member holds the cluster token, so a proof of the token says "a member", never which
# one. On the data plane each link proves a key only its two ends hold: the coordinator
# proves a key derived from the node's session (which only that node and the database know),
# and for each wiring it deals every link of a ring (stage k -> k + 1, a stage -> its part
# servers) a fresh random key, sealed to each end under that end's node key.

KEY_BYTES = 32
# A swarm without a cluster token (loopback only) keys its data plane all the same, from each
# node's session under this empty secret: a local process that never joined holds no key, and
# cannot drive a stage (issue 56: a stranger made a token-less stage 0 blame itself).
NO_TOKEN = b""
COORDINATOR = "coordinator"  # the name the coordinator proves on the data plane
RESERVED_IDS = frozenset({COORDINATOR, "client", OPERATOR})  # never a node's id


def node_key(token: bytes, session_digest: str) -> bytes:
    """The key a node and the coordinator share on the data plane: from the node's session
    (its sha256, as the database keeps it), so a member that joined as another node cannot
    derive it."""
    return hmac.new(token, f"node-link|{session_digest}".encode(), hashlib.sha256).digest()


def new_link_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _pad(key: bytes, label: str) -> bytes:
    return hmac.new(key, f"seal|{label}".encode(), hashlib.sha256).digest()


def seal_key(key: bytes, label: str, link_key: bytes) -> str:
    """link_key sealed to the holder of `key` (hex): XORed with a pad only `key` makes, one
    pad per label (an epoch and a link's name), so a frame read on the wire gives nothing."""
    return bytes(a ^ b for a, b in zip(link_key, _pad(key, label), strict=True)).hex()


def open_key(key: bytes, label: str, sealed: str) -> bytes:
    """seal_key's inverse; RequestError if it is not a sealed key."""
    try:
        raw = bytes.fromhex(sealed)
    except ValueError:
        raw = b""
    if len(raw) != KEY_BYTES:
        raise RequestError(f"a sealed link key of {len(sealed)} characters is not {KEY_BYTES} "
                           "bytes in hex")  # fmt: skip
    return bytes(a ^ b for a, b in zip(raw, _pad(key, label), strict=True))
