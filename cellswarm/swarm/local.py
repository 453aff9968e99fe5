"""A static pipeline of stage processes on this machine, and a client for it.

The coordinator (a later step) will place stages with the planner and start them on real
nodes; this module is what it builds on, and what the tests use: real processes, real sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from cellswarm.engine.sampling import SamplingParams
from cellswarm.swarm.frames import Frame, read_frame, write_frame
from cellswarm.swarm.stage import StageConfig


def even_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, sizes differing by at most one."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"{n_stages} stages for {n_layers} layers")
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(itertools.pairwise(bounds))


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


class LocalPipeline:
    """N stage processes in a ring; `generate` sends requests to stage 0."""

    def __init__(self, model: str, splits: Sequence[tuple[int, int]], threads: int = 1):
        ports = free_ports(len(splits))
        self.port = ports[0]
        self.procs: list[subprocess.Popen[str]] = []
        for i, layers in enumerate(splits):
            cfg = StageConfig(
                model=model, layers=layers, first=i == 0, last=i == len(splits) - 1,
                next_port=ports[(i + 1) % len(splits)], listen_port=ports[i], threads=threads,
            )  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "cellswarm.swarm.stage", cfg.to_json()],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in self.procs:
            line = p.stdout.readline() if p.stdout else ""
            if not line.startswith("READY"):
                self.close()
                raise RuntimeError(f"a stage failed to start (said {line!r})")

    def generate(self, requests: Sequence[dict[str, Any]]) -> list[Result]:
        """Each request: prompt (token ids), max_tokens, sampling (SamplingParams fields),
        stop_ids. All are sent at once, so they are in flight together."""
        return asyncio.run(self._generate(requests))

    async def _generate(self, requests: Sequence[dict[str, Any]]) -> list[Result]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        for i, r in enumerate(requests):
            sampling = asdict(r.get("sampling", SamplingParams()))
            fields = {"req": str(i), "max_tokens": r["max_tokens"], "sampling": sampling,
                      "stop_ids": list(r.get("stop_ids", ()))}  # fmt: skip
            await write_frame(writer, Frame("generate", fields, np.asarray(r["prompt"], np.int64)))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
        reasons: dict[str, str] = {}
        while len(reasons) < len(requests):
            frame = await read_frame(reader)
            if frame is None:
                raise ConnectionError("stage 0 closed the connection")
            if frame.type == "token":
                tokens[frame.fields["req"]].append(int(frame.fields["token"]))
            elif frame.type == "done":
                reasons[frame.fields["req"]] = frame.fields["reason"]
        writer.close()
        return [Result(tokens[str(i)], reasons[str(i)]) for i in range(len(requests))]

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
