"""A worker never goes silent (issue 30): its heartbeat has a thread and loop of its own, so
a step that blocks the stage's loop for 20 s — longer than the coordinator's heartbeat
timeout, ten times over — costs the node nothing: `status` shows it busy, not lost, and the
request finishes with one process's tokens."""

from __future__ import annotations

import time
from pathlib import Path

from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.conftest import greedy_reference
from tests.waiting import wait_until

STALL_S = 20.0


def test_a_step_that_blocks_20_s_shows_busy_not_lost(demo_path: Path, tmp_path: Path) -> None:
    [(prompt, expected)] = greedy_reference(demo_path, ["The capital of France is"], 8).items()
    with LocalSwarm(str(demo_path), 2, "400M", tmp_path, stages=2,
                    stall_step={1: STALL_S}) as swarm:
        swarm.wait_ready()
        epoch = swarm.status()["epoch"]
        rid = client.submit(swarm.url, {"prompt": list(prompt), "max_tokens": 8})
        seen: list[dict[str, object]] = []

        def busy() -> bool:
            node = next(n for n in swarm.status()["nodes"] if n["node_id"] == "worker-1")
            seen.append(node)
            return float(node["busy_s"]) > 3 * swarm.heartbeat_timeout_s

        wait_until(busy, timeout_s=STALL_S)
        t_busy = time.monotonic()
        while time.monotonic() - t_busy < 4.0:  # well past the heartbeat timeout, still busy
            status = swarm.status()
            assert status["epoch"] == epoch, status  # nobody was lost, nothing rewired
            for n in status["nodes"]:
                assert n["state"] == "assigned" and n["failures"] == 0, n
                assert n["last_seen_s_ago"] < swarm.heartbeat_timeout_s, n
            time.sleep(0.3)
        result = client.wait(swarm.url, rid, timeout_s=120)
        assert result["state"] == "done"
        assert result["tokens"] == expected
        status = swarm.status()
        assert status["epoch"] == epoch
        assert all(n["state"] == "assigned" and n["failures"] == 0 for n in status["nodes"])


CORE_STALL_S = 15.0


def test_a_coordinator_whose_core_stalls_15_s_loses_no_node(
    demo_path: Path, tmp_path: Path
) -> None:
    """The coordinator's core thread — where every database write and placement pass runs —
    stalls 15 s once a job is leased (injected: as a slow disk's fsync or a big placement
    pass would). Its event loop is not that thread: /healthz answers meanwhile, every
    heartbeat is answered ("held"), no worker gives up on its coordinator, no node is lost,
    and the request finishes with one process's tokens."""
    [(prompt, expected)] = greedy_reference(demo_path, ["The capital of France is"], 8).items()
    with LocalSwarm(str(demo_path), 2, "400M", tmp_path, stages=2,
                    stall_core=CORE_STALL_S) as swarm:  # fmt: skip
        swarm.wait_ready()
        epoch = swarm.status()["epoch"]
        rid = client.submit(swarm.url, {"prompt": list(prompt), "max_tokens": 8})

        def stalling() -> bool:
            return any("stalling the core thread" in line for line in swarm.output["coordinator"])

        wait_until(stalling, timeout_s=60)
        t0 = time.monotonic()
        answered = 0
        while time.monotonic() - t0 < CORE_STALL_S - 5:  # within the stall
            assert client.call(swarm.url, "/healthz", timeout_s=5.0) == {"ok": True}
            answered += 1
            time.sleep(0.5)
        assert answered > 0
        result = client.wait(swarm.url, rid, timeout_s=120)
        assert result["state"] == "done"
        assert result["tokens"] == expected
        status = swarm.status()
        assert status["epoch"] == epoch, status  # nobody was lost, nothing rewired
        assert all(n["state"] == "assigned" and n["failures"] == 0 for n in status["nodes"])
        for name in ("worker-0", "worker-1"):  # nobody stopped serving for want of answers
            said = "\n".join(swarm.output[name])
            assert "no coordinator for" not in said, said[-2000:]
