"""The pipeline head against a fake coordinator: one long-poll lease at a time, checkpoints
never waiting behind it."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from cellswarm.swarm.node.head import LEASE_WAIT_S, Head
from cellswarm.swarm.protocol.messages import JobOutput


class FakeStage:
    epoch = 1

    class config:  # stands for StageConfig
        max_sequences = 4

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.cancelled: list[str] = []

    async def on_generate(self, frame: Any, emit: Any) -> None:
        self.sent.append(str(frame.fields["req"]))

    async def cancel_request(self, req: str) -> None:
        self.cancelled.append(req)

    def activity(self, req: str | None = None) -> float | None:
        live = [r for r in self.sent if r not in self.cancelled]
        return time.monotonic() if (req in live if req else live) else None

    def in_flight(self) -> int:
        return len([r for r in self.sent if r not in self.cancelled])


class SlowCoordinator:
    """Holds every lease until released (an idle queue's long poll); answers the rest."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.release = threading.Event()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((path, body))
        if path == "/v1/jobs/lease":
            self.release.wait(10)
            if self.paths().count(path) > 1:
                return {"jobs": []}
            job = {"job_id": "j1", "fence": 7, "kind": "generate", "tokens": [],
                   "payload": {"prompt": [1, 2], "max_tokens": 4}}  # fmt: skip
            return {"jobs": [job]}
        return {"stale": []}

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]


def test_one_long_poll_at_a_time_and_checkpoints_do_not_wait_for_it() -> None:
    async def scenario() -> tuple[SlowCoordinator, FakeStage, Head]:
        coord, stage = SlowCoordinator(), FakeStage()
        head = Head(stage, coord.post, lease_s=0.3)
        for _ in range(20):  # 20 ticks while the queue is empty: one lease in flight
            await head.tick(True)
            await asyncio.sleep(0.005)
        assert coord.paths() == ["/v1/jobs/lease"]
        assert coord.calls[0][1] == {"n": 4, "wait_s": LEASE_WAIT_S}
        coord.release.set()
        assert head.leasing is not None
        await head.leasing
        await head.tick(True)
        for _ in range(500):  # the next poll's thread may start late on a busy machine
            if coord.paths().count("/v1/jobs/lease") == 2:
                break
            await asyncio.sleep(0.01)
        return coord, stage, head

    coord, stage, _ = asyncio.run(scenario())
    assert stage.sent == ["j1"]  # the job went into the ring as soon as the poll returned
    assert "/v1/jobs/checkpoint" in coord.paths()
    assert coord.paths().count("/v1/jobs/lease") == 2  # room for 3 more: asked again


def test_forget_gives_back_what_a_pending_poll_brings() -> None:
    """A stopped head's poll may still be leased to by the coordinator: what it brings goes
    back at once (not into the ring, not left leased until it expires)."""

    async def scenario() -> tuple[SlowCoordinator, FakeStage, Head]:
        coord, stage = SlowCoordinator(), FakeStage()
        head = Head(stage, coord.post, lease_s=1.0)
        await head.tick(True)
        head.forget()
        coord.release.set()
        assert head.leasing is not None
        await head.leasing
        for _ in range(500):
            if "/v1/jobs/release" in coord.paths():
                break
            await asyncio.sleep(0.01)
        return coord, stage, head

    coord, stage, head = asyncio.run(scenario())
    assert head.runs == {} and stage.sent == []
    [(_, body)] = [c for c in coord.calls if c[0] == "/v1/jobs/release"]
    assert body == {"runs": [{"job_id": "j1", "fence": 7}]}


class QuickCoordinator:
    """Hands out the given jobs on the first lease, nothing after; answers the rest."""

    def __init__(self, jobs: list[dict[str, Any]]) -> None:
        self.jobs, self.calls = jobs, []  # type: ignore[var-annotated]

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((path, body))
        if path == "/v1/jobs/lease":
            jobs, self.jobs = self.jobs, []
            return {"jobs": jobs}
        return {"stale": [], "outcomes": ["done"] * len(body.get("results", []))}

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b in self.calls if p == path]

    def results(self) -> list[dict[str, Any]]:
        """Every result posted, one post carrying one or several."""
        return [r for p, b in self.calls for r in b.get("results", [b] if p == "/v1/jobs/complete"
                                                          else [])]  # fmt: skip


def job(job_id: str, prompt: list[int], **payload: Any) -> dict[str, Any]:
    return {"job_id": job_id, "fence": 3, "kind": "generate", "tokens": [],
            "payload": {"prompt": prompt, "max_tokens": 4, **payload}}  # fmt: skip


def run_head(coord: QuickCoordinator, stage: Any, ticks: int = 5, lease_s: float = 0.3) -> Head:
    async def scenario() -> Head:
        head = Head(stage, coord.post, lease_s=lease_s)
        for _ in range(ticks):
            await head.tick(True)
            if head.leasing is not None:
                await head.leasing
            await asyncio.sleep(0.01)
        return head

    return asyncio.run(scenario())


def test_a_job_the_head_cannot_start_is_failed_at_once_not_renewed() -> None:
    """A payload that breaks before the ring (a token id beyond int64, no max_tokens) fails
    that attempt at once; the good job beside it runs and is renewed."""
    coord, stage = QuickCoordinator([job("bad", [1, 2**70]), job("good", [1, 2])]), FakeStage()
    coord.jobs.append({**job("nomax", [1]), "payload": {"prompt": [1]}})
    head = run_head(coord, stage, ticks=30)
    failed = {b["job_id"]: b for b in coord.bodies("/v1/jobs/fail")}
    assert set(failed) == {"bad", "nomax"}
    assert "OverflowError" in failed["bad"]["reason"] and failed["bad"]["fence"] == 3
    assert "KeyError" in failed["nomax"]["reason"] and failed["nomax"]["fault"] == "job"
    assert list(head.runs) == ["good"]
    renewed = {r["job_id"] for b in coord.bodies("/v1/jobs/checkpoint") for r in b["runs"]}
    assert renewed == {"good"}


def test_a_job_whose_work_does_not_decode_fails_alone() -> None:
    """The lease is typed (JobWork): a job whose work has a field of the wrong type or one no
    head knows fails that attempt, named, while the jobs beside it in the same lease run."""
    coord, stage = QuickCoordinator([job("text", "hello"), job("good", [1, 2]),
                                     job("odd", [1], colour="red")]), FakeStage()  # fmt: skip
    head = run_head(coord, stage, ticks=30)
    failed = {b["job_id"]: b for b in coord.bodies("/v1/jobs/fail")}
    assert set(failed) == {"text", "odd"} and list(head.runs) == ["good"]
    assert "prompt" in failed["text"]["reason"] and "colour" in failed["odd"]["reason"]
    assert failed["text"]["fence"] == 3 and failed["odd"]["fault"] == "job"


def test_an_error_frame_fails_the_job_and_a_dropped_or_stalled_run_is_not_renewed() -> None:
    from cellswarm.swarm.ring.frames import Frame

    class Stage(FakeStage):
        async def on_generate(self, frame: Any, emit: Any) -> None:
            await super().on_generate(frame, emit)
            req = str(frame.fields["req"])
            if req == "poison":  # a later stage found its data at fault
                await emit(Frame("error", {"req": req, "message": "seed -1", "fault": "job"}))

        def activity(self, req: str) -> float | None:
            if req == "dropped":
                return None  # stage 0 holds none of its sequences any more
            if req == "stalled":
                return time.monotonic() - 10.0  # nothing came back for 10 s
            return super().activity(req)

    jobs = [job(j, [1, 2]) for j in ("poison", "dropped", "stalled", "good")]
    coord, stage = QuickCoordinator(jobs), Stage()
    head = run_head(coord, stage, ticks=40, lease_s=0.3)
    failed = {b["job_id"]: b for b in coord.bodies("/v1/jobs/fail")}
    assert failed["poison"]["reason"] == "seed -1" and failed["poison"]["fault"] == "job"
    assert failed["dropped"]["fault"] == "head" and "dropped" in failed["dropped"]["reason"]
    assert set(failed) == {"poison", "dropped"}
    saves = [r["job_id"] for b in coord.bodies("/v1/jobs/checkpoint") for r in b["runs"]]
    assert saves.count("good") >= 3  # renewed every lease / 3 while its steps come back
    assert saves.count("stalled") == 1  # its first save; then no renewal without progress
    assert sorted(head.runs) == ["good", "stalled"]


def test_forget_releases_the_jobs_at_once() -> None:
    coord = QuickCoordinator([job("a", [1]), job("b", [2])])
    head = run_head(coord, FakeStage(), ticks=2)
    head.forget()
    deadline = time.monotonic() + 5
    while not coord.bodies("/v1/jobs/release") and time.monotonic() < deadline:
        time.sleep(0.01)
    [body] = coord.bodies("/v1/jobs/release")
    assert body == {"runs": [{"job_id": "a", "fence": 3}, {"job_id": "b", "fence": 3}]}
    assert head.runs == {}


def test_a_run_at_its_frontier_is_told_to_the_coordinator_before_its_step() -> None:
    """Stage 0 awaits head.frontier(req) before a step its job never completed: the head
    posts a checkpoint of that run marked "frontier" (with the checkpoints due) and returns
    once it is answered; a request it holds no run of costs no call; a run whose lease is
    gone is dropped and its sequence cancelled (stage 0 then runs no step of it)."""
    from cellswarm.swarm.node.head import Run

    class Coordinator(QuickCoordinator):
        def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            super().post(path, body)
            return {"stale": [r["job_id"] for r in body.get("runs", []) if r["job_id"] == "gone"]}

    async def scenario() -> tuple[Coordinator, FakeStage, Head]:
        coord, stage = Coordinator([]), FakeStage()
        head = Head(stage, coord.post, lease_s=1.0)
        for job_id in ("s", "gone"):  # both saved just now: no other checkpoint is due
            head.runs[job_id] = Run(job_id, 3, "generate", {}, [7], saved=1,
                                    saved_s=time.monotonic())  # fmt: skip
        await head.frontier("s#0")  # a scoring job's sequence names its job
        await head.frontier("stranger")
        await head.frontier("gone")
        return coord, stage, head

    coord, stage, head = asyncio.run(scenario())
    assert [b["runs"] for b in coord.bodies("/v1/jobs/checkpoint")] == [
        [{"job_id": "s", "fence": 3, "tokens": [7], "frontier": True}],
        [{"job_id": "gone", "fence": 3, "tokens": [7], "frontier": True}],
    ]
    assert list(head.runs) == ["s"] and stage.cancelled == ["gone"]


def test_frontiers_that_arrive_while_one_is_told_go_together() -> None:
    """B new jobs reaching stage 0 at once cost about one round trip, not B: the frontiers
    that arrive while one post is out are told in the next, and each call returns only once
    a post that carried its run was answered."""
    from cellswarm.swarm.node.head import Run

    async def scenario() -> QuickCoordinator:
        coord = QuickCoordinator([])
        head = Head(FakeStage(), coord.post, lease_s=1.0)
        for i in range(6):
            head.runs[f"j{i}"] = Run(f"j{i}", 3, "generate", {}, [7], saved=1,
                                     saved_s=time.monotonic())  # fmt: skip
        await asyncio.gather(*(head.frontier(f"j{i}") for i in range(6)))
        assert head.at_frontier == {}
        return coord

    posts = [b["runs"] for b in asyncio.run(scenario()).bodies("/v1/jobs/checkpoint")]
    assert len(posts) == 2  # the first to come, then the five that came while it was out
    assert sorted(r["job_id"] for runs in posts for r in runs) == [f"j{i}" for i in range(6)]
    assert all(r["frontier"] for runs in posts for r in runs)


def test_results_that_end_while_one_is_posted_go_together() -> None:
    """A batch of short jobs ending at once costs about one post, not one per job: results
    that end while a post is out go in the next, each call returns once its result went."""
    from cellswarm.swarm.node.head import Run

    async def scenario() -> QuickCoordinator:
        coord = QuickCoordinator([])
        head = Head(FakeStage(), coord.post, lease_s=1.0)
        runs = [Run(f"j{i}", 3, "score", {}, []) for i in range(6)]
        head.runs = {r.job_id: r for r in runs}
        await asyncio.gather(*(head._finish(r, JobOutput(scores=[-1.0], reason="scored"))
                               for r in runs))  # fmt: skip
        assert head.finished == {} and head.runs == {}
        return coord

    coord = asyncio.run(scenario())
    assert [p for p, _ in coord.calls] == ["/v1/jobs/checkpoint"] * 2  # the first, the 5 after
    assert sorted(r["job_id"] for r in coord.results()) == [f"j{i}" for i in range(6)]
    assert all(r["fence"] == 3 and r["result"]["reason"] == "scored" for r in coord.results())


def test_results_and_frontiers_that_come_together_share_a_post() -> None:
    """A labels line's result and the next line's frontier come at the same moment: one
    post carries both (the results committed first), not one each."""
    from cellswarm.swarm.node.head import Run

    async def scenario() -> QuickCoordinator:
        coord = QuickCoordinator([])
        head = Head(FakeStage(), coord.post, lease_s=1.0)
        runs = [Run(f"j{i}", 3, "score", {}, [], saved_s=time.monotonic()) for i in range(4)]
        head.runs = {r.job_id: r for r in runs}
        await asyncio.gather(head._finish(runs[0], JobOutput(scores=[-1.0], reason="scored")),
                             head.frontier("j1#0"),
                             head._finish(runs[2], JobOutput(scores=[-2.0], reason="scored")),
                             head.frontier("j3#0"))  # fmt: skip
        return coord

    coord = asyncio.run(scenario())
    posts = coord.bodies("/v1/jobs/checkpoint")
    assert [p for p, _ in coord.calls] == ["/v1/jobs/checkpoint"] * 2, coord.calls
    assert [r["job_id"] for r in posts[0]["results"]] == ["j0"] and posts[0]["runs"] == []
    assert [r["job_id"] for r in posts[1]["results"]] == ["j2"]
    assert [(r["job_id"], r["frontier"]) for r in posts[1]["runs"]] == [("j1", True),
                                                                        ("j3", True)]


class RingStage(FakeStage):
    """Stage 0 of a ring that holds `max_sequences`; it refuses more for room, as Stage does,
    and `finish()` ends the oldest sequence (a token for a generation, a score for a part)."""

    def __init__(self, refuse_over: int | None = None) -> None:
        super().__init__()
        self.live: list[tuple[str, Any]] = []
        self.most = 0
        self.refuse_over = refuse_over  # stage 0's own limit, when the head must overrun it
        self.options: dict[str, int] = {}  # a scoring sequence's completions

    async def on_generate(self, frame: Any, emit: Any) -> None:
        from cellswarm.swarm.ring.frames import Frame

        req = str(frame.fields["req"])
        if self.refuse_over is not None and len(self.live) >= self.refuse_over:
            await emit(Frame("error", {"req": req, "message": "full", "fault": "room"}))
            return
        self.sent.append(req)
        self.live.append((req, emit))
        self.options[req] = len(frame.fields.get("completions") or ())
        self.most = max(self.most, len(self.live))

    def activity(self, req: str | None = None) -> float | None:
        live = [r for r, _ in self.live]
        hit = live if req is None else [r for r in live if r == req or r.startswith(req + "#")]
        return time.monotonic() if hit else None

    def in_flight(self) -> int:
        return len(self.live)

    async def finish(self) -> None:
        from cellswarm.swarm.ring.frames import Frame

        if not self.live:
            return
        req, emit = self.live.pop(0)
        if "#" in req:  # a scoring job: all its completions' scores at once
            await emit(Frame("score", {"req": req, "logprobs": [-1.0] * self.options[req]}))
        else:
            await emit(Frame("token", {"req": req, "token": 5}))
            await emit(Frame("done", {"req": req, "reason": "max_tokens"}))


def run_ring(coord: QuickCoordinator, stage: RingStage, ticks: int) -> Head:
    async def scenario() -> Head:
        head = Head(stage, coord.post, lease_s=0.3)
        for k in range(ticks):
            await head.tick(True)
            if head.leasing is not None:
                await head.leasing
            if k % 3 == 2:  # the ring finishes a sequence every third tick
                await stage.finish()
            await asyncio.sleep(0.01)
        return head

    return asyncio.run(scenario())


def test_a_full_ring_makes_jobs_wait_and_never_fails_them() -> None:
    """Six generations and a scoring job of five completions, leased at once to a head whose
    ring holds two sequences (the coordinator says so): never more than two in the ring, a
    scoring job one sequence (its prompt, then its completions after it), nothing failed,
    every job completed, the waiting ones renewed."""
    jobs = [job(f"g{i}", [1, 2]) for i in range(6)]
    jobs.append({**job("s", [1, 2]), "kind": "score",
                 "payload": {"prompt": [1, 2], "completions": [[3]] * 5}})  # fmt: skip

    class Coordinator(QuickCoordinator):
        def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            out = super().post(path, body)
            return {**out, "ring_sequences": 2} if path == "/v1/jobs/lease" else out

    coord, stage = Coordinator(jobs), RingStage()
    head = run_ring(coord, stage, ticks=60)
    assert coord.bodies("/v1/jobs/fail") == []
    done = {b["job_id"]: b["result"] for b in coord.results()}
    assert set(done) == {*(f"g{i}" for i in range(6)), "s"}
    assert done["s"] == {"scores": [-1.0] * 5, "reason": "scored"}
    assert stage.most == 2 and head.runs == {}


def test_a_sequence_stage_0_refuses_for_room_waits_and_is_not_failed() -> None:
    """Stage 0 says "room" (the head's count was off): the sequence waits, then runs."""
    coord, stage = QuickCoordinator([job(f"g{i}", [1, 2]) for i in range(4)]), RingStage(1)
    head = run_ring(coord, stage, ticks=40)
    assert coord.bodies("/v1/jobs/fail") == []
    assert {b["job_id"] for b in coord.results()} == {"g0", "g1", "g2", "g3"}
    assert head.runs == {}
