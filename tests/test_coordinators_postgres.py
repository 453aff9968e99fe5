"""Several coordinators on one PostgreSQL database: any of them answers, one leads, and when
the leader is killed mid-batch the others take over without losing or repeating a job."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import cellswarm
from cellswarm.engine.model import GenerateOptions
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.test_coordinator import TEXTS, wait_for

pytestmark = pytest.mark.slow  # PostgreSQL and swarms of processes

MAX_TOKENS = 32
N_REQUESTS = 30


@pytest.fixture(scope="module")
def expected(demo_path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the single-process engine's greedy tokens) per text."""
    model = cellswarm.load(demo_path)
    opts = GenerateOptions(MAX_TOKENS, stop_ids=frozenset())
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    return [(p, model.generate(p, opts).token_ids) for p in prompts]


def leader_of(swarm: LocalSwarm) -> tuple[str, str]:
    """The leading coordinator's process name and URL."""
    for k, url in enumerate(swarm.urls):
        if client.call(url, "/v1/status", timeout_s=5)["leader"]:
            return (f"coordinator-{k}" if k else "coordinator"), url
    raise AssertionError("no coordinator leads")


@pytest.mark.slow
def test_the_leader_killed_mid_batch_loses_and_repeats_nothing(
    demo_path: Path, tmp_path: Path, pg_url: str, expected: list[tuple[list[int], list[int]]]
) -> None:
    with LocalSwarm(str(demo_path), 3, "128M", tmp_path, coordinators=2, db=pg_url,
                    leader_ttl_s=2.0) as swarm:  # fmt: skip
        swarm.wait_ready()
        leader, leader_url = leader_of(swarm)
        other = next(u for u in swarm.urls if u != leader_url)
        follower: dict[str, Any] = client.call(other, "/v1/status")
        follower_id = follower["coordinator"]
        assert not follower["leader"] and follower["wired"]  # the database says so
        assert {n["node_id"] for n in follower["nodes"]} == {f"worker-{i}" for i in range(3)}
        prompt_of: dict[str, int] = {}
        for i in range(N_REQUESTS):  # half through each coordinator
            url = swarm.urls[i % 2]
            k = i % len(expected)
            rid = client.submit(url, {"prompt": expected[k][0], "max_tokens": MAX_TOKENS,
                                      "request_id": f"r{i}"})  # fmt: skip
            prompt_of[rid] = k
        ids = list(prompt_of)

        def progress() -> int:
            return sum(client.call(other, f"/v1/requests/{r}")["n_tokens"] for r in ids)

        wait_for(lambda: progress() >= 40)
        t_kill, kill_ts = time.monotonic(), time.time()
        swarm.kill(leader, signal.SIGKILL)
        assert progress() < N_REQUESTS * MAX_TOKENS  # killed mid-way
        results = {rid: client.wait(other, rid, timeout_s=240) for rid in ids}
        took_s = time.monotonic() - t_kill
        for rid, r in results.items():
            assert r["state"] == "done", r
            assert r["tokens"] == expected[prompt_of[rid]][1], rid
        ledger = client.call(other, "/v1/ledger")
        assert ledger["done"] == N_REQUESTS and ledger["duplicates"] == 0, ledger
        assert ledger["done_without_commit"] == 0 and ledger["dead"] == 0, ledger
        wait_for(lambda: client.call(other, "/v1/status")["leader"], 30)
        status = client.call(other, "/v1/status")
        assert status["wired"] and all(n["state"] == "assigned" for n in status["nodes"])
        # the follower took the lead (and rewired: a new epoch, the heads replayed) while
        # the batch was still running
        events = [json.loads(line) for line in (swarm.log_dir / "coordinator.jsonl").open()
                  if line.strip().endswith("}")]  # fmt: skip
        took_lead = [e["ts"] for e in events
                     if e["event"] == "leader" and e["coordinator"] == follower_id]  # fmt: skip
        last_done = max(e["ts"] for e in events if e["event"] == "completed")
        assert len(took_lead) == 1 and took_lead[0] < last_done
        print(f"leader killed; took over after {took_lead[0] - kill_ts:.1f} s; the rest of "
              f"the batch took {took_s:.1f} s")
