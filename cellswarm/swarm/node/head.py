"""A pipeline's head: stage 0's worker pulls jobs from the coordinator and runs them.

    head --lease(n, wait_s)--> coordinator: jobs, each with a fence and the tokens to resume
         from; the coordinator holds the call up to wait_s while there is none (long poll)
    head --generate (replay = tokens so far)--> its own stage 0 --> ... ring ... --> tokens
    head --checkpoint(fence, tokens) every 0.1 s--> coordinator (renews the lease)
    head --complete / fail(fence)--> coordinator: 'done', or 'stale' if it lost the lease
    head --release(fence)--> coordinator: jobs it stops holding (the worker stopped serving)

Pull, not push: a head takes only what its ring has room for, a coordinator needs to know
nothing about how busy a ring is, and several coordinators can share one queue. A job whose
lease the head lost (it was paused past the lease, the job went elsewhere) is dropped at its
next checkpoint: its late result would be refused anyway (fencing). When the ring is reset
(a new layout), the head sends its jobs again with the tokens they have, which stage 0
replays: same lease, same attempt.

A lease is renewed by progress only: a job whose step came back to stage 0 within the lease.
A job the head cannot start (its payload breaks the frame) or that its ring dropped, and one
whose data failed a stage (an `error` frame, fault "job"), is failed at once — that attempt
is the job's — never held on to while its lease is renewed.

A full ring makes work wait, it never fails it: the head admits a sequence into stage 0 only
while the ring has room for it (the fewest sequences any of its stages has KV cache for, as
the coordinator says with each lease), and a sequence stage 0 still refuses for room (fault
"room") goes back to wait. A scoring job is one sequence: its prompt once, then each
completion after it. A waiting job's lease is renewed while the ring it waits for makes
progress.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from cellswarm.swarm.protocol.dataplane import (
    Done,
    ErrorOut,
    Generate,
    Sampling,
    ScoreOut,
    TokenOut,
    read,
)
from cellswarm.swarm.protocol.messages import (
    FailReport,
    JobOutput,
    JobRef,
    JobResult,
    JobWork,
    LeaseAnswer,
    LeaseAsk,
    ReleaseAsk,
    RunState,
    decode_leases,
    encode,
)
from cellswarm.swarm.ring.frames import Frame

if TYPE_CHECKING:
    from cellswarm.swarm.ring.stage import Stage

log = logging.getLogger("cellswarm.head")

CHECKPOINT_EVERY_S = 0.1
# An idle head waits at the coordinator for work instead of asking again and again: asking
# every tick (50 times a second) cost each head ~70 KB/s of its uplink with nothing queued,
# which on an oversubscribed rack uplink starved the heartbeats (docs/lab.md).
LEASE_WAIT_S = 1.0
RESULTS_PER_POST = 256  # results in one complete post at most (server.MAX_RESULTS_PER_POST)


@dataclass
class Run:
    """One leased job on this head."""

    job_id: str
    fence: int
    kind: str
    work: JobWork  # what the head runs of the job's payload
    tokens: list[int]
    sent_epoch: int = -1  # the ring epoch it was last sent into
    starting: bool = False  # being sent into the ring right now
    saved: int = -1  # tokens at the last checkpoint
    saved_s: float = 0.0
    scores: dict[int, float] = field(default_factory=dict)
    # its sequence ([0]) while it waits for room in the ring in the current epoch
    waiting: list[int] = field(default_factory=list)

    @property
    def sequences(self) -> int:
        """How many sequences the job runs in all: one (a scoring job's completions go
        through the ring after its prompt, in one sequence: Stage.layers_first)."""
        return 1


Post = Callable[[str, Mapping[str, object]], dict[str, object]]


class Head:
    def __init__(self, stage: Stage, post: Post, lease_s: float) -> None:
        self.stage = stage  # this worker's stage 0
        self.post = post  # blocking HTTP POST to the coordinator (run in a thread)
        self.lease_s = lease_s
        self.runs: dict[str, Run] = {}
        self.leasing: asyncio.Task[None] | None = None  # the long poll in flight, if any
        self.forgotten: list[JobRef] | None = None  # stopped: the jobs it gave back
        self.ring_sequences: int | None = None  # the coordinator's word: what its ring holds
        # runs at their frontier not yet told, results not yet posted, and the one post at a
        # time that carries both (with the checkpoints due then)
        self.at_frontier: dict[str, Run] = {}
        self.finished: dict[str, JobResult] = {}
        self.report_lock = asyncio.Lock()

    @property
    def capacity(self) -> int:
        """Sequences the ring holds at once: stage 0's, capped by the fewest of any stage."""
        own = int(self.stage.config.max_sequences)
        return min(own, self.ring_sequences) if self.ring_sequences else own

    async def tick(self, wired: bool) -> None:
        """One round: (re)send runs into the ring if its epoch changed, ask for more work if
        there is room (a long poll beside the ticks, so checkpoints never wait for it),
        checkpoint what progressed (or is due for a renewal)."""
        if not wired:
            return
        resend = [r for r in self.runs.values() if self._stale(r)]
        if resend:  # still ours? while the ring was down the job may have ended (quarantined
            await self._checkpoint(resend)  # as poison, cancelled): never replay one that did
        for run in list(self.runs.values()):
            if self._stale(run):  # (asked again: a reset may come at any await)
                await self._send(run)
        await self._admit()
        await self._fail_dropped()
        busy = sum(r.sequences for r in self.runs.values())
        free = self.capacity - busy
        if free > 0 and (self.leasing is None or self.leasing.done()):
            self.leasing = asyncio.create_task(self._lease(free))
        await self._checkpoint()

    async def _lease(self, free: int) -> None:
        body = encode(LeaseAsk(n=free, wait_s=LEASE_WAIT_S))
        said = await asyncio.to_thread(self._post_quietly, "/v1/jobs/lease", body)
        answer, bad = decode_leases(said) if said is not None else (LeaseAnswer(), [])
        for ref, why in bad:  # its work did not decode: that attempt fails, the rest run
            log.warning("job %s cannot start: %s", ref.job_id, why)
            await self._report_failure(ref, f"the head could not start it: {why}")
        if answer.ring_sequences:
            self.ring_sequences = answer.ring_sequences
        if self.forgotten is not None:  # it stopped serving while we waited: give all back
            brought = [JobRef(job_id=v.job_id, fence=v.fence) for v in answer.jobs]
            self._release([*self.forgotten, *brought])
            return
        for view in answer.jobs:
            run = Run(view.job_id, view.fence, view.kind, view.payload, list(view.tokens))
            if self.runs.pop(run.job_id, None) is not None:  # our older lease of it expired:
                await self.stage.cancel_request(run.job_id)  # its sequences must not feed this
            self.runs[run.job_id] = run
            await self._send(run)

    def room(self) -> int:
        """Sequences stage 0 may take now (its own count: a sequence leaves every stage after
        it leaves stage 0, its `end` frame ahead of any newer sequence on each link)."""
        return self.capacity - int(self.stage.in_flight())

    async def _admit(self) -> None:
        """Waiting sequences into the ring, oldest job first, while it has room."""
        for run in list(self.runs.values()):
            if run.waiting and not run.starting and not self._stale(run) and self.room() > 0:
                await self._send(run, fresh=False)

    def _stale(self, run: Run) -> bool:
        """Sent into an older epoch (the ring was reset since) and not being sent now."""
        return run.sent_epoch != self.stage.epoch and not run.starting

    async def _send(self, run: Run, fresh: bool = True) -> None:
        """Into stage 0 in its current epoch, as many of its sequences as the ring has room
        for (`fresh`: all of them wait first — a new run, or one the ring was reset under).
        A reset while the sends await (a scoring job sends several sequences) voids the lot:
        what went in after it is cancelled, and the next tick sends the run again — never two
        live sequences of one job in the ring."""
        epoch = run.sent_epoch = self.stage.epoch  # stage 0 makes each sequence at once
        if fresh:
            run.scores.clear()
            run.waiting = list(range(run.sequences))
        run.starting = True
        try:
            while run.waiting and self.room() > 0 and self.stage.epoch == epoch:
                i = run.waiting.pop(0)
                await self.stage.on_generate(self._frame(run, i), self._emit)
                if i in run.waiting:  # stage 0 refused it for room: the next tick tries
                    break
        except Exception as exc:  # its payload, as far as the head can tell: fail it now
            log.warning("job %s cannot start: %s: %s", run.job_id, type(exc).__name__, exc)
            await self._fail(run, f"the head could not start it: {type(exc).__name__}: {exc}")
        finally:
            run.starting = False
        if self.stage.epoch != epoch and run.job_id in self.runs:
            await self.stage.cancel_request(run.job_id)  # sent partly into the new epoch

    @staticmethod
    def _frame(run: Run, i: int) -> Frame:
        """The `generate` frame of the run's sequence i: a generation (i = 0) from the tokens
        it has; a scoring job's completion i, prompt + completion, scored at the end."""
        w = run.work
        if run.kind != "score":
            if w.max_tokens is None:  # not optional for a generation (the API always sets
                raise KeyError("max_tokens")  # it): failed as a payload without it always was
            generate = Generate(req=run.job_id, max_tokens=w.max_tokens,
                                sampling=w.sampling or Sampling(), stop_ids=list(w.stop_ids),
                                replay=list(run.tokens), speculative=w.speculative)  # fmt: skip
            return Frame.of(generate, np.asarray(w.prompt, np.int64))
        if w.completions is None:
            raise ValueError("a scoring job without completions (the API always sets them)")
        ids = w.prompt + [t for c in w.completions for t in c]
        score = Generate(req=f"{run.job_id}#{i}", max_tokens=1, score_from=len(w.prompt),
                         completions=[len(c) for c in w.completions], top=w.top)  # fmt: skip
        return Frame.of(score, np.asarray(ids, np.int64))

    async def _emit(self, frame: Frame) -> None:
        """Frames stage 0 sends its client: tokens, done, error, score."""
        rid = str(frame.fields.get("req", ""))
        job_id, _, part = rid.partition("#")
        run = self.runs.get(job_id)
        if run is None:
            return
        if frame.type == TokenOut.kind:
            run.tokens.append(read(TokenOut, frame.fields).token)
        elif frame.type == ScoreOut.kind:
            score = read(ScoreOut, frame.fields)
            run.scores = dict(enumerate(score.logprobs))
            if len(run.scores) == len(run.work.completions or ()):
                scores = [run.scores[i] for i in range(len(run.scores))]
                await self._finish(run, JobOutput(scores=scores, reason="scored",
                                                  detail=score.detail))  # fmt: skip
        elif frame.type == Done.kind and run.kind == "generate":
            done = read(Done, frame.fields)
            await self._finish(run, JobOutput(tokens=list(run.tokens), reason=done.reason,
                                              bits=done.bits[:16], drafted=done.drafted,
                                              accepted=done.accepted))  # fmt: skip
        elif frame.type == ErrorOut.kind:
            error = read(ErrorOut, frame.fields)
            if error.fault == "room":
                run.waiting.insert(0, int(part or 0))  # the ring was full after all: it waits
            else:  # stage 0 says whose
                await self._fail(run, error.message, error.fault)

    async def _fail(self, run: Run, reason: str, fault: str = "job") -> None:
        """This attempt of the job is over (the coordinator counts it, and dead-letters the
        third): drop it here, and its sequences still in the ring (a scoring job's)."""
        if self.runs.pop(run.job_id, None) is None:
            return  # ended meanwhile
        await self.stage.cancel_request(run.job_id)
        await self._report_failure(JobRef(job_id=run.job_id, fence=run.fence), reason, fault)

    async def _report_failure(self, ref: JobRef, reason: str, fault: str = "job") -> None:
        said = FailReport(job_id=ref.job_id, fence=ref.fence, reason=reason, fault=fault)
        body = msgspec.structs.asdict(said)  # every field: its fault said, "job" too
        await asyncio.to_thread(self._post_quietly, "/v1/jobs/fail", body)

    async def _fail_dropped(self) -> None:
        """A job sent into the ring in this epoch that stage 0 holds no sequence of any more,
        without a result or an error, was dropped: failed at once, not renewed for ever."""
        epoch = self.stage.epoch
        for run in list(self.runs.values()):
            if run.sent_epoch == epoch and not run.starting and not run.waiting and (
                self.stage.activity(run.job_id) is None
            ):
                log.warning("job %s: stage 0 dropped it", run.job_id)
                await self._fail(run, "its ring dropped it without a result", fault="head")

    def _alive(self, run: Run, now: float) -> bool:
        """A step of the run came back to stage 0 within the lease (a replay's steps count:
        they are progress that makes no new tokens)."""
        active = self.stage.activity(run.job_id)
        if run.waiting:  # (some of) it waits for room: alive while the ring moves
            active = max(active or 0.0, self.stage.activity() or 0.0)
        return active is not None and now - active < self.lease_s

    async def _finish(self, run: Run, result: JobOutput) -> None:
        """The job's result to the coordinator, in the next report (see `_report`)."""
        self.runs.pop(run.job_id, None)
        self.finished[run.job_id] = JobResult(job_id=run.job_id, fence=run.fence, result=result)
        await self._report(run.job_id)

    async def _report(self, job_id: str) -> None:
        """Post the results and frontiers pending (with the checkpoints due), once one that
        carries `job_id`'s is answered. What comes while a post is out goes together in the
        next: a batch of short jobs (a labels line is one step, its result and the next
        line's frontier come together) costs about one round trip a job, not two or three."""
        async with self.report_lock:
            if job_id not in self.finished and job_id not in self.at_frontier:
                return  # a post made while this one waited for the lock carried it
            results = list(self.finished.values())
            told = tuple(self.at_frontier.values())
            self.finished.clear()
            self.at_frontier.clear()
            for at in range(RESULTS_PER_POST, len(results), RESULTS_PER_POST):  # (a rare many)
                body = {"results": [encode(r) for r in results[at : at + RESULTS_PER_POST]]}
                await asyncio.to_thread(self._post_quietly, "/v1/jobs/complete", body)
            await self._checkpoint(frontier=told, results=results[:RESULTS_PER_POST])

    async def frontier(self, req: str) -> None:
        """Stage 0 is about to run a step of `req` that its job never completed (its first,
        or its first past the tokens it replays): the coordinator hears it first (with the
        checkpoints due now), awaited, so that it knows even if that step kills this process.
        A node failure strikes only the jobs its ring so reached since it was wired; not one
        waiting here to be sent, or replaying steps it had passed (jobs.strike_replica).
        Frontiers that arrive while one post is out go together in the next: a batch of B
        new jobs costs about one round trip, not B."""
        run = self.runs.get(req.partition("#")[0])
        if run is None:
            return
        self.at_frontier[run.job_id] = run
        await self._report(run.job_id)

    async def _checkpoint(self, due: list[Run] | None = None, frontier: tuple[Run, ...] = (),
                          results: list[JobResult] | None = None) -> None:  # fmt: skip
        """Save the tokens of the runs that progressed, renew those due (only while their
        steps come back), and drop the ones whose lease is gone. `due`: these runs, now.
        `frontier`: these runs too, at their frontier (see `frontier`). `results`: ended
        jobs' results, committed first in the same post."""
        now = time.monotonic()
        told = {r.job_id for r in frontier}
        if due is None:
            due = [r for r in self.runs.values() if r.job_id in told
                   or (len(r.tokens) != r.saved and now - r.saved_s >= CHECKPOINT_EVERY_S)
                   or (now - r.saved_s > self.lease_s / 3 and self._alive(r, now))]  # fmt: skip
        if not due and not results:
            return
        runs = [RunState(job_id=r.job_id, fence=r.fence, tokens=list(r.tokens),
                         frontier=r.job_id in told) for r in due]  # fmt: skip
        body: dict[str, object] = {"runs": [encode(r) for r in runs]}  # a Report's
        if results:
            body["results"] = [encode(r) for r in results]
        answer = await asyncio.to_thread(self._post_quietly, "/v1/jobs/checkpoint", body)
        if answer is None:
            return
        for r in due:  # (a frontier is no progress: the run's first token is not held back)
            r.saved, r.saved_s = len(r.tokens), r.saved_s if r.job_id in told else now
        stale = answer.get("stale")
        for job_id in stale if isinstance(stale, list) else []:  # the lease went elsewhere,
            # or it was cancelled
            log.warning("lost the lease of job %s; dropping it", job_id)
            self.runs.pop(str(job_id), None)
            await self.stage.cancel_request(str(job_id))  # and stop spending the ring on it

    def _post_quietly(self, path: str, body: Mapping[str, object]) -> dict[str, object] | None:
        """A lost call is safe: checkpoints are retried, a lost result's lease expires and
        the job runs again (its next result is committed once)."""
        try:
            return self.post(path, body)
        except (OSError, ValueError) as exc:
            log.warning("coordinator call %s failed: %s", path, exc)
            return None

    def forget(self) -> None:
        """The worker stopped serving: its jobs go back to the queue unharmed (no attempt
        spent: not their fault), if the coordinator answers; else their leases expire. A
        long poll still in flight is let land first — the coordinator may still lease to it,
        and a poll dropped with what it brings left those jobs leased to nobody until their
        leases ran out — and what it brings goes back with the rest."""
        self.forgotten = [JobRef(job_id=r.job_id, fence=r.fence) for r in self.runs.values()]
        self.runs.clear()
        if self.leasing is None or self.leasing.done():
            self._release(self.forgotten)

    def _release(self, runs: list[JobRef]) -> None:
        if runs:  # in a thread: the caller is stopping and must not wait for an answer
            body = encode(ReleaseAsk(runs=runs))
            threading.Thread(target=self._post_quietly, args=("/v1/jobs/release", body),
                             daemon=True).start()  # fmt: skip
