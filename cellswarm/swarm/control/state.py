"""The coordinator's state: everything its parts (election.py ... views.py) read and
write, set up once. The parts are a chain of classes, each adding one job over the ones
below it — state, election, joining, liveness, placing, wiring, work, verification, views —
and Coordinator (coordinator.py) is the last of them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cellswarm.planner.placement import StageCosts
from cellswarm.swarm.auth import load_token
from cellswarm.swarm.control.affinity import PrefixHomes
from cellswarm.swarm.control.checkup import Checkups
from cellswarm.swarm.control.db import open_database
from cellswarm.swarm.control.events import EventStore
from cellswarm.swarm.control.jobs import JobQueue, QueueConfig
from cellswarm.swarm.control.membership import Shard, load_layout
from cellswarm.swarm.control.nonces import Nonces
from cellswarm.swarm.control.request_metrics import RequestMetrics
from cellswarm.swarm.control.store import Store
from cellswarm.swarm.logs import JsonLog, Throttled
from cellswarm.swarm.protocol.messages import PartHolding
from cellswarm.swarm.settings import CoordinatorConfig
from cellswarm.swarm.tls import client_context
from cellswarm.swarm.transport.beats import check_control_url
from cellswarm.swarm.transport.logship import LogShipper

if TYPE_CHECKING:
    from cellswarm.io.tokenizer import Tokenizer
    from cellswarm.swarm.protocol.jsonvalue import JsonObject
    from cellswarm.swarm.transport.fetch import Manifest

log = logging.getLogger("cellswarm.coordinator")


PEER_ID = "coordinator"  # how the coordinator names itself on the data plane


@dataclass(frozen=True)
class Beat:
    """What a node's latest heartbeat said that is not worth a database write each time."""

    seen_s: float
    rss_bytes: int
    peak_rss_bytes: int
    written_s: float  # when the database row last got last_seen_s


class CoordinatorState:
    """A coordinator's fields, from its config and database (no job of its own)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        if config.control:  # a bad URL is one line now, not a traceback once serving
            check_control_url(config.control, config.tls_dir)
        db = open_database(config.db)
        self.store = Store(db)
        self.queue = JobQueue(db, QueueConfig(lease_s=config.lease_s))
        self.requests = RequestMetrics()  # what /metrics says of requests (vLLM's names)
        self.queue.on_end = self.requests.ended
        self.token = load_token(config.token_file) if config.token_file else None
        self.tls = client_context(config.tls_dir) if config.tls_dir else None  # for resets
        self.nonces = Nonces()  # join challenges, each good for one proof (nonces.py)
        self._joins_said = -1  # >= 0 inside join_many, whose rack's joins are one line
        self.layout: list[Shard] = load_layout(self.store.get_meta("layout", "[]"))
        self.id = f"{config.host}:{config.port}/{uuid.uuid4().hex[:8]}"
        self.leading, self.lead_until = False, 0.0
        self.pulse = asyncio.Event()  # set and replaced whenever a job makes progress
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's (see monitor)
        self.loop_thread = 0
        # the core thread: every call that touches the store or the swarm's state (on_core)
        self.core = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="core")
        self.last_probe: dict[str, float] = {}
        self.checkups = Checkups()  # doctor rounds, carried by heartbeats (checkup.py)
        self.log = JsonLog(config.log_dir, "coordinator")
        self.events = EventStore(db)  # every node's events, ours too (logship.py)
        self.log_shipper = LogShipper(lambda b: self.events.insert(PEER_ID, self.log_shipper.run,
                                                                   b))  # fmt: skip
        self.log.sink = self.log_shipper.add
        self._tokenizer: Tokenizer | None = None
        self._limits: tuple[int, int] | None = None
        self._limits_lock = threading.Lock()  # warm_up's thread and a request may race
        self._costs_at: Callable[[int, int], StageCosts] | None = None  # pipeline.costs_at
        self._context: int | None = None  # what it serves (see `context`)
        self._reconciled: tuple[int | None, str | None] = (None, None)  # (membership, layout)
        self._placed: tuple[int | None, list[str]] = (None, [])  # (membership, node ids)
        self._timeouts_checked_s = 0.0  # when check_timeouts last walked the nodes
        self._ticked_s = 0.0  # when check_timeouts was last called (a tick)
        self.deaf: tuple[tuple[float, float], ...] = ()  # policy/nodes.py deaf_spells
        self.beats_via: dict[str, int] = {"http": 0, "nats": 0}  # heartbeats by transport
        self._splits: dict[tuple[int, int, int, int], list[tuple[int, int]] | str] = {}  # str: why
        self._manifest: Manifest | None = None
        # one hashing of the model at a time: 60 workers asking at once for a 10 GB file's
        # manifest each started its own, and every one ran past their 30 s timeouts
        self._manifest_lock = threading.Lock()
        self.part_specs: list[PartHolding] = []  # set by Coordinator (placing.py)
        # the latest stage stats each node reported (NodeStats, as JSON builtins)
        self.node_stats: dict[str, JsonObject | None] = {}
        self.named_since: tuple[str, float] | None = None  # (layout, monotonic s) status
        # first named its bottleneck: rebalance waits until it has been named a while
        self.metrics_ports: dict[str, int] = {}  # where each node serves GET /metrics
        self.beats: dict[str, Beat] = {}  # each node's latest heartbeat here (see heartbeat)
        self.sessions: dict[str, str] = {}  # node -> its session's digest (held_answer)
        self.beat_seqs: dict[str, tuple[str, int]] = {}  # node -> (session digest, last seq)
        self.beat_keys: dict[str, tuple[str, bytes]] = {}  # node -> (session digest, its key)
        self._stall_due = False  # tests: --stall-core's stall comes at the next tick
        self.homes = PrefixHomes()  # which replica holds which prompt prefix (affinity.py)
        self.struck: dict[str, int | None] = {}  # replica -> wired epoch its jobs were struck at
        # On PostgreSQL another coordinator may lead and judge liveness from the rows; on
        # SQLite this one is alone (a restart gives every node a grace), so a row is only
        # written when something changes.
        shared = self.store.db.dialect != "sqlite"
        self._shared = shared  # rows refreshed a third of the timeout apart (see heartbeat)
        self.disk_full = Throttled(log)  # a full disk: one line a minute, not one per write
        # each node's clock behind ours (s) and the estimate's error bound, from heartbeats
        self.node_clock: dict[str, tuple[float, float]] = {}
        self.problem = ""  # why nothing is placed, when nothing can be
        now = time.time()
        for n in self.store.nodes():  # a restart is not the nodes' fault: give them a grace
            self.store.update_node(n.node_id, last_seen_s=now)

    def notify(self) -> None:
        """Wake whoever waits for news (progress readers, heads' long polls); from the
        event loop or, through it, from a worker thread."""
        loop = self.loop
        if loop is not None and threading.get_ident() != self.loop_thread:
            loop.call_soon_threadsafe(self.notify)
            return
        self.pulse.set()
        self.pulse = asyncio.Event()
