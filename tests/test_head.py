"""The pipeline head against a fake coordinator: one long-poll lease at a time, checkpoints
never waiting behind it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from cellswarm.swarm.head import LEASE_WAIT_S, Head


class FakeStage:
    epoch = 1

    class config:  # stands for StageConfig
        max_sequences = 4

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def on_generate(self, frame: Any, emit: Any) -> None:
        self.sent.append(str(frame.fields["req"]))

    async def cancel_request(self, req: str) -> None:
        pass


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
        return coord, stage, head

    coord, stage, _ = asyncio.run(scenario())
    assert stage.sent == ["j1"]  # the job went into the ring as soon as the poll returned
    assert "/v1/jobs/checkpoint" in coord.paths()
    assert coord.paths().count("/v1/jobs/lease") == 2  # room for 3 more: asked again


def test_forget_drops_a_pending_poll() -> None:
    async def scenario() -> Head:
        coord = SlowCoordinator()
        head = Head(FakeStage(), coord.post, lease_s=1.0)
        await head.tick(True)
        head.forget()
        coord.release.set()
        await asyncio.sleep(0.05)
        return head

    head = asyncio.run(scenario())
    assert head.runs == {} and head.leasing is not None and head.leasing.cancelled()
