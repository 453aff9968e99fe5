"""The coordinator's store of every node's shipped events (transport/logship.py sends them).

`EventStore` (portable SQL over db.py) keeps each event with the node's own
timestamp and one corrected by the node's clock offset (coordinator − node, from
heartbeats), indexed by request id; its own events go through a `LogShipper` too, into the
same table. `GET /v1/logs/{request_id}` returns one request's events across nodes in corrected
time order; old events are pruned (older than `retain_s`, beyond `max_rows`).
"""


from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence

from cellswarm.swarm.control.db import Database, integer, text
from cellswarm.swarm.protocol.messages import LogEvent
from cellswarm.swarm.transport.logship import Event

log = logging.getLogger("cellswarm.logship")


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

    def insert(self, node: str, run: str, events: Sequence[LogEvent | Mapping[str, object]],
               offset_s: float = 0.0, error_s: float | None = None) -> int:  # fmt: skip
        """Store a batch (each event once per node, run and seq); how many were new ones.
        A node's come typed (LogBatch); the coordinator's own shipper hands its lines."""
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
                 "event": r["event"], **json.loads(text(r, "fields")), "node_ts": r["node_ts"],
                 "clock_offset_s": r["offset_s"], "clock_error_s": r["error_s"]}
                for r in rows]  # fmt: skip

    def count(self, node: str | None = None) -> int:
        if node is None:
            return integer(self.db.execute("SELECT COUNT(*) AS n FROM events")[0]["n"])
        return integer(
            self.db.execute("SELECT COUNT(*) AS n FROM events WHERE node=?", (node,))[0]["n"]
        )


def _row(node: str, run: str, line: LogEvent | Mapping[str, object], offset_s: float,
         error_s: float | None, now: float) -> tuple[object, ...]:  # fmt: skip
    e = line if isinstance(line, LogEvent) else LogEvent.of(line)
    fields = json.dumps(e.fields, separators=(",", ":"))
    return (node, run, e.seq, e.request_id, e.event, e.ts, offset_s, error_s, e.ts + offset_s,
            now, fields)  # fmt: skip
