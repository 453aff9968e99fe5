"""GET /metrics on a worker: its own view in Prometheus' text format, served by a thread of its
own (a scrape never waits on a step).

Read at scrape time from the worker: memory used and peak against its budget, its stage's
counters (steps, tokens, decode and busy time, per-hop-part time), a histogram of step
times, and an energy estimate. The coordinator's /metrics carries the same per node from
heartbeats; a worker's own is for a scrape that must not depend on the coordinator.

Written by hand rather than with prometheus_client, which the coordinator uses: a worker on
a 256 MB node pays for every import (prometheus_client and http.server cost ~3 MiB of a
process that idles at ~28), and the text format is a few lines of rules. The tests parse
this output with prometheus_client's own parser.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cellswarm.engine.memory import peak_rss_bytes, rss_bytes
from cellswarm.swarm.protocol.messages import NodeStats, StepHistogram
from cellswarm.swarm.ring.step_times import cumulative

if TYPE_CHECKING:
    from cellswarm.swarm.node.worker import Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Sample = tuple[dict[str, str], float]  # labels, value


class Power:
    """A node's energy estimate: busy seconds at busy watts, the rest of its life at idle. The
    watts come from the coordinator at join (its profile's, or a laptop's without one)."""

    def __init__(self) -> None:
        self.started_s = time.monotonic()
        self.busy_w = self.idle_w = 0.0
        self.source = ""  # unknown until the coordinator says

    def set(self, busy_w: float, idle_w: float, source: str) -> None:
        self.busy_w, self.idle_w, self.source = float(busy_w), float(idle_w), str(source)

    def joules(self, busy_s: float, awake_s: float = 0.0) -> float | None:
        """awake_s: seconds the CPUs were kept out of deep sleep (awake.py); a polling idle
        core draws about what a busy one does, so they count at busy watts."""
        if not self.source:
            return None
        up_s = time.monotonic() - self.started_s
        hot_s = min(max(busy_s, awake_s), up_s)  # the steps run inside the held spans
        return hot_s * self.busy_w + (up_s - hot_s) * self.idle_w


def family(name: str, kind: str, doc: str, samples: list[Sample]) -> str:
    """One metric family in the text format: counters' samples get `_total`, histograms are
    given as their own samples (name_bucket/_sum/_count) in `samples` labels' "__name__"."""
    head = f"{name}_total" if kind == "counter" else name
    lines = [f"# HELP {head} {_escape_doc(doc)}", f"# TYPE {head} {kind}"]
    for labels, value in samples:
        sample = labels.pop("__name__", head)
        inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
        lines.append(f"{sample}{{{inner}}} {_number(value)}" if inner else
                     f"{sample} {_number(value)}")  # fmt: skip
    return "\n".join(lines) + "\n"


def histogram(name: str, doc: str, hist: StepHistogram | Mapping[str, object]) -> str:
    buckets, total = cumulative(hist)
    samples: list[Sample] = [({"__name__": f"{name}_bucket", "le": le}, n) for le, n in buckets]
    samples += [({"__name__": f"{name}_sum"}, total),
                ({"__name__": f"{name}_count"}, buckets[-1][1])]  # fmt: skip
    return family(name, "histogram", doc, samples)


def render(worker: Worker) -> str:
    w = worker
    stats = w.stage.stats() if w.stage is not None else NodeStats()
    out = [
        family("cellswarm_worker_memory_budget_bytes", "gauge", "the --memory budget",
               [({}, float(w.config.memory_bytes))]),
        family("cellswarm_worker_memory_used_bytes", "gauge", "resident memory now",
               [({}, float(rss_bytes()))]),
        family("cellswarm_worker_memory_peak_bytes", "gauge", "peak resident memory (VmHWM)",
               [({}, float(peak_rss_bytes()))]),
        family("cellswarm_worker_serving", "gauge", "1 while it serves a shard",
               [({}, float(w.ready is not None))]),
        family("cellswarm_worker_sequences", "gauge", "sequences in flight",
               [({}, float(stats.sequences or 0))]),
    ]  # fmt: skip
    for key, name, doc in (
        ("steps", "cellswarm_worker_steps", "forward steps of its stage"),
        ("decode_steps", "cellswarm_worker_tokens", "decode steps (one token each)"),
        ("decode_s", "cellswarm_worker_decode_seconds", "time in decode steps"),
        ("busy_s", "cellswarm_worker_busy_seconds", "time computing"),
        ("batches", "cellswarm_worker_decode_batches", "decode passes of several sequences"),
        ("prefix_hits", "cellswarm_worker_prefix_cache_hits", "prompt blocks found cached"),
        ("prefix_misses", "cellswarm_worker_prefix_cache_misses", "prompt blocks computed"),
        ("prefix_evictions", "cellswarm_worker_prefix_cache_evictions", "blocks let go (LRU)"),
        ("rows_unsent", "cellswarm_worker_prefix_rows_unsent", "rows of first steps not sent "
         "on: the next stage restored them from its own prefix cache"),
        ("rows_resent", "cellswarm_worker_prefix_rows_resent", "of those, rows the next stage "
         "did not hold and asked for"),
        ("drafted_tokens", "cellswarm_worker_speculative_drafted_tokens", "speculative "
         "decoding: drafts sent to be verified (stage 0)"),
        ("accepted_tokens", "cellswarm_worker_speculative_accepted_tokens", "of those, drafts "
         "the model agreed with (kept)"),
    ):
        out.append(family(name, "counter", doc, [({}, float(counter(stats, key)))]))
    out.append(family("cellswarm_worker_prefix_cache_bytes", "gauge", "bytes of cached "
                      "prompt blocks", [({}, float(stats.prefix_bytes or 0))]))  # fmt: skip
    hops = [({"part": str(p)}, float(s)) for p, s in (stats.hop_s or {}).items()]
    out.append(family("cellswarm_worker_hop_seconds", "counter", "time per part of a hop", hops))
    if stats.step_s:
        out.append(histogram("cellswarm_worker_step_seconds", "compute time per step",
                             stats.step_s))  # fmt: skip
    joules = w.power.joules(float(stats.busy_s or 0.0), w.awake_s())
    if joules is not None:
        out.append(family("cellswarm_worker_energy_joules", "counter", "estimated energy: busy "
                          "time (and time kept awake) at busy power, the rest at idle",
                          [({"profile": w.power.source}, joules)]))  # fmt: skip
    return "".join(out)


def counter(stats: NodeStats, key: str) -> float:
    """One of the stage's counters by name (0 when it has none)."""
    value = getattr(stats, key)
    return float(value) if isinstance(value, int | float) else 0.0


def serve(worker: Worker, host: str, port: int) -> int:
    """Start the metrics server (a daemon thread); the port it listens on."""

    class Handler(socketserver.StreamRequestHandler):
        timeout = 10  # a client that sends nothing holds one thread for this long at most

        def handle(self) -> None:
            line = self.rfile.readline(1024).decode("latin-1").split()
            while self.rfile.readline(8192).strip():  # the headers: not needed
                pass
            ok = len(line) >= 2 and line[0] in ("GET", "HEAD") and line[1] in ("/metrics", "/")
            body = render(worker).encode() if ok else b"not found: GET /metrics\n"
            status = "200 OK" if ok else "404 Not Found"
            self.wfile.write(f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                             f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                             .encode())  # fmt: skip
            if line[:1] != ["HEAD"]:
                self.wfile.write(body)

    class Server(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return int(server.server_address[1])


def _number(v: float) -> str:
    return repr(float(v)) if v == v and abs(v) != float("inf") else \
        ("NaN" if v != v else ("+Inf" if v > 0 else "-Inf"))  # fmt: skip


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_doc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")
