"""Join challenges (control/nonces.py, issue 31): single use, expiring, bounded in all and
per address, so one flooding host cannot take the pool the others join from."""

from __future__ import annotations

import pytest

from cellswarm.errors import RequestError
from cellswarm.swarm.control.nonces import Nonces


def test_a_nonce_is_good_once_and_only_until_it_expires() -> None:
    pool = Nonces(ttl_s=30.0)
    a, b = pool.issue(2, "10.0.0.1", now_s=0.0)
    assert pool.take(a, now_s=1.0)
    assert not pool.take(a, now_s=1.0)  # used up
    assert not pool.take(b, now_s=31.0)  # expired
    assert not pool.take("never issued", now_s=1.0)


def test_one_address_cannot_take_the_pool_from_the_others() -> None:
    pool = Nonces(cap=100, per_address=40)
    pool.issue(40, "stranger", now_s=0.0)
    with pytest.raises(RequestError, match="stranger holds 40 unanswered challenges"):
        pool.issue(1, "stranger", now_s=1.0)
    member = pool.issue(1, "10.0.0.2", now_s=1.0)[0]  # another address still joins
    assert pool.take(member, now_s=2.0)


def test_the_pool_is_bounded_and_refills_as_nonces_expire() -> None:
    pool = Nonces(ttl_s=30.0, cap=10, per_address=10)
    pool.issue(10, "a", now_s=0.0)
    with pytest.raises(RequestError, match="10 challenges are outstanding"):
        pool.issue(1, "b", now_s=29.0)
    assert len(pool.issue(10, "b", now_s=30.0)) == 10  # all ten of "a" expired at 30 s
    assert len(pool) == 10


def test_a_flood_expires_in_one_pass_per_nonce() -> None:
    """262,144 challenges, then as many again a TTL later: the expiry pops each once from
    the front (the old dict-front purge was quadratic: a 24 s freeze of the loop)."""
    pool = Nonces()
    for k in range(64):
        pool.issue(4096, f"10.0.{k}.1", now_s=0.0)
    for k in range(64):
        pool.issue(4096, f"10.1.{k}.1", now_s=31.0)
    assert len(pool) == 262_144
