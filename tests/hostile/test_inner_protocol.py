"""A member turned hostile (a real session: it holds the cluster token) on the inner
protocol's routes: numbers no field could mean are a 400 naming the field, never a 500,
and the coordinator goes on serving (transport/wire.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.members import join

PROBES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/heartbeat", {"rss_bytes": 10**30}, "rss_bytes"),
    ("/v1/heartbeat", {"rss_bytes": 1e300}, "rss_bytes"),
    ("/v1/heartbeat", {"data_port": 10**30}, "data_port"),  # was a 500 (SQLite overflow)
    ("/v1/heartbeat", {"data_port": -1}, "data_port"),
    ("/v1/heartbeat", {"data_port": 70000}, "data_port"),
    ("/v1/heartbeat", {"clock_offset_s": 1e308}, "clock_offset_s"),
    ("/v1/heartbeat", {"stats": {"busy_s": 10**40}}, "stats.busy_s"),
    ("/v1/jobs/lease", {"n": 10**30}, "n"),
    ("/v1/jobs/lease", {"wait_s": 1e300}, "wait_s"),
    ("/v1/jobs/complete", {"job_id": "x", "fence": 10**30, "result": {}}, "fence"),  # a 500
    ("/v1/fault", {"epoch": 10**30, "kind": "forward"}, "epoch"),
    # a log batch (issue 56): a seq past 2^53 was a bare 500; a ts of 1e400 was stored, and
    # another client's `cellswarm logs` then crashed on it
    ("/v1/logs", {"run": "r", "events": [{"seq": 2**70, "ts": 1.0, "event": "x"}]}, "seq"),
    ("/v1/logs", {"run": "r", "events": [{"seq": 1, "ts": "1e400", "event": "x"}]}, "ts"),
]


def test_numbers_out_of_range_are_a_400_naming_the_field(demo_path: Path, tmp_path: Path) -> None:
    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        session = join(swarm, "m1")
        said = {}
        for route, body, field in PROBES:
            raw = json.dumps({"node_id": "m1", "session": session, **body})
            raw = raw.replace('"1e400"', "1e400")  # a number JSON allows and a float cannot hold
            r = httpx.post(f"{swarm.url}{route}", content=raw, timeout=30,
                           headers={"content-type": "application/json"})  # fmt: skip
            said[(route, field, str(body)[:40])] = (r.status_code, field in r.text)
        assert all(v == (400, True) for v in said.values()), said
        assert client.call(swarm.url, "/healthz")
        beat = client.call(swarm.url, "/v1/heartbeat", {"node_id": "m1", "session": session})
        assert "epoch" in beat
