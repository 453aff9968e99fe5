"""Logs travel: every node ships its JSON-line events to the coordinator's database.

Nodes share no disk, so besides its own file (logs.py's `JsonLog`, kept as it was) each
node hands every event to a `LogShipper`: a bounded buffer that a thread of its own empties
in batches (every `every_s`, or sooner once `batch` events wait), so logging an event never
waits on the network — a forward step or a heartbeat never does. When the buffer is full the
oldest event is dropped and counted; the count goes out as a `log_dropped` event (per request
id) so the gap shows in the timeline. A batch the coordinator did not acknowledge is sent
again, the same events with the same sequence numbers: the coordinator stores an event once
per (node, run, seq) — `run` is random per process, so a restarted node never collides with
its earlier self — which makes resending after a coordinator restart or failover harmless.

The coordinator stores events (`EventStore`, portable SQL over db.py) with the node's own
timestamp and one corrected by the node's clock offset (coordinator − node, from
heartbeats), indexed by request id; its own events go through a `LogShipper` too, into the
same table. `GET /v1/logs/{request_id}` returns one request's events across nodes in corrected
time order; old events are pruned (older than `retain_s`, beyond `max_rows`).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from cellswarm.errors import RequestError
from cellswarm.swarm.control.db import Database

log = logging.getLogger("cellswarm.logship")

Event = dict[str, Any]
BASE_KEYS = ("ts", "node", "request_id", "event", "seq")
MAX_DROP_KEYS = 1000  # request ids whose drops are counted apart; beyond that, under None


class LogShipper:
    """A bounded buffer of events and the thread that sends them, oldest first.

    `send(batch)` delivers a list of events (each with its `seq`) or raises; only then are
    they removed. `ship_once()` is one round (the thread calls it; tests may, without one)."""

    def __init__(self, send: Callable[[list[Event]], object], capacity: int = 10_000,
                 batch: int = 500, every_s: float = 0.5,
                 max_backoff_s: float = 5.0, thread: bool = True) -> None:  # fmt: skip
        if capacity < 1 or batch < 1:
            raise ValueError(f"capacity {capacity} and batch {batch} must be positive")
        self.send, self.capacity, self.batch = send, capacity, batch
        self.every_s, self.max_backoff_s = every_s, max_backoff_s
        self.run = uuid.uuid4().hex[:12]  # this process's sequence numbers
        self.seq = 0
        self.buffer: collections.deque[Event] = collections.deque()
        self.dropped: dict[str | None, list[float]] = {}  # request id -> [count, last ts]
        self.notes: list[Event] = []  # drop counts made into events, not yet acknowledged
        self.dropped_total = 0
        self.shipped = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._failing = False  # backing off: a full batch does not cut the wait short
        self._thread: threading.Thread | None = None
        self._threaded = thread  # False: the caller runs ship_once (tests)

    def add(self, event: Event) -> None:
        """Queue one event (never blocks on the network). The oldest goes when full."""
        with self._lock:
            self.seq += 1
            event = {**event, "seq": self.seq}
            if len(self.buffer) >= self.capacity:
                old = self.buffer.popleft()
                key = old.get("request_id")
                if key not in self.dropped and len(self.dropped) >= MAX_DROP_KEYS:
                    key = None
                count = self.dropped.setdefault(key, [0, 0.0])
                count[0] += 1
                count[1] = float(old.get("ts", 0.0))
                self.dropped_total += 1
            self.buffer.append(event)
            full = len(self.buffer) >= self.batch
        if full and not self._failing:
            self._wake.set()
        if self._thread is None and self._threaded:
            self.start()

    def pending(self) -> int:
        with self._lock:
            return len(self.buffer) + len(self.notes)

    def _take(self) -> list[Event]:
        with self._lock:
            for key, (count, ts) in self.dropped.items():  # the gap, as events of their own
                self.seq += 1
                self.notes.append({"ts": ts, "request_id": key, "event": "log_dropped",
                                   "dropped": int(count), "seq": self.seq})  # fmt: skip
            self.dropped.clear()
            room = max(0, self.batch - len(self.notes))
            return [*self.notes, *(self.buffer[i] for i in range(min(room, len(self.buffer))))]

    def _ack(self, batch: list[Event]) -> None:
        sent = {e["seq"] for e in batch}
        with self._lock:
            self.notes = [e for e in self.notes if e["seq"] not in sent]
            while self.buffer and self.buffer[0]["seq"] in sent:  # some may have been dropped
                self.buffer.popleft()
            self.shipped += len(batch)

    def ship_once(self) -> bool:
        """Send one batch; True if there was nothing to send or it was acknowledged."""
        batch = self._take()
        if not batch:
            return True
        try:
            self.send(batch)
        except Exception as exc:  # unreachable, refused, restarting: the same batch again later
            log.debug("shipping %d events failed: %s", len(batch), exc)
            return False
        self._ack(batch)
        return True

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="log-shipper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        backoff = self.every_s
        while not self._stop:
            self._wake.wait(backoff)
            self._wake.clear()
            ok = self.ship_once()
            while ok and not self._stop and self.pending() >= self.batch:  # catching up
                ok = self.ship_once()
            backoff = self.every_s if ok else min(2 * backoff, self.max_backoff_s)
            self._failing = not ok

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread after one last try at what is left."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline and self.ship_once():
            pass


SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    node TEXT NOT NULL,
    run TEXT NOT NULL,            -- the node process's shipper (a restart starts another)
    seq BIGINT NOT NULL,          -- per run: a resent event is stored once
    request_id TEXT,
    event TEXT NOT NULL,
    node_ts DOUBLE PRECISION NOT NULL,   -- the node's clock
    offset_s DOUBLE PRECISION NOT NULL,  -- coordinator clock - node clock, when received
    error_s DOUBLE PRECISION,
    ts DOUBLE PRECISION NOT NULL,        -- node_ts + offset_s: the coordinator's clock
    received_s DOUBLE PRECISION NOT NULL,
    fields TEXT NOT NULL,                -- JSON: the event's own fields
    PRIMARY KEY (node, run, seq)
);
CREATE INDEX IF NOT EXISTS events_by_request ON events(request_id, ts);
CREATE INDEX IF NOT EXISTS events_by_received ON events(received_s);
"""

_COLUMNS = ("node", "run", "seq", "request_id", "event", "node_ts", "offset_s", "error_s", "ts",
            "received_s", "fields")  # fmt: skip
_ROWS_PER_INSERT = 80  # 11 columns: under SQLite's old limit of 999 parameters


class EventStore:
    """The coordinator's table of every node's events."""

    def __init__(self, db: Database, retain_s: float = 24 * 3600.0, max_rows: int = 1_000_000,
                 prune_every_s: float = 60.0) -> None:  # fmt: skip
        self.db, self.retain_s, self.max_rows = db, retain_s, max_rows
        self.prune_every_s = prune_every_s
        self._last_prune = 0.0
        db.script(SCHEMA)

    def insert(self, node: str, run: str, events: list[Event], offset_s: float = 0.0,
               error_s: float | None = None) -> int:  # fmt: skip
        """Store a batch (each event once per node, run and seq); how many were new ones."""
        now = time.time()
        rows = [_row(node, run, e, offset_s, error_s, now) for e in events]
        added = 0
        with self.db.transaction():
            for i in range(0, len(rows), _ROWS_PER_INSERT):
                chunk = rows[i : i + _ROWS_PER_INSERT]
                marks = ", ".join("(" + ", ".join("?" * len(_COLUMNS)) + ")" for _ in chunk)
                added += self.db.execute_count(
                    f"INSERT INTO events({', '.join(_COLUMNS)}) VALUES {marks} "
                    "ON CONFLICT DO NOTHING", [v for r in chunk for v in r])  # fmt: skip
        if now - self._last_prune > self.prune_every_s:
            self._last_prune = now
            self.prune(now)
        return added

    def prune(self, now: float | None = None) -> int:
        """Drop events received more than `retain_s` ago, then the oldest beyond `max_rows`
        (both by the received_s index)."""
        now = time.time() if now is None else now
        gone = self.db.execute_count("DELETE FROM events WHERE received_s < ?",
                                     (now - self.retain_s,))  # fmt: skip
        edge = self.db.execute("SELECT received_s FROM events ORDER BY received_s DESC "
                               "LIMIT 1 OFFSET ?", (self.max_rows,))  # fmt: skip
        if edge:
            gone += self.db.execute_count("DELETE FROM events WHERE received_s <= ?",
                                          (edge[0]["received_s"],))  # fmt: skip
        return gone

    def timeline(self, request_id: str) -> list[Event]:
        """One request's events across nodes, in corrected time order: each as the node
        logged it, `ts` corrected, plus `node_ts`, `clock_offset_s` and `clock_error_s`."""
        rows = self.db.execute("SELECT * FROM events WHERE request_id=? ORDER BY ts, node, seq",
                               (request_id,))  # fmt: skip
        return [{"ts": r["ts"], "node": r["node"], "request_id": r["request_id"],
                 "event": r["event"], **json.loads(r["fields"]), "node_ts": r["node_ts"],
                 "clock_offset_s": r["offset_s"], "clock_error_s": r["error_s"]}
                for r in rows]  # fmt: skip

    def count(self, node: str | None = None) -> int:
        if node is None:
            return int(self.db.execute("SELECT COUNT(*) AS n FROM events")[0]["n"])
        return int(
            self.db.execute("SELECT COUNT(*) AS n FROM events WHERE node=?", (node,))[0]["n"]
        )


def _row(node: str, run: str, e: Any, offset_s: float, error_s: float | None,
         now: float) -> tuple[Any, ...]:  # fmt: skip
    if (
        not isinstance(e, dict)
        or not isinstance(e.get("seq"), int)
        or not isinstance(e.get("ts"), int | float)
        or not isinstance(e.get("event"), str)
    ):
        raise RequestError("each shipped event needs an integer seq, a number ts and an event")
    rid = e.get("request_id")
    fields = {k: v for k, v in e.items() if k not in BASE_KEYS}
    ts = float(e["ts"])
    return (
        node,
        run,
        int(e["seq"]),
        None if rid is None else str(rid),
        e["event"],
        ts,
        offset_s,
        error_s,
        ts + offset_s,
        now,
        json.dumps(fields, separators=(",", ":")),
    )


# -- the CLI's side ------------------------------------------------------------------------

OPERATOR = "operator"  # the peer id an operator proves the cluster token under


def fetch_timeline(url: str, request_id: str, token: bytes | None = None,
                   api_key: str | None = None, tls: str | None = None,
                   ) -> tuple[list[Event], dict[str, Any]]:  # fmt: skip
    """One request's events from a coordinator, as `logs.timeline` reads them from files,
    and each node's clock correction (offset s, error s) once."""
    from urllib.parse import quote

    from cellswarm.swarm.api import client
    from cellswarm.swarm.auth import prove

    headers: dict[str, str] = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    elif token is not None:
        nonce = str(client.call(url, "/v1/challenge", {}, tls=tls)["nonce"])
        headers["X-Cellswarm-Proof"] = f"{nonce}:{prove(token, nonce, OPERATOR)}"
    answer = client.call(url, f"/v1/logs/{quote(request_id, safe='')}", tls=tls,
                         headers=headers)  # fmt: skip
    events: list[Event] = []
    clocks: dict[str, Any] = {}
    for e in answer["events"]:
        offset, error = e.pop("clock_offset_s", 0.0), e.pop("clock_error_s", None)
        e.pop("node_ts", None)
        clocks.setdefault(e["node"], (offset, error))
        events.append(e)
    return events, clocks

