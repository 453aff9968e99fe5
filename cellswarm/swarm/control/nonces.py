"""Join challenges: nonces that cost the coordinator nothing to hold, each good for one proof.

A stranger may ask for challenges without proving anything. A table of issued nonces, however
bounded, lets a flood fill it and lock the members out (issue 31: 64 requests of 4,096 took
all 262,144 places; 16 of 28 joins were refused). So a nonce is *stateless*: its expiry, 16
random bytes and an HMAC of both under a key only this process knows. Issuing stores nothing;
checking one recomputes the HMAC. What is stored is only the nonces *spent by a proof that
held* (the token's), until they expire, so a replayed proof finds its nonce used — and that
set grows with members' joins, never with a stranger's requests. What a stranger can still
cost is CPU: issuing is rate-limited per address (a token bucket, RATE_PER_ADDRESS a second,
BURST at once), with the buckets of at most MAX_ADDRESSES addresses kept.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from cellswarm.errors import RequestError

NONCE_TTL_S = 30.0
RATE_PER_ADDRESS = 16_384.0  # nonces a second for one address (a relay asks for its racks)
BURST = 65_536  # at once (the 100,000-node bench's relay, 64 racks in flight)
MAX_ADDRESSES = 65_536  # rate buckets kept; the least recently seen goes first
MAX_COUNT = 4096  # nonces in one request
MAX_NONCE_CHARS = 128  # ours are 77


@dataclass
class Nonces:
    ttl_s: float = NONCE_TTL_S
    rate: float = RATE_PER_ADDRESS
    burst: int = BURST
    _key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    _spent: dict[str, float] = field(default_factory=dict)  # nonce -> its expiry
    _order: deque[tuple[float, str]] = field(default_factory=deque)  # spent, oldest first
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)

    def issue(self, count: int, address: str, now_s: float) -> list[str]:
        """`count` fresh nonces for `address`; RequestError (saying when to come back) when
        the address asks faster than its rate."""
        if not 1 <= count <= MAX_COUNT:
            raise RequestError(f"count = {count}: ask for 1..{MAX_COUNT} challenges at once")
        self._draw(address, count, now_s)
        expiry = f"{int((now_s + self.ttl_s) * 1000):x}"
        return [self._sign(f"{expiry}.{secrets.token_hex(16)}") for _ in range(count)]

    def good(self, nonce: str, now_s: float) -> bool:
        """Whether this process issued `nonce`, it has not expired and no proof spent it."""
        body = nonce.rpartition(".")[0]
        if not body or len(nonce) > MAX_NONCE_CHARS:
            return False
        if not hmac.compare_digest(self._sign(body), nonce):
            return False
        expiry_s = int(body.partition(".")[0], 16) / 1000  # ours: it parses
        return expiry_s > now_s and nonce not in self._spent

    def spend(self, nonce: str, now_s: float) -> None:
        """A proof over `nonce` held: it is used up until it would have expired anyway."""
        self._expire(now_s)
        if nonce not in self._spent:
            expiry_s = int(nonce.partition(".")[0], 16) / 1000
            self._spent[nonce] = expiry_s
            self._order.append((expiry_s, nonce))

    def take(self, nonce: str, now_s: float) -> bool:
        """good, then spent: for a caller whose proof over it already held."""
        if not self.good(nonce, now_s):
            return False
        self.spend(nonce, now_s)
        return True

    def __len__(self) -> int:
        return len(self._spent)

    def _sign(self, body: str) -> str:
        mac = hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()[:32]
        return f"{body}.{mac}"

    def _draw(self, address: str, count: int, now_s: float) -> None:
        tokens, at = self._buckets.pop(address, (float(self.burst), now_s))
        tokens = min(float(self.burst), tokens + (now_s - at) * self.rate)
        if tokens < count:
            self._buckets[address] = (tokens, now_s)
            wait_s = (count - tokens) / self.rate
            raise RequestError(f"{address} asks for challenges faster than {self.rate:,.0f} a "
                               f"second: ask again in {max(wait_s, 0.1):.1f} s")  # fmt: skip
        self._buckets[address] = (tokens - count, now_s)  # now the most recently seen
        while len(self._buckets) > MAX_ADDRESSES:
            self._buckets.popitem(last=False)

    def _expire(self, now_s: float) -> None:
        while self._order and self._order[0][0] <= now_s:
            _, nonce = self._order.popleft()
            self._spent.pop(nonce, None)
