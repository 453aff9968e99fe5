"""The coordinator's control plane on a real swarm: what a heartbeat costs the database."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm


def test_heartbeats_live_in_memory_and_reach_the_database_on_change(
    demo_path: Path, tmp_path: Path
) -> None:
    """Heartbeats every 0.1 s for 3 s are 30 a node; the database row is written when
    something changes (on PostgreSQL also when a third of the timeout old, for a leader
    elsewhere): on SQLite, with nothing changing, none (at most a refresh's 3 allowed)."""
    with LocalSwarm(str(demo_path), workers=2, memory="256M", state_dir=tmp_path, stages=2,
                    heartbeat_s=0.1, heartbeat_timeout_s=3.0) as swarm:  # fmt: skip
        swarm.wait_ready()
        time.sleep(1.0)  # past the wiring (ready, data ports: changes, written at once)
        db = sqlite3.connect(tmp_path / "coordinator.db")
        rows: set[tuple[str, float]] = set()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:
            rows |= set(db.execute("SELECT node_id, last_seen_s FROM nodes"))
            time.sleep(0.05)
        status = client.call(swarm.url, "/v1/status")
        stored = dict(db.execute("SELECT node_id, last_seen_s FROM nodes"))
    writes = len(rows) / 2
    assert writes <= 3.0 / (3.0 / 3) + 2, sorted(rows)
    now = time.time()
    for n in status["nodes"]:  # `status` shows the beat in memory, not the older row
        assert now - n["last_seen_s_ago"] >= stored[n["node_id"]] - 0.5


def test_a_100000_line_batch_costs_no_node_its_place(demo_path: Path, tmp_path: Path) -> None:
    """The issue's report: a 100,000-line batch froze the coordinator 14-26 s and every
    worker was declared lost. Tokenized in a thread, written in chunks off the event loop:
    heartbeats keep arriving, nobody is lost, the ring is not rewired."""
    items = [{"prompt": "hi", "max_tokens": 1} for _ in range(100_000)]
    with LocalSwarm(str(demo_path), workers=2, memory="256M", state_dir=tmp_path, stages=2,
                    heartbeat_s=0.25, heartbeat_timeout_s=2.0) as swarm:  # fmt: skip
        before = swarm.wait_ready()
        out = client.call(swarm.url, "/v1/batches", {"name": "big", "items": items})
        assert out["total"] == 100_000
        time.sleep(2 * swarm.heartbeat_timeout_s)  # a node silenced by it is lost by now
        status = client.call(swarm.url, "/v1/status")
        client.call(swarm.url, f"/v1/batches/{out['batch_id']}/cancel", {})
    assert [n["state"] for n in status["nodes"]] == ["assigned", "assigned"], status["nodes"]
    assert status["epoch"] == before["epoch"]
    assert all(n["failures"] == 0 for n in status["nodes"])
