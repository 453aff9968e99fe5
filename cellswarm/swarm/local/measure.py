"""Measure a real local swarm of emulated nodes: what the simulator is calibrated against.

`measure_local` starts a coordinator and N workers that behave like a planner profile
(`--profile`: padded compute, metered link), one ring of N stages, runs a batch of J jobs of
M tokens with S in flight, optionally SIGKILLs one stage's worker once tokens flow (a spare
takes its layers), and reports what a user sees: generated tokens per second over the whole
batch (submit to last result) and the median request latency (submission to completion, from
the coordinator's own log) — the same two numbers the simulator predicts.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from cellswarm.swarm.api import client
from cellswarm.swarm.api.client import NodeRow
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.protocol.jsonvalue import JsonObject

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3,"]


@dataclass(frozen=True)
class LocalRun:
    workers: int  # stages in the ring (a spare more when `kill`)
    profile: str
    jobs: int
    max_tokens: int
    in_flight: int
    killed: bool
    split: tuple[tuple[int, int], ...]  # the layer ranges the coordinator placed
    prompt_tokens: tuple[int, ...]  # per job
    tokens: int  # generated, all jobs
    makespan_s: float  # first submission to last completion
    tokens_per_s: float
    p50_latency_s: float
    kill_at_s: float | None  # when the worker was killed, after the batch was submitted

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def measure_local(
    workers: int, profile: str = "rpi4", jobs: int = 8, max_tokens: int = 16,
    in_flight: int = 4, kill: bool = False, memory: str = "160M",
    model: str | None = None,
) -> LocalRun:  # fmt: skip
    from cellswarm.demo import demo_model_path

    path = model or str(demo_model_path())
    rows = [{"id": str(i), "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens}
            for i in range(jobs)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(
        path, workers + (1 if kill else 0), memory, Path(tmp), profile=profile,
        stages=workers, max_sequences=in_flight, context=64, heartbeat_timeout_s=6.0,
        rebalance=False,  # the split measured is the split predicted
    ) as swarm:  # fmt: skip
        status = swarm.wait_ready(timeout_s=300)
        split = tuple(_layers(n) for n in _stages(status["nodes"]))
        warm = client.submit(swarm.url, {"prompt": PROMPTS[0], "max_tokens": 2})
        client.wait(swarm.url, warm)  # first touch of every page, kernels built: not measured
        t0 = time.time()
        batch = client.call(swarm.url, "/v1/batches", {"items": rows})["batch_id"]
        kill_at = _kill_mid_batch(swarm, batch) - t0 if kill else None
        while client.call(swarm.url, f"/v1/batches/{batch}")["finished"] < jobs:
            time.sleep(0.05)
        results = client.call(swarm.url, f"/v1/batches/{batch}/results")["results"]
        events = _coordinator_events(swarm.log_dir)
    assert all(r["state"] == "done" for r in results), results
    latencies, makespan, tokens = batch_timings(events, results, t0)
    from cellswarm.loader import load_tokenizer

    tok = load_tokenizer(path)
    return LocalRun(
        workers, profile, jobs, max_tokens, in_flight, kill, split,
        tuple(len(tok.encode(str(r["prompt"]))) for r in rows), tokens, round(makespan, 4),
        round(tokens / makespan, 3), round(statistics.median(latencies), 4),
        None if kill_at is None else round(kill_at, 4),
    )  # fmt: skip


def batch_timings(
    events: Sequence[Mapping[str, object]], results: Sequence[Mapping[str, object]], t0: float
) -> tuple[list[float], float, int]:
    """From the coordinator's events: each job's latency (submitted to completed), the
    makespan from t0 to the last completion, and the tokens generated."""
    submitted = {e["request_id"]: _seconds(e["ts"]) for e in events
                 if e["event"] == "submitted"}  # fmt: skip
    done = {e["request_id"]: _seconds(e["ts"]) for e in events
            if e["event"] == "completed" and e.get("outcome") == "done"}  # fmt: skip
    ids = [r["job_id"] for r in results]
    latencies = [done[i] - submitted.get(i, t0) for i in ids]
    return latencies, max(done[i] for i in ids) - t0, sum(_count(r["tokens"]) for r in results)


def _seconds(ts: object) -> float:
    """An event's time (unix seconds, a JSON number)."""
    if not isinstance(ts, int | float):
        raise TypeError(f"an event's ts is {type(ts).__name__}, not a number")
    return ts


def _count(tokens: object) -> int:
    """How many tokens a result holds (its JSON list of ids)."""
    if not isinstance(tokens, list):
        raise TypeError(f"a result's tokens are {type(tokens).__name__}, not a list")
    return len(tokens)


def _stages(nodes: list[NodeRow]) -> list[NodeRow]:
    """The nodes holding a stage of the ring, in stage order."""
    staged = [(n["stage"], n) for n in nodes if n["stage"] is not None]
    return [n for _, n in sorted(staged, key=lambda sn: sn[0])]


def _layers(n: NodeRow) -> tuple[int, int]:
    if n["layers"] is None:
        raise TypeError(f"stage node {n['node_id']} holds no layers")
    return int(n["layers"][0]), int(n["layers"][1])


def _kill_mid_batch(swarm: LocalSwarm, batch: str) -> float:
    """SIGKILL the worker of the ring's middle stage once a few tokens are out; when."""
    while client.call(swarm.url, f"/v1/batches/{batch}")["tokens"] < 4:
        time.sleep(0.02)
    stages = _stages(swarm.status()["nodes"])
    victim = stages[len(stages) // 2]["node_id"]
    swarm.kill(victim)
    return time.time()


def _coordinator_events(log_dir: Path) -> list[JsonObject]:
    path = Path(log_dir) / "coordinator.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
