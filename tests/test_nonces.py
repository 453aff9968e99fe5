"""Join challenges (control/nonces.py, issue 31): stateless nonces, each spent by the one
proof that held over it, issued at a bounded rate per address; a flood stores nothing, so it
can never lock the members out (a bounded table could: 16 of 28 joins were refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cellswarm.errors import RequestError
from cellswarm.swarm.control.nonces import MAX_ADDRESSES, Nonces
from cellswarm.swarm.protocol import PROTOCOL


def test_a_nonce_is_good_until_a_proof_spends_it_or_it_expires() -> None:
    pool = Nonces(ttl_s=30.0)
    a, b = pool.issue(2, "10.0.0.1", now_s=0.0)
    assert pool.good(a, now_s=1.0) and pool.good(a, now_s=1.0)  # checking spends nothing
    assert pool.take(a, now_s=1.0)
    assert not pool.good(a, now_s=1.0) and not pool.take(a, now_s=1.0)  # spent
    assert not pool.good(b, now_s=31.0)  # expired
    assert not pool.good("never issued", now_s=1.0)
    forged = b[:-1] + ("0" if b[-1] != "0" else "1")
    assert not pool.good(forged, now_s=1.0)
    assert not Nonces().good(b, now_s=1.0)  # another process's key
    assert not pool.good(b + "." * 200, now_s=1.0)


def test_a_flood_stores_nothing_and_a_member_still_joins() -> None:
    """64 addresses asking for 4,096 each, twice: the old table held 262,144 and refused
    the next join; here nothing is held, and the spent set holds only proven nonces."""
    pool = Nonces()
    for k in range(64):
        pool.issue(4096, f"10.0.{k}.1", now_s=0.0)
        pool.issue(4096, f"10.0.{k}.1", now_s=0.0)
    assert len(pool) == 0
    member = pool.issue(1, "10.9.0.2", now_s=1.0)[0]
    assert pool.take(member, now_s=2.0) and len(pool) == 1
    pool.spend(member, now_s=40.0)  # spending anything expires the old ones first
    assert len(pool) <= 1


def test_one_address_is_rate_limited_and_the_others_are_not() -> None:
    pool = Nonces(rate=100.0, burst=200)
    assert len(pool.issue(200, "stranger", now_s=0.0)) == 200
    with pytest.raises(RequestError, match="stranger asks for challenges faster than 100"):
        pool.issue(1, "stranger", now_s=0.0)
    assert len(pool.issue(200, "10.0.0.2", now_s=0.0)) == 200  # another address: its own
    assert len(pool.issue(100, "stranger", now_s=1.0)) == 100  # refilled at 100 a second
    with pytest.raises(RequestError, match=r"1\.\.4096"):
        pool.issue(4097, "10.0.0.3", now_s=0.0)


def test_the_rate_buckets_are_bounded() -> None:
    pool = Nonces()
    for k in range(MAX_ADDRESSES + 100):
        pool.issue(1, f"a{k}", now_s=0.0)
    assert len(pool._buckets) == MAX_ADDRESSES


def test_a_stranger_s_failed_joins_spend_no_nonce(demo_path: Path, tmp_path: Path) -> None:
    """Joins with a wrong proof (no token) over fresh nonces: each refused, none spent, and
    the nonce still serves the member who proves the token over it."""
    from cellswarm.swarm.api import client
    from cellswarm.swarm.auth import prove
    from cellswarm.swarm.local.up import LocalSwarm

    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        token = swarm.token_file.read_bytes().strip()
        nonce = client.call(swarm.url, "/v1/challenge", {})["nonce"]
        join = {"node_id": "m1", "nonce": nonce,
                "capabilities": {"memory_bytes": 1 << 20, "protocol": PROTOCOL}}
        for guess in ("", "00" * 32, prove(b"not the token", nonce, "m1")):
            with pytest.raises(Exception, match="proof does not match"):
                client.call(swarm.url, "/v1/join", {**join, "proof": guess})
        assert client.call(swarm.url, "/v1/join", {**join, "proof": prove(token, nonce, "m1")})
        with pytest.raises(Exception, match="used nonce"):  # and now it is spent
            client.call(swarm.url, "/v1/join", {**join, "proof": prove(token, nonce, "m1")})
