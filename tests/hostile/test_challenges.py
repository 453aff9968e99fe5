"""A challenge flood with no credential (issue 31): two strangers' addresses ask for all the
challenges they can get; a member joining next still gets its nonce and its session, and
the coordinator holds nothing for the flood (control/nonces.py)."""

from __future__ import annotations

from pathlib import Path

import httpx

from cellswarm.swarm.local.up import LocalSwarm
from tests.members import join


def test_a_challenge_flood_from_two_addresses_locks_no_member_out(
    demo_path: Path, tmp_path: Path
) -> None:
    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        got, refused = {}, []
        for stranger in ("127.0.0.2", "127.0.0.3"):  # all of 127/8 is loopback
            transport = httpx.HTTPTransport(local_address=stranger)
            with httpx.Client(transport=transport, timeout=30) as http:
                answers = [http.post(f"{swarm.url}/v1/challenge", json={"count": 4096})
                           for _ in range(40)]  # fmt: skip
            got[stranger] = sum(len(a.json().get("nonces", [])) for a in answers
                                if a.status_code == 200)  # fmt: skip
            refused += [a.text for a in answers if a.status_code != 200]
        assert join(swarm, "m1")  # its challenge: refused by the old, full table
        assert sum(got.values()) >= 131_072  # what filled the old table half-way each
        assert refused and all("faster than" in r for r in refused)  # rate-limited
