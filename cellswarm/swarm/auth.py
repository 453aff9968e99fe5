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
