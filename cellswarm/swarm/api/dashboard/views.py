"""What the dashboard shows, as plain data: pure functions from the coordinator's status,
ledger and events to the rows its templates render (tested with tables, no browser)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cellswarm.swarm.protocol.jsonvalue import number, whole

if TYPE_CHECKING:
    from cellswarm.swarm.control.request_metrics import Ended

STATE_ORDER = ("assigned", "spare", "offline", "refused", "lost")


# -- the status's JSON values, as the views read them ---------------------------------------


def objects(value: object, what: str = "nodes") -> list[Mapping[str, object]]:
    """A list of objects of the status (its nodes, its bottlenecks)."""
    if not isinstance(value, list | tuple):
        raise TypeError(f"{what} is {type(value).__name__}, not a list")
    return [mapping(v, what) for v in value]


def mapping(value: object, what: str = "stats") -> Mapping[str, object]:
    """An object of the status (a node, its stats); {} for one that is null or empty."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} is {type(value).__name__}, not an object")
    return value


def layer_pair(layers: object) -> tuple[object, int]:
    """A node's "layers" [lo, hi): lo as it came, hi (exclusive) a whole number."""
    if not isinstance(layers, list | tuple):
        raise TypeError(f"layers is {type(layers).__name__}, not a pair")
    return layers[0], whole(layers[1])


def layer_span(layers: object) -> str:
    """"lo..hi-1" of a node's layers; "" when it holds none."""
    if not layers:
        return ""
    lo, hi = layer_pair(layers)
    return f"{lo}..{hi - 1}"


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
    address: str = ""  # HOST:PORT of its stage's data link
    beat: str = ""  # its last heartbeat's age, "0.3 s ago"
    tok_s: str = "-"  # its stage's tokens (decode steps) a second, lately
    fetch_pct: float | None = None  # its shard's fetch, while one runs
    fetch: str = ""  # "12.0 of 80.0 MiB"


@dataclass(frozen=True)
class RackView:
    name: str
    nodes: list[NodeView]


class NodeRates:
    """Each node's decode steps a second between two looks at the status (a stage makes
    one token a step); a counter that went back (a restart) starts over."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, int]] = {}
        self.rate: dict[str, float] = {}

    def sample(self, status: Mapping[str, object], now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        for n in objects(status["nodes"]):
            node, steps = str(n["node_id"]), whole(mapping(n.get("stats")).get("decode_steps") or 0)
            before = self.last.get(node)
            if before is None or steps < before[1]:
                self.last[node] = (now_s, steps)
            elif now_s - before[0] >= 1.0:
                self.rate[node] = (steps - before[1]) / (now_s - before[0])
                self.last[node] = (now_s, steps)


def racks(status: Mapping[str, object], rates: NodeRates | None = None) -> list[RackView]:
    """Nodes grouped by rack (a node's --rack), else by host; each group in state order."""
    groups: dict[str, list[NodeView]] = {}
    for n in objects(status["nodes"]):
        view = node_view(n, rates)
        rack = n.get("rack") or f"host {str(n.get('address') or '?').rsplit(':', 1)[0]}"
        groups.setdefault(str(rack), []).append(view)
    order = {s: i for i, s in enumerate(STATE_ORDER)}
    return [RackView(name, sorted(nodes, key=lambda v: (order.get(v.state, 9), v.node_id)))
            for name, nodes in sorted(groups.items())]  # fmt: skip


def node_view(n: Mapping[str, object], rates: NodeRates | None = None) -> NodeView:
    """One node as the map and the ring show it."""
    from cellswarm.units import format_bytes

    stats, node = mapping(n.get("stats")), str(n["node_id"])
    lo_hi = n.get("layers")
    budget, rss = whole(n.get("memory_bytes") or 0), whole(n.get("rss_bytes") or 0)
    steps = whole(stats.get("decode_steps") or 0)
    rate = rates.rate.get(node) if rates is not None else None
    done = whole(stats.get("fetch_done_bytes") or 0)
    total = whole(stats.get("fetch_total_bytes") or 0)
    fetching = total > 0 and done < total
    return NodeView(
        node_id=node, state=str(n["state"]), holds=str(n.get("holds") or "-"),
        layers=layer_span(lo_hi),
        memory_pct=100.0 * rss / budget if budget else 0.0,
        memory=f"{format_bytes(rss)} of {format_bytes(budget)}" if budget else format_bytes(rss),
        step_ms=f"{1e3 * number(stats['decode_s']) / steps:.1f} ms" if steps else "-",
        temp=f"{number(stats['temp_c']):.0f} C" if stats.get("temp_c") is not None else "",
        message=str(n.get("message") or ""), address=str(n.get("address") or ""),
        beat=f"{number(n.get('last_seen_s_ago') or 0):.1f} s ago",
        tok_s="-" if rate is None else f"{rate:.1f}",
        fetch_pct=100.0 * done / total if fetching else None,
        fetch=f"{format_bytes(done)} of {format_bytes(total)}" if fetching else "",
    )  # fmt: skip


@dataclass(frozen=True)
class RingView:
    """One replica's ring in token order: stage 0 (the head) to the last stage."""

    replica: int
    stages: list[NodeView]


def rings(status: Mapping[str, object], rates: NodeRates | None = None) -> list[RingView]:
    by_replica: dict[int, list[tuple[int, NodeView]]] = {}
    for n in objects(status["nodes"]):
        if n.get("state") == "assigned" and n.get("stage") is not None:
            by_replica.setdefault(whole(n.get("replica") or 0), []).append(
                (whole(n["stage"]), node_view(n, rates)))  # fmt: skip
    return [RingView(r, [v for _, v in sorted(stages, key=lambda x: x[0])])
            for r, stages in sorted(by_replica.items())]  # fmt: skip


def bottleneck_text(b: Mapping[str, object]) -> str:
    """A ring's slowest stage in words: "stage 1 on worker-2: 41.2 ms a step (1.8x the
    median)"."""
    return (f"stage {b.get('stage')} on {b.get('node_id')}: {number(b.get('step_ms') or 0):.1f} "
            f"ms a step ({number(b.get('times_median') or 0):.1f}x the median)")


def bottleneck_texts(status: Mapping[str, object]) -> list[str]:
    """Each ring's slowest stage in words (`bottleneck_text`)."""
    return [bottleneck_text(b) for b in objects(status["bottlenecks"], "bottlenecks")]


def tokens_so_far(status: Mapping[str, object]) -> int:
    """Tokens the swarm has produced: decode steps of the nodes holding a ring's last layer."""
    nodes = objects(status["nodes"])
    ends = [layer_pair(n["layers"])[1] for n in nodes if n.get("layers")]
    if not ends:
        return 0
    last = max(ends)
    return sum(whole(mapping(n.get("stats")).get("decode_steps") or 0) for n in nodes
               if n.get("layers") and layer_pair(n["layers"])[1] == last)  # fmt: skip


RANGES_S = (60, 300, 900)  # the charts' time ranges: 1, 5, 15 minutes


@dataclass(frozen=True)
class Chart:
    """An SVG line chart with its axes: polyline points, and ticks as (pixel, label)."""

    points: str
    y_ticks: list[tuple[float, str]]
    x_ticks: list[tuple[float, str]]
    latest: float
    peak: float
    width: int = 600
    height: int = 120


def chart(series: list[tuple[float, float]], now_s: float, range_s: float, unit: str,
          width: int = 600, height: int = 120) -> Chart:  # fmt: skip
    """(time, value) points of the last `range_s` seconds before `now_s`, scaled to the
    box: y from 0 to the peak (3 ticks), x from -range to now (4 ticks)."""
    shown = [(t, v) for t, v in series if now_s - range_s <= t <= now_s]
    peak = max((v for _, v in shown), default=0.0)
    top = peak if peak > 0 else 1.0
    points = " ".join(f"{width * (1 - (now_s - t) / range_s):.1f},"
                      f"{height - height * v / top:.1f}" for t, v in shown)  # fmt: skip
    y_ticks = [(height - height * f, f"{top * f:.3g} {unit}".strip()) for f in (0, 0.5, 1)]
    x_ticks = [(width * (1 - k / 3), "now" if k == 0 else f"-{range_s * k / 3 / 60:.3g} min")
               for k in range(3, -1, -1)]  # fmt: skip
    return Chart(points, y_ticks, x_ticks, shown[-1][1] if shown else 0.0, peak, width, height)


class Throughput:
    """Tokens/s over the last 15 minutes, sampled when the page asks (at most every
    `min_gap_s`). A node that restarts resets its counters: a drop counts as zero, not as a
    negative rate."""

    def __init__(self, keep: int = 1800, min_gap_s: float = 0.5) -> None:
        self.samples: deque[tuple[float, int]] = deque(maxlen=keep)
        self.min_gap_s = min_gap_s

    def sample(self, tokens: int, now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        if not self.samples or now_s - self.samples[-1][0] >= self.min_gap_s:
            self.samples.append((now_s, tokens))

    def rates(self) -> list[float]:
        return [v for _, v in self.series()]

    def series(self) -> list[tuple[float, float]]:
        """(time, tokens/s) between each two samples."""
        return [(b[0], max(0, b[1] - a[1]) / (b[0] - a[0]))
                for a, b in itertools.pairwise(self.samples)]  # fmt: skip

    def chart(self, range_s: float, now_s: float | None = None) -> Chart:
        now_s = time.monotonic() if now_s is None else now_s
        return chart(self.series(), now_s, range_s, "tok/s")


def latency_chart(recent: Sequence[Ended], range_s: float, now_s: float | None = None) -> Chart:
    """End-to-end seconds of the requests done lately, by when they ended (wall clock)."""
    now_s = time.time() if now_s is None else now_s
    done = [(e.ended_s, e.e2e_s) for e in recent if e.state == "done" and e.e2e_s is not None]
    return chart(done, now_s, range_s, "s")


@dataclass(frozen=True)
class RequestView:
    job_id: str
    state: str
    ago: str
    e2e: str
    ttft: str
    tokens: int
    batch: str


def request_rows(recent: Sequence[Ended], limit: int = 15,
                 now_s: float | None = None) -> list[RequestView]:  # fmt: skip
    """The requests that ended lately, newest first."""
    now_s = time.time() if now_s is None else now_s

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    return [RequestView(e.job_id, e.state, f"{now_s - e.ended_s:.0f} s ago", secs(e.e2e_s),
                        secs(e.ttft_s), e.tokens, e.batch_id or "")
            for e in list(reversed(recent))[:limit]]  # fmt: skip


def queue_rows(ledger: dict[str, int], retries: int) -> list[tuple[str, int]]:
    states = ("queued", "leased", "done", "dead", "cancelled")
    return [*((s, int(ledger.get(s, 0))) for s in states), ("retries", retries),
            ("duplicate commits", int(ledger.get("duplicates", 0)))]  # fmt: skip


BATCH_STATES = ("done", "dead", "cancelled", "leased", "queued")  # the bar's order


@dataclass(frozen=True)
class BatchView:
    batch_id: str
    name: str
    total: int
    finished: int
    pct: float
    detail: str
    segments: list[tuple[str, float, int]]  # (state, % of the bar, jobs), in BATCH_STATES order
    rate: str  # "3.2 items/s"
    eta: str  # "ETA 40 s", "finished", "waiting: nothing ran yet"


def batch_rows(infos: Sequence[Mapping[str, object]],
               now_s: float | None = None) -> list[BatchView]:  # fmt: skip
    now_s = time.time() if now_s is None else now_s
    out = []
    for b in infos:
        c, total = mapping(b["counts"], "counts"), whole(b["total"])
        finished = sum(whole(c.get(s, 0)) for s in ("done", "dead", "cancelled"))
        detail = ", ".join(f"{n} {s}" for s, n in c.items() if n)
        segments = [(s, 100.0 * whole(c.get(s, 0)) / total if total else 0.0, whole(c.get(s, 0)))
                    for s in BATCH_STATES if c.get(s)]  # fmt: skip
        end_s = number(b.get("last_s") or now_s) if finished >= total else now_s
        elapsed = max(end_s - number(b.get("created_s") or end_s), 1e-3)
        rate = finished / elapsed
        left = total - finished
        eta = ("finished" if not left else f"ETA {left / rate:.0f} s" if rate > 0
               else "waiting: nothing has finished yet")  # fmt: skip
        out.append(BatchView(str(b["batch_id"]), str(b["name"]), total, finished,
                             100.0 * finished / total if total else 100.0,
                             f"{detail}; {b['tokens']} tokens", segments,
                             f"{rate:.2f} items/s", eta))  # fmt: skip
    return out


@dataclass(frozen=True)
class EventView:
    at_ms: str  # since the request's first event
    node: str
    event: str
    fields: str
    left_pct: float = 0.0  # the waterfall's bar: from this event to the next
    width_pct: float = 0.0
    lane: int = 0  # the node's colour


def timeline_rows(events: Sequence[Mapping[str, object]]) -> list[EventView]:
    """A request's events in time order, each a bar from it to the next (a waterfall: the
    hops from the coordinator through each stage and back)."""
    if not events:
        return []
    t0 = number(events[0]["ts"])
    span = max(number(events[-1]["ts"]) - t0, 1e-6)
    skip = {"ts", "node", "request_id", "event", "node_ts", "clock_offset_s", "clock_error_s"}
    lanes: dict[str, int] = {}
    out = []
    for i, e in enumerate(events):
        at = number(e["ts"]) - t0
        nxt = number(events[i + 1]["ts"]) - t0 if i + 1 < len(events) else at
        lane = lanes.setdefault(str(e["node"]), len(lanes) % 6)
        out.append(EventView(f"{1e3 * at:.1f}", str(e["node"]), str(e["event"]),
                             " ".join(f"{k}={v}" for k, v in e.items() if k not in skip),
                             100.0 * at / span, max(100.0 * (nxt - at) / span, 0.4),
                             lane))  # fmt: skip
    return out
