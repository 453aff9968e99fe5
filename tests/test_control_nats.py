"""Heartbeats through a real NATS server (`--control nats://...`, control/beats.py): a swarm
beats through it and serves; with NATS killed it carries on over HTTP, nobody lost.

Without nats-server or nats-py the tests skip, unless CELLSWARM_REQUIRE_NATS=1 (CI installs
both and sets it, so there they must run)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cellswarm.lab.nats import NatsServer, why_not
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.waiting import wait_until


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    why = why_not()
    if why:
        if os.environ.get("CELLSWARM_REQUIRE_NATS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    with NatsServer() as server:
        yield server


def beats_via(url: str) -> dict[str, float]:
    """The coordinator's heartbeat counters by transport, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        if fam.name == "cellswarm_heartbeats":
            return {s.labels["via"]: s.value for s in fam.samples if s.name.endswith("_total")}
    return {}


def test_a_swarm_beats_through_nats_and_over_http_without_it(
    demo_path: Path, tmp_path: Path, nats_server: NatsServer
) -> None:
    with LocalSwarm(str(demo_path), 2, "256M", tmp_path, stages=2,
                    control=nats_server.url) as swarm:  # fmt: skip
        before = swarm.wait_ready()
        out = client.call(swarm.url, "/v1/requests", {"prompt": "The capital of France is",
                                                      "max_tokens": 4})  # fmt: skip
        wait_until(lambda: client.call(swarm.url, f"/v1/requests/{out['request_id']}")["state"]
                   == "done", 120)  # fmt: skip
        via = beats_via(swarm.url)
        http_before = via["http"]
        time.sleep(1.0)  # 4 more beats a worker
        via = beats_via(swarm.url)
        assert via["nats"] >= 8 and via["http"] == http_before  # all beats on NATS now
        nats_server.stop()  # NATS gone: the workers beat over HTTP, nobody is lost
        time.sleep(3 * swarm.heartbeat_timeout_s)
        status = client.call(swarm.url, "/v1/status")
        assert [n["state"] for n in status["nodes"]] == ["assigned", "assigned"]
        assert status["epoch"] == before["epoch"] and status["wired"]
        assert beats_via(swarm.url)["http"] > http_before


def test_a_stranger_on_the_subject_is_refused_and_a_bad_beat_answered_alone(
    demo_path: Path, tmp_path: Path, nats_server: NatsServer
) -> None:
    """Anyone on the NATS server may publish: the coordinator still wants a joined node's
    session for the batch and for each beat."""
    import nats

    from cellswarm.swarm.auth import prove
    from cellswarm.swarm.control.beats import SUBJECT

    with LocalSwarm(str(demo_path), 0, "120M", tmp_path, control=nats_server.url) as swarm:
        token = swarm.token_file.read_bytes().strip()
        nonce = client.call(swarm.url, "/v1/challenge", {})["nonce"]
        session = client.call(swarm.url, "/v1/join", {
            "node_id": "r1", "nonce": nonce, "proof": prove(token, nonce, "r1"),
            "capabilities": {"memory_bytes": 1 << 20}})["session"]  # fmt: skip

        async def ask(body: object) -> dict[str, object]:
            nc = await nats.connect(nats_server.url)
            try:
                msg = await nc.request(SUBJECT, json.dumps(body).encode(), timeout=10)
                return dict(json.loads(msg.data))
            finally:
                await nc.close()

        stranger = asyncio.run(ask({"node_id": "x", "session": "y", "beats": []}))
        assert stranger["status"] == 401 and "no such session" in str(stranger["error"])
        assert asyncio.run(ask([1, 2]))["status"] == 400
        mixed = asyncio.run(ask({"node_id": "r1", "session": session, "beats": [
            {"node_id": "r1", "session": session}, {"node_id": "r1", "session": "wrong"}]}))
        answers = mixed["answers"]
        assert isinstance(answers, list) and "error" not in answers[0]
        assert "no such session" in answers[1]["error"]
