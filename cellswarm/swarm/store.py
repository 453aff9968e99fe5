"""The coordinator's durable state: nodes, the layout epoch and requests, in SQLite (WAL).

Everything the coordinator must remember across a crash lives here, so a coordinator
restarted from its database picks up its workers (their sessions are rows) and finishes its
requests (their tokens are checkpointed as they come). One connection, used from the
coordinator's event loop only; `synchronous=FULL` so an acknowledged write survives a
power cut, at the price of an fsync per commit (token checkpoints are batched).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NewType

NodeId = NewType("NodeId", str)
RequestId = NewType("RequestId", str)

# Node states. A node is `spare` until placed, `assigned` while it holds a shard, `lost` when
# its heartbeats stop (it may come back), `offline` after K failures in a row (it gets no
# shard until it passes a probe), `refused` when its budget cannot hold the shard it was given.
NODE_STATES = ("spare", "assigned", "lost", "offline", "refused")
REQUEST_STATES = ("queued", "running", "done", "failed")

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    session TEXT NOT NULL,
    capabilities TEXT NOT NULL,
    shard TEXT,              -- JSON: stage index, layers, first, last (NULL for a spare)
    host TEXT NOT NULL,
    data_port INTEGER,       -- where its stage listens, once loaded
    ready TEXT,              -- the shard it has loaded and serves (membership.shard_id)
    joined_s REAL NOT NULL,
    last_seen_s REAL NOT NULL,
    rss_bytes INTEGER NOT NULL DEFAULT 0,
    peak_rss_bytes INTEGER NOT NULL DEFAULT 0,
    served INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    consecutive_failures INTEGER NOT NULL DEFAULT 0,
    message TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    payload TEXT NOT NULL,   -- JSON: prompt ids, max_tokens, sampling, stop ids
    tokens TEXT NOT NULL DEFAULT '[]',
    reason TEXT NOT NULL DEFAULT '',
    attempts INTEGER NOT NULL DEFAULT 0,
    created_s REAL NOT NULL,
    updated_s REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Node:
    node_id: NodeId
    state: str
    session: str
    capabilities: dict[str, Any]
    host: str
    joined_s: float
    last_seen_s: float
    shard: dict[str, Any] | None = None
    data_port: int | None = None
    ready: str | None = None
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    served: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    message: str = ""

    def __post_init__(self) -> None:
        if self.state not in NODE_STATES:
            raise ValueError(f"node state {self.state!r} is not one of {NODE_STATES}")

    @property
    def memory_bytes(self) -> int:
        return int(self.capabilities.get("memory_bytes") or 0)

    @property
    def serving(self) -> bool:
        """Loaded the shard it was given and listening for frames."""
        return (
            self.state == "assigned"
            and self.shard is not None
            and self.data_port is not None
            and self.ready == shard_id(self.shard)
        )


def shard_id(shard: dict[str, Any]) -> str:
    """What identifies a shard's content: a worker reports it once loaded."""
    keys = ("slot", "role", "layers", "first", "last", "spec")
    return json.dumps({k: shard.get(k) for k in keys}, sort_keys=True)


@dataclass(frozen=True)
class Request:
    request_id: RequestId
    state: str
    payload: dict[str, Any]
    created_s: float
    updated_s: float
    tokens: list[int] = field(default_factory=list)
    reason: str = ""
    attempts: int = 0

    @property
    def terminal(self) -> bool:
        return self.state in ("done", "failed")


_JSON_NODE = ("capabilities", "shard")


class Store:
    """SQLite-backed state. `path` ':memory:' gives a throwaway store for unit tests."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- meta ------------------------------------------------------------------------------

    def get_meta(self, key: str, default: str = "") -> str:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return str(row["value"]) if row else default

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def next_epoch(self) -> int:
        epoch = int(self.get_meta("epoch", "0")) + 1
        self.set_meta("epoch", str(epoch))
        return epoch

    # -- nodes -----------------------------------------------------------------------------

    def put_node(self, node: Node) -> None:
        row = asdict(node)
        for k in _JSON_NODE:
            row[k] = None if row[k] is None else json.dumps(row[k])
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        sql = f"INSERT OR REPLACE INTO nodes({cols}) VALUES ({marks})"
        self.db.execute(sql, tuple(row.values()))

    def node(self, node_id: str) -> Node | None:
        row = self.db.execute("SELECT * FROM nodes WHERE node_id=?", (node_id,)).fetchone()
        return _node(row) if row else None

    def nodes(self) -> list[Node]:
        return [_node(r) for r in self.db.execute("SELECT * FROM nodes ORDER BY joined_s, node_id")]

    def update_node(self, node_id: str, **changes: Any) -> Node:
        node = self.node(node_id)
        if node is None:
            raise KeyError(node_id)
        node = replace(node, **changes)
        self.put_node(node)
        return node

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, payload: dict[str, Any]) -> tuple[Request, bool]:
        """Insert a queued request; an id seen before returns the existing one (idempotent)."""
        now = time.time()
        cur = self.db.execute(
            "INSERT OR IGNORE INTO requests(request_id, state, payload, created_s, updated_s) "
            "VALUES (?, 'queued', ?, ?, ?)",
            (request_id, json.dumps(payload), now, now),
        )
        req = self.request(request_id)
        assert req is not None
        return req, cur.rowcount == 1

    def request(self, request_id: str) -> Request | None:
        row = self.db.execute("SELECT * FROM requests WHERE request_id=?", (request_id,)).fetchone()
        return _request(row) if row else None

    def open_requests(self) -> list[Request]:
        rows = self.db.execute(
            "SELECT * FROM requests WHERE state IN ('queued', 'running') ORDER BY created_s"
        )
        return [_request(r) for r in rows]

    def checkpoint(self, progress: dict[str, list[int]]) -> None:
        """Tokens so far for several requests, in one transaction."""
        now = time.time()
        with self.transaction():
            for rid, tokens in progress.items():
                self.db.execute(
                    "UPDATE requests SET tokens=?, state='running', updated_s=? "
                    "WHERE request_id=? AND state IN ('queued', 'running')",
                    (json.dumps(tokens), now, rid),
                )

    def start_attempt(self, request_id: str) -> int:
        self.db.execute(
            "UPDATE requests SET attempts=attempts+1, state='running', updated_s=? "
            "WHERE request_id=?",
            (time.time(), request_id),
        )
        req = self.request(request_id)
        return req.attempts if req else 0

    def finish(self, request_id: str, state: str, reason: str, tokens: list[int]) -> None:
        """The request's one terminal state: a second finish of the same request is a no-op."""
        if state not in ("done", "failed"):
            raise ValueError(f"{state!r} is not a terminal state")
        self.db.execute(
            "UPDATE requests SET state=?, reason=?, tokens=?, updated_s=? "
            "WHERE request_id=? AND state IN ('queued', 'running')",
            (state, reason, json.dumps(tokens), time.time(), request_id),
        )

    def transaction(self) -> _Transaction:
        return _Transaction(self.db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def _node(row: sqlite3.Row) -> Node:
    d = dict(row)
    for k in _JSON_NODE:
        d[k] = None if d[k] is None else json.loads(d[k])
    d["node_id"] = NodeId(d["node_id"])
    return Node(**d)


def _request(row: sqlite3.Row) -> Request:
    d = dict(row)
    return Request(
        request_id=RequestId(d["request_id"]), state=d["state"], payload=json.loads(d["payload"]),
        created_s=d["created_s"], updated_s=d["updated_s"], tokens=json.loads(d["tokens"]),
        reason=d["reason"], attempts=d["attempts"],
    )  # fmt: skip

