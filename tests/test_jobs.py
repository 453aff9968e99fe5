"""The job queue (swarm/control/jobs.py): each transition on its own, then a Hypothesis state
machine that drives the queue beside a model of it in Python, crashing and reopening the database
between steps, and checks after every step that nothing acknowledged was lost, every job has
one state, terminal states stay, attempts stay bounded, and each result is committed once.

The database is a fixture parameter (`backend`): SQLite files here; PostgreSQL joins as
another parameter (a `Backend` whose `fresh` empties its schema and returns an opener).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from cellswarm.errors import RequestError
from cellswarm.swarm.control.db import Database, SQLiteDatabase
from cellswarm.swarm.control.jobs import (
    MAX_ATTEMPTS,
    MAX_RUNS,
    POISON_AFTER,
    TERMINAL,
    JobQueue,
    QueueConfig,
    inconsistent,
)

T0 = 1_000.0  # the simulated clock's start (not_before_s defaults to 0: any T0 > 0 works)
CONFIG = QueueConfig(lease_s=10.0, backoff_s=0.5, max_backoff_s=30.0)


# -- backends -----------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    fresh: Callable[[], Callable[[], Database]]  # an empty store; how to (re)open it


def _sqlite_backend(root: Path) -> Backend:
    def fresh() -> Callable[[], Database]:
        path = str(root / f"{uuid.uuid4().hex}.db")
        return lambda: SQLiteDatabase(path)

    return Backend("sqlite", fresh)


@pytest.fixture(params=["sqlite"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        # tmpfs when there is one: thousands of fsyncs (synchronous=FULL) on a busy disk take
        # the state machine from seconds to minutes; a crash here is a closed connection
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            with tempfile.TemporaryDirectory(dir=shm) as root:
                yield _sqlite_backend(Path(root))
        else:
            yield _sqlite_backend(tmp_path)
        return
    raise AssertionError(request.param)


@pytest.fixture
def queue(backend: Backend) -> Iterator[JobQueue]:
    db = backend.fresh()()
    yield JobQueue(db, CONFIG)
    db.close()


def commits(q: JobQueue, job_id: str) -> list[dict[str, Any]]:
    return q.db.execute("SELECT * FROM commits WHERE job_id=? ORDER BY fence", (job_id,))


# -- transitions, one at a time -----------------------------------------------------------


def test_submit_with_a_key_twice_is_one_job(queue: JobQueue) -> None:
    a, new_a = queue.submit({"prompt": [1]}, idem_key="k")
    b, new_b = queue.submit({"prompt": [2]}, idem_key="k")
    c, new_c = queue.submit({"prompt": [1]})
    d, new_d = queue.submit({"prompt": [1]})
    assert (new_a, new_b, new_c, new_d) == (True, False, True, True)
    assert a.job_id == b.job_id and b.payload == {"prompt": [1]}  # the first one's payload
    assert len({a.job_id, c.job_id, d.job_id}) == 3
    assert queue.ledger()["queued"] == 3
    with pytest.raises(RequestError):
        queue.submit({}, kind="train")


def test_lease_increments_the_fence_and_renews_with_checkpoints(queue: JobQueue) -> None:
    job, _ = queue.submit({"prompt": [1]})
    assert job.fence == 0 and job.state == "queued"
    [leased] = queue.lease("h0", "r0", now=T0)
    assert (leased.fence, leased.leases, leased.state) == (1, 1, "leased")
    assert (leased.lease_owner, leased.lease_replica, leased.lease_expires_s) == (
        "h0",
        "r0",
        T0 + 10,
    )
    assert queue.lease("h1", "r1", now=T0) == []  # nothing else to lease
    assert queue.checkpoint(job.job_id, 1, [5, 6], now=T0 + 8)
    assert queue.expire(now=T0 + 12) == 0  # renewed until T0 + 18
    got = queue.get(job.job_id)
    assert got is not None and got.tokens == [5, 6] and got.lease_expires_s == T0 + 18
    assert queue.release(job.job_id, 1, now=T0 + 13)
    [again] = queue.lease("h1", "r1", now=T0 + 13)
    assert again.fence == 2 and again.lease_view()["tokens"] == [5, 6]  # resumes from there


@pytest.mark.parametrize(
    "call",
    [
        lambda q, j, f: q.checkpoint(j, f, [9], now=T0 + 1) is False,
        lambda q, j, f: q.complete(j, f, {"tokens": [9]}, now=T0 + 1) == "stale",
        lambda q, j, f: q.fail(j, f, "boom", now=T0 + 1) == "stale",
        lambda q, j, f: q.release(j, f, now=T0 + 1) is False,
    ],
    ids=["checkpoint", "complete", "fail", "release"],
)
def test_a_stale_fence_is_refused(queue: JobQueue, call: Callable[..., bool]) -> None:
    job, _ = queue.submit({"prompt": [1]})
    [first] = queue.lease("h0", "r0", now=T0)
    assert queue.release(job.job_id, first.fence, now=T0)
    [second] = queue.lease("h1", "r1", now=T0)
    before = queue.get(job.job_id)
    assert call(queue, job.job_id, first.fence)  # the first holder's fence is stale
    assert queue.get(job.job_id) == before
    assert commits(queue, job.job_id) == []
    assert queue.complete(job.job_id, second.fence, {"tokens": [1]}, now=T0 + 2) == "done"


def test_fail_backs_off_then_dies_on_the_third_attempt(queue: JobQueue) -> None:
    job, _ = queue.submit({"prompt": [1]})
    now = T0
    for attempt in range(1, MAX_ATTEMPTS + 1):
        [leased] = queue.lease("h0", "r0", now=now)
        assert leased.lease_view()["attempt"] == attempt
        outcome = queue.fail(job.job_id, leased.fence, f"oom {attempt}", now=now)
        got = queue.get(job.job_id)
        assert got is not None and got.attempts == attempt
        if attempt < MAX_ATTEMPTS:
            assert outcome == "queued" and got.state == "queued" and got.error == f"oom {attempt}"
            backoff = CONFIG.backoff(attempt)
            assert got.not_before_s == now + backoff
            assert queue.lease("h0", "r0", now=now + backoff - 0.01) == []  # not yet
            now += backoff
        else:
            assert outcome == "dead" and got.state == "dead"
            assert got.error == f"failed 3 times; last: oom {attempt}"
    assert queue.lease("h0", "r0", now=now + 100) == []
    assert queue.ledger()["dead"] == 1


def test_an_unrenewed_lease_expires_as_a_failed_attempt(queue: JobQueue) -> None:
    job, _ = queue.submit({"prompt": [1]})
    [leased] = queue.lease("h0", "r0", now=T0)
    assert queue.expire(now=T0 + 10) == 0  # expires strictly after lease_s
    assert queue.expire(now=T0 + 10.5) == 1
    got = queue.get(job.job_id)
    assert got is not None and (got.state, got.attempts) == ("queued", 1)
    assert "lease of h0 expired (attempt 1)" in got.error
    assert queue.complete(job.job_id, leased.fence, {"tokens": [1]}, now=T0 + 11) == "stale"
    # lease() expires on its own: the next lease past the backoff takes it over
    [again] = queue.lease("h1", "r0", now=T0 + 11)
    assert again.fence == 2 and again.attempts == 1
    assert queue.lease("h1", "r0", now=T0 + 30) == []  # that lease expired too: backing off
    got = queue.get(job.job_id)
    assert got is not None and got.attempts == 2


def test_release_spends_no_attempt(queue: JobQueue) -> None:
    job, _ = queue.submit({"prompt": [1]})
    for i in range(2 * MAX_ATTEMPTS):
        [leased] = queue.lease("h0", "r0", now=T0 + i)
        assert queue.release(job.job_id, leased.fence, now=T0 + i)
    got = queue.get(job.job_id)
    assert got is not None and (got.state, got.attempts, got.leases) == ("queued", 0, 6)


def test_a_job_present_at_poison_after_node_failures_in_a_row_is_quarantined(
    queue: JobQueue,
) -> None:
    """Strikes cost no attempt; progress clears them; the POISON_AFTER-th in a row without
    progress makes the job dead with the reason. Only leased jobs are struck."""
    poison, _ = queue.submit({"prompt": [1]})
    innocent, _ = queue.submit({"prompt": [2]})
    waiting, _ = queue.submit({"prompt": [3]})
    [p, i] = queue.lease("h0", "r0", n=2, now=T0)
    for k in range(1, POISON_AFTER):
        assert queue.strike_replica("r0", f"w1 lost ({k})", now=T0 + k) == []
        assert queue.checkpoint(i.job_id, i.fence, [7] * k, now=T0 + k)  # it progresses
        assert queue.checkpoint(p.job_id, p.fence, [], now=T0 + k)  # renewed, no progress
    got_i, got_p = queue.get(i.job_id), queue.get(p.job_id)
    assert got_i is not None and got_p is not None
    assert (got_p.strikes, got_p.attempts, got_i.strikes) == (POISON_AFTER - 1, 0, 0)
    assert queue.strike([p.job_id, i.job_id, waiting.job_id], "w2: ValueError") == [p.job_id]
    dead = queue.get(poison.job_id)
    assert dead is not None and dead.state == "dead" and dead.attempts == 0
    assert dead.error.startswith(f"quarantined as poison: present at {POISON_AFTER} node")
    assert "w2: ValueError" in dead.error
    assert queue.checkpoint(p.job_id, p.fence, [1], now=T0 + 9) is False  # its holder: stale
    assert queue.strike_replica("r1", "another ring") == []
    left = queue.get(innocent.job_id)
    assert left is not None and (left.state, left.strikes) == ("leased", 1)
    queued = queue.get(waiting.job_id)
    assert queued is not None and (queued.state, queued.strikes) == ("queued", 0)


def test_a_ring_failure_strikes_only_the_jobs_it_ran_at_a_step_new_to_them(
    queue: JobQueue,
) -> None:
    """A ring wired in epoch W fails and nobody knows whose step it was: a strike for each
    job whose holder said, in W or later, that its ring was about to run a step the job never
    completed (checkpoint's frontier_epoch) — not for one leased there but still waiting in
    its head, one only replaying tokens it had, one at its frontier only in an earlier wiring
    or under an earlier lease. A query of death reaches its frontier in every wiring and is
    still quarantined at the POISON_AFTER-th. (Every job was struck before: under churn,
    innocent jobs reached POISON_AFTER — tests/test_jobs_swarm.py's churn test.)"""
    ids = [queue.submit({"prompt": [k]})[0].job_id for k in range(5)]
    poison, waiting, replaying, earlier, released = ids
    leased = {j.job_id: j for j in queue.lease("h0", "r0", n=5, now=T0)}
    fence = {j: leased[j].fence for j in ids}
    assert queue.checkpoint(earlier, fence[earlier], [], now=T0, frontier_epoch=3)
    assert queue.checkpoint(released, fence[released], [], now=T0, frontier_epoch=4)
    assert queue.release(released, fence[released], now=T0)
    [again] = queue.lease("h0", "r0", now=T0)  # the same job, a new lease: not yet at it
    assert again.job_id == released
    for k, wired in enumerate(range(4, 4 + 2 * POISON_AFTER, 2), start=1):
        now = T0 + k
        assert queue.checkpoint(replaying, fence[replaying], [5, 6], now=now)  # no frontier
        assert queue.checkpoint(poison, fence[poison], [], now=now, frontier_epoch=wired)
        out = queue.strike_replica("r0", f"w1 re-joined ({k})", now=now, since_epoch=wired)
        assert out == ([poison] if k == POISON_AFTER else []), k
    dead = queue.get(poison)
    assert dead is not None and dead.state == "dead" and dead.attempts == 0
    assert dead.error.startswith(f"quarantined as poison: present at {POISON_AFTER} node")
    for job_id in (waiting, replaying, earlier, released):
        got = queue.get(job_id)
        assert got is not None and (got.state, got.strikes) == ("leased", 0), job_id
    # without an epoch (a caller that does not know it), every leased job was present
    assert queue.strike_replica("r0", "w1 lost") == []
    assert [j.strikes for j in map(queue.get, ids[1:]) if j is not None] == [1] * 4


def test_a_database_from_before_strikes_opens(tmp_path: Path) -> None:
    db = SQLiteDatabase(str(tmp_path / "old.db"))
    db.script("CREATE TABLE jobs (job_id TEXT PRIMARY KEY, idem_key TEXT UNIQUE, batch_id TEXT, "
              "position INTEGER NOT NULL DEFAULT 0, kind TEXT NOT NULL, priority INTEGER NOT "
              "NULL DEFAULT 0, payload TEXT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT "
              "NULL DEFAULT 0, leases INTEGER NOT NULL DEFAULT 0, fence INTEGER NOT NULL "
              "DEFAULT 0, lease_owner TEXT, lease_replica TEXT, lease_expires_s DOUBLE "
              "PRECISION, not_before_s DOUBLE PRECISION NOT NULL DEFAULT 0, tokens TEXT NOT "
              "NULL DEFAULT '[]', n_tokens INTEGER NOT NULL DEFAULT 0, result TEXT, error TEXT "
              "NOT NULL DEFAULT '', verify INTEGER NOT NULL DEFAULT 0, runs TEXT NOT NULL "
              "DEFAULT '[]', created_s DOUBLE PRECISION NOT NULL, updated_s DOUBLE PRECISION "
              "NOT NULL);")  # fmt: skip
    db.execute("INSERT INTO jobs(job_id, kind, payload, state, created_s, updated_s) "
               "VALUES ('old', 'generate', '{}', 'queued', 1, 1)")  # fmt: skip
    q = JobQueue(db, CONFIG)
    JobQueue(db, CONFIG)  # twice: the column is added once
    [job] = q.lease("h0", "r0", now=T0)
    assert job.job_id == "old" and job.strikes == 0
    assert q.strike(["old"], "w0 lost") == []
    db.close()


def test_submit_batch_keeps_input_order_and_cancel_and_retry_act_on_the_batch(
    queue: JobQueue,
) -> None:
    items = [("generate", {"prompt": [i]}) for i in range(6)]
    batch = queue.submit_batch("b", items)
    other = queue.submit_batch("other", items[:2])
    jobs = queue.batch(batch)
    assert [j.payload["prompt"][0] for j in jobs] == list(range(6))
    assert [j.position for j in jobs] == list(range(6))
    leased = queue.lease("h0", "r0", n=3, now=T0)
    assert [j.job_id for j in leased] == [j.job_id for j in jobs[:3]]  # in input order
    assert queue.complete(jobs[0].job_id, leased[0].fence, {"tokens": [1]}, now=T0) == "done"
    for i in range(MAX_ATTEMPTS):  # jobs[1] fails to death (backoffs 0.5 s, 1 s)
        now = T0 + 1.5 * i
        job = queue.get(jobs[1].job_id)
        assert job is not None
        if job.state == "queued":
            [job] = queue.lease("h0", "r0", now=now)  # the oldest runnable
        assert job.job_id == jobs[1].job_id
        queue.fail(job.job_id, job.fence, "bad", now=now)
    info = queue.batch_info(batch)
    assert info is not None and info["total"] == 6 and info["counts"]["dead"] == 1
    assert queue.retry_failed(batch) == 1
    retried = queue.get(jobs[1].job_id)
    assert retried is not None and (retried.state, retried.attempts) == ("queued", 0)
    assert queue.cancel(batch) == 5  # everything but the done one, leased or queued
    assert [j.state for j in queue.batch(batch)] == ["done"] + ["cancelled"] * 5
    assert [j.state for j in queue.batch(other)] == ["queued", "queued"]
    assert queue.retry_failed(batch) == 0 and queue.cancel(batch) == 0
    assert queue.ledger() == {
        "queued": 2,
        "leased": 0,
        "done": 1,
        "dead": 0,
        "cancelled": 5,
        "duplicates": 0,
        "done_without_commit": 0,
    }


def _run(q: JobQueue, job_id: str, replica: str, tokens: list[int], now: float) -> str:
    leased = q.lease(f"head-{replica}", replica, now=now)
    assert [j.job_id for j in leased] == [job_id], f"{replica} could not lease {job_id}"
    return q.complete(job_id, leased[0].fence, {"tokens": tokens}, replica=replica, now=now)


def test_verification_two_agreeing_runs_decide(queue: JobQueue) -> None:
    job, _ = queue.submit({"prompt": [1]}, verify=2)
    assert _run(queue, job.job_id, "A", [7, 8], T0) == "verify"
    assert queue.lease("head-A", "A", now=T0) == []  # the second run wants another replica
    assert _run(queue, job.job_id, "B", [7, 8], T0) == "done"
    got = queue.get(job.job_id)
    assert got is not None and got.result == {"tokens": [7, 8], "runs": 2}
    assert len(commits(queue, job.job_id)) == 1


def test_verification_disagreement_takes_a_third_run_on_another_replica(queue: JobQueue) -> None:
    job, _ = queue.submit({"prompt": [1]}, verify=2)
    assert _run(queue, job.job_id, "A", [1], T0) == "verify"
    assert _run(queue, job.job_id, "B", [2], T0) == "verify"
    assert queue.lease("head-B", "B", now=T0) == []  # the third run avoids the last replica
    assert _run(queue, job.job_id, "A", [2], T0) == "done"  # 2 of 3: B and the rerun on A
    got = queue.get(job.job_id)
    assert got is not None and got.result == {"tokens": [2], "runs": 3}
    assert [r["replica"] for r in got.runs] == ["A", "B", "A"]
    assert len(commits(queue, job.job_id)) == 1


def test_a_third_run_goes_to_a_replica_that_has_not_run_the_job(queue: JobQueue) -> None:
    """With three replicas the deciding run goes to the one that has not run the job: two runs
    on one replica never decide, so a run back on the first (a bad node not yet evicted)
    could alternate with a good one until the job died while C stood idle."""
    job, _ = queue.submit({"prompt": [1]}, verify=2)
    assert _run(queue, job.job_id, "A", [1], T0) == "verify"
    assert _run(queue, job.job_id, "B", [2], T0) == "verify"
    assert queue.lease("head-A", "A", now=T0, n_replicas=3) == []
    assert queue.lease("head-B", "B", now=T0, n_replicas=3) == []
    [third] = queue.lease("head-C", "C", now=T0, n_replicas=3)
    assert queue.complete(job.job_id, third.fence, {"tokens": [2]}, replica="C", now=T0) == "done"


def test_verification_without_agreement_dies_after_max_runs(queue: JobQueue) -> None:
    job, _ = queue.submit({"prompt": [1]}, verify=2)
    for i in range(MAX_RUNS):
        outcome = _run(queue, job.job_id, "AB"[i % 2], [i], T0)
        assert outcome == ("dead" if i == MAX_RUNS - 1 else "verify")
    got = queue.get(job.job_id)
    assert got is not None and got.state == "dead" and got.attempts == 0
    assert got.error == f"{MAX_RUNS} runs and no two agree"
    assert commits(queue, job.job_id) == []


def test_a_verification_run_never_resumes_another_leases_checkpoint(queue: JobQueue) -> None:
    """A verification run is computed whole by the ring it is leased to: a liar's tokens,
    checkpointed before it was taken out and resumed by the honest spare that took its place,
    were recorded as the spare's run, and the spare was outvoted and taken out in its turn
    (tests/test_jobs_swarm.py, the lying worker). A job run once keeps its checkpoint."""
    job, _ = queue.submit({"prompt": [1]}, verify=2)
    plain, _ = queue.submit({"prompt": [2]})
    leased = {j.job_id: j for j in queue.lease("head-A", "A", n=2, now=T0)}
    for j in leased.values():
        assert queue.checkpoint(j.job_id, j.fence, [1140], now=T0)
    assert queue.expire(now=T0 + 11) == 2
    later = T0 + 100  # past the backoff
    again = {j.job_id: j for j in queue.lease("head-A", "A", n=2, now=later)}
    assert again[job.job_id].tokens == [] and again[plain.job_id].tokens == [1140]


def _run_on(q: JobQueue, job_id: str, replica: str, nodes: list[str], tokens: list[int]) -> str:
    [leased] = q.lease(f"head-{replica}", replica, now=T0)
    return q.complete(job_id, leased.fence, {"tokens": tokens}, replica=replica, nodes=nodes,
                      now=T0)  # fmt: skip


def test_a_replica_whose_bad_node_was_replaced_is_new_evidence(queue: JobQueue) -> None:
    """Runs are independent when no node computed both: replica A's bad node w0 gave [1], B
    (w1) gave [2]; A's rerun on the spare w2 that took w0's place agrees with B and decides
    (by the replica's name alone it could not, and with two replicas the job would die)."""
    job, _ = queue.submit({"prompt": [1]}, verify=2)
    assert _run_on(queue, job.job_id, "A", ["w0"], [1]) == "verify"
    assert _run_on(queue, job.job_id, "B", ["w1"], [2]) == "verify"
    assert _run_on(queue, job.job_id, "A", ["w2"], [2]) == "done"
    job2, _ = queue.submit({"prompt": [2]}, verify=2)  # shared nodes never decide
    assert _run_on(queue, job2.job_id, "A", ["w0", "w3"], [1]) == "verify"
    assert _run_on(queue, job2.job_id, "B", ["w1", "w3"], [1]) == "verify"


def test_reruns_that_tell_nothing_new_do_not_kill_a_job(queue: JobQueue) -> None:
    """With two replicas a verification run goes back to the same nodes: B's second [2] adds
    no evidence, so A's liar must differ MAX_RUNS times, not MAX_RUNS / 2, before "no two
    agree" — and a liar that contradicts itself is named by `inconsistent` at once."""
    job, _ = queue.submit({"prompt": [1]}, verify=2)
    outcomes = [_run_on(queue, job.job_id, r, [f"w-{r}"], [t])
                for r, t in [("B", 2), ("A", 10), ("B", 2), ("A", 11), ("B", 2)]]  # fmt: skip
    assert outcomes == ["verify"] * 5
    got = queue.get(job.job_id)
    assert got is not None and inconsistent(got.runs) == []  # B agrees with itself
    assert inconsistent(got.runs[:4]) == ["w-A"]  # A gave [10], then [11]


def test_ledger_counts(queue: JobQueue) -> None:
    ids = [queue.submit({"prompt": [i]})[0].job_id for i in range(5)]
    leased = {j.job_id: j for j in queue.lease("h0", "r0", n=4, now=T0)}
    assert queue.complete(ids[0], leased[ids[0]].fence, {"tokens": [1]}, now=T0) == "done"
    assert queue.complete(ids[0], leased[ids[0]].fence, {"tokens": [2]}, now=T0) == "stale"
    for i in range(MAX_ATTEMPTS):
        job = queue.get(ids[1])
        assert job is not None
        if job.state == "queued":
            [job] = queue.lease("h0", "r0", now=T0 + 1.5 * i)  # the oldest runnable
        assert job.job_id == ids[1]
        queue.fail(ids[1], job.fence, "x", now=T0 + 1.5 * i)
    assert queue.ledger() == {
        "queued": 1,
        "leased": 2,
        "done": 1,
        "dead": 1,
        "cancelled": 0,
        "duplicates": 0,
        "done_without_commit": 0,
    }
    assert queue.leased_count("h0") == 2


def test_acknowledged_work_survives_reopening_the_file(backend: Backend) -> None:
    opener = backend.fresh()
    db = opener()
    q = JobQueue(db, CONFIG)
    a, _ = q.submit({"prompt": [1]}, idem_key="a")
    batch = q.submit_batch("b", [("score", {"prompt": [2]})])
    [leased] = q.lease("h0", "r0", now=T0)
    assert q.complete(a.job_id, leased.fence, {"tokens": [3]}, now=T0) == "done"
    db.close()
    db = opener()
    q = JobQueue(db, CONFIG)
    got = q.get(a.job_id)
    assert got is not None and got.state == "done" and got.result == {"tokens": [3]}
    assert [j.kind for j in q.batch(batch)] == ["score"]
    assert q.submit({"prompt": [9]}, idem_key="a") == (got, False)
    if isinstance(db, SQLiteDatabase):
        assert db.integrity_check() == "ok"
    db.close()


# -- the state machine --------------------------------------------------------------------


@dataclass
class ModelJob:
    seq: int  # submission order: the queue takes the oldest first, within a priority
    priority: int
    verify: int
    batch: str | None = None
    state: str = "queued"
    attempts: int = 0
    fence: int = 0
    owner: str | None = None
    replica: str | None = None
    expires: float | None = None
    not_before: float = 0.0
    tokens: list[int] = field(default_factory=list)
    result: dict[str, Any] | None = None
    runs: list[tuple[str, list[int]]] = field(default_factory=list)  # replica, tokens
    commits: int = 0


@dataclass(frozen=True)
class Ticket:
    """What a holder was given: it may have gone stale since."""

    job_id: str
    fence: int
    owner: str
    replica: str


OWNERS = st.sampled_from(["h0", "h1", "h2"])
REPLICAS = st.sampled_from(["r0", "r1", "r2"])
TOKENS = st.sampled_from([[1], [2], [1], [2], [1, 2]])  # verification runs agree ~40%
KEYS = st.none() | st.sampled_from(["k0", "k1", "k2", "k3"])
DT = st.sampled_from([0.0, 0.2, 1.0, 4.0, 9.0, 10.5, 31.0])


def make_machine(backend: Backend) -> type[RuleBasedStateMachine]:
    class QueueMachine(RuleBasedStateMachine):
        tickets = Bundle("tickets")
        batches = Bundle("batches")

        def __init__(self) -> None:
            super().__init__()
            self.opener = backend.fresh()
            self.db = self.opener()
            self.q = JobQueue(self.db, CONFIG)
            self.now = T0
            self.jobs: dict[str, ModelJob] = {}
            self.keys: dict[str, str] = {}
            self.batch_jobs: dict[str, list[str]] = {}
            self.seq = 0
            self.before: dict[str, tuple[str, Any]] = {}  # terminal jobs as of the last step

        def teardown(self) -> None:
            self.db.close()

        # -- the model's rules (what the queue must do) ------------------------------------

        def _new(self, job_id: str, priority: int, verify: int, batch: str | None) -> None:
            self.seq += 1
            self.jobs[job_id] = ModelJob(self.seq, priority, verify, batch)

        def _fail(self, m: ModelJob) -> None:
            m.attempts += 1
            m.owner, m.expires = None, None
            if m.attempts >= MAX_ATTEMPTS:
                m.state = "dead"
            else:
                m.state, m.not_before = "queued", self.now + CONFIG.backoff(m.attempts)

        def _expire(self) -> int:
            late = [
                m
                for m in self.jobs.values()
                if m.state == "leased" and m.expires is not None and m.expires < self.now
            ]
            for m in late:
                self._fail(m)
            return len(late)

        def _holds(self, t: Ticket) -> ModelJob | None:
            m = self.jobs[t.job_id]
            return m if m.state == "leased" and m.fence == t.fence else None

        @staticmethod
        def _wants(m: ModelJob, replica: str) -> bool:
            """A verification run goes to a replica other than the last run's (the second
            run: other than the first's)."""
            return not m.runs or replica != m.runs[-1][0]

        # -- rules -------------------------------------------------------------------------

        @rule(key=KEYS, priority=st.sampled_from([0, 1]), verify=st.sampled_from([0, 0, 2]))
        def submit(self, key: str | None, priority: int, verify: int) -> None:
            job, new = self.q.submit({"p": self.seq}, idem_key=key, priority=priority,
                                     verify=verify)  # fmt: skip
            if key is not None and key in self.keys:
                assert not new and job.job_id == self.keys[key]
                return
            assert new and job.job_id not in self.jobs and job.state == "queued"
            self._new(job.job_id, priority, verify, None)
            if key is not None:
                self.keys[key] = job.job_id

        @rule(target=batches, size=st.integers(1, 3), verify=st.sampled_from([0, 2]))
        def submit_batch(self, size: int, verify: int) -> str:
            batch = self.q.submit_batch("b", [("generate", {"i": i}) for i in range(size)],
                                        verify_fraction=1.0 if verify else 0.0)  # fmt: skip
            jobs = self.q.batch(batch)
            assert [j.position for j in jobs] == list(range(size))
            for j in jobs:
                self._new(j.job_id, 0, verify, batch)
            self.batch_jobs[batch] = [j.job_id for j in jobs]
            return batch

        @initialize(target=batches, size=st.integers(1, 3), verify=st.sampled_from([0, 2]))
        def start(self, size: int, verify: int) -> str:
            return self.submit_batch(size, verify)

        @rule(target=tickets, owner=OWNERS, replica=REPLICAS, n=st.integers(1, 2), dt=DT)
        def lease(self, owner: str, replica: str, n: int, dt: float) -> Any:
            return multiple(*self._lease(owner, replica, n, dt))

        @rule(owner=OWNERS, replica=REPLICAS, tokens=TOKENS, dt=DT)
        def lease_and_complete(
            self, owner: str, replica: str, tokens: list[int], dt: float
        ) -> None:
            """A holder that finishes at once (verification needs several of these)."""
            for t in self._lease(owner, replica, 1, dt):
                self.complete(t, tokens, 0.0)

        def _lease(self, owner: str, replica: str, n: int, dt: float) -> list[Ticket]:
            self.now += dt
            got = self.q.lease(owner, replica, n=n, now=self.now)
            event(f"lease: {len(got)} jobs")
            self._expire()
            runnable = sorted(
                (m.priority * -1, m.seq, job_id) for job_id, m in self.jobs.items()
                if m.state == "queued" and m.not_before <= self.now and self._wants(m, replica)
            )  # fmt: skip
            assert [j.job_id for j in got] == [job_id for *_, job_id in runnable[:n]]
            out = []
            for j in got:
                m = self.jobs[j.job_id]
                m.state, m.fence = "leased", m.fence + 1
                m.owner, m.replica, m.expires = owner, replica, self.now + CONFIG.lease_s
                assert j.fence == m.fence and j.state == "leased" and j.attempts == m.attempts
                out.append(Ticket(j.job_id, j.fence, owner, replica))
            return out

        @rule(t=tickets, tokens=TOKENS, dt=DT)
        def checkpoint(self, t: Ticket, tokens: list[int], dt: float) -> None:
            self.now += dt
            m = self._holds(t)
            assert self.q.checkpoint(t.job_id, t.fence, tokens, now=self.now) == (m is not None)
            if m is not None:
                m.tokens, m.expires = tokens, self.now + CONFIG.lease_s

        @rule(t=tickets, tokens=TOKENS, dt=DT)
        def complete(self, t: Ticket, tokens: list[int], dt: float) -> None:
            self.now += dt
            m = self._holds(t)
            outcome = self.q.complete(t.job_id, t.fence, {"tokens": tokens}, replica=t.replica,
                                      now=self.now)  # fmt: skip
            event(f"complete: {outcome}{' (verify)' if self.jobs[t.job_id].verify else ''}")
            if m is None:
                assert outcome == "stale"  # and the invariants check nothing changed
                return
            m.owner, m.expires = None, None
            if not m.verify:
                m.state, m.result, m.tokens, m.commits = "done", {"tokens": tokens}, tokens, 1
                assert outcome == "done"
                return
            m.runs.append((t.replica, tokens))
            # two runs agree only from different replicas (jobs._majority): a replica wrong
            # the same way every time must not outvote the others with its own second run
            agreed = [a for i, (ra, a) in enumerate(m.runs)
                      if any(b == a and rb != ra for rb, b in m.runs[i + 1 :])]  # fmt: skip
            if agreed:
                m.state, m.result, m.commits = "done", {"tokens": agreed[0], "runs": len(m.runs)}, 1
                m.tokens = agreed[0]
                assert outcome == "done"
            elif len(set(map(str, m.runs))) >= MAX_RUNS or len(m.runs) >= 2 * MAX_RUNS:
                m.state = "dead"  # a rerun with the same result tells nothing new (_evidence)
                assert outcome == "dead"
            else:
                m.state, m.tokens = "queued", []
                assert outcome == "verify"

        @rule(t=tickets, dt=DT)
        def fail(self, t: Ticket, dt: float) -> None:
            self.now += dt
            m = self._holds(t)
            outcome = self.q.fail(t.job_id, t.fence, "boom", now=self.now)
            if m is None:
                assert outcome == "stale"
                return
            self._fail(m)
            assert outcome == m.state

        @rule(t=consumes(tickets), dt=DT)
        def release(self, t: Ticket, dt: float) -> None:
            self.now += dt
            m = self._holds(t)
            assert self.q.release(t.job_id, t.fence, now=self.now) == (m is not None)
            if m is not None:
                m.state, m.owner, m.expires = "queued", None, None

        @rule(dt=DT)
        def expire(self, dt: float) -> None:
            self.now += dt
            expired = self.q.expire(now=self.now)
            event(f"expire: {expired > 0}")
            assert expired == self._expire()

        @rule(batch=batches)
        def cancel(self, batch: str) -> None:
            live = [j for j in self.batch_jobs[batch] if self.jobs[j].state in ("queued", "leased")]
            assert self.q.cancel(batch) == len(live)
            for j in live:
                m = self.jobs[j]
                m.state = "cancelled"

        @rule(batch=batches)
        def retry_failed(self, batch: str) -> None:
            dead = [j for j in self.batch_jobs[batch] if self.jobs[j].state == "dead"]
            assert self.q.retry_failed(batch) == len(dead)
            for j in dead:
                m = self.jobs[j]
                m.state, m.attempts, m.not_before = "queued", 0, 0.0
                m.runs = []  # a fresh start: a verify job's earlier runs are dropped too
                self.before.pop(j, None)  # the one way out of a terminal state

        @rule()
        def crash(self) -> None:
            """The coordinator dies and a new one opens the same database."""
            self.db.close()
            self.db = self.opener()
            self.q = JobQueue(self.db, CONFIG)

        # -- invariants --------------------------------------------------------------------

        @invariant()
        def matches_the_model(self) -> None:
            rows = {r["job_id"]: r for r in self.db.execute("SELECT job_id FROM jobs")}
            assert set(rows) == set(self.jobs)  # every acknowledged submission, nothing else
            ledger = self.q.ledger()
            n_commits = {r["job_id"]: r["n"] for r in self.db.execute(
                "SELECT job_id, COUNT(*) AS n FROM commits GROUP BY job_id")}  # fmt: skip
            for job_id, m in self.jobs.items():
                j = self.q.get(job_id)
                assert j is not None
                assert (j.state, j.attempts, j.fence) == (m.state, m.attempts, m.fence), job_id
                assert j.attempts <= MAX_ATTEMPTS
                assert n_commits.get(job_id, 0) == m.commits == (j.state == "done")
                if j.state == "leased":
                    assert (j.lease_owner, j.lease_expires_s) == (m.owner, m.expires)
                if j.state == "queued":
                    assert j.not_before_s == m.not_before
                if j.state == "dead":
                    assert j.attempts == MAX_ATTEMPTS or len(j.runs) >= MAX_RUNS
                    assert j.error
                if j.state == "done":
                    assert j.result == m.result and j.tokens == m.tokens
                if j.state in ("queued", "leased") and not m.verify:
                    assert j.tokens == m.tokens  # the last accepted checkpoint
                assert [(r["replica"], r["result"]["tokens"]) for r in j.runs] == m.runs
            counts = {s: 0 for s in ("queued", "leased", *TERMINAL)}
            for m in self.jobs.values():
                counts[m.state] += 1
            assert ledger == {**counts, "duplicates": 0, "done_without_commit": 0}

        @invariant()
        def terminal_states_stay(self) -> None:
            now = {}
            for job_id in self.jobs:
                j = self.q.get(job_id)
                assert j is not None
                now[job_id] = (j.state, j.result)
            for job_id, seen in self.before.items():
                assert now[job_id] == seen, job_id
            self.before = {j: seen for j, seen in now.items() if seen[0] in TERMINAL}

    return QueueMachine


@pytest.mark.slow
def test_queue_state_machine(backend: Backend) -> None:
    run_state_machine_as_test(
        make_machine(backend),
        settings=settings(max_examples=150, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )  # fmt: skip


def test_a_batch_submitted_again_with_its_key_is_the_same_batch(queue: JobQueue) -> None:
    """A client that retries a batch submission (its answer was lost) gets the batch it made."""
    items = [("generate", {"prompt": [i]}) for i in range(3)]
    first = queue.submit_batch("b", items, batch_id="client-7")
    again = queue.submit_batch("b", items, batch_id="client-7")
    assert again == first
    assert len(queue.batch(again)) == 3
    assert queue.ledger()["queued"] == 3
    assert len(queue.db.execute("SELECT * FROM batches")) == 1


def test_verification_reruns_at_the_head_do_not_hide_runnable_jobs(queue: JobQueue) -> None:
    """A fast replica that made the first run of many verified jobs still gets the jobs
    behind them (those reruns wait for another replica)."""
    ids = [queue.submit({"prompt": [i]}, verify=2)[0].job_id for i in range(20)]
    for job_id in ids:
        assert _run(queue, job_id, "A", [1], T0) == "verify"
    fresh, _ = queue.submit({"prompt": [99]})
    assert [j.job_id for j in queue.lease("head-A", "A", now=T0)] == [fresh.job_id]
    assert len(queue.lease("head-B", "B", n=20, now=T0)) == 20


def test_a_finished_batch_s_clock_stops_at_its_last_job(queue: JobQueue) -> None:
    """elapsed_s and tokens/s of a finished batch do not change as time goes on (issue 30:
    its elapsed_s kept growing, its tokens/s falling)."""
    from cellswarm.swarm.api.batch_api import progress

    batch = queue.submit_batch("b", [("generate", {"prompt": [1], "max_tokens": 2})] * 2)
    start = time.time()
    for job in queue.lease("h0", "r0", n=2, now=start + 1):
        assert queue.complete(job.job_id, job.fence, {"tokens": [3, 4]}, now=start + 4) == "done"
    info = queue.batch_info(batch)
    assert info is not None
    info = {**info, "created_s": start}
    early, late = progress(info, start + 5), progress(info, start + 500)
    assert early["elapsed_s"] == late["elapsed_s"] == 4.0
    assert early["tokens_per_s"] == late["tokens_per_s"] and late["eta_s"] == 0.0


@pytest.mark.parametrize("damage", ["garbage pages", "not a database"])
def test_a_damaged_database_is_one_line_and_exit_2(tmp_path: Path, damage: str) -> None:
    """A coordinator on a damaged SQLite file: three garbage pages mid-file (it used to
    start and serve without noticing) or a file that is no database (a 21-line traceback)
    is refused at start, in one line naming the file and the fix (PRAGMA quick_check)."""
    import subprocess
    import sys

    from cellswarm.demo import demo_model_path

    path = tmp_path / "c.db"
    db = SQLiteDatabase(str(path))
    queue = JobQueue(db)
    for _ in range(300):
        queue.submit({"prompt": "x" * 200, "max_tokens": 4})
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.conn.close()
    with path.open("r+b") as f:
        if damage == "garbage pages":
            f.seek(4096 * 5)
            f.write(os.urandom(4096 * 3))
        else:
            f.write(os.urandom(4096))
    out = subprocess.run([sys.executable, "-m", "cellswarm.cli", "coordinator", "--model",
                          str(demo_model_path()), "--db", f"sqlite:///{path}", "--listen",
                          "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out
    [line] = out.stderr.strip().splitlines()
    assert f"database {path} is damaged" in line and "restore it from a backup" in line
