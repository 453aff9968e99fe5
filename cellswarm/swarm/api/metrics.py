"""GET /metrics on the coordinator: the swarm in Prometheus' text format (prometheus_client).

Read at scrape time from what the coordinator already holds — the node table, each node's
latest heartbeat (its stage's counters: steps, decode time, per-hop time), the job ledger —
so a scrape costs a few queries and nothing is counted twice. Counters are the nodes' own
(they restart with a node's process, which Prometheus' rate() takes as a reset).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cellswarm.swarm.ring.step_times import cumulative

if TYPE_CHECKING:
    from cellswarm.swarm.control.coordinator import Coordinator

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NODE_STATES = ("spare", "assigned", "lost", "offline", "refused")


class SwarmCollector:
    """One scrape: gauges and counters built from the coordinator's state."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def collect(self) -> Iterator[Metric]:
        status = self.coord.status()
        yield from swarm_metrics(status)
        yield from node_metrics(status["nodes"])
        yield from queue_metrics(self.coord.queue.ledger(), self.coord.queue.retries())
        beats = CounterMetricFamily("cellswarm_heartbeats", "heartbeats answered, by how "
                                    "they came (http, nats)", labels=["via"])  # fmt: skip
        for via, n in sorted(self.coord.beats_via.items()):
            beats.add_metric([via], n)
        yield beats


def render(coord: Coordinator) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(coord))
    return bytes(generate_latest(registry))


def swarm_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    yield _gauge("cellswarm_epoch", "placement epoch (it moves on every re-placement)",
                 status["epoch"])  # fmt: skip
    yield _gauge("cellswarm_wired", "1 when every ring of this epoch is wired", status["wired"])
    yield _gauge("cellswarm_leader", "1 on the coordinator that leads", status["leader"])
    states = GaugeMetricFamily("cellswarm_nodes", "nodes by state", labels=["state"])
    for state in NODE_STATES:
        states.add_metric([state], sum(n["state"] == state for n in status["nodes"]))
    yield states


# key, kind, metric name, what it is; labelled by node
NODE_FAMILIES = (
    ("budget", "gauge", "cellswarm_node_memory_budget_bytes", "the node's memory budget"),
    ("rss", "gauge", "cellswarm_node_memory_used_bytes", "resident memory at the last heartbeat"),
    ("peak", "gauge", "cellswarm_node_memory_peak_bytes", "peak resident memory"),
    ("seen", "gauge", "cellswarm_node_last_seen_seconds", "seconds since its last heartbeat"),
    ("failures", "counter", "cellswarm_node_failures", "failed steps charged to the node"),
    ("served", "counter", "cellswarm_node_served", "requests the node served"),
    ("steps", "counter", "cellswarm_node_steps", "forward steps of the node's stage"),
    ("decode_steps", "counter", "cellswarm_node_decode_steps", "decode steps (one token each)"),
    ("decode_s", "counter", "cellswarm_node_decode_seconds", "time in decode steps"),
    ("busy_s", "counter", "cellswarm_node_busy_seconds", "time computing"),
    ("sequences", "gauge", "cellswarm_node_sequences", "sequences in flight"),
    ("batches", "counter", "cellswarm_node_decode_batches", "decode passes of several sequences"),
    ("prefix_hits", "counter", "cellswarm_node_prefix_cache_hits", "prompt blocks found cached"),
    ("prefix_misses", "counter", "cellswarm_node_prefix_cache_misses", "prompt blocks computed"),
    ("prefix_bytes", "gauge", "cellswarm_node_prefix_cache_bytes", "bytes of cached prompt blocks"),
    ("energy_j", "counter", "cellswarm_node_energy_joules", "estimated energy (busy time at "
     "busy power, the rest at idle, from its profile)"),
)


def node_metrics(nodes: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per node: state, memory against its budget, and its stage's counters."""
    kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
    fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        key: kinds[kind](name, doc, labels=["node"]) for key, kind, name, doc in NODE_FAMILIES
    }
    fams["state"] = GaugeMetricFamily("cellswarm_node_state", "1 for the node's state",
                                      labels=["node", "state"])  # fmt: skip
    fams["hop_s"] = CounterMetricFamily(
        "cellswarm_node_hop_seconds", "time per part of a hop (read, dispatch, compute, "
        "encode, send)", labels=["node", "part"])  # fmt: skip
    steps = HistogramMetricFamily("cellswarm_node_step_seconds",
                                  "compute time per step of the node's stage", labels=["node"])
    for n in nodes:
        _add_node(fams, n)
        hist = (n.get("stats") or {}).get("step_s")
        if hist:
            buckets, total = cumulative(hist)
            steps.add_metric([str(n["node_id"])], buckets, total)
    yield from fams.values()
    yield steps


def _add_node(fams: dict[str, GaugeMetricFamily | CounterMetricFamily], n: dict[str, Any]) -> None:
    node = [str(n["node_id"])]
    for state in NODE_STATES:
        fams["state"].add_metric([*node, state], float(n["state"] == state))
    fams["budget"].add_metric(node, n["memory_bytes"])
    fams["rss"].add_metric(node, n["rss_bytes"])
    fams["peak"].add_metric(node, n["peak_rss_bytes"])
    fams["seen"].add_metric(node, n["last_seen_s_ago"])
    fams["failures"].add_metric(node, n["failures"])
    fams["served"].add_metric(node, n["served"])
    stats = n.get("stats") or {}
    for key in ("steps", "decode_steps", "decode_s", "busy_s", "sequences", "energy_j", "batches",
                "prefix_hits", "prefix_misses", "prefix_bytes"):
        if key in stats:
            fams[key].add_metric(node, float(stats[key]))

    for part, seconds in (stats.get("hop_s") or {}).items():
        fams["hop_s"].add_metric([*node, str(part)], float(seconds))


def queue_metrics(ledger: dict[str, int], retries: int) -> Iterator[Metric]:
    jobs = GaugeMetricFamily("cellswarm_jobs", "jobs by state (dead: the dead letters)",
                             labels=["state"])  # fmt: skip
    for state in ("queued", "leased", "done", "dead", "cancelled"):
        jobs.add_metric([state], ledger.get(state, 0))
    yield jobs
    yield _gauge("cellswarm_leases_active", "jobs leased to a ring now", ledger.get("leased", 0))
    retried = CounterMetricFamily("cellswarm_job_retries", "leases beyond each job's first")
    retried.add_metric([], retries)
    yield retried
    yield _gauge("cellswarm_job_duplicate_commits", "jobs committed more than once (always 0)",
                 ledger.get("duplicates", 0))  # fmt: skip


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))
