"""Structured logs: one JSON line per event on every node, joined later by request id.

Each line: {"ts": unix seconds, "node": node id, "request_id": ..., "stage": "0..9",
"event": ..., plus the event's own fields (timings in ms)}. `cellswarm logs REQUEST_ID`
merges every node's file into one timeline, ordered by time (`--dir`, a shared disk); every
event also goes to `sink` when one is set — a `LogShipper` (logship.py) that sends it to the
coordinator's database, whence `cellswarm logs REQUEST_ID --coordinator URL` reads it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

from cellswarm.swarm.protocol.jsonvalue import JsonObject


class Throttled:
    """A warning said at most once per `every_s` (a full disk fails every write; the log
    should say so once a minute, with how many more there were, not thousands of times)."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0) -> None:
        self.logger, self.every_s = logger, every_s
        self.last_s, self.more = -math.inf, 0

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last_s < self.every_s:
            self.more += 1
            return
        since = f" ({self.more} more like it in the last {self.every_s:.0f} s)" if self.more else ""
        self.logger.warning("%s%s", message, since)
        self.last_s, self.more = now, 0


class JsonLog:
    def __init__(self, directory: str | Path | None, node: str) -> None:
        self.node = node
        self._file: TextIO | None = None
        self.dropped = 0  # events a full disk (or another write error) kept out of the file
        self._full = Throttled(logging.getLogger("cellswarm.logs"))
        self.sink: Callable[[dict[str, object]], None] | None = None  # e.g. LogShipper.add
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._file = (Path(directory) / f"{node}.jsonl").open("a", buffering=1)

    def event(self, event: str, request_id: str | None = None, **fields: object) -> None:
        if self._file is None and self.sink is None:
            return
        line: dict[str, object] = {"ts": round(time.time(), 6), "node": self.node,
                                   "request_id": request_id, "event": event,
                                   **fields}  # fmt: skip
        if self._file is not None:
            try:
                self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
            except OSError as exc:  # a full disk: the event still ships; the node carries on
                self.dropped += 1
                self._full.warn(f"cannot write {self._file.name}: {exc}; events not kept "
                                f"here ({self.dropped} so far) until there is room")  # fmt: skip
        if self.sink is not None:
            self.sink(line)


def timeline(directory: str | Path, request_id: str) -> list[JsonObject]:
    """Every node's events for one request, in time order."""
    events = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        with path.open() as f:
            for line in f:
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:  # a node killed mid-line leaves half a line
                    continue
                if e.get("request_id") == request_id:
                    events.append(e)
    return sorted(events, key=lambda e: (e["ts"], e["node"]))


def format_timeline(events: Sequence[Mapping[str, object]],
                    clocks: Mapping[str, tuple[float, float | None]] | None = None) -> str:
    """One line per event, ms since the first; `clocks` (node -> the offset its times were
    corrected by, and its error bound, in s) heads the timeline, once per node."""
    if not events:
        return "no events for that request id"
    t0 = _seconds(events[0])
    rows = []
    for node, (offset_s, error_s) in sorted((clocks or {}).items()):
        bound = "" if error_s is None else f" +- {1000 * error_s:.2f} ms"
        rows.append(f"clock {node:<10} {1000 * offset_s:+.2f} ms{bound}")
    for e in events:
        extra = {k: v for k, v in e.items() if k not in ("ts", "node", "request_id", "event")}
        detail = " ".join(f"{k}={v}" for k, v in extra.items())
        rows.append(f"{1000 * (_seconds(e) - t0):10.2f} ms  {e['node']:<10} {e['event']:<10} "
                    f"{detail}")
    return "\n".join(rows)


def _seconds(event: Mapping[str, object]) -> float:
    """An event's time: unix seconds, a JSON number."""
    ts = event["ts"]
    if not isinstance(ts, int | float):
        raise TypeError(f"an event's ts is {type(ts).__name__}, not a number")
    return ts
