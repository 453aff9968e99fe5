"""Jobs: submitted by clients, leased by pipeline heads (pull, long poll), checkpointed,
completed or failed under fenced leases (jobs.py holds the queue itself)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from cellswarm.errors import RequestError
from cellswarm.swarm.control.jobs import Job, n_tokens
from cellswarm.swarm.control.membership import replicas, ring
from cellswarm.swarm.control.store import Node, whole_of
from cellswarm.swarm.control.verification import Verification
from cellswarm.swarm.policy import nodes as health
from cellswarm.swarm.protocol.messages import (
    JobLease,
    JobRef,
    JobResult,
    JobWork,
    RunState,
    encode,
)

log = logging.getLogger("cellswarm.coordinator")


class Work(Verification):
    """The job routes' side of the coordinator (a part of Coordinator)."""


    def submit(self, payload: Mapping[str, object], request_id: str | None = None,
               kind: str = "generate", owner: str | None = None) -> Job:  # fmt: skip
        """An interactive request: a job ahead of batch work. `request_id` is its
        idempotency key (the same id twice is the same job); `owner` the hash of the API key
        that submitted it (access.py)."""
        job, new = self.queue.submit(payload, kind, request_id, priority=1, owner=owner)
        if new:
            self.log.event("submitted", job.job_id, prompt_tokens=n_tokens(payload, "prompt"),
                           key=request_id)  # fmt: skip
            self.notify()  # a head waiting in a long poll takes it now
        return job

    def lease(self, node: Node, n: int) -> list[JobLease]:
        """Jobs for a pipeline head: only stage 0 of a wired replica, and no more than the
        sequences its ring has KV cache for."""
        shard = node.shard
        if self.wired_epoch != self.epoch or shard is None or shard.role != "stage" or shard.stage:
            return []
        stages = ring(self.placed(), shard.replica)
        capacity = min(whole_of(s.capabilities, "max_sequences", self.sequences)
                       for s in stages)  # fmt: skip
        # a job is one sequence (a scoring job's completions follow its prompt in it)
        room = capacity - self.queue.leased_count(node.node_id)
        if room <= 0:
            return []
        n_replicas, replica = len(replicas(self.placed())), str(shard.replica)
        rank = (lambda job: self.homes.rank(job.payload, replica)) if n_replicas > 1 else None
        jobs = self.queue.lease(node.node_id, replica, min(n, room), exclusive=n_replicas > 1,
                                n_replicas=n_replicas, rank=rank)  # fmt: skip
        self._stall_due = self._stall_due or bool(jobs and self.config.stall_core_s)
        now = time.time()
        for job in jobs:
            self.requests.leased(job, now)
            self.homes.note(job.payload, replica)
            self.log.event("leased", job.job_id, worker=node.node_id, fence=job.fence,
                           resume=len(job.tokens), attempt=job.attempts + 1)  # fmt: skip
        leases = []
        for j in jobs:
            try:  # the queue keeps the client's payload; the lease carries the work in it
                work = JobWork.of(j.payload)
            except RequestError as exc:  # a stored payload of no shape a head runs: the
                self.fail(node, j.job_id, j.fence, f"its work: {exc}")  # attempt is its own
                continue
            leases.append(JobLease(job_id=j.job_id, kind=j.kind, payload=work, fence=j.fence,
                                   tokens=j.tokens, attempt=j.attempts + 1))  # fmt: skip
        return leases

    def drafting_heads(self) -> tuple[int, int]:
        """(rings' first stages placed, those whose worker has a draft model): who can run
        `speculative: "draft"` (api/schema.py check_speculative)."""
        heads = [n for n in self.placed()
                 if n.shard is not None and n.shard.role == "stage" and n.shard.first]  # fmt: skip
        return len(heads), sum(n.capabilities.get("draft") is True for n in heads)

    def ring_sequences(self, node: Node) -> int | None:
        """The sequences the ring headed by `node` holds at once: the fewest any of its
        stages has KV cache for (a head admits no more into stage 0)."""
        if node.shard is None or node.shard.role != "stage":
            return None
        stages = ring(self.placed(), node.shard.replica)
        return min((whole_of(s.capabilities, "max_sequences", self.config.max_sequences)
                    for s in stages), default=None)  # fmt: skip

    def checkpoint(self, node: Node, runs: list[RunState]) -> list[str]:
        """Tokens so far of a head's jobs (renewing their leases); the ids it lost. One
        transaction for the lot: a commit (an fsync) per post, not per job."""
        with self.store.transaction():
            stale = [r.job_id for r in runs
                     if not self.queue.checkpoint(r.job_id, r.fence, r.tokens, owner=node.node_id,
                                                  frontier_epoch=self.epoch if r.frontier
                                                  else None)]  # fmt: skip
        now = time.time()
        for r in runs:
            self.requests.tokens(r.job_id, len(r.tokens), now)
        for rid in stale:
            self.log.event("stale", rid, worker=node.node_id, call="checkpoint")
        self.notify()
        return stale

    def _run_nodes(self, node: Node, job_id: str) -> tuple[str, list[str]]:
        """Which replica ran a job's lease and which nodes computed it, for the verification
        votes. The replica it was leased on (the queue's record), not the reporter's shard
        now: a head evicted or made spare mid-run still reports, and its shard no longer says
        where it ran. Its ring's members only while the reporter is one of them; else only
        the reporter is known (blaming today's members of that replica, an honest node moved
        in since, marked it for the evicted node's bits: seen under test)."""
        job = self.queue.get(job_id)
        leased = job.lease_replica if job is not None else None
        replica = leased if leased is not None else str(node.replica)
        members = ([str(n.node_id) for n in ring(self.placed(), int(replica))]
                   if replica.isdigit() else [])  # fmt: skip
        return replica, members if node.node_id in members else [str(node.node_id)]

    def report(self, node: Node, items: list[JobResult],
               runs: list[RunState]) -> tuple[list[str], list[str]]:  # fmt: skip
        """A head's one post: results (`complete_all`), then checkpoints (`checkpoint`), in
        one transaction; (the ids it lost, the results' outcomes)."""
        with self.store.transaction():
            outcomes = self.complete_all(node, items)
            return self.checkpoint(node, runs), outcomes

    def complete_all(self, node: Node, items: list[JobResult]) -> list[str]:
        """`complete` of each (job_id, fence, result) a head posted together, in one
        transaction: each outcome is what it would be alone, and the lot costs one commit (an
        fsync) where it cost three a job (the job, its ring's nodes, its events). A failure
        commits none: the head's post failed, and the leases run out as for a lost post."""
        with self.store.transaction():
            return [self.complete(node, r.job_id, r.fence, encode(r.result)) for r in items]

    def complete(self, node: Node, job_id: str, fence: int,
                 result: dict[str, object]) -> str:  # fmt: skip
        replica, members = self._run_nodes(node, job_id)
        outcome = self.queue.complete(job_id, fence, result, replica, members,
                                      owner=node.node_id)  # fmt: skip
        self.log.event("completed" if outcome != "stale" else "stale", job_id,
                       worker=node.node_id, outcome=outcome,
                       tokens=n_tokens(result))  # fmt: skip
        if outcome == "done":
            with self.store.transaction():
                for nid in members:
                    n = self.store.node(nid)
                    if n is not None:
                        well, _ = health.apply(n.health, health.Served())
                        self.store.update_node(nid, served=n.served + 1,
                                               consecutive_failures=well.consecutive_failures)
            self._record_votes(job_id)
        elif outcome == "verify":
            self._record_contradiction(job_id)
        self.notify()
        return outcome

    def fail(self, node: Node, job_id: str, fence: int, reason: str,
             fault: str = "job") -> str:  # fmt: skip
        """A head says this attempt of the job failed: its data failed a stage, the head could
        not start it, or its ring dropped it (`fault` says which). The attempt is the job's;
        no node is charged."""
        outcome = self.queue.fail(job_id, fence, reason, owner=node.node_id)
        self.log.event("failed", job_id, worker=node.node_id, outcome=outcome, reason=reason,
                       fault=fault)  # fmt: skip
        self.notify()
        return outcome

    def release(self, node: Node, runs: list[JobRef]) -> int:
        """A head stopped serving: its jobs go back to the queue unharmed (no attempt)."""
        released = 0
        for r in runs:
            if self.queue.release(r.job_id, r.fence, owner=node.node_id):
                released += 1
                self.log.event("released", r.job_id, worker=node.node_id)
        self.notify()
        return released
