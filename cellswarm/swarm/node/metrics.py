"""GET /metrics on a worker: its own view in Prometheus' text format (prometheus_client's
server, in a thread of its own so a scrape never waits on a step).

Read at scrape time from the worker: memory used and peak against its budget, its stage's
counters (steps, decode steps and time, busy time, per-hop-part time), a histogram of step
times, and an energy estimate (busy time at the node's busy power, the rest at idle power,
from its --profile or the `laptop` profile's figures). The coordinator's /metrics carries
the same per node from heartbeats; a worker's own is there for a scrape that must not depend
on the coordinator, and for what a heartbeat does not carry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cellswarm.engine.memory import peak_rss_bytes, rss_bytes
from cellswarm.swarm.ring.step_times import cumulative

if TYPE_CHECKING:
    from cellswarm.swarm.node.worker import Worker

DEFAULT_POWER_PROFILE = "laptop"  # whose watts a node without --profile is estimated at


class Power:
    """A node's energy estimate: busy seconds at busy watts, the rest of its life at idle."""

    def __init__(self, profile: str | None) -> None:
        from cellswarm.planner.profiles import get_profile

        p = get_profile(profile or DEFAULT_POWER_PROFILE)
        self.source = p.name
        self.busy_w, self.idle_w = p.power_busy_w, p.power_idle_w
        self.started_s = time.monotonic()

    def joules(self, busy_s: float) -> float:
        up_s = time.monotonic() - self.started_s
        busy_s = min(busy_s, up_s)
        return busy_s * self.busy_w + (up_s - busy_s) * self.idle_w


class WorkerCollector:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self.worker
        stats: dict[str, Any] = w.stage.stats() if w.stage is not None else {}
        yield _gauge("cellswarm_worker_memory_budget_bytes", "the --memory budget",
                     w.config.memory_bytes)  # fmt: skip
        yield _gauge("cellswarm_worker_memory_used_bytes", "resident memory now", rss_bytes())
        yield _gauge("cellswarm_worker_memory_peak_bytes", "peak resident memory (VmHWM)",
                     peak_rss_bytes())  # fmt: skip
        yield _gauge("cellswarm_worker_serving", "1 while it serves a shard", w.ready is not None)
        yield _gauge("cellswarm_worker_sequences", "sequences in flight", stats.get("sequences", 0))
        for key, name, doc in (
            ("steps", "cellswarm_worker_steps", "forward steps of its stage"),
            ("decode_steps", "cellswarm_worker_tokens", "decode steps (one token each)"),
            ("decode_s", "cellswarm_worker_decode_seconds", "time in decode steps"),
            ("busy_s", "cellswarm_worker_busy_seconds", "time computing"),
        ):
            yield _counter(name, doc, float(stats.get(key, 0)))
        hop = CounterMetricFamily("cellswarm_worker_hop_seconds", "time per part of a hop",
                                  labels=["part"])  # fmt: skip
        for part, seconds in (stats.get("hop_s") or {}).items():
            hop.add_metric([str(part)], float(seconds))
        yield hop
        if stats.get("step_s"):
            buckets, total = cumulative(stats["step_s"])
            yield HistogramMetricFamily("cellswarm_worker_step_seconds", "compute time per step",
                                        buckets=buckets, sum_value=total)  # fmt: skip
        energy = CounterMetricFamily("cellswarm_worker_energy_joules", "estimated energy: busy "
                                     "time at busy power, the rest at idle", labels=["profile"])
        energy.add_metric([w.power.source], w.power.joules(float(stats.get("busy_s", 0.0))))
        yield energy


def serve(worker: Worker, host: str, port: int) -> int:
    """Start the metrics server; the port it listens on."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
