"""Heartbeats through a real NATS server (`--control nats://...`, transport/beats.py): a swarm
beats through it and serves; with NATS killed it carries on over HTTP, nobody lost.

Without nats-server or nats-py the tests skip, unless CELLSWARM_REQUIRE_NATS=1 (CI installs
both and sets it, so there they must run)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cellswarm.lab.nats import NatsServer, why_not
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.members import join
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


def beats_via(url: str, tls: ssl.SSLContext | None = None) -> dict[str, float]:
    """The coordinator's heartbeat counters by transport, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30, verify=tls or True).text
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


def test_a_stranger_on_every_subject_hears_no_session_and_forges_or_replays_nothing(
    demo_path: Path, tmp_path: Path, nats_server: NatsServer
) -> None:
    """The worst case: a NATS server anyone may use. A stranger subscribed to every subject
    hears the beats and their answers, but no session (a beat is sealed with a key derived
    from it, transport/beats.py); a heard beat sent again is refused as replayed, an altered
    one (a forged "refused", which used to knock a stage out) as a seal that does not hold,
    and the old unsealed form as not sealed; the worker keeps its shard, the epoch stays."""
    import nats

    from cellswarm.swarm.transport.beats import SUBJECT, NatsBeats, unseal

    with LocalSwarm(str(demo_path), 2, "256M", tmp_path, stages=2,
                    control=nats_server.url) as swarm:
        before = swarm.wait_ready()
        session = join(swarm, "r1")
        token = swarm.token_file.read_bytes().strip()

        async def scenario() -> dict[str, dict[str, Any]]:
            stranger = await nats.connect(nats_server.url)
            heard: list[tuple[str, bytes]] = []

            async def hear(msg: Any) -> None:
                heard.append((msg.subject, msg.data))

            await stranger.subscribe(">", cb=hear)
            ours = NatsBeats(nats_server.url, "r1", token)
            answer = await ours.beat({"node_id": "r1", "session": session}, 10)
            assert answer is not None and "epoch" in answer
            await asyncio.sleep(1.5)  # the worker's beats too
            beats = [d for subject, d in heard if subject == SUBJECT]
            assert any(b'"r1"' in d for d in beats) and any(b'"r1"' not in d for d in beats)
            assert len(heard) > len(beats)  # the answers, heard on their inboxes
            for _, data in heard:
                assert session.encode() not in data and b'"session"' not in data
            ours_heard = next(d for d in beats if b'"r1"' in d)
            worker_heard = next(d for d in beats if b'"r1"' not in d)
            mac, _, env = unseal(worker_heard)
            env["seq"] += 10**6
            env["beats"][0]["refused"] = "forged by a stranger"
            forged = mac.encode() + b"\n" + json.dumps(env).encode()
            old_form = json.dumps({"node_id": "r1", "session": "guess", "beats": []}).encode()
            replies = {}
            for name, data in [("replayed", ours_heard), ("forged", forged),
                               ("unsealed", old_form)]:  # fmt: skip
                msg = await stranger.request(SUBJECT, data, timeout=10)
                replies[name] = json.loads(msg.data)
            await ours.close()
            await stranger.close()
            return replies

        replies = asyncio.run(scenario())
        assert replies["replayed"]["status"] == 401 and "replayed" in replies["replayed"]["error"]
        assert replies["forged"]["status"] == 401 and "does not hold" in replies["forged"]["error"]
        assert replies["unsealed"]["status"] == 400
        time.sleep(1.0)
        status = client.call(swarm.url, "/v1/status")
        worker = next(n for n in status["nodes"] if n["node_id"] != "r1")
        assert worker["state"] == "assigned" and status["epoch"] == before["epoch"]


def test_a_node_ignores_an_answer_whose_seal_does_not_hold() -> None:
    """A stranger who hears a beat's reply subject could race the coordinator's answer with
    a forged one (a shard, an epoch): only an answer sealed with the node's key over its
    beat's number is taken; anything else is no answer (the node beats over HTTP)."""
    from cellswarm.swarm.auth import digest
    from cellswarm.swarm.transport.beats import NatsBeats, beat_key, seal

    beats = NatsBeats("nats://127.0.0.1:1", "n1", b"t" * 32)
    key = beat_key(b"t" * 32, digest("session"))
    answer = {"epoch": 7, "shard": None}
    assert beats._answer(key, seal(key, {"seq": beats.seq, "answers": [answer]})) == answer
    assert beats._answer(key, seal(b"other", {"seq": beats.seq, "answers": [answer]})) is None
    assert beats._answer(key, seal(key, {"seq": beats.seq - 1, "answers": [answer]})) is None
    assert beats._answer(key, json.dumps({"answers": [answer]}).encode()) is None
    with pytest.raises(PermissionError, match="gone"):
        beats._answer(key, seal(key, {"seq": beats.seq, "answers": [{"error": "gone"}]}))


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    from cellswarm.swarm.tls import init_ca, issue

    init_ca(tmp_path / "ca")
    init_ca(tmp_path / "other-ca")
    return {"node": issue(tmp_path / "ca", "n1", tmp_path / "n1", hosts=["127.0.0.1"]),
            "other": issue(tmp_path / "other-ca", "n1", tmp_path / "other")}  # fmt: skip


def test_with_tls_nats_admits_only_the_cluster(
    demo_path: Path, tmp_path: Path, certs: dict[str, Path]
) -> None:
    """`cellswarm nats config --token-file --tls`: the swarm beats through NATS over mutual
    TLS with the cluster's user and password; a stranger is refused in plain TCP, with the
    cluster's certificate but no password, with the password but another CA's certificate;
    and a member given --tls never sends the password to a NATS that does not ask for TLS."""
    import nats
    import nats.errors

    from cellswarm.swarm.auth import write_secret
    from cellswarm.swarm.tls import client_context
    from cellswarm.swarm.transport.beats import NATS_USER, connect, nats_password

    if why_not():
        pytest.skip(why_not())
    token = b"a-cluster-token-of-32-characters"
    (tmp_path / "swarm").mkdir()
    write_secret(tmp_path / "swarm" / "cluster.token", token)  # LocalSwarm's, made first
    server = NatsServer(token=token, tls_dir=certs["node"])
    with server, LocalSwarm(str(demo_path), 2, "256M", tmp_path / "swarm", stages=2,
                            control=server.url, tls_dir=str(certs["node"])) as swarm:
        swarm.wait_ready()
        ctx = client_context(certs["node"])
        wait_until(lambda: beats_via(swarm.url, ctx).get("nats", 0) >= 4, 60)
        port = server.port

        async def refused(**options: Any) -> str:
            try:
                nc = await nats.connect(**options, connect_timeout=3, allow_reconnect=False,
                                        max_reconnect_attempts=0)  # fmt: skip
            except (OSError, TimeoutError, nats.errors.Error, ssl.SSLError) as exc:
                return type(exc).__name__ + str(exc)
            await nc.close()
            return ""

        async def probes() -> dict[str, str]:
            member = await connect(server.url, "probe", token, certs["node"], 10)
            await member.close()
            return {
                "plain": await refused(servers=[f"nats://127.0.0.1:{port}"]),
                "no password": await refused(servers=[server.url], tls=ctx),
                "other CA": await refused(
                    servers=[server.url], user=NATS_USER, password=nats_password(token),
                    tls=client_context(certs["other"])),
            }

        said = asyncio.run(probes())
        assert all(said.values()), said
    with NatsServer() as plain:  # no TLS: a member with --tls sends it no password

        async def to_plain() -> None:
            await connect(plain.url.replace("nats://", "tls://"), "probe", token,
                          certs["node"], 3)  # fmt: skip

        with pytest.raises(Exception, match="does not require TLS"):
            asyncio.run(to_plain())


def test_nats_down_at_start_is_an_outage_like_any_other(
    demo_path: Path, tmp_path: Path
) -> None:
    """A coordinator and a worker started with --control while nothing listens there serve
    over HTTP at once (it used to never serve HTTP and log a traceback every 2 s); when the
    NATS server comes up they move their beats to it; SIGTERM stops the coordinator."""
    if why_not():
        pytest.skip(why_not())
    server = NatsServer()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        server.port = int(s.getsockname()[1])
    with LocalSwarm(str(demo_path), 2, "256M", tmp_path, stages=2,
                    control=server.url) as swarm:  # fmt: skip
        before = swarm.wait_ready()
        out = client.call(swarm.url, "/v1/requests", {"prompt": "The capital of France is",
                                                      "max_tokens": 4})  # fmt: skip
        assert client.wait(swarm.url, out["request_id"], timeout_s=120)["state"] == "done"
        assert beats_via(swarm.url)["nats"] == 0
        with server:
            wait_until(lambda: beats_via(swarm.url)["nats"] >= 4, 90)
            status = client.call(swarm.url, "/v1/status")
            assert status["epoch"] == before["epoch"]
        coordinator = swarm.procs["coordinator"]
        coordinator.terminate()
        assert coordinator.wait(30) is not None


class _Core:
    """The seam transport/beats.py answers NATS beats through (its Coordinator protocol),
    with a core thread a test can stall: every node's session is `session-<id>`."""

    def __init__(self, token: bytes) -> None:
        from collections import Counter
        from concurrent.futures import ThreadPoolExecutor
        from types import SimpleNamespace

        self.id, self.token, self.config = "c1", token, SimpleNamespace(tls_dir=None)
        self.core, self.beats_via = ThreadPoolExecutor(1), Counter[str]()
        self.heard: list[str] = []

    def key(self, node_id: str) -> bytes:
        from cellswarm.swarm.auth import digest
        from cellswarm.swarm.transport.beats import beat_key

        return beat_key(self.token, digest(f"session-{node_id}"))

    def authenticate(self, node_id: str, session: str) -> Any:
        raise PermissionError("HTTP is not this test's")

    def authenticate_sealed(self, beat: Any, mac: str, raw: bytes) -> tuple[Any, bytes, int]:
        from types import SimpleNamespace

        from cellswarm.swarm.transport.beats import holds

        key = self.key(str(beat["node_id"]))
        if not holds(key, mac, raw):
            raise PermissionError("a seal that does not hold")
        return SimpleNamespace(node_id=str(beat["node_id"])), key, int(beat["seq"])

    def held_sealed(self, env: Any, mac: str, raw: bytes) -> bytes | None:
        from cellswarm.swarm.transport.beats import holds, seal

        key = self.key(str(env["node_id"]))
        if len(env["beats"]) != 1 or not holds(key, mac, raw):
            return None
        return seal(key, {"seq": env["seq"], "answers": [{"held": True}]})

    def heartbeat(self, node: Any, beat: Any) -> dict[str, object]:
        self.heard.append(node.node_id)
        return {"epoch": 1}


def test_nats_beats_are_answered_side_by_side_not_one_after_another(
    nats_server: NatsServer,
) -> None:
    """nats-py hands a subscription's messages to its callback one at a time, and the
    coordinator used to answer inside it: each message waited for the one before it to reach
    the core thread and come back. At 100,000 simulated nodes (`python -m
    bench.control_plane --via nats`) 2,500 racks' batches queued so and 18,760-97,920 beats
    timed out with the core half idle. At a test's scale the same class shows in a stall:
    the core is busy 6 s (a slow fsync, a placement pass) while 24 nodes beat; each must
    hear "held" after BEAT_ANSWER_S, side by side, well inside its own 4 s timeout (one
    after another, the fifth would have waited 5 s), and every beat is recorded after."""
    from cellswarm.swarm.transport.beats import NatsBeats, subscribe

    token = b"t" * 32
    fake = _Core(token)

    async def scenario() -> list[dict[str, object] | None]:
        task = await subscribe(fake, nats_server.url)  # type: ignore[arg-type]
        nodes = [NatsBeats(nats_server.url, f"n{i}", token) for i in range(24)]
        try:
            deadline = time.monotonic() + 30
            while await nodes[0].beat({"node_id": "n0", "session": "session-n0"}, 2) is None:
                assert time.monotonic() < deadline, "the coordinator never subscribed"
            for node in nodes[1:]:  # connected, so that only the answers are timed below
                assert await node.beat({"node_id": node.name, "session": f"session-{node.name}"},
                                       4) is not None  # fmt: skip
            fake.heard.clear()
            fake.core.submit(time.sleep, 6.0)
            return await asyncio.gather(*[
                node.beat({"node_id": node.name, "session": f"session-{node.name}"}, 4)
                for node in nodes])  # fmt: skip
        finally:
            for node in nodes:
                await node.close()
            task.cancel()

    answers = asyncio.run(scenario())
    assert answers == [{"held": True}] * 24
    wait_until(lambda: len(fake.heard) == 24, 30)  # recorded when the core came back
    assert sorted(fake.heard) == sorted(f"n{i}" for i in range(24))
    fake.core.shutdown()
