"""The job queue and the node store on PostgreSQL behave as on SQLite, and stay exact with
several coordinators (connections) leasing, expiring and completing at once.

PostgreSQL runs as a throwaway cluster (tests/pg_cluster.py); without its binaries the
PostgreSQL cases skip with the reason, the SQLite ones still run.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cellswarm.swarm.control.coordinator import elect
from cellswarm.swarm.control.db import Database, SQLiteDatabase, open_database
from cellswarm.swarm.control.db_postgres import split_script, translate
from cellswarm.swarm.control.jobs import MAX_ATTEMPTS, SCHEMA, JobQueue, QueueConfig
from cellswarm.swarm.control.store import Node, NodeId, Store
from cellswarm.swarm.protocol.messages import Shard


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "jobs.db")
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def db(url: str) -> Iterator[Database]:
    d = open_database(url)
    yield d
    d.close()


def queue(db: Database, **kw: Any) -> JobQueue:
    return JobQueue(db, QueueConfig(**{"lease_s": 10.0, "backoff_s": 0.5, **kw}))


# -- SQL translation ---------------------------------------------------------------------


def test_placeholders_become_psycopg_ones_and_percent_signs_stay_literal() -> None:
    assert translate("SELECT * FROM t WHERE a=? AND b LIKE 'x%?'") == (
        "SELECT * FROM t WHERE a=%s AND b LIKE 'x%%?'"
    )
    assert translate("UPDATE t SET v=? -- why?\nWHERE k=?") == (
        "UPDATE t SET v=%s -- why?\nWHERE k=%s"
    )
    assert len(split_script(SCHEMA)) == 7  # tables, indexes and one DROP INDEX
    assert split_script("CREATE TABLE a (x TEXT DEFAULT ';'); -- a; b\n;") == [
        "CREATE TABLE a (x TEXT DEFAULT ';')"
    ]


def test_percent_signs_and_rows_on_the_database(db: Database) -> None:
    rows = db.execute("SELECT '50%' AS p, ? AS x", ("a?",))
    assert rows == [{"p": "50%", "x": "a?"}]


# -- the queue, on both databases ---------------------------------------------------------


def test_submit_is_idempotent_by_key(db: Database) -> None:
    q = queue(db)
    a, new_a = q.submit({"prompt": [1, 2]}, idem_key="k1")
    b, new_b = q.submit({"prompt": [9]}, idem_key="k1")
    c, new_c = q.submit({"prompt": [1, 2]})
    assert new_a and not new_b and new_c
    assert b.job_id == a.job_id and b.payload == {"prompt": [1, 2]} and c.job_id != a.job_id
    batch = q.submit_batch("b", [("generate", {"prompt": [i]}) for i in range(4)])
    assert [j.payload["prompt"] for j in q.batch(batch)] == [[0], [1], [2], [3]]
    info = q.batch_info(batch)
    assert info is not None and info["total"] == 4 and info["counts"]["queued"] == 4


def test_lease_fences_and_stale_holders_are_refused(db: Database) -> None:
    q = queue(db, lease_s=1.0)
    job, _ = q.submit({"prompt": [1]})
    [first] = q.lease("head-a", "0", now=100.0)
    assert first.fence == 1 and first.state == "leased"
    assert q.lease("head-b", "0", now=100.0) == []  # leased: nobody else gets it
    assert q.checkpoint(job.job_id, 1, [5, 6], now=100.5)
    assert q.expire(now=102.0) == 1  # not renewed in time: back to the queue
    [second] = q.lease("head-b", "0", now=200.0)
    assert second.fence == 2 and second.tokens == [5, 6] and second.attempts == 1
    assert not q.checkpoint(job.job_id, 1, [5, 6, 7], now=200.1)  # the old holder is stale
    assert q.complete(job.job_id, 1, {"tokens": [5, 6, 7]}, now=200.2) == "stale"
    assert q.fail(job.job_id, 1, "late", now=200.2) == "stale"
    assert q.complete(job.job_id, 2, {"tokens": [5, 6, 8]}, now=200.3) == "done"
    assert q.complete(job.job_id, 2, {"tokens": [5, 6, 8]}, now=200.4) == "stale"
    done = q.get(job.job_id)
    assert done is not None and done.state == "done" and done.tokens == [5, 6, 8]
    assert q.ledger()["duplicates"] == 0 and q.ledger()["done"] == 1


def test_failures_back_off_then_die_after_three(db: Database) -> None:
    q = queue(db, backoff_s=1.0)
    job, _ = q.submit({"prompt": [1]})
    now = 1000.0
    outcomes = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        [held] = q.lease("h", "0", now=now)
        outcomes.append(q.fail(job.job_id, held.fence, f"boom {attempt}", now=now))
        j = q.get(job.job_id)
        assert j is not None and j.attempts == attempt
        if j.state == "queued":
            assert j.not_before_s == now + 2.0 ** (attempt - 1)
            assert q.lease("h", "0", now=now + 0.5) == []  # still backing off
            now = j.not_before_s
    assert outcomes == ["queued", "queued", "dead"]
    dead = q.get(job.job_id)
    assert dead is not None and dead.state == "dead" and "boom 3" in dead.error
    assert q.ledger()["dead"] == 1


def test_release_gives_a_job_back_without_spending_an_attempt(db: Database) -> None:
    q = queue(db)
    job, _ = q.submit({"prompt": [1]})
    [held] = q.lease("h", "0", now=10.0)
    assert q.release(job.job_id, held.fence, now=11.0)
    [again] = q.lease("h", "0", now=12.0)
    assert again.attempts == 0 and again.fence == 2


def test_the_ledger_counts_every_state(db: Database) -> None:
    q = queue(db)
    ids = [q.submit({"prompt": [i]})[0].job_id for i in range(5)]
    held = q.lease("h", "0", n=3, now=10.0)
    assert len(held) == 3
    q.complete(held[0].job_id, held[0].fence, {"tokens": [1]}, now=11.0)
    q.complete(held[1].job_id, held[1].fence, {"tokens": [2]}, now=11.0)
    ledger = q.ledger()
    assert ledger == {"queued": 2, "leased": 1, "done": 2, "dead": 0, "cancelled": 0,
                      "duplicates": 0, "done_without_commit": 0}  # fmt: skip
    assert len(ids) == 5


# -- the store ------------------------------------------------------------------------------


def test_nodes_meta_and_epochs(url: str) -> None:
    a, b = Store(url), Store(url)  # two coordinators' connections
    try:
        node = Node(NodeId("n1"), "spare", "s1", {"memory_bytes": 10}, "127.0.0.1", 1.0, 1.0)
        a.put_node(node)
        got = b.node("n1")
        assert got == node
        b.update_node("n1", state="assigned", shard=Shard(slot=0, n=1, role="stage"))
        moved = a.update_node("n1", last_seen_s=5.0)  # does not undo b's assignment
        assert moved.state == "assigned" and moved.shard == Shard(slot=0, n=1, role="stage")
        with pytest.raises(KeyError):
            a.update_node("nobody", last_seen_s=1.0)
        with pytest.raises(ValueError):
            a.update_node("n1", state="sleeping")
        a.set_meta("layout", "[1]")
        a.set_meta("layout", "[2]")
        assert b.get_meta("layout") == "[2]" and b.get_meta("missing", "x") == "x"
        epochs: list[int] = []
        lock = threading.Lock()

        def bump(store: Store) -> None:
            for _ in range(25):
                e = store.next_epoch()
                with lock:
                    epochs.append(e)

        threads = [threading.Thread(target=bump, args=(s,)) for s in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(epochs) == list(range(1, 51))  # distinct, none lost
    finally:
        a.close()
        b.close()


# -- several coordinators at once (PostgreSQL) ----------------------------------------------


def test_concurrent_coordinators_lease_each_job_once_per_fence(pg_url: str) -> None:
    """Three connections (three coordinators) lease, expire some, and complete from one
    queue until it is empty: every (job, fence) goes to one holder, and every job is
    committed exactly once."""
    setup = JobQueue(open_database(pg_url))
    n_jobs = 120
    for i in range(n_jobs):
        setup.submit({"prompt": [i]}, idem_key=f"k{i}")
    leased: list[tuple[str, int]] = []
    outcomes: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def coordinator(k: int) -> None:
        db = open_database(pg_url)
        q = JobQueue(db, QueueConfig(lease_s=0.05, backoff_s=0.0))
        try:
            idle = 0
            while idle < 20:
                jobs = q.lease(f"head-{k}", str(k), n=3)
                q.expire()
                if not jobs:
                    idle += 1
                    time.sleep(0.01)
                    continue
                idle = 0
                for j in jobs:
                    with lock:
                        leased.append((j.job_id, j.fence))
                    # some holders dawdle past their lease: the job goes elsewhere
                    if (j.fence + k) % 4 == 0:
                        continue
                    out = q.complete(j.job_id, j.fence, {"tokens": j.payload["prompt"]})
                    with lock:
                        outcomes.append(out)
        except BaseException as exc:
            errors.append(exc)
        finally:
            db.close()

    threads = [threading.Thread(target=coordinator, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    counts = Counter(leased)
    assert max(counts.values()) == 1  # no (job, fence) leased twice
    ledger = setup.ledger()
    assert ledger["duplicates"] == 0 and ledger["done_without_commit"] == 0
    assert ledger["done"] + ledger["dead"] == n_jobs and ledger["done"] == outcomes.count("done")
    commits = setup.db.execute("SELECT job_id, COUNT(*) AS n FROM commits GROUP BY job_id")
    assert len(commits) == ledger["done"] and all(r["n"] == 1 for r in commits)
    # attempts count lease expiries once each, however many coordinators expire at once
    for r in setup.db.execute("SELECT attempts, leases, state FROM jobs"):
        assert r["attempts"] <= r["leases"]
        assert r["attempts"] == r["leases"] - (1 if r["state"] == "done" else 0)
    setup.db.close()


def test_a_lost_connection_is_opened_again(pg_url: str) -> None:
    import psycopg

    db = open_database(pg_url)
    pid = db.execute("SELECT pg_backend_pid() AS pid")[0]["pid"]
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(psycopg.OperationalError):
        db.execute("SELECT 1 AS one")  # the statement it broke under fails ...
    assert db.execute("SELECT 1 AS one") == [{"one": 1}]  # ... the next one reconnects
    db.close()


def test_sqlite_database_is_still_the_default(tmp_path: Path) -> None:
    assert isinstance(open_database(str(tmp_path / "x.db")), SQLiteDatabase)
    assert open_database("sqlite:///" + str(tmp_path / "y.db")).dialect == "sqlite"


# -- leader election, the pure part -------------------------------------------------------


def test_leader_election_transitions() -> None:
    a = elect(None, "a", now=10.0, ttl_s=3.0)
    assert a == {"id": "a", "until": 13.0}
    assert elect(a, "b", now=12.0, ttl_s=3.0) == a  # held: b waits
    assert elect(a, "a", now=12.0, ttl_s=3.0) == {"id": "a", "until": 15.0}  # renewed
    assert elect(a, "b", now=13.5, ttl_s=3.0) == {"id": "b", "until": 16.5}  # expired: taken
