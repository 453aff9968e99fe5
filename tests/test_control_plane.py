"""The coordinator's control plane on a real swarm: what a heartbeat costs the database."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from cellswarm.errors import RequestError
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.protocol import PROTOCOL
from cellswarm.swarm.protocol.messages import Shard


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


def test_the_store_keeps_its_rows_in_memory_written_through(tmp_path: Path) -> None:
    """On SQLite the rows are read from memory; every write reaches the file first, and a
    transaction that fails drops the copy (the next read sees what the file holds)."""
    from cellswarm.swarm.control.store import Node, NodeId, Store

    store = Store(tmp_path / "c.db")
    node = Node(NodeId("a"), "spare", "s", {"memory_bytes": 1}, "h", 1.0, 1.0)
    store.put_node(node)
    gen = store.membership
    store.update_node("a", state="assigned", shard=Shard(slot=0, n=1, role="stage"))
    assert store.membership_changed(gen) and not store.membership_changed(store.membership)
    store.nodes()  # the copy is loaded (without one, any write may be a change)
    gen = store.membership  # a completion's counter or a beat's memory: no placement input
    store.update_node("a", served=3, rss_bytes=5, last_seen_s=2.0)
    assert not store.membership_changed(gen) and store.node("a").served == 3  # type: ignore[union-attr]
    raw = sqlite3.connect(tmp_path / "c.db")
    assert raw.execute("SELECT state FROM nodes").fetchall() == [("assigned",)]
    assert store.node("a") is not None and store.node("a").shard == Shard(slot=0, n=1, role="stage")  # type: ignore[union-attr]
    try:
        with store.transaction():
            store.update_node("a", state="lost")
            assert store.node("a").state == "lost"  # type: ignore[union-attr]
            raise RuntimeError("a later write failed")
    except RuntimeError:
        pass
    assert store.node("a").state == "assigned"  # type: ignore[union-attr]  # rolled back
    store.set_meta("epoch", "7")
    assert store.get_meta("epoch") == "7" and store.get_meta("nothing", "d") == "d"
    assert [n.node_id for n in store.nodes()] == ["a"]


def test_placing_many_spares_asks_the_splitter_once_a_stage_count() -> None:
    """100,000 spares too small for the model: a placement pass is O(nodes), not a split
    per node count (that was quadratic, and the monitor asks on every change)."""
    from cellswarm.errors import BudgetError
    from cellswarm.swarm.control.membership import place
    from cellswarm.swarm.control.store import Node, NodeId

    nodes = [Node(NodeId(f"n{i:06d}"), "spare", "s", {"memory_bytes": 1 << 20}, "h", float(i),
                  float(i)) for i in range(100_000)]  # fmt: skip
    asked: list[tuple[int, int]] = []

    def split(count: int, memory_bytes: int) -> list[tuple[int, int]]:
        asked.append((count, memory_bytes))
        raise BudgetError("too small")

    assert place(nodes, split, None, max_stages=30) == ([], {})
    assert len(asked) == 30 and asked[-1] == (30, 1 << 20)


def test_a_bigger_swarm_beats_less_often_and_waits_longer(demo_path: Path, tmp_path: Path) -> None:
    from cellswarm.swarm.control.coordinator import Beat, Coordinator, CoordinatorConfig

    coord = Coordinator(CoordinatorConfig(str(demo_path), db=str(tmp_path / "c.db"),
                                          heartbeat_s=0.5, heartbeat_timeout_s=3.0,
                                          max_beats_per_s=1000.0))  # fmt: skip
    assert (coord.heartbeat_interval_s(), coord.heartbeat_timeout_s()) == (0.5, 3.0)
    for i in range(10_000):
        coord.beats[f"n{i}"] = Beat(0.0, 0, 0, 0.0)
    assert coord.heartbeat_interval_s() == 10.0  # 10,000 nodes at 1,000 beats a second
    assert coord.heartbeat_timeout_s() == 60.0  # the same 6 intervals


def test_a_racks_heartbeats_in_one_request_each_answered_alone(
    demo_path: Path, tmp_path: Path
) -> None:
    """POST /v1/heartbeats (a rack's relay): each beat its own session and its own answer; a
    bad one is refused alone."""
    from cellswarm.swarm.auth import prove

    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        token = swarm.token_file.read_bytes().strip()
        sessions = {}
        for node in ("r1", "r2"):
            nonce = client.call(swarm.url, "/v1/challenge", {})["nonce"]
            sessions[node] = client.call(swarm.url, "/v1/join", {
                "node_id": node, "nonce": nonce, "proof": prove(token, nonce, node),
                "capabilities": {"memory_bytes": 1 << 20, "protocol": PROTOCOL},
            })["session"]  # fmt: skip
        beats = [{"node_id": "r1", "session": sessions["r1"]},
                 {"node_id": "r2", "session": "not-its-session"}, 7,
                 {"node_id": "r2", "session": sessions["r2"], "rss_bytes": 5}]  # fmt: skip
        with pytest.raises(RequestError, match="no such session"):  # a stranger sends none
            client.call(swarm.url, "/v1/heartbeats", {"node_id": "x", "session": "y",
                                                      "beats": beats})  # fmt: skip
        answers = client.call(swarm.url, "/v1/heartbeats", {
            "node_id": "r1", "session": sessions["r1"], "beats": beats})["answers"]  # fmt: skip
        assert [("error" in a) for a in answers] == [False, True, True, False]
        assert answers[0]["heartbeat_s"] > 0 and "session" in answers[1]["error"]
        status = {n["node_id"]: n for n in client.call(swarm.url, "/v1/status")["nodes"]}
        assert status["r2"]["rss_bytes"] == 5


def test_a_racks_joins_in_one_request_each_proved_alone(demo_path: Path, tmp_path: Path) -> None:
    """A rack's relay asks for its rack's nonces in one challenge and sends their proofs in
    one POST /v1/joins (one commit): each join its own session or its own error, and each
    session then beats as its own node's."""
    from cellswarm.swarm.auth import prove

    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        token = swarm.token_file.read_bytes().strip()
        nonce = client.call(swarm.url, "/v1/challenge", {})["nonce"]
        relay = client.call(swarm.url, "/v1/join", {
            "node_id": "relay", "nonce": nonce, "proof": prove(token, nonce, "relay"),
            "capabilities": {"memory_bytes": 1 << 20, "protocol": PROTOCOL},
        })["session"]  # fmt: skip
        nonces = client.call(swarm.url, "/v1/challenge", {"count": 4})["nonces"]
        caps = {"memory_bytes": 1 << 20, "protocol": PROTOCOL}
        joins = [{"node_id": "a", "nonce": nonces[0], "proof": prove(token, nonces[0], "a"),
                  "capabilities": caps},
                 {"node_id": "b", "nonce": nonces[1], "proof": "forged", "capabilities": caps},
                 {"node_id": "c", "nonce": nonces[0], "proof": prove(token, nonces[0], "c"),
                  "capabilities": caps},  # a nonce is good for one proof
                 {"nonce": nonces[2]},
                 {"node_id": "d", "nonce": nonces[3], "proof": prove(token, nonces[3], "d"),
                  "capabilities": caps, "host": "10.0.0.4"}]  # fmt: skip
        with pytest.raises(RequestError, match="no such session"):  # a stranger sends none
            client.call(swarm.url, "/v1/joins", {"node_id": "x", "session": "y", "joins": joins})
        answers = client.call(swarm.url, "/v1/joins", {
            "node_id": "relay", "session": relay, "joins": joins})["answers"]  # fmt: skip
        assert [("session" in a) for a in answers] == [True, False, False, False, True]
        assert "cluster token" in answers[1]["error"] and "nonce" in answers[2]["error"]
        assert "node_id" in answers[3]["error"] and answers[4]["heartbeat_s"] > 0
        beats = [{"node_id": a["node_id"], "session": a["session"]} for a in answers
                 if "session" in a]  # fmt: skip
        beaten = client.call(swarm.url, "/v1/heartbeats", {
            "node_id": "relay", "session": relay, "beats": beats})["answers"]  # fmt: skip
        assert not any("error" in a for a in beaten)
        status = {n["node_id"]: n for n in client.call(swarm.url, "/v1/status")["nodes"]}
        assert sorted(status) == ["a", "d", "relay"]
        db = sqlite3.connect(tmp_path / "coordinator.db")
        hosts = dict(db.execute("SELECT node_id, host FROM nodes"))
        assert hosts["d"] == "10.0.0.4" and hosts["a"] == hosts["relay"]  # the relay's address
        with pytest.raises(RequestError, match="count must be"):
            client.call(swarm.url, "/v1/challenge", {"count": 100_000})


def test_a_node_that_joins_again_drops_its_old_loss_note(demo_path: Path, tmp_path: Path) -> None:
    """A lost node's note ("no heartbeat for ...") is history once it joins again (issue 30:
    `status` showed stale loss notes on healthy nodes); an offline node's note stays."""
    from cellswarm.swarm.control.coordinator import Coordinator, CoordinatorConfig

    coord = Coordinator(CoordinatorConfig(str(demo_path), db=str(tmp_path / "c.db")))
    caps = {"memory_bytes": 1 << 20, "protocol": PROTOCOL}
    for node_id in ("a", "b"):
        coord.join(node_id, coord.challenge(), "", caps, "127.0.0.1")
    a = coord.store.node("a")
    assert a is not None
    coord.lose(a, "no heartbeat for 2.2 s")
    coord.store.update_node("b", state="offline", message="offline after 2 failures in a row")
    for node_id in ("a", "b"):
        coord.join(node_id, coord.challenge(), "", caps, "127.0.0.1")
    again_a, again_b = coord.store.node("a"), coord.store.node("b")
    assert again_a is not None and again_b is not None
    assert again_a.state == "spare" and again_a.message == ""
    assert again_b.state == "offline" and "2 failures" in again_b.message


def test_a_run_is_blamed_on_the_nodes_that_ran_it_not_on_who_holds_its_replica_now(
    demo_path: Path, tmp_path: Path
) -> None:
    """A head taken out mid-run (its shard gone) still completes its lease: the run belongs to
    the replica it was leased on and to that head alone, not to whoever holds that replica
    now (an honest node moved in was marked, then evicted, for a flipped-bit node's results
    under --verify: seen in tests/test_jobs_swarm.py's flipped-bit test)."""
    from cellswarm.swarm.control.coordinator import Coordinator, CoordinatorConfig

    coord = Coordinator(CoordinatorConfig(str(demo_path), db=str(tmp_path / "c.db")))
    for node_id in ("bad", "honest"):
        caps = {"memory_bytes": 1 << 20, "protocol": PROTOCOL}
        coord.join(node_id, coord.challenge(), "", caps, "127.0.0.1")
    whole = Shard(slot=0, n=1, role="stage", stage=0, layers=(0, 30), replica=0)
    coord.store.update_node("bad", state="assigned", shard=whole)
    job_id = coord.submit({"prompt": "hi", "max_tokens": 2}).job_id
    assert len(coord.queue.lease("bad", "0", 1)) == 1
    # taken out mid-run; the honest node now holds replica 0
    coord.store.update_node("bad", state="evicted", shard=None)
    coord.store.update_node("honest", state="assigned", shard=whole)
    bad = coord.store.node("bad")
    assert bad is not None
    assert coord._run_nodes(bad, job_id) == ("0", ["bad"])
    honest = coord.store.node("honest")
    assert honest is not None
    assert coord._run_nodes(honest, job_id) == ("0", ["honest"])


def test_a_head_that_joins_again_gives_its_leases_back_unspent(
    demo_path: Path, tmp_path: Path
) -> None:
    """A worker killed and restarted faster than its silence makes it lost joins again under
    its id: the old process's leases go back to the queue at once, no attempt spent (they
    expired as failed attempts: a job whose head was killed 3 times died in the churn test
    under a CPU hog)."""
    from cellswarm.swarm.control.coordinator import Coordinator, CoordinatorConfig

    coord = Coordinator(CoordinatorConfig(str(demo_path), db=str(tmp_path / "c.db")))
    caps = {"memory_bytes": 1 << 20, "protocol": PROTOCOL}
    whole = Shard(slot=0, n=1, role="stage", stage=0, layers=(0, 30), replica=0)
    coord.join("head", coord.challenge(), "", caps, "127.0.0.1")
    coord.store.update_node("head", state="assigned", shard=whole)
    job_id = coord.submit({"prompt": "hi", "max_tokens": 2}).job_id
    for _ in range(3):  # killed and back three times, each time holding the job
        assert [j.job_id for j in coord.queue.lease("head", "0", 1)] == [job_id]
        coord.join("head", coord.challenge(), "", caps, "127.0.0.1")
        job = coord.queue.get(job_id)
        assert job is not None and job.state == "queued" and job.attempts == 0, job
        coord.store.update_node("head", state="assigned", shard=whole)
