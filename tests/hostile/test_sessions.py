"""A node's session crosses the wire (a join's answer; in plain HTTP without --tls), the
cluster token never does: a session unlocks its own node's routes, not an operator's —
no request's timeline, no doctor round over every node (api/log_api.require_operator)."""

from __future__ import annotations

from pathlib import Path

import httpx

from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.members import join


def test_a_session_reads_no_timeline_and_drives_no_doctor(demo_path: Path, tmp_path: Path) -> None:
    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        rid = client.submit(swarm.url, {"prompt": "The capital of France is", "max_tokens": 2})
        header = {"X-Cellswarm-Session": f"m1:{join(swarm, 'm1')}"}
        timeline = httpx.get(f"{swarm.url}/v1/logs/{rid}", headers=header, timeout=30)
        doctor = httpx.post(f"{swarm.url}/v1/doctor", headers=header, json={}, timeout=30)
        assert (timeline.status_code, doctor.status_code) == (401, 401), (timeline, doctor)
        assert "proof of the cluster token" in timeline.text
