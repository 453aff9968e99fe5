"""A static pipeline of stage processes on this machine, and a client for it.

The coordinator (a later step) will place stages with the planner and start them on real
nodes; this module is what it builds on, and what the tests use: real processes, real sockets.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import NotRequired, TypedDict

import numpy as np

from cellswarm.engine.sampling import SamplingParams
from cellswarm.errors import BudgetError, RequestError, SwarmError
from cellswarm.swarm import policy
from cellswarm.swarm.auth import load_token
from cellswarm.swarm.protocol.dataplane import Done, Reset, TokenOut, read
from cellswarm.swarm.ring.costs import part_specs
from cellswarm.swarm.ring.frames import Frame, connect, read_frame, reset_stage, write_frame
from cellswarm.swarm.ring.parts import PartConfig
from cellswarm.swarm.ring.stage import StageConfig


class StageRequest(TypedDict):
    """A request `LocalPipeline.generate` sends to stage 0."""

    prompt: Sequence[int] | np.ndarray  # token ids
    max_tokens: int
    sampling: NotRequired[SamplingParams]  # greedy when absent
    stop_ids: NotRequired[Iterable[int]]
    request_id: NotRequired[str]  # a random one when absent
    speculative: NotRequired[str]  # engine/speculative.py MODES (auto when absent)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class Result:
    tokens: list[int]
    reason: str
    request_id: str




class LocalPipeline:
    """N stage processes in a ring; `generate` sends requests to stage 0.

    It also plays the coordinator's part in failures: it watches the stage processes, and when
    one dies it starts a replacement on the same port, tells the others to forget their
    sequences, and replays every unfinished request as prompt + the tokens it already has —
    so a dead stage costs a replay, never a request, and greedy output is unchanged.

    expert_nodes: move every MoE layer's routed experts to this many part processes
    (swarm/ring/parts.py); vocab_nodes: split the embedding and output head by rows over this
    many. Part processes are watched and replaced like stages. prefix_cache_bytes: stage i's
    prefix cache budget, where it is not the default.
    """

    def __init__(
        self, model: str, splits: Sequence[tuple[int, int]], threads: int = 1,
        memory_bytes: int | None = None, context: int = 512, max_sequences: int = 8,
        log_dir: str | None = None, profile: str | None = None,
        crash_after_steps: dict[int, int] | None = None, token_file: str | None = None,
        expert_nodes: int = 0, vocab_nodes: int = 0, max_batch: int = StageConfig.max_batch,
        prefix_cache_bytes: dict[int, int] | None = None,
        max_attempts: int = policy.MAX_ATTEMPTS, offline_after: int = policy.OFFLINE_AFTER,
        draft: str | None = None,
    ):  # fmt: skip
        # the swarm's failure policy (swarm/policy/), unless a test asks for other numbers
        self.max_attempts, self.offline_after = max_attempts, offline_after
        ports = free_ports(len(splits) + expert_nodes + vocab_nodes)
        specs = part_specs(model, expert_nodes, vocab_nodes, ports[len(splits) :])
        self.port = ports[0]
        self.configs = [
            StageConfig(
                model=model,
                layers=layers,
                first=i == 0,
                last=i == len(splits) - 1,
                next_port=ports[(i + 1) % len(splits)],
                listen_port=ports[i],
                threads=threads,
                memory_bytes=memory_bytes,
                context=context,
                max_sequences=max_sequences,
                log_dir=log_dir,
                node_id=f"stage-{i}",
                profile=profile,
                crash_after_steps=(crash_after_steps or {}).get(i),
                token_file=token_file,
                peers=("client", f"stage-{(i - 1) % len(splits)}"),
                parts=tuple(specs),
                max_batch=max_batch,
                prefix_cache_bytes=(prefix_cache_bytes or {}).get(i),
                draft=draft if i == 0 else None,  # stage 0 drafts
            )
            for i, layers in enumerate(splits)
        ]
        stage_ids = tuple(c.node_id for c in self.configs)
        self.part_configs = [
            PartConfig(model, spec, threads, token_file, ("client", *stage_ids)) for spec in specs
        ]
        self.part_procs = [self._spawn_part(c) for c in self.part_configs]
        self.procs: list[subprocess.Popen[str]] = [self._spawn(c) for c in self.configs]
        self.token = load_token(token_file) if token_file else None
        self.restarts = 0
        self.failures = [0] * len(splits)  # consecutive, per stage
        self.part_failures = [0] * len(specs)
        self.epoch = 0
        self._ids: list[str] = []
        self._on_token: Callable[[int, int], None] | None = None
        for p in [*self.part_procs, *self.procs]:
            self._await_ready(p)

    def _spawn(self, cfg: StageConfig) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "cellswarm.swarm.ring.stage", cfg.to_json()]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def _spawn_part(self, cfg: PartConfig) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "cellswarm.swarm.ring.parts", cfg.to_json()]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def _await_ready(self, p: subprocess.Popen[str]) -> None:
        line = p.stdout.readline() if p.stdout else ""
        if not line.startswith("READY"):
            self.close()
            if line.startswith("REFUSED "):
                raise BudgetError(line.removeprefix("REFUSED ").strip())
            raise RuntimeError(f"a stage failed to start (said {line!r})")

    def stats(self) -> list[dict[str, object]]:
        """Each stage's layers, budget, peak RSS, steps and busy seconds."""
        return asyncio.run(self._stats([c.listen_port for c in self.configs]))

    def part_stats(self) -> list[dict[str, object]]:
        """Each part server's weight bytes by kind, peak RSS and requests answered."""
        return asyncio.run(self._stats([c.spec.port for c in self.part_configs]))

    async def _stats(self, ports: list[int]) -> list[dict[str, object]]:
        out = []
        for port in ports:
            reader, writer = await connect("127.0.0.1", port, self.token)
            await write_frame(writer, Frame("stats", {}))
            frame = await read_frame(reader)
            writer.close()
            out.append(frame.fields if frame is not None else {})
        return out

    def generate(
        self, requests: Sequence[StageRequest], on_token: Callable[[int, int], None] | None = None
    ) -> list[Result]:
        """Each request: prompt (token ids), max_tokens, sampling (SamplingParams fields),
        stop_ids. All are sent at once, so they are in flight together. on_token(request
        index, token) is called as tokens arrive."""
        self._on_token = on_token
        return asyncio.run(self._generate(requests))

    async def _generate(self, requests: Sequence[StageRequest]) -> list[Result]:
        self._ids = [str(r.get("request_id") or uuid.uuid4().hex[:12]) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        reasons: dict[int, str] = {}
        attempts = [0] * len(requests)
        while len(reasons) < len(requests):
            todo = [i for i in range(len(requests)) if i not in reasons]
            for i in todo:
                attempts[i] += 1
                if attempts[i] > self.max_attempts:
                    raise SwarmError(
                        f"request {self._ids[i]} failed {self.max_attempts} times (the last after "
                        f"{len(tokens[i])} tokens); giving up on it"
                    )
            try:
                await self._round(requests, todo, tokens, reasons)
                self.failures = [0] * len(self.failures)
                self.part_failures = [0] * len(self.part_failures)
            except (ConnectionError, OSError):
                await self._recover()
        return [Result(tokens[i], reasons[i], self._ids[i]) for i in range(len(requests))]

    async def _round(
        self, requests: Sequence[StageRequest], todo: list[int], tokens: list[list[int]],
        reasons: dict[int, str],
    ) -> None:  # fmt: skip
        """Send the unfinished requests (prompt + tokens so far) and read until all are done
        or a stage dies."""
        reader, writer = await connect("127.0.0.1", self.port, self.token)
        try:
            for i in todo:
                await write_frame(writer, _request_frame(requests[i], tokens[i], self._ids[i]))
            index = {rid: i for i, rid in enumerate(self._ids)}
            while any(i not in reasons for i in todo):
                frame = await self._read_watching(reader)
                i = index[str(frame.fields["req"])]
                if frame.type == "token":
                    tokens[i].append(read(TokenOut, frame.fields).token)
                    if self._on_token is not None:
                        self._on_token(i, tokens[i][-1])
                elif frame.type == "done":
                    reasons[i] = read(Done, frame.fields).reason
                elif frame.type == "error":
                    raise RequestError(f"request {i}: {frame.fields['message']}")
        finally:
            writer.close()

    async def _read_watching(self, reader: asyncio.StreamReader) -> Frame:
        """The next frame from stage 0; ConnectionError as soon as any stage process died."""
        while True:
            if any(p.poll() is not None for p in [*self.procs, *self.part_procs]):
                raise ConnectionError("a stage or part process died")
            try:
                frame = await asyncio.wait_for(read_frame(reader), timeout=0.2)
            except TimeoutError:
                continue
            if frame is None:
                raise ConnectionError("stage 0 closed the connection")
            return frame

    async def _recover(self) -> None:
        """Replace dead stages (same layer range, same port); reset the survivors. A stage
        that does not answer its reset counts as dead: it is killed and replaced too. Dead
        part servers are replaced first (they hold no sequences: nothing to reset), so the
        stages' replay finds them up."""
        self.epoch += 1
        for k, part in enumerate(self.part_configs):
            if self.part_procs[k].poll() is None:
                continue
            self.part_failures[k] += 1
            if self.part_failures[k] >= self.offline_after:
                raise SwarmError(
                    f"part {part.spec.node_id} failed {self.part_failures[k]} times in a row: "
                    "marked offline, and no spare node can take what it holds"
                )
            self.part_procs[k].wait()
            self.part_procs[k] = self._spawn_part(part)
            self._await_ready(self.part_procs[k])
            self.restarts += 1
        for k, cfg in enumerate(self.configs):
            if self.procs[k].poll() is None and await reset_stage(
                "127.0.0.1", cfg.listen_port, Reset(epoch=self.epoch), self.token
            ):
                continue
            self.failures[k] += 1
            if self.failures[k] >= self.offline_after:
                raise SwarmError(
                    f"stage {k} (layers {cfg.layers[0]}..{cfg.layers[1] - 1}) failed "
                    f"{self.failures[k]} times in a row: marked offline, and no spare node "
                    "can take its layers"
                )
            self.procs[k].kill()
            self.procs[k].wait()
            self.procs[k] = self._spawn(cfg)
            self._await_ready(self.procs[k])
            self.restarts += 1
            if not await reset_stage("127.0.0.1", cfg.listen_port, Reset(epoch=self.epoch),
                                     self.token):  # fmt: skip
                raise ConnectionError(f"the replacement stage for layers {cfg.layers} is silent")

    def close(self) -> None:
        procs = [*self.procs, *getattr(self, "part_procs", [])]
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _request_frame(request: StageRequest, done: list[int], request_id: str) -> Frame:
    """A request, resumed after `done` tokens: stage 0 prefills the prompt and replays those
    tokens one decode step each — the same computations as the first time, so the cache, the
    sampler and the continuation are identical (a one-shot prefill of prompt + done would
    take the batched path, whose rounding differs from decode's)."""
    sampling = asdict(request.get("sampling", SamplingParams()))
    fields = {
        "req": request_id, "max_tokens": request["max_tokens"], "sampling": sampling,
        "stop_ids": list(request.get("stop_ids", ())), "replay": list(done),
        "speculative": request.get("speculative", "auto"),
    }  # fmt: skip
    return Frame("generate", fields, np.asarray(request["prompt"], np.int64))
