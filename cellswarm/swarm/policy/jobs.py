"""A job's life as a pure function: `apply(job, event) -> (job, effects)`.

The durable queue (control/jobs.py) and the simulator (sim/engine.py) both run this; neither
writes the rules again. No clock (every event carries its time), no I/O, no database: the
queue turns the new value into one guarded UPDATE and the effects into its callbacks; the
simulator into heap events. tests/test_policy_core.py drives this and the real queue
(SQLite) with the same random event sequences and checks they agree at every step.

    queued --Lease--> leased --Complete--> done
      ^                 |  \\--Fail / Expire (attempt n)--> queued, not before backoff(n)
      |                 |        ... attempt MAX_ATTEMPTS --> dead (reason kept)
      +----Release------+  \\--Strike x POISON_AFTER (no Checkpoint with progress)--> dead
    queued|leased --Cancel--> cancelled

An event that does not fit the job (a holder's call on a job not leased, or under an old
fence) changes nothing and says `Stale`: exactly one terminal state, whatever arrives late.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from cellswarm.swarm.policy import MAX_ATTEMPTS, POISON_AFTER, Retry

JobState = Literal["queued", "leased", "done", "dead", "cancelled"]
TERMINAL: tuple[JobState, ...] = ("done", "dead", "cancelled")


@dataclass(frozen=True)
class Job:
    """What the policy needs of a job; the queue's row and the simulator's job carry more."""

    state: JobState = "queued"
    fence: int = 0  # leases so far: a holder's calls name the fence of its lease
    attempts: int = 0  # leases that ended in a failure or an expiry
    strikes: int = 0  # node failures it was present at since its last progress
    n_tokens: int = 0  # checkpointed tokens
    not_before_s: float = 0.0  # a retry waits out its backoff
    lease_expires_s: float | None = None
    error: str = ""

    def __post_init__(self) -> None:
        if min(self.fence, self.attempts, self.strikes, self.n_tokens) < 0:
            raise ValueError(f"a job's counters are never negative: {self}")

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


# -- events: what happens to a job, each with its time ---------------------------------------


@dataclass(frozen=True)
class Lease:
    now_s: float


@dataclass(frozen=True)
class Checkpoint:
    now_s: float
    fence: int
    n_tokens: int


@dataclass(frozen=True)
class Complete:
    now_s: float
    fence: int


@dataclass(frozen=True)
class Fail:
    now_s: float
    fence: int
    reason: str


@dataclass(frozen=True)
class Strike:
    """Present at a node failure that was not its own attempt's (poison accounting)."""

    now_s: float
    reason: str


@dataclass(frozen=True)
class Release:
    now_s: float
    fence: int


@dataclass(frozen=True)
class Expire:
    """Time passes: a lease not renewed by now is a failed attempt."""

    now_s: float
    holder: str = "its holder"


@dataclass(frozen=True)
class Cancel:
    now_s: float
    reason: str = "cancelled"


Event = Lease | Checkpoint | Complete | Fail | Strike | Release | Expire | Cancel

# -- effects: what the runner does besides storing the new value ------------------------------


@dataclass(frozen=True)
class Ended:
    """The job reached its terminal state (the queue counts it and wakes its waiters)."""

    state: JobState
    reason: str = ""


@dataclass(frozen=True)
class Retried:
    """A failed attempt: runnable again at `at_s` (the simulator schedules the release)."""

    at_s: float


@dataclass(frozen=True)
class Stale:
    """The event did not fit the job: nothing changed (a late holder, a second expiry)."""


Effect = Ended | Retried | Stale


@dataclass(frozen=True)
class Rules:
    max_attempts: int = MAX_ATTEMPTS
    poison_after: int = POISON_AFTER
    retry: Retry = field(default_factory=Retry)


RULES = Rules()


def apply(job: Job, event: Event, rules: Rules = RULES) -> tuple[Job, tuple[Effect, ...]]:
    """The job after `event`, and what the runner must do about it."""
    if isinstance(event, Lease):
        if job.state != "queued" or event.now_s < job.not_before_s:
            return job, (Stale(),)
        return replace(job, state="leased", fence=job.fence + 1,
                       lease_expires_s=event.now_s + rules.retry.lease_s), ()  # fmt: skip
    if isinstance(event, Cancel):
        if job.terminal:
            return job, (Stale(),)
        return _end(job, "cancelled", event.reason)
    if isinstance(event, Expire):
        if job.state != "leased" or job.lease_expires_s is None:
            return job, (Stale(),)
        if job.lease_expires_s >= event.now_s:
            return job, ()
        reason = f"lease of {event.holder} expired (attempt {job.attempts + 1})"
        return _failed(job, reason, event.now_s, rules)
    if isinstance(event, Strike):
        if job.state != "leased":
            return job, (Stale(),)
        return _struck(job, event, rules)
    # a holder's call: only under the fence of the current lease
    if job.state != "leased" or event.fence != job.fence:
        return job, (Stale(),)
    if isinstance(event, Checkpoint):  # renews the lease; progress clears the strikes
        strikes = 0 if event.n_tokens > job.n_tokens else job.strikes
        return replace(job, n_tokens=event.n_tokens, strikes=strikes,
                       lease_expires_s=event.now_s + rules.retry.lease_s), ()  # fmt: skip
    if isinstance(event, Complete):
        return _end(job, "done")
    if isinstance(event, Fail):
        return _failed(job, event.reason, event.now_s, rules)
    # Release: given back unharmed (its holder is stopping), no attempt spent
    return replace(job, state="queued", lease_expires_s=None), ()


def _failed(job: Job, reason: str, now_s: float, rules: Rules) -> tuple[Job, tuple[Effect, ...]]:
    attempts = job.attempts + 1
    if attempts >= rules.max_attempts:
        return _end(replace(job, attempts=attempts), "dead",
                    f"failed {attempts} times; last: {reason}")  # fmt: skip
    at_s = now_s + rules.retry.backoff(attempts)
    return replace(job, state="queued", attempts=attempts, error=reason, not_before_s=at_s,
                   lease_expires_s=None), (Retried(at_s),)  # fmt: skip


def _struck(job: Job, event: Strike, rules: Rules) -> tuple[Job, tuple[Effect, ...]]:
    strikes = job.strikes + 1
    if strikes < rules.poison_after:
        return replace(job, strikes=strikes), ()
    return _end(replace(job, strikes=strikes), "dead", poison_reason(strikes, event.reason))


def poison_reason(strikes: int, reason: str) -> str:
    return (f"quarantined as poison: present at {strikes} node failures in a row without "
            f"progress (last: {reason}); check its input before retrying")  # fmt: skip


def _end(job: Job, state: JobState, reason: str = "") -> tuple[Job, tuple[Effect, ...]]:
    error = reason if state != "done" else job.error
    return replace(job, state=state, error=error, lease_expires_s=None), (Ended(state, reason),)
