"""The coordinator's durable state about nodes: who they are, what they hold, the layout
and its epoch (jobs live beside them, in jobs.py), in a `Database` (db.py).

A coordinator restarted from its database picks up its workers: their sessions are rows.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NewType

import msgspec

from cellswarm.swarm.control.db import (
    Database,
    Row,
    integer,
    maybe_text,
    maybe_whole,
    open_database,
    real,
    text,
    whole,
)
from cellswarm.swarm.policy.nodes import Health
from cellswarm.swarm.protocol import shard_id
from cellswarm.swarm.protocol.messages import Shard

NodeId = NewType("NodeId", str)

# Node states. A node is `spare` until placed, `assigned` while it holds a shard, `lost` when
# its heartbeats stop (it may come back), `offline` after K failures in a row (it gets no
# shard until it passes a probe), `refused` when its budget cannot hold the shard it was given,
# `evicted` when other replicas outvoted its results too often (no probe clears that: its
# steps run fine, its answers are wrong; an operator re-admits it under a new node id).
NODE_STATES = ("spare", "assigned", "lost", "offline", "refused", "evicted")

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    session TEXT NOT NULL,   -- sha256 of the session the node was given (auth.digest)
    capabilities TEXT NOT NULL,
    shard TEXT,              -- JSON: slot, role, replica, layers or part spec (NULL: a spare)
    host TEXT NOT NULL,
    data_port INTEGER,       -- where its stage or part server listens, once loaded
    ready TEXT,              -- the shard it has loaded and serves (shard_id)
    joined_s DOUBLE PRECISION NOT NULL,
    last_seen_s DOUBLE PRECISION NOT NULL,
    rss_bytes BIGINT NOT NULL DEFAULT 0,
    peak_rss_bytes BIGINT NOT NULL DEFAULT 0,
    served INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    consecutive_failures INTEGER NOT NULL DEFAULT 0,
    agreements INTEGER NOT NULL DEFAULT 0,     -- verification runs it was part of that agreed
    disagreements INTEGER NOT NULL DEFAULT 0,  -- ... and that the majority outvoted
    message TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Node:
    node_id: NodeId
    state: str
    session: str
    capabilities: dict[str, object]  # what it joined with (messages.Capabilities, encoded)
    host: str
    joined_s: float
    last_seen_s: float
    shard: Shard | None = None
    data_port: int | None = None
    ready: str | None = None
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    served: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    agreements: int = 0
    disagreements: int = 0
    message: str = ""

    def __post_init__(self) -> None:
        if self.state not in NODE_STATES:
            raise ValueError(f"node state {self.state!r} is not one of {NODE_STATES}")

    @property
    def memory_bytes(self) -> int:
        return whole_of(self.capabilities, "memory_bytes")

    @property
    def health(self) -> Health:
        """What the policy core decides on (swarm/policy/nodes.py)."""
        return Health(self.failures, self.consecutive_failures, self.state == "offline")

    @property
    def replica(self) -> int:
        """The replica its shard belongs to (0 without a shard)."""
        return self.shard.replica if self.shard else 0

    @property
    def rack(self) -> str:
        """The rack it said it sits in at its join (`--rack`); "" when it did not say."""
        return str(self.capabilities.get("rack") or "")

    @property
    def serving(self) -> bool:
        """Loaded the shard it was given and listening for frames."""
        return (
            self.state == "assigned"
            and self.shard is not None
            and self.data_port is not None
            and self.ready == shard_id(self.shard)
        )


_JSON_NODE = ("capabilities", "shard")
# what placement, wiring and leasing read of a node (membership.py, coordinator.py)
_PLACEMENT_FIELDS = ("state", "shard", "capabilities", "joined_s", "host", "data_port", "ready",
                     "session")  # fmt: skip


class Store:
    """Nodes, the layout and the epoch, in a `Database` (SQLite, or PostgreSQL to share).

    On SQLite this process is the database's only writer (one coordinator), so its rows are
    also kept in memory, written through: a read — every heartbeat authenticates its node,
    every monitor tick walks the table — is a dict lookup, not a query and a row decode (at
    10,000 nodes a tick's three walks were ~0.5 s of a core). A transaction that fails drops
    the copy (it may hold a write that was rolled back); the next read loads it again. On
    PostgreSQL other coordinators write too: every read goes to the database."""

    def __init__(self, db: Database | str | Path) -> None:
        self.db: Database = db if not isinstance(db, str | Path) else open_database(str(db))
        self.db.script(SCHEMA)
        self._cached = self.db.dialect == "sqlite"
        self._nodes: dict[str, Node] | None = None  # the rows, in joined_s order
        self._meta: dict[str, str | None] = {}
        self.generation = 0  # moves on every write of a node's row
        self.membership = 0  # moves when what placement reads changed (see membership_changed)

    def membership_changed(self, since: int | None) -> bool:
        """Whether what placement and wiring read of the nodes (`_PLACEMENT_FIELDS`) may
        differ from when `membership` was `since`: always on PostgreSQL, where other
        coordinators write too. A completion's counters or a beat's memory are no change: at
        100,000 nodes each one would cost a placement pass."""
        return not self._cached or since != self.membership

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        try:
            with self.db.transaction():
                yield
        except BaseException:
            self._forget()
            raise

    def _forget(self) -> None:
        self._nodes, self._meta = None, {}
        self.generation += 1
        self.membership += 1

    def _rows(self) -> dict[str, Node] | None:
        """The in-memory rows (loaded on first use), or None where they are not kept."""
        if not self._cached:
            return None
        nodes = self._nodes
        if nodes is None:
            # Loaded without a lock (a request thread may load while the event loop writes):
            # installed only if no write came in meanwhile — such a write bumps the
            # generation before it looks for the copy to update, so a snapshot that may miss
            # it is used for this read and not kept.
            gen = self.generation
            rows = self.db.execute("SELECT * FROM nodes ORDER BY joined_s, node_id")
            nodes = {str(r["node_id"]): _node(r) for r in rows}
            if gen == self.generation:
                self._nodes = nodes
        return nodes

    # -- meta ------------------------------------------------------------------------------

    def get_meta(self, key: str, default: str = "") -> str:
        if self._cached and key in self._meta:
            found = self._meta[key]
            return default if found is None else found
        rows = self.db.execute("SELECT value FROM meta WHERE key=?", (key,))
        value = str(rows[0]["value"]) if rows else None
        if self._cached:
            self._meta[key] = value  # None: no such row (asked every heartbeat, too)
        return default if value is None else value

    def set_meta(self, key: str, value: str) -> None:
        try:
            self.db.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, value),
            )
        except BaseException:
            self._forget()
            raise
        if self._cached:
            self._meta[key] = value

    def next_epoch(self) -> int:
        """A new layout epoch, atomically (several coordinators may share the database)."""
        self.db.execute("INSERT INTO meta(key, value) VALUES ('epoch', '0') ON CONFLICT DO NOTHING")
        rows = self.db.execute(
            "UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) "
            "WHERE key='epoch' RETURNING value"
        )
        self._meta.pop("epoch", None)
        return integer(rows[0]["value"])

    # -- nodes -----------------------------------------------------------------------------

    def put_node(self, node: Node) -> None:
        row = {f.name: getattr(node, f.name) for f in fields(Node)}
        for k in _JSON_NODE:
            row[k] = _to_json(row[k])
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        updates = ", ".join(f"{c}=excluded.{c}" for c in row if c != "node_id")
        sql = (f"INSERT INTO nodes({cols}) VALUES ({marks}) "
               f"ON CONFLICT(node_id) DO UPDATE SET {updates}")  # fmt: skip
        self._write(node.node_id, lambda: (self.db.execute(sql, tuple(row.values())), node)[1])

    def _write(self, node_id: str, write: Callable[[], Node]) -> Node:
        """A node's row written; the in-memory copy follows only a write that succeeded."""
        try:
            node = write()
        except BaseException:
            self._forget()
            raise
        self.generation += 1
        rows = self._rows() if self._nodes is not None else None
        old = rows.get(node_id) if rows is not None else None
        if old is None or any(getattr(old, f) != getattr(node, f) for f in _PLACEMENT_FIELDS):
            self.membership += 1
        if rows is not None:  # a new node goes last, as its joined_s is the latest
            rows[node_id] = node
        return node

    def node(self, node_id: str) -> Node | None:
        rows = self._rows()
        if rows is not None:
            return rows.get(node_id)
        found = self.db.execute("SELECT * FROM nodes WHERE node_id=?", (node_id,))
        return _node(found[0]) if found else None

    def nodes(self) -> list[Node]:
        rows = self._rows()
        if rows is not None:
            return list(rows.values())
        return [_node(r) for r in self.db.execute("SELECT * FROM nodes ORDER BY joined_s, node_id")]

    def update_node(self, node_id: str, **changes: object) -> Node:
        """One UPDATE of just these columns: a coordinator recording a heartbeat never
        overwrites what another one (the leader placing shards) wrote in the meantime."""
        unknown = set(changes) - _NODE_FIELDS
        if unknown or "node_id" in changes:
            raise ValueError(f"not node fields: {sorted(unknown) or ['node_id']}")
        if changes.get("state", NODE_STATES[0]) not in NODE_STATES:
            raise ValueError(f"node state {changes['state']!r} is not one of {NODE_STATES}")
        if not changes:
            node = self.node(node_id)
            if node is None:
                raise KeyError(node_id)
            return node
        values = [_to_json(v) if k in _JSON_NODE else v for k, v in changes.items()]
        sets = ", ".join(f"{k}=?" for k in changes)

        def write() -> Node:
            rows = self.db.execute(f"UPDATE nodes SET {sets} WHERE node_id=? RETURNING *",
                                   (*values, node_id))  # fmt: skip
            if not rows:
                raise KeyError(node_id)
            return _node(rows[0])

        return self._write(node_id, write)


_NODE_FIELDS = {f.name for f in fields(Node)}


def _to_json(value: object) -> str | None:
    return None if value is None else msgspec.json.encode(value).decode()


def whole_of(caps: Mapping[str, object], key: str, default: int = 0) -> int:
    """A number among a node's capabilities (`default` when it lacks it, or it is 0)."""
    value = caps.get(key) or default
    if not isinstance(value, int | float | str):
        raise TypeError(f"capability {key} is {type(value).__name__}, not a number")
    return int(value)


def text_of(caps: Mapping[str, object], key: str) -> str | None:
    """A text among a node's capabilities (its profile, its rack), or None."""
    value = caps.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"capability {key} is {type(value).__name__}, not text")
    return value


def _shard(text: str | None) -> Shard | None:
    """A node's stored shard; one of an older protocol's shape is none (placed again)."""
    try:
        return msgspec.json.decode(text, type=Shard) if text else None
    except msgspec.ValidationError:
        return None


def _node(row: Row) -> Node:
    caps, shard = text(row, "capabilities"), maybe_text(row, "shard")
    return Node(
        node_id=NodeId(text(row, "node_id")), state=text(row, "state"),
        session=text(row, "session"), capabilities=json.loads(caps) if caps else {},
        host=text(row, "host"), joined_s=real(row, "joined_s"),
        last_seen_s=real(row, "last_seen_s"),
        shard=_shard(shard),
        data_port=maybe_whole(row, "data_port"), ready=maybe_text(row, "ready"),
        rss_bytes=whole(row, "rss_bytes"), peak_rss_bytes=whole(row, "peak_rss_bytes"),
        served=whole(row, "served"), failures=whole(row, "failures"),
        consecutive_failures=whole(row, "consecutive_failures"),
        agreements=whole(row, "agreements"), disagreements=whole(row, "disagreements"),
        message=text(row, "message"),
    )  # fmt: skip


