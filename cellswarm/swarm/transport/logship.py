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

"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

log = logging.getLogger("cellswarm.logship")

Event = dict[str, Any]
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
