"""Join challenges: single-use nonces, O(1) to issue, take and expire, bounded per address.

A stranger may ask for challenges without proving anything, so what it can cost is bounded:
every nonce lives `ttl_s` (one TTL for all, so the oldest expire first and expiry pops from
the front of a deque — a dict's front is not O(1) once many entries went from it, which made
the old purge quadratic); at most `cap` are held in all, and at most `per_address` are
outstanding for one address, so one flooding host cannot take the pool the others join from.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from cellswarm.errors import RequestError
from cellswarm.swarm.auth import new_nonce

NONCE_TTL_S = 30.0
MAX_NONCES = 262_144  # held at once: a rack's relay asks for its rack's at once
MAX_PER_ADDRESS = MAX_NONCES // 2  # outstanding for one address (a 100,000-node test's relay)


@dataclass
class Nonces:
    ttl_s: float = NONCE_TTL_S
    cap: int = MAX_NONCES
    per_address: int = MAX_PER_ADDRESS
    _live: dict[str, tuple[float, str]] = field(default_factory=dict)  # nonce -> expiry, addr
    _order: deque[tuple[float, str]] = field(default_factory=deque)  # (expiry, nonce), oldest first
    _outstanding: Counter[str] = field(default_factory=Counter)  # address -> live nonces

    def issue(self, count: int, address: str, now_s: float) -> list[str]:
        """`count` fresh nonces for `address`; RequestError (saying when to come back) when
        the pool or the address's share is full."""
        self._expire(now_s)
        if len(self._order) + count > self.cap:
            raise RequestError(f"{len(self._order):,} challenges are outstanding (at most "
                               f"{self.cap:,}): join again in {self.ttl_s:.0f} s")  # fmt: skip
        if self._outstanding[address] + count > self.per_address:
            raise RequestError(f"{address} holds {self._outstanding[address]:,} unanswered "
                               f"challenges (at most {self.per_address:,} per address): join "
                               f"again in {self.ttl_s:.0f} s")  # fmt: skip
        expiry = now_s + self.ttl_s
        fresh = [new_nonce() for _ in range(count)]
        for nonce in fresh:
            self._live[nonce] = (expiry, address)
            self._order.append((expiry, nonce))
        self._outstanding[address] += count
        return fresh

    def take(self, nonce: str, now_s: float) -> bool:
        """Whether `nonce` was issued and is still good; it is used up either way."""
        held = self._live.pop(nonce, None)
        if held is None:
            return False
        self._release(held[1])
        return held[0] > now_s

    def __len__(self) -> int:
        return len(self._live)

    def _expire(self, now_s: float) -> None:
        while self._order and self._order[0][0] <= now_s:
            _, nonce = self._order.popleft()
            held = self._live.pop(nonce, None)
            if held is not None:  # not taken: its address gets the slot back
                self._release(held[1])

    def _release(self, address: str) -> None:
        self._outstanding[address] -= 1
        if self._outstanding[address] <= 0:
            del self._outstanding[address]
