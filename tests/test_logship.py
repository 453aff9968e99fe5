"""Logs travel: workers ship their events to the coordinator's database, and
`cellswarm logs ID --coordinator URL` reads one request's timeline from there — on a swarm
whose nodes share no disk (each its own log folder), across a coordinator SIGKILL."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cellswarm.cli import main as cli
from cellswarm.swarm.api import client
from cellswarm.swarm.control.db import Database, open_database
from cellswarm.swarm.control.events import EventStore
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.transport.logship import LogShipper
from tests.waiting import wait_until

# -- the shipper, with a fake sender -------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The coordinator's database: SQLite, and PostgreSQL when its binaries exist."""
    url = str(tmp_path / "c.db") if request.param == "sqlite" else request.getfixturevalue("pg_url")
    d = open_database(url)
    yield d
    d.close()


class FlakySender:
    """Stores each batch in a real EventStore; `lose_ack` stores it, then fails (the answer
    was lost), `down` fails before storing (the coordinator is gone)."""

    def __init__(self, db: Database | None = None) -> None:
        self.store = EventStore(db or open_database(":memory:"))
        self.batches: list[list[int]] = []
        self.down = self.lose_ack = False
        self.run = ""

    def __call__(self, batch: list[dict[str, Any]]) -> None:
        self.batches.append([e["seq"] for e in batch])
        if self.down:
            raise OSError("connection refused")
        self.store.insert("w", self.run, batch, offset_s=0.5, error_s=0.001)
        if self.lose_ack:
            raise OSError("timed out reading the answer")


def event(i: int, rid: str = "r") -> dict[str, Any]:
    return {"ts": 1000.0 + i, "node": "w", "request_id": rid, "event": "step", "i": i}


def test_the_buffer_is_bounded_drops_are_counted_and_order_is_kept() -> None:
    send = FlakySender()
    shipper = LogShipper(send, capacity=5, batch=4, thread=False)
    send.run = shipper.run
    for i in range(8):  # 3 too many: the oldest 3 go
        shipper.add(event(i))
    assert shipper.dropped_total == 3 and shipper.pending() == 5
    while shipper.pending():
        assert shipper.ship_once()
    stored = send.store.timeline("r")
    assert [e["i"] for e in stored if e["event"] == "step"] == [3, 4, 5, 6, 7]  # order kept
    (note,) = [e for e in stored if e["event"] == "log_dropped"]
    assert note["dropped"] == 3 and note["ts"] == 1000.0 + 2 + 0.5  # where the gap is
    assert all(e["clock_offset_s"] == 0.5 for e in stored)
    assert [e["ts"] for e in stored] == sorted(e["ts"] for e in stored)


def test_an_unacknowledged_batch_is_resent_and_stored_once(db: Database) -> None:
    send = FlakySender(db)
    shipper = LogShipper(send, capacity=100, batch=3, thread=False)
    send.run = shipper.run
    for i in range(5):
        shipper.add(event(i))
    send.down = True  # not delivered: kept
    assert not shipper.ship_once() and shipper.pending() == 5
    send.down, send.lose_ack = False, True  # delivered, answer lost: kept, sent again
    assert not shipper.ship_once() and shipper.pending() == 5
    send.lose_ack = False
    assert shipper.ship_once() and shipper.ship_once() and shipper.pending() == 0
    assert send.batches == [[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 5]]  # the same events again
    assert send.store.count("w") == 5  # deduplicated by (node, run, seq)
    assert [e["i"] for e in send.store.timeline("r")] == [0, 1, 2, 3, 4]
    # a restarted node (a new run) numbers from 1 again: not taken for duplicates
    again = LogShipper(send, thread=False)
    send.run = again.run
    again.add(event(9))
    assert again.ship_once() and send.store.count("w") == 6


def test_the_table_is_pruned_by_age_and_by_rows(db: Database) -> None:
    store = EventStore(db, retain_s=3600.0, max_rows=4)
    for k in range(3):
        store.insert("w", "run", [{**event(i), "seq": 10 * k + i} for i in range(3)])
    assert store.count() == 9
    store.prune()
    assert store.count() <= 4
    assert store.prune(now=10**12) > 0 and store.count() == 0  # all older than an hour


# -- a real swarm whose nodes share no disk ------------------------------------------------


@pytest.fixture(scope="module")
def swarm(demo_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(str(demo_path), workers=2, memory="256M", stages=2, own_log_dirs=True,
                    state_dir=tmp_path_factory.mktemp("logship")) as s:  # fmt: skip
        s.wait_ready()
        yield s


def logs_cli(swarm: LocalSwarm, rid: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    capsys.readouterr()
    args = ["logs", rid, "--coordinator", swarm.url, "--token-file", str(swarm.token_file)]
    assert cli(args) == 0
    return capsys.readouterr().out.splitlines()


def local_events(swarm: LocalSwarm, i: int) -> list[dict[str, Any]]:
    path = swarm.node_log_dir(i) / f"worker-{i}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stored_events(swarm: LocalSwarm, node: str) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"file:{swarm.state_dir / 'coordinator.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT event, request_id, node_ts, seq, run FROM events WHERE node=?",
                          (node,)).fetchall()  # fmt: skip
    finally:
        db.close()
    return rows


def same_as_local(swarm: LocalSwarm, i: int) -> bool:
    """The coordinator holds exactly the worker's local log: each event once."""
    local = sorted((e["event"], e["request_id"], e["ts"]) for e in local_events(swarm, i))
    stored = sorted(r[:3] for r in stored_events(swarm, f"worker-{i}"))
    return bool(local) and stored == local


def test_logs_from_every_stage_node_in_time_order(
    swarm: LocalSwarm, capsys: pytest.CaptureFixture[str]
) -> None:
    rid = client.submit(swarm.url, {"prompt": "Once upon a time", "max_tokens": 6})
    assert client.wait(swarm.url, rid, timeout_s=120)["state"] == "done"
    assert not (swarm.state_dir / "logs").exists()  # no shared folder
    wait_until(lambda: all(same_as_local(swarm, i) for i in range(2)), 30)
    # the coordinator ships its own events on a timer too: wait for its "completed"
    wait_until(lambda: any("completed" in ln for ln in logs_cli(swarm, rid, capsys)), 30)
    lines = logs_cli(swarm, rid, capsys)
    clocks = [ln.split()[1] for ln in lines if ln.startswith("clock ")]
    assert sorted(clocks) == ["coordinator", "worker-0", "worker-1"]  # each once
    rows = [ln.split() for ln in lines if not ln.startswith("clock ")]
    ms = [float(r[0]) for r in rows]
    assert ms == sorted(ms)
    hops = [(r[2], r[3]) for r in rows]
    for w in ("worker-0", "worker-1"):  # both stages stepped this request
        assert (w, "step") in hops
    order = [e for _, e in hops]
    assert order.index("submitted") < order.index("leased") < order.index("generate")
    assert order.index("generate") < order.index("done") < order.index("completed")
    # the route is for operators: nothing without a key, a proof or a session
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(f"{swarm.url}/v1/logs/{rid}", timeout=5)
    assert denied.value.code == 401


def test_events_pending_across_a_coordinator_sigkill_arrive_once(
    swarm: LocalSwarm, capsys: pytest.CaptureFixture[str]
) -> None:
    rid = client.submit(swarm.url, {"prompt": "The capital of France is", "max_tokens": 24})
    stops = [sum(e["event"] == "stop" for e in local_events(swarm, i)) for i in range(2)]
    swarm.kill("coordinator")  # SIGKILL, whatever the request is doing
    # meanwhile the workers go on logging (a cut-off worker stops serving and says so)
    wait_until(lambda: all(sum(e["event"] == "stop" for e in local_events(swarm, i)) > stops[i]
                           for i in range(2)), 30)  # fmt: skip
    unsent = [len(local_events(swarm, i)) - len(stored_events(swarm, f"worker-{i}"))
              for i in range(2)]  # fmt: skip
    assert all(n > 0 for n in unsent)  # pending while no coordinator answers
    swarm.start_coordinator()  # the same database, the same port
    assert client.wait(swarm.url, rid, timeout_s=120)["state"] == "done"
    wait_until(lambda: all(same_as_local(swarm, i) for i in range(2)), 30)
    for i in range(2):  # each (run, seq) once, and no seq of a run missing
        keys = [(r[4], r[3]) for r in stored_events(swarm, f"worker-{i}")]
        assert len(keys) == len(set(keys))
        for run in {k[0] for k in keys}:
            seqs = sorted(s for r, s in keys if r == run)
            assert seqs == list(range(1, len(seqs) + 1))
    # the coordinator's own events reach its store from its shipper thread every 0.5 s, maybe
    # later beside a busy core: the request being done does not mean they are stored yet
    wait_until(lambda: any(r[1] == rid for r in stored_events(swarm, "coordinator")), 30)
    lines = logs_cli(swarm, rid, capsys)
    nodes = {ln.split()[2] for ln in lines if re.match(r"\s*-?\d", ln)}
    # the coordinator is killed at once after submitting: the request may run on one
    # worker alone once it is back (the other rejoining later), so one worker is enough
    assert "coordinator" in nodes and nodes & {"worker-0", "worker-1"}, nodes
    swarm.kill("coordinator", signal.SIGTERM)  # a clean stop flushes its own events
