"""What the dashboard shows, as plain data: pure functions from the coordinator's status,
ledger and events to the rows its templates render (tested with tables, no browser)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

STATE_ORDER = ("assigned", "spare", "offline", "refused", "lost")


@dataclass(frozen=True)
class NodeView:
    node_id: str
    state: str
    holds: str  # "layers 0..14", "experts ...", "-"
    layers: str  # "0..14" or "" (the test and the map's data attribute)
    memory_pct: float  # resident memory against the budget, 0..100+
    memory: str  # "93 MiB of 200 MiB"
    step_ms: str  # the mean decode step, "-" before one
    temp: str  # "54 C" where the node knows it, else ""
    message: str


@dataclass(frozen=True)
class RackView:
    name: str
    nodes: list[NodeView]


def racks(status: dict[str, Any]) -> list[RackView]:
    """Nodes grouped by rack (a node's --rack), else by host; each group in state order."""
    from cellswarm.units import format_bytes

    groups: dict[str, list[NodeView]] = {}
    for n in status["nodes"]:
        stats = n.get("stats") or {}
        lo_hi = n.get("layers")
        layers = f"{lo_hi[0]}..{int(lo_hi[1]) - 1}" if lo_hi else ""
        budget, rss = int(n.get("memory_bytes") or 0), int(n.get("rss_bytes") or 0)
        steps = int(stats.get("decode_steps") or 0)
        step_ms = f"{1e3 * float(stats['decode_s']) / steps:.1f} ms" if steps else "-"
        temp = f"{float(stats['temp_c']):.0f} C" if stats.get("temp_c") is not None else ""
        view = NodeView(
            node_id=str(n["node_id"]), state=str(n["state"]), holds=str(n.get("holds") or "-"),
            layers=layers, memory_pct=100.0 * rss / budget if budget else 0.0,
            memory=f"{format_bytes(rss)} of {format_bytes(budget)}" if budget else
            format_bytes(rss), step_ms=step_ms, temp=temp, message=str(n.get("message") or ""),
        )  # fmt: skip
        rack = n.get("rack") or f"host {str(n.get('address') or '?').rsplit(':', 1)[0]}"
        groups.setdefault(str(rack), []).append(view)
    order = {s: i for i, s in enumerate(STATE_ORDER)}
    return [RackView(name, sorted(nodes, key=lambda v: (order.get(v.state, 9), v.node_id)))
            for name, nodes in sorted(groups.items())]  # fmt: skip


def tokens_so_far(status: dict[str, Any]) -> int:
    """Tokens the swarm has produced: decode steps of the nodes holding a ring's last layer."""
    ends = [int(n["layers"][1]) for n in status["nodes"] if n.get("layers")]
    if not ends:
        return 0
    last = max(ends)
    return sum(int((n.get("stats") or {}).get("decode_steps") or 0) for n in status["nodes"]
               if n.get("layers") and int(n["layers"][1]) == last)  # fmt: skip


class Throughput:
    """Tokens/s over the last few minutes, sampled when the page asks (at most every
    `min_gap_s`), as points for a sparkline. A node that restarts resets its counters: a
    drop counts as zero, not as a negative rate."""

    def __init__(self, keep: int = 300, min_gap_s: float = 0.5) -> None:
        self.samples: deque[tuple[float, int]] = deque(maxlen=keep)
        self.min_gap_s = min_gap_s

    def sample(self, tokens: int, now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        if not self.samples or now_s - self.samples[-1][0] >= self.min_gap_s:
            self.samples.append((now_s, tokens))

    def rates(self) -> list[float]:
        s = self.samples
        return [max(0, b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(s)]

    def sparkline(self, width: int = 600, height: int = 80) -> tuple[str, float, float]:
        """SVG polyline points, the latest rate and the peak (tokens/s)."""
        rates = self.rates()[-120:]
        if not rates:
            return "", 0.0, 0.0
        peak = max(max(rates), 1e-9)
        step = width / max(len(rates) - 1, 1)
        points = " ".join(f"{i * step:.1f},{height - height * r / peak:.1f}"
                          for i, r in enumerate(rates))  # fmt: skip
        return points, rates[-1], max(rates)


def queue_rows(ledger: dict[str, int], retries: int) -> list[tuple[str, int]]:
    states = ("queued", "leased", "done", "dead", "cancelled")
    return [*((s, int(ledger.get(s, 0))) for s in states), ("retries", retries),
            ("duplicate commits", int(ledger.get("duplicates", 0)))]  # fmt: skip


@dataclass(frozen=True)
class BatchView:
    batch_id: str
    name: str
    total: int
    finished: int
    pct: float
    detail: str


def batch_rows(infos: list[dict[str, Any]]) -> list[BatchView]:
    out = []
    for b in infos:
        c, total = b["counts"], int(b["total"])
        finished = sum(int(c.get(s, 0)) for s in ("done", "dead", "cancelled"))
        detail = ", ".join(f"{n} {s}" for s, n in c.items() if n)
        out.append(BatchView(str(b["batch_id"]), str(b["name"]), total, finished,
                             100.0 * finished / total if total else 100.0,
                             f"{detail}; {b['tokens']} tokens"))  # fmt: skip
    return out


@dataclass(frozen=True)
class EventView:
    at_ms: str  # since the request's first event
    node: str
    event: str
    fields: str


def timeline_rows(events: list[dict[str, Any]]) -> list[EventView]:
    if not events:
        return []
    t0 = float(events[0]["ts"])
    skip = {"ts", "node", "request_id", "event", "node_ts", "clock_offset_s", "clock_error_s"}
    return [EventView(f"{1e3 * (float(e['ts']) - t0):.1f}", str(e["node"]), str(e["event"]),
                      " ".join(f"{k}={v}" for k, v in e.items() if k not in skip))
            for e in events]  # fmt: skip
