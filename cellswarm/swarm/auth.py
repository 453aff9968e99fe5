"""Proving membership of a swarm: HMAC challenge-response over a shared cluster token.

On every connection the listening side sends a fresh random nonce; the connecting side
answers HMAC-SHA256(token, nonce | its peer id). The token never crosses the wire, a proof
is bound to one nonce (so replaying a recorded proof fails), and the peer id it names must
be one the listener expects (so a node outside the current placement is refused).
The token comes from a file, never from the command line (where `ps` would show it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cellswarm.errors import RequestError

NONCE_BYTES = 32


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
