"""The durable job queue: pull-mode leases with fencing, bounded attempts, dead letters.

    submit --> queued --lease(fence+1)--> leased --complete(fence)--> done
                 ^                          |  \\--fail / lease expired--> queued (backoff)
                 |                          |        ... attempt 3 --> dead (reason kept)
                 +----- verify: rerun ------+  cancel --> cancelled
                                            \\--strike x POISON_AFTER--> dead (quarantined)

Every transition is one transaction guarded by the job's state and, for a holder's calls,
its fence: each lease increments the job's fence, so a holder that was presumed dead (its
lease expired and the job went to someone else) finds its checkpoints and its result refused
— exactly one result is ever committed (the `commits` ledger records each one). A job has
exactly one terminal state (done, dead or cancelled) and at most MAX_ATTEMPTS leases that
failed. Submissions carry an idempotency key: the same key gives the same job.

Faults are charged where they belong. A job whose own data fails a stage fails its attempt
(`fail`). A node failure costs the jobs in its ring no attempt (they replay), but each job
present at it gets a strike — the one whose step raised, or every job that the ring of a node
that went silent was running at a step new to it (its first, or its first past the tokens it
replays: the head says so first, `checkpoint`'s frontier_epoch) since it was wired — and
progress (new tokens checkpointed) clears them: a job present at POISON_AFTER node failures
in a row without progress is the likely cause (a query of death) and is quarantined, dead
with that reason, before it takes more nodes down.

Verification (`verify` = runs that must agree, 2 with `--verify`): a completed run is kept,
and the job goes back to the queue for a run on another replica; two runs with the same
tokens and scores, compared exactly, decide (2 of 3 when the first two differ). Greedy
decoding, or sampling with the job's fixed seed, makes the same tokens and the same score
bits on any correct replica, whatever its CPU, thread count or batch (the kernels compute
in one order everywhere: kernels/exact.c), so a node outvoted by a majority computed
something wrong and is taken out at once (`--evict-after`, 1 by default).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, NewType, NotRequired, TypedDict

from cellswarm.errors import RequestError
from cellswarm.swarm.control.db import (
    Database,
    Row,
    ensure_column,
    integer,
    maybe_real,
    maybe_text,
    real,
    text,
    whole,
)
from cellswarm.swarm.policy import MAX_ATTEMPTS, POISON_AFTER, Retry
from cellswarm.swarm.policy import jobs as core
from cellswarm.swarm.protocol.jsonvalue import JsonObject

JobId = NewType("JobId", str)

__all__ = ["MAX_ATTEMPTS", "POISON_AFTER", "JobQueue", "QueueConfig"]  # policy's, re-exported
MAX_RUNS = 5  # verification: give up (dead) when this many runs never had two agree
TERMINAL = ("done", "dead", "cancelled")
JOB_STATES = ("queued", "leased", *TERMINAL)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    idem_key TEXT UNIQUE,
    batch_id TEXT,
    position INTEGER NOT NULL DEFAULT 0,
    kind TEXT NOT NULL,                 -- generate | score
    priority INTEGER NOT NULL DEFAULT 0, -- interactive requests before batch work
    payload TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, -- leases that ended in a failure or an expiry
    strikes INTEGER NOT NULL DEFAULT 0, -- node failures present at, in a row, no progress
    frontier_epoch INTEGER,             -- this lease's ring began a step new to it then
    leases INTEGER NOT NULL DEFAULT 0,
    fence INTEGER NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_replica TEXT,
    lease_expires_s DOUBLE PRECISION,
    not_before_s DOUBLE PRECISION NOT NULL DEFAULT 0,
    tokens TEXT NOT NULL DEFAULT '[]',  -- the current run's checkpoint
    n_tokens INTEGER NOT NULL DEFAULT 0, -- its length (batch progress sums it)
    result TEXT,
    error TEXT NOT NULL DEFAULT '',
    verify INTEGER NOT NULL DEFAULT 0,
    runs TEXT NOT NULL DEFAULT '[]',    -- verification runs: replica, nodes, tokens
    created_s DOUBLE PRECISION NOT NULL,
    updated_s DOUBLE PRECISION NOT NULL,
    owner TEXT                          -- sha256 of the API key that submitted it (access.py)
);
-- the lease's order, exactly (priority DESC): with an ascending priority the database
-- sorted every queued job for each lease (20,000 queued: 40 ms a lease, now 3.6 ms)
DROP INDEX IF EXISTS jobs_pick;
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs(state, priority DESC, created_s, position);
CREATE INDEX IF NOT EXISTS jobs_batch ON jobs(batch_id, position);
-- a batch's progress (batch_info, polled) read from the index alone: 2,000 jobs 1.25 ms a
-- poll from the table's rows, 0.26 ms here
CREATE INDEX IF NOT EXISTS jobs_progress ON jobs(batch_id, state, n_tokens, updated_s);
CREATE TABLE IF NOT EXISTS commits (
    job_id TEXT NOT NULL,
    fence INTEGER NOT NULL,
    replica TEXT,
    committed_s DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    total INTEGER NOT NULL,
    created_s DOUBLE PRECISION NOT NULL,
    owner TEXT
);
"""
# Columns added since the first schema: a database made before them gets them on open.
BATCH_CHUNK = 250  # jobs per transaction when a batch is submitted (submit_batch)
MIGRATIONS = (("jobs", "owner", "TEXT"), ("batches", "owner", "TEXT"),
              ("jobs", "strikes", "INTEGER NOT NULL DEFAULT 0"),
              ("jobs", "frontier_epoch", "INTEGER"))  # fmt: skip


Result = Mapping[str, object]  # what a run of a job made (messages.JobResult.result)


class Run(TypedDict):
    """A verification run of a job, as `runs` keeps it (JSON)."""

    replica: str
    nodes: NotRequired[list[str]]  # recorded since runs are told apart by their nodes
    result: Result


@dataclass(frozen=True)
class Job:
    job_id: JobId
    kind: str
    payload: dict[str, Any]
    state: str
    created_s: float
    updated_s: float
    idem_key: str | None = None
    batch_id: str | None = None
    position: int = 0
    priority: int = 0
    attempts: int = 0
    strikes: int = 0
    leases: int = 0
    fence: int = 0
    lease_owner: str | None = None
    lease_replica: str | None = None
    lease_expires_s: float | None = None
    not_before_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: str = ""
    verify: int = 0
    runs: list[Run] = field(default_factory=list)
    owner: str | None = None  # the submitting API key's hash; None: submitted without keys

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def facts(self) -> core.Job:
        """What the policy core decides on (swarm/policy/jobs.py)."""
        return core.Job(state=self.state, fence=self.fence,  # type: ignore[arg-type]
                        attempts=self.attempts, strikes=self.strikes,
                        n_tokens=len(self.tokens), not_before_s=self.not_before_s,
                        lease_expires_s=self.lease_expires_s, error=self.error)  # fmt: skip

    def lease_view(self) -> dict[str, object]:
        """What a holder needs: the work, its fence, and the tokens to resume from."""
        return {
            "job_id": self.job_id, "kind": self.kind, "payload": self.payload,
            "fence": self.fence, "tokens": self.tokens, "attempt": self.attempts + 1,
        }  # fmt: skip


QueueConfig = Retry  # the queue's settings are the retry policy (policy.py)
DEFAULT_CONFIG = QueueConfig()


# (state, job id, the job as it was leased or None, tokens it made, when): each job that
# ends here, as it ends (the coordinator's request metrics count them)
OnEnd = Callable[[str, str, "Job | None", int, float], None]


def _ignore(state: str, job_id: str, job: Job | None, n_tokens: int, now: float) -> None:
    pass


class JobQueue:
    def __init__(self, db: Database, config: QueueConfig = DEFAULT_CONFIG) -> None:
        self.db, self.config = db, config
        self.rules = core.Rules(retry=config)
        self.on_end: OnEnd = _ignore
        self.db.script(SCHEMA)
        for table, column, decl in MIGRATIONS:
            ensure_column(self.db, table, column, decl)

    # -- submitting --------------------------------------------------------------------------

    def submit(
        self, payload: Mapping[str, object], kind: str = "generate", idem_key: str | None = None,
        batch_id: str | None = None, position: int = 0, priority: int = 0, verify: int = 0,
        owner: str | None = None,
    ) -> tuple[Job, bool]:  # fmt: skip
        """A queued job, or the one submitted before under the same key; and whether new.
        `owner`: the hash of the API key submitting it (only that key, or an admin, sees it)."""
        if kind not in ("generate", "score"):
            raise RequestError(f"job kind {kind!r} is not 'generate' or 'score'")
        job_id = self._insert(payload, kind, idem_key, batch_id, position, priority, verify,
                              owner)  # fmt: skip
        if job_id is not None:
            job = self.get(job_id)
            assert job is not None
            return job, True
        if idem_key is None:
            raise RuntimeError("a job id collided")  # 64 random bits: not in this universe
        found = self.db.execute("SELECT * FROM jobs WHERE idem_key=?", (idem_key,))
        return _job(found[0]), False

    def submit_batch(
        self, name: str, items: Sequence[tuple[str, Mapping[str, object]]],
        verify_fraction: float = 0.0, batch_id: str | None = None, owner: str | None = None,
    ) -> str:  # fmt: skip
        """A batch of (kind, payload) in input order; its id. The same `batch_id` twice is
        the same batch (its jobs' keys are batch id : position). A `verify_fraction` of its
        jobs, chosen by a hash of their position, are run twice.

        The jobs go in chunks of BATCH_CHUNK, a transaction each, so the database's lock is
        let go between them: a 100,000-line batch makes heartbeats and leases wait for one
        chunk, not for all of it. Acknowledged only once every chunk is in; a batch sent
        again after a crash part-way fills in just the positions it lacks (the keys make
        every insert idempotent)."""
        batch_id = batch_id or uuid.uuid4().hex[:12]
        self.db.execute(
            "INSERT INTO batches(batch_id, name, total, created_s, owner) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (batch_id, name, len(items), time.time(), owner),
        )
        have = self.db.execute("SELECT COUNT(*) AS n FROM jobs WHERE batch_id=?", (batch_id,))
        if integer(have[0]["n"]) >= len(items):
            return batch_id
        for start in range(0, len(items), BATCH_CHUNK):
            with self.db.transaction():
                for i in range(start, min(start + BATCH_CHUNK, len(items))):
                    kind, payload = items[i]
                    verify = 2 if _chosen(batch_id, i, verify_fraction) else 0
                    self._insert(payload, kind, f"{batch_id}:{i}", batch_id, i, 0, verify,
                                 owner)  # fmt: skip
            time.sleep(0.002)  # the lock is not fair: let a waiting heartbeat take it first
        return batch_id

    def _insert(
        self, payload: Mapping[str, object], kind: str, idem_key: str | None, batch_id: str | None,
        position: int, priority: int, verify: int, owner: str | None,
    ) -> JobId | None:  # fmt: skip
        """A new queued job's id; None when its key was taken (the job exists)."""
        now = time.time()
        job_id = uuid.uuid4().hex[:16]
        rows = self.db.execute(
            "INSERT INTO jobs(job_id, idem_key, batch_id, position, kind, priority, payload, "
            "state, verify, created_s, updated_s, owner) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING RETURNING job_id",
            (job_id, idem_key, batch_id, position, kind, priority, json.dumps(payload),
             verify, now, now, owner),
        )  # fmt: skip
        return JobId(job_id) if rows else None

    # -- holding -----------------------------------------------------------------------------

    def lease(
        self, owner: str, replica: str, n: int = 1, now: float | None = None,
        exclusive: bool = True, n_replicas: int = 2, rank: Callable[[Job], int] | None = None,
    ) -> list[Job]:  # fmt: skip
        """Up to n runnable jobs for `owner` (a pipeline head), each with a new fence. With
        `exclusive`, a verification run goes to another replica than the one before, and to
        one that has not run the job while any of the `n_replicas` has not (off in a swarm of
        one replica: two runs there still catch a node that is not deterministic). A
        verification run starts from no tokens: it is computed whole by its own ring.
        `rank`: within a page of the queue's order, lower ranks first at equal priority
        (affinity.py: the jobs whose prefix this replica holds)."""
        now = time.time() if now is None else now
        out: list[Job] = []
        with self.db.transaction():
            self.expire(now)
            page, skipped = max(4 * n, 16), 0
            while len(out) < n:  # page on past verification runs that want another replica
                rows = self.db.execute(
                    "SELECT * FROM jobs WHERE state='queued' AND not_before_s <= ? "
                    "ORDER BY priority DESC, created_s, position LIMIT ? OFFSET ?"
                    + self.db.skip_locked,
                    (now, page, skipped),
                )
                page_jobs = [_job(row) for row in rows]
                if rank is not None:  # stable: the queue's order among equals
                    page_jobs.sort(key=lambda j: (-j.priority, rank(j)))
                for job in page_jobs:
                    if len(out) >= n or (exclusive and _ran_on(job, replica, n_replicas)):
                        skipped += 1  # a verification run wants another replica
                        continue
                    # a verification run is computed whole by the ring it is leased to: it
                    # never resumes another lease's checkpoint (a liar's tokens, resumed by an
                    # honest spare, were recorded as the spare's run and took it out)
                    fresh = ", tokens='[]', n_tokens=0" if job.verify else ""
                    self.db.execute(
                        "UPDATE jobs SET state='leased', fence=fence+1, leases=leases+1, "
                        "frontier_epoch=NULL, "
                        "lease_owner=?, lease_replica=?, lease_expires_s=?, updated_s=?"
                        + fresh + " WHERE job_id=? AND state='queued'",
                        (owner, replica, now + self.config.lease_s, now, job.job_id),
                    )
                    leased = self.get(job.job_id)
                    assert leased is not None
                    out.append(leased)
                if len(rows) < page:
                    break
        return out

    def checkpoint(
        self, job_id: str, fence: int, tokens: list[int], now: float | None = None,
        owner: str | None = None, frontier_epoch: int | None = None,
    ) -> bool:  # fmt: skip
        """Record the tokens so far and renew the lease (new tokens clear its strikes: it
        makes progress); False: the lease is no longer yours. `frontier_epoch`: the holder's
        ring is about to run a step the job never completed, in this layout epoch (from then
        on a failure of that ring may be the job's doing: strike_replica)."""
        now = time.time() if now is None else now
        held, who = _held_by(owner)
        return self.db.execute_count(
            "UPDATE jobs SET strikes=CASE WHEN ? > n_tokens THEN 0 ELSE strikes END, tokens=?, "
            "n_tokens=?, lease_expires_s=?, updated_s=?, "
            "frontier_epoch=COALESCE(?, frontier_epoch) "
            "WHERE job_id=? AND fence=? AND state='leased'" + held,
            (len(tokens), json.dumps(tokens), len(tokens), now + self.config.lease_s, now,
             frontier_epoch, job_id, fence, *who),
        ) == 1  # fmt: skip

    def complete(
        self, job_id: str, fence: int, result: Result, replica: str = "",
        nodes: Sequence[str] = (), now: float | None = None, owner: str | None = None,
    ) -> str:  # fmt: skip
        """'done', 'verify' (kept; another replica runs it next) or 'stale' (refused: not
        leased, another fence, or — with `owner` — not that node's lease)."""
        now = time.time() if now is None else now
        held, who = _held_by(owner)
        with self.db.transaction():
            rows = self.db.execute(  # waits for a row lock (never skips): no false 'stale'
                "SELECT * FROM jobs WHERE job_id=? AND fence=? AND state='leased'" + held
                + self.db.for_update, (job_id, fence, *who),
            )  # fmt: skip
            if not rows:
                return "stale"
            job = _job(rows[0])
            if job.verify:
                return self._verify_run(job, result, replica, list(nodes), now)
            self._commit(job, result, replica, now)
            return "done"

    def fail(self, job_id: str, fence: int, reason: str, now: float | None = None,
             owner: str | None = None) -> str:  # fmt: skip
        """A holder says this attempt failed: back to the queue after a backoff, or dead
        after MAX_ATTEMPTS; 'stale' if the lease is not the caller's any more."""
        now = time.time() if now is None else now
        held, who = _held_by(owner)
        with self.db.transaction():
            rows = self.db.execute(
                "SELECT * FROM jobs WHERE job_id=? AND fence=? AND state='leased'" + held +
                self.db.skip_locked, (job_id, fence, *who),
            )  # fmt: skip
            if not rows:  # (or another coordinator is expiring it right now)
                return "stale"
            return self._write(_job(rows[0]), core.Fail(now, fence, reason), now)

    def strike(
        self, job_ids: Sequence[str], reason: str, now: float | None = None
    ) -> list[str]:
        """Leased jobs that were present at a node failure get a strike each; one that
        reaches POISON_AFTER in a row (no progress between) is quarantined: dead, with the
        reason. The ids quarantined."""
        now = time.time() if now is None else now
        out: list[str] = []
        with self.db.transaction():
            for job_id in job_ids:
                rows = self.db.execute(
                    "SELECT * FROM jobs WHERE job_id=? AND state='leased'" + self.db.for_update,
                    (job_id,),
                )
                if not rows:
                    continue
                job = _job(rows[0])
                after, _ = core.apply(job.facts, core.Strike(now, reason), self.rules)
                if after.state == "leased":
                    self.db.execute("UPDATE jobs SET strikes=? WHERE job_id=? AND fence=?",
                                    (after.strikes, job.job_id, job.fence))  # fmt: skip
                    continue
                if self.db.execute_count(
                    "UPDATE jobs SET state=?, strikes=?, error=?, lease_owner=NULL, "
                    "lease_expires_s=NULL, updated_s=? WHERE job_id=? AND fence=? "
                    "AND state='leased'",
                    (after.state, after.strikes, after.error, now, job.job_id, job.fence),
                ):  # fmt: skip
                    out.append(job.job_id)
                    self.on_end("dead", job.job_id, job, len(job.tokens), now)
        return out

    def strike_replica(
        self, replica: str, reason: str, now: float | None = None, since_epoch: int | None = None
    ) -> list[str]:
        """A node of `replica` failed and nobody knows whose step it was: the jobs leased on
        that replica were present — with `since_epoch` (the epoch its ring was wired in), only
        those whose ring ran a step new to them since (`checkpoint`'s frontier_epoch). Not one
        that waited in its head to be sent, nor one replaying steps it had passed before (the
        same bits again): neither can have caused it, and under churn such innocent jobs
        reached POISON_AFTER (tests/test_jobs_swarm.py). A query of death reaches its fatal
        step in every wiring, so it is still struck each time. The ids quarantined."""
        exposed = "" if since_epoch is None else " AND frontier_epoch >= ?"
        rows = self.db.execute(
            "SELECT job_id FROM jobs WHERE state='leased' AND lease_replica=?" + exposed,
            (replica,) if since_epoch is None else (replica, since_epoch),
        )
        return self.strike([str(r["job_id"]) for r in rows], reason, now)

    def release(self, job_id: str, fence: int, now: float | None = None,
                owner: str | None = None) -> bool:  # fmt: skip
        """A holder gives a job back unharmed (it is stopping): no attempt is spent."""
        now = time.time() if now is None else now
        held, who = _held_by(owner)
        return self.db.execute_count(
            "UPDATE jobs SET state='queued', lease_owner=NULL, lease_expires_s=NULL, "
            "updated_s=? WHERE job_id=? AND fence=? AND state='leased'" + held,
            (now, job_id, fence, *who),
        ) == 1

    def expire(self, now: float | None = None) -> int:
        """Leases not renewed in time count as failed attempts. Several coordinators may
        expire at once: each job's row is locked by the one that takes it, skipped by others."""
        now = time.time() if now is None else now
        with self.db.transaction():
            rows = self.db.execute(
                "SELECT * FROM jobs WHERE state='leased' AND lease_expires_s < ?" +
                self.db.skip_locked, (now,),
            )  # fmt: skip
            for row in rows:
                job = _job(row)
                self._write(job, core.Expire(now, str(job.lease_owner)), now)
        return len(rows)

    def extend_replica(self, replica: str, now: float | None = None) -> int:
        """Renew every lease on `replica`: one of its nodes is busy with a step (a long
        prompt's prefill), which is progress the head cannot see come back yet."""
        until = (time.time() if now is None else now) + self.config.lease_s
        return self.db.execute_count(
            "UPDATE jobs SET lease_expires_s=? WHERE state='leased' AND lease_replica=? "
            "AND lease_expires_s < ?", (until, replica, until),
        )  # fmt: skip

    def extend_leases(self, now: float | None = None) -> int:
        """A coordinator (re)starting: holders could not renew while none answered, so every
        lease gets a fresh term instead of expiring for the coordinator's absence."""
        now = time.time() if now is None else now
        return self.db.execute_count(
            "UPDATE jobs SET lease_expires_s=? WHERE state='leased' AND lease_expires_s < ?",
            (now + self.config.lease_s, now + self.config.lease_s),
        )

    def cancel(self, batch_id: str) -> int:
        now = time.time()
        n = self.db.execute_count(
            "UPDATE jobs SET state='cancelled', error='cancelled', updated_s=? "
            "WHERE batch_id=? AND state IN ('queued', 'leased')",
            (now, batch_id),
        )
        for _ in range(n):
            self.on_end("cancelled", "", None, 0, now)
        return n

    def cancel_job(self, job_id: str, reason: str = "cancelled") -> bool:
        """One unfinished job -> cancelled (its holder's next checkpoint is refused, and the
        head drops the sequence); False if it had already ended."""
        now = time.time()
        if self.db.execute_count(
            "UPDATE jobs SET state='cancelled', error=?, lease_owner=NULL, "
            "lease_expires_s=NULL, updated_s=? WHERE job_id=? AND state IN ('queued', 'leased')",
            (reason, now, job_id),
        ) != 1:  # fmt: skip
            return False
        self.on_end("cancelled", job_id, None, 0, now)
        return True

    def retry_failed(self, batch_id: str) -> int:
        """Dead-lettered jobs of a batch go back to the queue with fresh attempts."""
        now = time.time()
        return self.db.execute_count(
            "UPDATE jobs SET state='queued', attempts=0, strikes=0, error='', not_before_s=0, "
            "runs='[]', updated_s=? WHERE batch_id=? AND state='dead'",
            (now, batch_id),
        )

    def leased_count(self, owner: str) -> int:
        rows = self.db.execute(
            "SELECT COUNT(*) AS n FROM jobs WHERE state='leased' AND lease_owner=?", (owner,)
        )
        return integer(rows[0]["n"])

    def release_owner(self, owner: str, now: float | None = None) -> list[str]:
        """Every job leased to `owner` back to the queue unharmed (its holder was lost: not
        the jobs' fault, no attempt spent); the ids."""
        now = time.time() if now is None else now
        with self.db.transaction():
            rows = self.db.execute(
                "SELECT job_id, fence FROM jobs WHERE state='leased' AND lease_owner=?"
                + self.db.for_update, (owner,),
            )  # fmt: skip
            return [str(r["job_id"]) for r in rows
                    if self.release(str(r["job_id"]), integer(r["fence"]), now)]  # fmt: skip

    # -- reading -----------------------------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        rows = self.db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,))
        return _job(rows[0]) if rows else None

    def batch(self, batch_id: str) -> list[Job]:
        rows = self.db.execute("SELECT * FROM jobs WHERE batch_id=? ORDER BY position", (batch_id,))
        return [_job(r) for r in rows]

    def batch_info(self, batch_id: str) -> JsonObject | None:
        """A batch's row, its jobs' counts by state, their tokens and when one last moved."""
        rows = self.db.execute("SELECT * FROM batches WHERE batch_id=?", (batch_id,))
        if not rows:
            return None
        batch = rows[0]
        counts = {s: 0 for s in JOB_STATES}
        tokens, last_s = 0, float(real(batch, "created_s"))
        for r in self.db.execute(  # one pass over the batch's rows (it is polled)
            "SELECT state, COUNT(*) AS n, COALESCE(SUM(n_tokens), 0) AS tokens, "
            "MAX(updated_s) AS last_s FROM jobs WHERE batch_id=? GROUP BY state", (batch_id,)
        ):  # fmt: skip
            counts[str(r["state"])] = integer(r["n"])
            tokens += int(r["tokens"] or 0)
            last_s = max(last_s, float(r["last_s"] or 0.0))
        return {"batch_id": text(batch, "batch_id"), "name": text(batch, "name"),
                "total": whole(batch, "total"), "created_s": real(batch, "created_s"),
                "owner": maybe_text(batch, "owner"), "counts": dict(counts), "tokens": tokens,
                "last_s": last_s}  # fmt: skip

    def recent_batches(self, limit: int = 10) -> list[JsonObject]:
        """The latest batches with their progress (the dashboard)."""
        rows = self.db.execute("SELECT batch_id FROM batches ORDER BY created_s DESC LIMIT ?",
                               (int(limit),))  # fmt: skip
        infos = (self.batch_info(str(r["batch_id"])) for r in rows)
        return [i for i in infos if i is not None]

    def ledger(self) -> dict[str, int]:
        """Jepsen-style counts: every job terminal once, results committed once."""
        states = {s: 0 for s in JOB_STATES}
        for r in self.db.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state"):
            states[str(r["state"])] = integer(r["n"])
        dup = self.db.execute(
            "SELECT COUNT(*) AS n FROM (SELECT job_id FROM commits GROUP BY job_id "
            "HAVING COUNT(*) > 1) AS d"
        )
        done_without = self.db.execute(
            "SELECT COUNT(*) AS n FROM jobs WHERE state='done' AND job_id NOT IN "
            "(SELECT job_id FROM commits)"
        )
        return {**states, "duplicates": integer(dup[0]["n"]),
                "done_without_commit": integer(done_without[0]["n"])}  # fmt: skip

    def retries(self) -> int:
        """Leases beyond each job's first: how often a job had to be run again."""
        rows = self.db.execute(
            "SELECT COALESCE(SUM(leases - 1), 0) AS n FROM jobs WHERE leases > 1"
        )
        return integer(rows[0]["n"])

    # -- transitions inside a transaction ---------------------------------------------------

    def _commit(self, job: Job, result: Result, replica: str, now: float) -> None:
        self.db.execute(
            "UPDATE jobs SET state='done', result=?, tokens=?, n_tokens=?, lease_owner=NULL, "
            "lease_expires_s=NULL, updated_s=? WHERE job_id=? AND fence=? AND state='leased'",
            (json.dumps(result), json.dumps(result.get("tokens", [])),
             n_tokens(result), now, job.job_id, job.fence),
        )  # fmt: skip
        self.db.execute(
            "INSERT INTO commits(job_id, fence, replica, committed_s) VALUES (?, ?, ?, ?)",
            (job.job_id, job.fence, replica, now),
        )
        self.on_end("done", job.job_id, job, n_tokens(result), now)

    def _write(self, job: Job, event: core.Fail | core.Expire, now: float) -> str:
        """A failed attempt, as the policy core rules: back to the queue after its backoff,
        or dead. Guarded by fence and state: a holder that completed meanwhile (another
        coordinator, under PostgreSQL's READ COMMITTED) keeps its result. The state written,
        or 'stale'."""
        after, _ = core.apply(job.facts, event, self.rules)
        if after == job.facts:  # not a failure of the lease it holds
            return "stale"
        changed = self.db.execute_count(
            "UPDATE jobs SET state=?, attempts=?, error=?, lease_owner=NULL, "
            "lease_expires_s=NULL, not_before_s=?, updated_s=? "
            "WHERE job_id=? AND fence=? AND state='leased'",
            (after.state, after.attempts, after.error, after.not_before_s, now, job.job_id,
             job.fence),
        )  # fmt: skip
        if not changed:
            return "stale"
        if after.terminal:
            self.on_end(after.state, job.job_id, job, len(job.tokens), now)
        return after.state

    def _verify_run(
        self, job: Job, result: Result, replica: str, nodes: list[str], now: float
    ) -> str:
        runs: list[Run] = [*job.runs, {"replica": replica, "nodes": nodes, "result": result}]
        winner = _majority(runs)
        if winner is not None:
            self._commit(job, {**winner["result"], "runs": len(runs)}, replica, now)
            self.db.execute("UPDATE jobs SET runs=? WHERE job_id=?",
                            (json.dumps(runs), job.job_id))  # fmt: skip
            return "done"
        if _evidence(runs) >= MAX_RUNS or len(runs) >= 2 * MAX_RUNS:
            self.db.execute(
                "UPDATE jobs SET state='dead', runs=?, error=?, updated_s=? WHERE job_id=?",
                (json.dumps(runs), f"{len(runs)} runs and no two agree", now, job.job_id),
            )
            self.on_end("dead", job.job_id, job, 0, now)
            return "dead"
        self.db.execute(  # back to the queue, for a run on a replica it has not had yet
            "UPDATE jobs SET state='queued', runs=?, tokens='[]', n_tokens=0, strikes=0, "
            "lease_owner=NULL, lease_expires_s=NULL, updated_s=? WHERE job_id=?",
            (json.dumps(runs), now, job.job_id),
        )
        return "verify"


def _chosen(batch_id: str, position: int, fraction: float) -> bool:
    """A stable pick of `fraction` of a batch's positions (the same on every coordinator)."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{batch_id}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def n_tokens(result: Mapping[str, object], key: str = "tokens") -> int:
    """The tokens a result (or a payload's prompt) holds: len() of its `key`, [] when it has
    none (a TypeError when it has no length, as len() says)."""
    tokens = result.get(key, [])
    if not isinstance(tokens, Sized):
        raise TypeError(f"object of type {type(tokens).__name__!r} has no len()")
    return len(tokens)


def _majority(runs: list[Run]) -> Run | None:
    """The first result two independent runs agree on (_apart)."""
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            if _apart(a, b) and same_result(a["result"], b["result"]):
                return a
    return None


def _apart(a: Run, b: Run) -> bool:
    """Two runs are independent evidence when no node computed both: a node that is wrong the
    same way every time (a bad weight, a broken kernel) must not outvote the others with its
    own second run. A replica whose bad node was replaced is new evidence, so the nodes
    decide, not the replica's name (runs recorded without nodes fall back to it)."""
    if a.get("nodes") and b.get("nodes"):
        return not set(a["nodes"]) & set(b["nodes"])
    return a.get("replica") is None or a.get("replica") != b.get("replica")


def _evidence(runs: list[Run]) -> int:
    """Runs that told something new: a rerun on the same nodes with the same result does not
    (the queue sends a verification run back to a replica when it has no other), so it does
    not bring a job nearer to "no two agree" — the total is capped at twice MAX_RUNS."""
    seen: list[tuple[list[str], str, Result]] = []
    for r in runs:
        key = (sorted(r.get("nodes") or []), str(r.get("replica")), r["result"])
        if not any(k[:2] == key[:2] and same_result(k[2], key[2]) for k in seen):
            seen.append(key)
    return len(seen)


def inconsistent(runs: list[Run]) -> list[str]:
    """The nodes of the latest run if an earlier run of the same job on exactly those nodes
    gave another result: every correct node computes the same bits for the same input on any
    CPU (issue 32), so a node set that contradicts itself has a broken node in it — no third
    replica is needed to say so."""
    if len(runs) < 2 or not runs[-1].get("nodes"):
        return []
    last = runs[-1]
    for r in runs[:-1]:
        if sorted(r.get("nodes") or []) == sorted(last["nodes"]) and not same_result(
            r["result"], last["result"]
        ):
            return list(last["nodes"])
    return []


def same_result(a: Result, b: Result) -> bool:
    """Two runs' results agree: tokens and scores equal, and the bits of the logits the last
    token came from (a node whose weights or arithmetic are off in the last bit gives other
    bits long before it gives another token; every correct node gives these)."""
    return (a.get("tokens") == b.get("tokens") and a.get("scores") == b.get("scores")
            and a.get("bits", "") == b.get("bits", ""))  # fmt: skip


def _ran_on(job: Job, replica: str, n_replicas: int = 2) -> bool:
    """A verification run goes to a replica that has not run the job yet, while one exists
    that has not; after that it only avoids the replica of the last run. Why: two runs on one
    replica never decide (_majority), so a third run that went back to the replica of the
    first (a bad node, before its eviction) could alternate with a good one until the job
    died of "no two agree" while a third replica stood idle (seen under test)."""
    had = [r["replica"] for r in job.runs]
    if not had:
        return False
    return replica in had[-1:] or (replica in had and len(set(had)) < n_replicas)


def _held_by(owner: str | None) -> tuple[str, tuple[str, ...]]:
    """The SQL that limits a holder's call to its own lease (and its parameter): a fence is
    a number anyone who saw the job can guess, the owner is who the queue leased it to."""
    return ("", ()) if owner is None else (" AND lease_owner=?", (owner,))


def _job(d: Row) -> Job:
    result = maybe_text(d, "result")
    return Job(
        job_id=JobId(text(d, "job_id")), kind=text(d, "kind"),
        payload=json.loads(text(d, "payload")), state=text(d, "state"),
        created_s=real(d, "created_s"), updated_s=real(d, "updated_s"),
        idem_key=maybe_text(d, "idem_key"), batch_id=maybe_text(d, "batch_id"),
        position=whole(d, "position"), priority=whole(d, "priority"),
        attempts=whole(d, "attempts"), strikes=whole(d, "strikes"),
        leases=whole(d, "leases"), fence=whole(d, "fence"),
        lease_owner=maybe_text(d, "lease_owner"), lease_replica=maybe_text(d, "lease_replica"),
        lease_expires_s=maybe_real(d, "lease_expires_s"),
        not_before_s=real(d, "not_before_s"), tokens=json.loads(text(d, "tokens")),
        result=None if result is None else json.loads(result),
        error=text(d, "error"), verify=whole(d, "verify"), runs=json.loads(text(d, "runs")),
        owner=maybe_text(d, "owner"),
    )  # fmt: skip
