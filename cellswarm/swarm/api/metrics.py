"""GET /metrics on the coordinator: the swarm in Prometheus' text format (prometheus_client).

Read at scrape time from what the coordinator already holds — the node table, each node's
latest heartbeat (its stage's counters: steps, decode time, per-hop time), the job ledger —
so a scrape costs a few queries and nothing is counted twice. Counters are the nodes' own
(they restart with a node's process, which Prometheus' rate() takes as a reset).
"""

from __future__ import annotations

import platform
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from cellswarm.swarm.api.dashboard.views import mapping, number, objects
from cellswarm.swarm.control.request_metrics import RequestMetrics
from cellswarm.swarm.ring.step_times import cumulative
from cellswarm.version import __version__

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
        nodes = status["nodes"]
        assert isinstance(nodes, list)  # status(): the node table, an object per node
        yield from node_metrics([n for n in nodes if isinstance(n, dict)], self.coord.sequences)
        ledger = self.coord.queue.ledger()
        yield from queue_metrics(ledger, self.coord.queue.retries())
        yield from request_metrics(self.coord.requests, ledger)
        beats = CounterMetricFamily("cellswarm_heartbeats", "heartbeats answered, by how "
                                    "they came (http, nats)", labels=["via"])  # fmt: skip
        for via, n in sorted(self.coord.beats_via.items()):
            beats.add_metric([via], n)
        yield beats


def render(coord: Coordinator) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(coord))
    return bytes(generate_latest(registry))


def swarm_metrics(status: Mapping[str, object]) -> Iterator[Metric]:
    yield _gauge("cellswarm_epoch", "placement epoch (it moves on every re-placement)",
                 number(status["epoch"]))  # fmt: skip
    yield _gauge("cellswarm_wired", "1 when every ring of this epoch is wired",
                 number(status["wired"]))  # fmt: skip
    yield _gauge("cellswarm_leader", "1 on the coordinator that leads", number(status["leader"]))
    states = GaugeMetricFamily("cellswarm_nodes", "nodes by state", labels=["state"])
    nodes = objects(status["nodes"])
    for state in NODE_STATES:
        states.add_metric([state], sum(n["state"] == state for n in nodes))
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
    ("drafted_tokens", "counter", "cellswarm_node_speculative_drafted_tokens", "speculative "
     "decoding: drafts the node (a stage 0) sent to be verified"),
    ("accepted_tokens", "counter", "cellswarm_node_speculative_accepted_tokens", "of those, "
     "drafts the model agreed with (kept)"),
    ("energy_j", "counter", "cellswarm_node_energy_joules", "estimated energy (busy time at "
     "busy power, the rest at idle, from its profile)"),
)


def request_metrics(r: RequestMetrics, ledger: dict[str, int]) -> Iterator[Metric]:
    """Requests as vLLM and llama-server name them (control/request_metrics.py)."""
    for name, doc, hist in (
        ("cellswarm_request_queue_time_seconds", "time a request waited in the queue "
         "before its first lease", r.queue_s),
        ("cellswarm_time_to_first_token_seconds", "time from submit to the first token "
         "checkpointed", r.ttft_s),
        ("cellswarm_e2e_request_latency_seconds", "time from submit to the result", r.e2e_s),
    ):  # fmt: skip
        fam = HistogramMetricFamily(name, doc)
        fam.add_metric([], hist.cumulative(), hist.sum_s)
        yield fam
    for name, doc, value in (
        ("cellswarm_prompt_tokens", "prompt tokens of the requests done", r.prompt_tokens),
        ("cellswarm_generation_tokens", "tokens generated by the requests done",
         r.generation_tokens),
    ):  # fmt: skip
        counter = CounterMetricFamily(name, doc)
        counter.add_metric([], value)
        yield counter
    outcomes = CounterMetricFamily("cellswarm_job_outcomes", "jobs that ended here, by how "
                                   "(done, dead, cancelled)", labels=["state"])  # fmt: skip
    for state in ("done", "dead", "cancelled"):
        outcomes.add_metric([state], r.outcomes.get(state, 0))
    yield outcomes
    yield _gauge("cellswarm_num_requests_running", "requests leased to a ring now",
                 ledger.get("leased", 0))  # fmt: skip
    yield _gauge("cellswarm_num_requests_waiting", "requests queued, waiting for a ring",
                 ledger.get("queued", 0))  # fmt: skip
    yield InfoMetricFamily("cellswarm_build", "the coordinator's build",
                           value={"version": __version__,
                                  "python": platform.python_version()})  # fmt: skip


def node_metrics(nodes: Sequence[Mapping[str, object]], max_sequences: int) -> Iterator[Metric]:
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
    kv = GaugeMetricFamily("cellswarm_node_kv_cache_usage_ratio", "the share of the stage's "
                           "KV cache in use (sequences in flight of those it reserved)",
                           labels=["node"])  # fmt: skip
    for n in nodes:
        _add_node(fams, n)
        stats = mapping(n.get("stats"))
        if "sequences" in stats and max_sequences:
            kv.add_metric([str(n["node_id"])], number(stats["sequences"]) / max_sequences)
        hist = stats.get("step_s")
        if hist:
            buckets, total = cumulative(mapping(hist, "step_s"))
            steps.add_metric([str(n["node_id"])], buckets, total)
    yield from fams.values()
    yield steps
    yield kv


def _add_node(fams: dict[str, GaugeMetricFamily | CounterMetricFamily],
              n: Mapping[str, object]) -> None:  # fmt: skip
    node = [str(n["node_id"])]
    for state in NODE_STATES:
        fams["state"].add_metric([*node, state], float(n["state"] == state))
    fams["budget"].add_metric(node, number(n["memory_bytes"]))
    fams["rss"].add_metric(node, number(n["rss_bytes"]))
    fams["peak"].add_metric(node, number(n["peak_rss_bytes"]))
    fams["seen"].add_metric(node, number(n["last_seen_s_ago"]))
    fams["failures"].add_metric(node, number(n["failures"]))
    fams["served"].add_metric(node, number(n["served"]))
    stats = mapping(n.get("stats"))
    for key in ("steps", "decode_steps", "decode_s", "busy_s", "sequences", "energy_j", "batches",
                "prefix_hits", "prefix_misses", "prefix_bytes", "drafted_tokens",
                "accepted_tokens"):  # fmt: skip
        if key in stats:
            fams[key].add_metric(node, number(stats[key]))

    for part, seconds in mapping(stats.get("hop_s"), "hop_s").items():
        fams["hop_s"].add_metric([*node, str(part)], number(seconds))


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
