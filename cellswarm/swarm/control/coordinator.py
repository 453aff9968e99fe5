"""The coordinator: membership, placement, the ring's wiring, and the job queue.

    worker --HTTP join/heartbeat/fault--> coordinator (database) --reset frames--> stages
    head (stage 0's worker) --HTTP lease/checkpoint/complete--> coordinator: jobs

Workers join with an HMAC proof of the cluster token, heartbeat their memory and readiness,
and learn their shard from the heartbeat's answer. The coordinator places shards with the
planner's inventory (`budget_split`), fills a lost node's stage with a spare or re-places,
and — once every stage of the layout is loaded — wires each ring with one `reset` frame per
stage (new epoch, next stage's address, who may connect). Requests and batch lines are jobs
(jobs.py) that replicas' heads pull, checkpoint and complete under fenced leases; after a
failure (or a coordinator restart) a job resumes from its checkpointed tokens. With several
coordinators on PostgreSQL one leader places and wires; every one answers every call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import json
import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from cellswarm.errors import BudgetError, RequestError, StorageFullError
from cellswarm.planner.placement import (
    StageCosts,
    balanced_layers,
    fit_context,
    fits,
    too_long,
)
from cellswarm.swarm.auth import digest, load_token, verify
from cellswarm.swarm.control import rebalance
from cellswarm.swarm.control.affinity import PrefixHomes
from cellswarm.swarm.control.beats import beat_key, check_control_url, holds, seal
from cellswarm.swarm.control.checkup import Checkups
from cellswarm.swarm.control.db import open_database
from cellswarm.swarm.control.jobs import (
    Job,
    JobQueue,
    QueueConfig,
    inconsistent,
    same_result,
)
from cellswarm.swarm.control.logship import EventStore, LogShipper
from cellswarm.swarm.control.membership import (
    Shard,
    layout_complete,
    part_nodes,
    repair,
    replicas,
    ring,
)
from cellswarm.swarm.control.nonces import Nonces
from cellswarm.swarm.control.request_metrics import RequestMetrics
from cellswarm.swarm.control.store import Node, NodeId, Store
from cellswarm.swarm.control.wire import port
from cellswarm.swarm.local.pipeline import costs_at
from cellswarm.swarm.logs import JsonLog, Throttled
from cellswarm.swarm.protocol import VersionMismatch, check_version
from cellswarm.swarm.ring.stage import reset_stage
from cellswarm.swarm.settings import CoordinatorConfig
from cellswarm.swarm.tls import client_context
from cellswarm.units import format_bytes

log = logging.getLogger("cellswarm.coordinator")
T = TypeVar("T")

PEER_ID = "coordinator"  # how the coordinator names itself on the data plane
# The leader's watch (timeouts, placement, wiring, lease expiry): 4 a second reacts well
# within a heartbeat timeout; 10 a second was a third of an idle coordinator's CPU.
MONITOR_TICK_S = 0.25


@dataclass(frozen=True)
class Beat:
    """What a node's latest heartbeat said that is not worth a database write each time."""

    seen_s: float
    rss_bytes: int
    peak_rss_bytes: int
    written_s: float  # when the database row last got last_seen_s


# A step that runs longer than this (heartbeats say so) is a stuck node, not a slow one: the
# longest honest step — a 512-position prefill chunk of a big shard on a slow node — is
# seconds to a minute
STUCK_STEP_S = 300.0


class Coordinator:
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
        self.layout: list[Shard] = json.loads(self.store.get_meta("layout", "[]"))
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
        self._tokenizer: Any = None
        self._limits: Any = None
        self._limits_lock = threading.Lock()  # warm_up's thread and a request may race
        self._costs_at: Callable[[int, int], StageCosts] | None = None  # pipeline.costs_at
        self._context: int | None = None  # what it serves (see `context`)
        self._reconciled: tuple[int | None, str | None] = (None, None)  # (membership, layout)
        self._placed: tuple[int | None, list[str]] = (None, [])  # (membership, node ids)
        self._timeouts_checked_s = 0.0  # when check_timeouts last walked the nodes
        self.beats_via: dict[str, int] = {"http": 0, "nats": 0}  # heartbeats by transport
        self._splits: dict[tuple[int, int, int, int], list[tuple[int, int]] | str] = {}  # str: why
        self._manifest: Any = None
        self.part_specs = self._part_specs()
        self.node_stats: dict[str, Any] = {}  # the latest stage stats each node reported
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
        self.lead()  # taking the lead (at once on SQLite) rewires whatever was there

    # -- shared state: the epoch and leadership live in the database -----------------------

    @property
    def epoch(self) -> int:
        """The layout's epoch, read from the database: every coordinator answers the same."""
        return int(self.store.get_meta("epoch", "0"))

    @property
    def wired_epoch(self) -> int | None:
        """The epoch the leader last finished wiring (wired: it equals `epoch`)."""
        value = self.store.get_meta("wired_epoch")
        return int(value) if value else None

    @wired_epoch.setter
    def wired_epoch(self, epoch: int | None) -> None:
        self.store.set_meta("wired_epoch", "" if epoch is None else str(epoch))

    def lead(self) -> bool:
        """Whether this coordinator runs timeouts, placement, wiring and lease expiry now.
        On SQLite it is the only one. On PostgreSQL the `leader` row of `meta` names the
        leader and the end of its term (`elect`), renewed every tick; a coordinator takes it
        over once the term has run out. A new leader starts a new epoch (the old one may have
        died halfway through wiring), so the stages are reset and the heads replay."""
        db, now = self.store.db, time.time()
        if db.dialect == "sqlite":
            leading = True
        else:
            db.execute("INSERT INTO meta(key, value) VALUES ('leader', '{}') "
                       "ON CONFLICT DO NOTHING")  # fmt: skip
            with db.transaction():
                rows = db.execute("SELECT value FROM meta WHERE key='leader'" + db.skip_locked)
                if not rows:  # another coordinator is electing right now: keep our term
                    leading = self.leading and now < self.lead_until
                else:
                    held = json.loads(rows[0]["value"]) or None
                    term = elect(held, self.id, now, self.config.leader_ttl_s)
                    if term != held:
                        self.store.set_meta("leader", json.dumps(term))
                    leading = term["id"] == self.id
                    self.lead_until = float(term["until"]) if leading else 0.0
        if leading != self.leading:
            self.leading = leading
            self.log.event("leader" if leading else "follower", None, coordinator=self.id)
            log.warning("coordinator %s %s", self.id, "leads" if leading else "follows")
            if leading:
                self.unwire("took the lead")
                # a coordinator restart is not the holders' fault either: they could not
                # renew while none answered
                self.queue.extend_leases()
        return leading

    # -- joining ---------------------------------------------------------------------------

    def challenge(self, address: str = "127.0.0.1") -> str:
        return self.challenges(1, address)[0]

    def challenges(self, count: int, address: str = "127.0.0.1") -> list[str]:
        """`count` fresh nonces for a caller at `address` (nonces.py: stateless, rate-limited
        per address)."""
        return self.nonces.issue(count, address, time.monotonic())

    def join_many(self, joins: list[Any], host: str) -> list[dict[str, Any]]:
        """A rack's joins in one transaction (one commit, not one each: 100,000 joins one
        by one were ~300 a second on SQLite). Each proves the token over its own nonce and
        gets its own session or its own error; `host` is the relay's address, used for a
        join that does not say its own."""
        answers: list[dict[str, Any]] = []
        self._joins_said = 0  # a rack's joins are one line (log_join), not a line each
        with self.store.transaction():
            for j in joins:
                try:
                    if not isinstance(j, dict):
                        raise RequestError("a join is an object")
                    node_id = str(j["node_id"])
                    session = self.join(node_id, str(j["nonce"]), str(j.get("proof", "")),
                                        dict(j.get("capabilities") or {}),
                                        str(j.get("host") or host))  # fmt: skip
                    answers.append({"node_id": node_id, "session": session})
                except (PermissionError, RequestError, VersionMismatch, KeyError, TypeError,
                        ValueError) as exc:  # fmt: skip
                    why = f"a join needs {exc}" if isinstance(exc, KeyError) else str(exc)
                    answers.append({"error": why})
        if len(joins) > 1:
            log.info("%d of %d nodes joined through %s", sum("session" in a for a in answers),
                     len(joins), host)  # fmt: skip
        self._joins_said = -1
        return answers

    def join(self, node_id: str, nonce: str, proof: str, caps: dict[str, Any], host: str) -> str:
        """A session for a node that proved the cluster token over a fresh nonce."""
        now_s = time.monotonic()
        if not self.nonces.good(nonce, now_s):  # single use: a replayed proof finds it spent
            raise PermissionError("unknown, expired or used nonce: ask /v1/challenge for a "
                                  "fresh one")  # fmt: skip
        if self.token is not None and not verify(self.token, nonce, node_id, proof):
            self.log.event("join_denied", None, worker=node_id)
            raise PermissionError("proof does not match the cluster token")
        self.nonces.spend(nonce, now_s)  # only a proof that held spends one (nonces.py)
        check_version(caps.get("protocol"), node_id)  # after the proof: strangers learn none
        if int(caps.get("memory_bytes") or 0) <= 0:
            raise RequestError("capabilities.memory_bytes must be a positive byte count")
        old = self.store.node(node_id)
        session, now = secrets.token_hex(16), time.time()
        kept = digest(session)  # the database holds its hash: a copy of the file joins nobody
        kept_out = old is not None and old.state in ("offline", "evicted")
        state = old.state if old is not None and kept_out else "spare"
        node = Node(NodeId(node_id), state, kept, caps, host, now, now)
        if old is not None:  # a re-join: it dropped whatever it served; keep its record
            # a note on why it was lost is history now (its failures count keeps it); an
            # offline or evicted node's note still says why it waits
            node = replace(old, state=state, session=kept, capabilities=caps, host=host,
                           last_seen_s=now, shard=None, data_port=None, ready=None,
                           message=old.message if kept_out else "")  # fmt: skip
        oom = oom_message(old.capabilities if old else {}, caps)
        if oom:
            node = replace(node, message=oom)
        self.store.put_node(node)
        self.beats[node_id] = Beat(now, 0, 0, now)  # alive now; and the swarm's size counts it
        if old is not None and old.state == "assigned":
            # a new process under the old id (restarted faster than its silence made it
            # lost): the old one's work is gone as with a loss, its leases given back now
            # rather than left to expire as failed attempts (a worker killed 3 times in a
            # row spent a job's every attempt: tests/test_jobs_swarm.py's churn test)
            self._drop_work(old, f"{node_id} re-joined: a new process")
        self.log.event("join", None, worker=node_id, memory_bytes=node.memory_bytes)
        if self._joins_said < 0:  # (join_many says its rack's in one line)
            log.info("node %s joined from %s with %s", node_id, host,
                     format_bytes(node.memory_bytes))  # fmt: skip
        return session

    def authenticate(self, node_id: str, session: str) -> Node:
        node = self.store.node(node_id)
        if node is None or not hmac.compare_digest(node.session, digest(session)):
            raise PermissionError(f"node {node_id} has no such session: join again")
        self.sessions[node_id] = node.session
        return node

    def authenticate_sealed(self, beat: dict[str, Any], mac: str,
                            raw: bytes) -> tuple[Node, bytes, int]:  # fmt: skip
        """The node of a sealed NATS beat (control/beats.py), its beat key and sequence
        number: the seal holds under the key of the node's session and the number is past
        the last one heard for that session (a replayed message is refused)."""
        node_id, seq = str(beat.get("node_id")), beat.get("seq")
        node = self.store.node(node_id)
        key = self._beat_key(node_id, node.session) if node is not None else b""
        if node is None or not holds(key, mac, raw) or not isinstance(seq, int):
            raise PermissionError(f"node {node_id}: no such session, or a seal that does not "
                                  f"hold: join again")  # fmt: skip
        kept, last = self.beat_seqs.get(node_id, ("", 0))
        if kept == node.session and seq <= last:
            raise PermissionError(f"node {node_id}: beat {seq} is not past {last} (replayed)")
        self.beat_seqs[node_id] = (node.session, seq)
        self.sessions[node_id] = node.session
        return node, key, seq

    def held_sealed(self, env: dict[str, Any], mac: str, raw: bytes) -> bytes | None:
        """held_answer for a sealed NATS beat of one node (from the event loop: no
        database), sealed; None for anything else (a relay's batch waits for the core)."""
        node_id, seq, beats = str(env.get("node_id")), env.get("seq"), env.get("beats")
        kept = self.sessions.get(node_id)
        if kept is None or not isinstance(seq, int) or not isinstance(beats, list):
            return None
        key = self._beat_key(node_id, kept)
        last_kept, last = self.beat_seqs.get(node_id, ("", 0))
        if len(beats) != 1 or not holds(key, mac, raw) or (last_kept == kept and seq <= last):
            return None
        return seal(key, {"seq": seq, "answers": [self._held()]})

    def _beat_key(self, node_id: str, session_digest: str) -> bytes:
        """beat_key, kept per node while its session lasts (an HMAC less per beat)."""
        kept = self.beat_keys.get(node_id)
        if kept is None or kept[0] != session_digest:
            kept = self.beat_keys[node_id] = (session_digest,
                                              beat_key(self.token, session_digest))  # fmt: skip
        return kept[1]

    def _held(self) -> dict[str, Any]:
        return {"held": True, "now_s": time.time(), "heartbeat_s": self.heartbeat_interval_s()}

    def held_answer(self, node_id: str, session: str) -> dict[str, Any] | None:
        """A heartbeat's answer while the core thread is busy (from the event loop: no
        database): "heard you, nothing new" for a node whose session was good last time,
        so a slow fsync or placement pass never makes a node give up on its coordinator;
        the beat itself is recorded when the core gets to it. None for anyone else."""
        kept = self.sessions.get(node_id)
        if kept is None or not hmac.compare_digest(kept, digest(session)):
            return None
        return self._held()

    # -- heartbeats and faults -------------------------------------------------------------

    def heartbeat(self, node: Node, beat: dict[str, Any]) -> dict[str, Any]:
        """Record what the node reports; answer with its shard and whether to run a probe.

        What changes every beat (when it was seen, its memory) is kept in memory; the
        database is written when something else changed, or when the row's last_seen_s is
        a third of the timeout old (so a leader elsewhere, reading the database, still sees
        the node alive). A beat is otherwise no write: an fsync per heartbeat per node was
        most of an idle coordinator's work."""
        now = time.time()
        live = Beat(now, int(beat.get("rss_bytes", 0)), int(beat.get("peak_rss_bytes", 0)), now)
        changes: dict[str, Any] = {"data_port": port(beat.get("data_port"), "data_port"),
                                   "ready": beat.get("ready")}  # fmt: skip
        if beat.get("data_host"):  # what the node advertises; else the address it came from
            changes["host"] = str(beat["data_host"])
        if beat.get("clock_offset_s") is not None:  # the node's estimate of our clock - its
            self.node_clock[node.node_id] = (float(beat["clock_offset_s"]),
                                             float(beat.get("clock_error_s") or 0.0))  # fmt: skip
        if beat.get("max_sequences"):  # what its KV cache was sized for
            changes["capabilities"] = {**node.capabilities,
                                       "max_sequences": int(beat["max_sequences"])}  # fmt: skip
        if node.state == "lost":  # it is back; whatever it held went to someone else
            changes.update(state="spare", shard=None, message="")
        if beat.get("refused") and node.state == "assigned":
            changes.update(state="refused", shard=None, message=str(beat["refused"]))
            self.unwire(f"{node.node_id} refused its shard")
        if node.state == "offline" and beat.get("probe_ok") is not None:
            if beat["probe_ok"]:
                changes.update(state="spare", consecutive_failures=0, message="passed its probe")
            else:
                changes.update(message=f"failed its probe: {beat.get('probe_error', '')}")
        changes = {k: v for k, v in changes.items() if getattr(node, k) != v}
        written = self.beats.get(node.node_id)
        refresh_s = self.heartbeat_timeout_s() / 3 if self._shared else math.inf
        if changes or written is None or now - written.written_s > refresh_s:
            try:
                node = self.store.update_node(node.node_id, **changes, last_seen_s=now,
                                              rss_bytes=live.rss_bytes,
                                              peak_rss_bytes=live.peak_rss_bytes)  # fmt: skip
            except StorageFullError as exc:  # a full disk costs no node its place: the beat
                self.disk_full.warn(str(exc))  # is in memory, the write is tried next beat
                live = replace(live, written_s=written.written_s if written else 0.0)
        else:
            live = replace(live, written_s=written.written_s)
        self.beats[node.node_id] = live
        self.node_stats[node.node_id] = beat.get("stats")
        if beat.get("metrics_port"):
            self.metrics_ports[node.node_id] = int(beat["metrics_port"])
        if isinstance(beat.get("check"), dict):
            self.checkups.take(node.node_id, beat["check"])
        epoch = self.epoch
        return {"shard": self._shard_for(node), "epoch": epoch, "probe": self._probe(node),
                "wired": self.wired_epoch == epoch, "lease_s": self.config.lease_s,
                "now_s": time.time(), "check": self.checkups.ask(node.node_id),
                "heartbeat_s": self.heartbeat_interval_s(),
                **({"problem": self.problem} if self.problem else {})}  # fmt: skip

    def metrics_targets(self) -> list[dict[str, Any]]:
        """Prometheus' HTTP service discovery: one group per node that said where its
        /metrics is, labelled by its id alone — stable while its state changes (a state
        label split one worker's series in two), and kept once it is lost, so that
        `up == 0` fires for it (its state is `cellswarm_node_state` on /metrics)."""
        out = []
        for n in sorted(self.store.nodes(), key=lambda n: n.node_id):
            port = self.metrics_ports.get(n.node_id)
            if port:
                host = f"[{n.host}]" if ":" in n.host else n.host
                out.append({"targets": [f"{host}:{port}"],
                            "labels": {"job": "cellswarm-worker", "node": str(n.node_id)}})
        return out

    def _shard_for(self, node: Node) -> dict[str, Any] | None:
        if node.state != "assigned" or node.shard is None:
            return None
        c = self.config
        out = {**node.shard, "model": c.model, "context": self.context,
               "max_sequences": self.sequences}  # fmt: skip
        if node.shard["role"] == "stage":
            out["parts"] = self.part_specs  # what it does not hold; addresses come on wiring
        return out

    def _probe(self, node: Node) -> bool:
        if node.state != "offline":
            return False
        now = time.monotonic()
        if now - self.last_probe.get(node.node_id, 0.0) < self.config.probe_every_s:
            return False
        self.last_probe[node.node_id] = now
        return True

    def fault(self, node: Node, kind: str, detail: str, epoch: int | None = None,
              job: str | None = None) -> None:  # fmt: skip
        """A stage failed a step of `job` ("forward"), found the next stage gone ("next") or
        a part server ("part"), or got a malformed frame from the node `detail` ("sender":
        that node's fault, not the receiver's). Only a fault in the current epoch counts:
        the steps in flight when the first one struck fail too, and are one failure, not
        several. The job whose step failed gets a strike (jobs.py: poison); a job's own
        faults never come here — they fail the job (`fail`)."""
        job = job.partition("#")[0] if job else None  # a scoring job's sequence: the job
        self.log.event("fault", job, worker=node.node_id, kind=kind, detail=detail, epoch=epoch)
        if epoch is not None and epoch != self.epoch:
            return
        if node.state != "assigned" or node.shard is None:  # it runs no step: nothing of
            return  # its own failed, and a member outside the rings may not accuse others
        if job and not self._ring_holds(node, job):
            job = None  # a job its ring does not hold is not its to strike
        if kind == "next":
            return self._suspect_next(node)
        if kind == "part":  # a part server it calls broke the step: that one is suspect
            suspect = self.store.node(detail)
            if suspect is not None:
                self.lose(suspect, f"{node.node_id} could not reach it")
            else:
                self.unwire(f"{node.node_id} lost a part server")
            return
        if kind == "sender":
            sender = self.store.node(detail)
            if sender is not None and sender.state == "assigned":
                self._charge(sender, f"sent {node.node_id} a malformed frame")
            return
        if job:
            self._strike([job], f"{node.node_id}: {detail}")
        self._charge(node, detail)

    def _ring_holds(self, node: Node, job_id: str) -> bool:
        """Whether the job is leased to the replica the node is a stage of."""
        job = self.queue.get(job_id)
        replica = str((node.shard or {}).get("replica", 0))
        return job is not None and job.state == "leased" and job.lease_replica == replica

    def _charge(self, node: Node, detail: str) -> None:
        """A failure that is the node's own: offline after `offline_after` in a row."""
        failures = node.consecutive_failures + 1
        changes: dict[str, Any] = {"failures": node.failures + 1, "consecutive_failures": failures,
                                   "message": detail[:200]}  # fmt: skip
        if failures >= self.config.offline_after:
            changes.update(state="offline", shard=None,
                           message=f"offline after {failures} failures in a row: {detail[:160]}")
        self.store.update_node(node.node_id, **changes)
        self.unwire(f"{node.node_id} failed: {detail}")

    def _suspect_next(self, node: Node) -> None:
        nodes = ring(self.placed(), int((node.shard or {}).get("replica", 0)))
        ids = [n.node_id for n in nodes]
        if node.node_id in ids:
            nxt = nodes[(ids.index(node.node_id) + 1) % len(nodes)]
            self.lose(nxt, f"{node.node_id} could not reach it")

    def lose(self, node: Node, why: str) -> None:
        if node.state not in ("assigned", "spare"):
            return
        self.store.update_node(node.node_id, state="lost", shard=None, data_port=None,
                               ready=None, message=why, failures=node.failures + 1)
        self.log.event("lost", None, worker=node.node_id, why=why)
        log.warning("node %s lost: %s", node.node_id, why)
        if node.state == "assigned":
            self._drop_work(node, f"{node.node_id} lost: {why}")

    def _drop_work(self, node: Node, why: str) -> None:
        """What an assigned node was doing is gone (it was lost, or a new process took its
        id): its ring's jobs get a strike, and the jobs it led go back, attempts unspent."""
        # whose step it was nobody knows: every job its ring was running at a step new to
        # it since it was wired was present (a strike: one that kills its nodes, the head
        # included, is quarantined after POISON_AFTER; one still waiting in the head, or
        # replaying steps it had passed, was not: jobs.strike_replica) — once per wiring of
        # the ring: a rack cut off (or a node lost because its neighbour could not reach it)
        # loses several nodes in one failure, not several
        replica = str((node.shard or {}).get("replica", 0))
        self.homes.forget(replica)  # its new member starts with an empty prefix cache
        wired = self.wired_epoch
        if self.struck.get(replica) != wired:
            self.struck[replica] = wired
            self._strike_replica(replica, why, wired)
        if not (node.shard or {}).get("stage"):
            # a lost head's jobs go back to the queue now, their attempts unspent (the loss
            # is no job's fault)
            for job_id in self.queue.release_owner(node.node_id):
                self.log.event("released", job_id, worker=node.node_id, why=why)
        self.unwire(why)

    def _strike(self, job_ids: list[str], why: str) -> None:
        self._quarantined(self.queue.strike(job_ids, why), why)

    def _strike_replica(self, replica: str, why: str, since_epoch: int | None) -> None:
        self._quarantined(self.queue.strike_replica(replica, why, since_epoch=since_epoch), why)

    def _quarantined(self, job_ids: list[str], why: str) -> None:
        for job_id in job_ids:
            self.log.event("quarantined", job_id, why=why)
            log.warning("job %s quarantined as poison (%s)", job_id, why)
        if job_ids:
            self.notify()

    def unwire(self, why: str) -> None:
        """The layout changed: a new epoch (so not wired); stage frames of the old one are void."""
        epoch = self.store.next_epoch()
        self.log.event("unwire", None, epoch=epoch, why=why)
        log.info("rewiring the rings (epoch %d): %s", epoch, why)

    # -- placement and wiring --------------------------------------------------------------

    def live(self, node: Node) -> Node:
        """The node as its latest heartbeat here has it (the database's row may be older)."""
        beat = self.beats.get(node.node_id)
        if beat is None or beat.seen_s <= node.last_seen_s:
            return node
        return replace(node, last_seen_s=beat.seen_s, rss_bytes=beat.rss_bytes,
                                   peak_rss_bytes=beat.peak_rss_bytes)  # fmt: skip

    def placed(self) -> list[Node]:
        """The nodes holding a shard (assigned: stages, part servers), in join order: a few
        among maybe 100,000 spares. Leases, completions and wiring read rings from it; kept
        until membership changes (on SQLite; PostgreSQL reads it every time). Which nodes is
        kept; each node is read fresh (its counters move without a membership change)."""
        if self.store.membership_changed(self._placed[0]):
            nodes = [n for n in self.store.nodes() if n.shard is not None]
            self._placed = (self.store.membership, [n.node_id for n in nodes])
            return nodes
        found = map(self.store.node, self._placed[1])
        return [n for n in found if n is not None]

    def heartbeat_interval_s(self) -> float:
        """How often nodes beat: --heartbeat, or slower in a swarm whose beats would pass
        --max-beats a second (100,000 nodes at 4,000 a second: every 25 s). Told to every
        node in each answer; a node beats at the interval it was last told."""
        c = self.config
        return max(c.heartbeat_s, len(self.beats) / c.max_beats_per_s)

    def heartbeat_timeout_s(self) -> float:
        """Silence that makes a node lost: --heartbeat-timeout, grown with the interval. A
        shrinking swarm shortens it while nodes still wait out their last, longer interval:
        the timeout stays several of those, so none is lost for it."""
        c = self.config
        return c.heartbeat_timeout_s * self.heartbeat_interval_s() / c.heartbeat_s

    def check_timeouts(self) -> None:
        """Nodes silent past the timeout are lost. From the heartbeats held in memory (the
        rows' last_seen_s may be old by design): a dict lookup per node, no row copied.
        Walked a quarter of an interval apart (every tick in a small swarm; at 100,000 nodes
        every ~6 s, not 4 times a second: the walk was most of the coordinator's time), so
        a silent node is lost at most that much after its timeout."""
        now, timeout = time.time(), self.heartbeat_timeout_s()
        if now - self._timeouts_checked_s < self.heartbeat_interval_s() / 4:
            return
        self._timeouts_checked_s = now
        for n in self.store.nodes():
            if n.state not in ("assigned", "spare"):
                continue
            beat = self.beats.get(n.node_id)
            quiet_s = now - max(n.last_seen_s, beat.seen_s if beat else 0.0)
            if quiet_s > timeout:
                self.lose(self.live(n), f"no heartbeat for {quiet_s:.1f} s")

    def reconcile(self) -> None:
        """Place and repair: run when membership (what placement reads of the nodes, see
        Store.membership_changed) or the layout changed since the last run (every tick on
        PostgreSQL, where others write; on SQLite a quiet tick is free — at 100,000 spares a
        placement pass costs a good part of a second)."""
        layout_text = self.store.get_meta("layout", "[]")  # a past leader's, maybe
        seen = (self.store.membership, layout_text)
        if not self.store.membership_changed(self._reconciled[0]) and \
                seen[1] == self._reconciled[1]:  # fmt: skip
            return
        self._reconciled = seen
        self.layout = json.loads(layout_text)
        nodes = self.store.nodes()
        layout, target, sequences = self._repair(nodes)
        if not target:
            problem = self._why_unplaced(nodes)
            if problem and problem != self.problem:  # said once, not every tick
                log.warning("cannot place the model: %s", problem)
            self.problem = problem
            return
        self.problem = ""
        current = {n.node_id: n.shard for n in nodes}
        if layout == self.layout and all(current.get(k) == v for k, v in target.items()):
            return
        with self.store.transaction():
            for node_id, shard in target.items():
                state = "assigned" if shard is not None else "spare"
                self.store.update_node(node_id, state=state, shard=shard)
            self.layout = layout
            self.store.set_meta("layout", json.dumps(layout))
            self.store.set_meta("sequences", str(sequences))
        placed = {k: v["layers"] for k, v in target.items() if v is not None}
        self.log.event("placed", None, layout=placed, context=self.context, sequences=sequences)
        shown = ", ".join(f"{k} {v[0]}..{v[1] - 1}" for k, v in list(placed.items())[:8])
        more = f" and {len(placed) - 8} more" if len(placed) > 8 else ""
        log.info("placed the model on %d nodes (%s%s), %d sequences of %d tokens",
                 len(placed), shown, more, sequences, self.context)  # fmt: skip
        self.unwire("new placement")

    def _repair(self, nodes: list[Node]) -> tuple[list[Shard], dict[NodeId, Shard | None], int]:
        """membership.repair at the served context, and the sequences in flight it placed
        for: --max-sequences if a stage count of the live nodes holds them; at the model's
        own context (no --context) else fewer, down to 1 — more stages before fewer
        sequences, as far as the nodes that joined allow (a pipeline needs sequences in
        flight to keep its stages busy). A context asked for waits for nodes that hold
        --max-sequences (`cellswarm up` fits both to its workers). A layout kept or mended
        keeps its sequences."""
        c, held = self.config, self.sequences
        layers = len(self.stage_costs().weights)
        fewest = 1 if c.context is None else c.max_sequences
        own = c.context or self.model_context
        for sequences in range(c.max_sequences, fewest - 1, -1):
            layout, target = self._repair_at(nodes, own, sequences, layers)
            if target:
                self._set_context(own if layout != self.layout else self.context)
                return layout, target, held if layout == self.layout else sequences
        live = [n for n in nodes if n.state in ("spare", "assigned")]
        if c.context is not None or not live:
            return [], {}, held
        # not one sequence of the model's own context fits: the context is capped by what
        # the stages' budgets leave for KV (planner/placement.py: fit_context) — as many
        # stages as the live nodes make (or --stages), one sequence a stage where it can
        stages = min(c.stages or max(len(live) - len(self.part_specs), 1), layers)
        try:
            fit = fit_context(self.costs_at(), stages, min(n.memory_bytes for n in live), own,
                              c.max_sequences)  # fmt: skip
        except BudgetError:
            return [], {}, held
        layout, target = self._repair_at(nodes, fit.context_tokens, fit.sequences, layers)
        if not target:
            return [], {}, held
        self._set_context(fit.context_tokens)
        return layout, target, fit.sequences

    def _repair_at(self, nodes: list[Node], context: int, sequences: int,
                   layers: int) -> tuple[list[Shard], dict[NodeId, Shard | None]]:  # fmt: skip
        split = functools.partial(self._split, sequences=sequences, context=context)
        return repair(nodes, self.layout, split, self.config.stages, self.part_specs,
                      self.config.replicas, max_stages=layers)  # fmt: skip

    def _set_context(self, context: int) -> None:
        """The context the layout was placed for: what shards and requests are held to."""
        if context != self._context:
            self._context = context
            self._limits = None  # the request checks read it
        self.store.set_meta("context", str(context))

    def _why_unplaced(self, nodes: list[Node]) -> str:
        live = [n for n in nodes if n.state in ("spare", "assigned")]
        if not live:
            return "no live workers"
        memory = min(n.memory_bytes for n in live)
        workers = max(len(live) - len(self.part_specs), 1)  # part servers hold no layers
        stages = min(self.config.stages or workers, len(self.stage_costs().weights))
        fewest = 1 if self.config.context is None else self.config.max_sequences
        at = self.costs_at()
        if not fits(at(self.context, fewest), stages, memory):  # it names what does fit
            return too_long(at, self.context, stages, memory, fewest)
        try:
            self._split(len(live), memory, fewest)
        except BudgetError as exc:
            return str(exc)
        return ""

    def _split(self, stages: int, memory_bytes: int, sequences: int,
               context: int | None = None) -> list[tuple[int, int]]:  # fmt: skip
        """The placement's layer ranges (planner/placement.py: balanced_layers), remembered
        per (stages, budget, sequences): the monitor asks every tick, and the model does not
        change — reading its header for each ask was most of a busy coordinator's time."""
        context = context or self.context
        key = (stages, memory_bytes, sequences, context)
        if key not in self._splits:
            try:
                self._splits[key] = balanced_layers(self.costs_at()(context, sequences), stages,
                                                    memory_bytes, Path(self.config.model).name)
            except BudgetError as exc:
                self._splits[key] = str(exc)
        found = self._splits[key]
        if isinstance(found, str):
            raise BudgetError(found)
        return found

    def costs_at(self) -> Callable[[int, int], StageCosts]:
        """(context, sequences) -> StageCosts of this model as a stage holds it."""
        if self._costs_at is None:
            c = self.config
            self._costs_at = costs_at(c.model, c.expert_nodes > 0, c.vocab_nodes > 0)
        return self._costs_at

    def stage_costs(self, sequences: int | None = None) -> StageCosts:
        """What a stage holds at the served context with `sequences` (default: the placed)."""
        return self.costs_at()(self.context, sequences or self.sequences)

    @property
    def context(self) -> int:
        """The tokens a sequence may hold, prompt + completion: --context; else the model's
        own context (GGUF context_length), capped by what the placed stages' budgets leave
        for KV (the placement's, kept with the layout)."""
        if self._context is None:
            placed = int(self.store.get_meta("context", "0") or 0)
            self._context = self.config.context or placed or self.model_context
        return self._context

    @functools.cached_property
    def model_context(self) -> int:
        from cellswarm.loader import read_config

        return int(read_config(self.config.model).context_length)

    @property
    def sequences(self) -> int:
        """The sequences in flight the layout was placed for (at most --max-sequences)."""
        placed = int(self.store.get_meta("sequences", "0") or 0)
        return min(placed, self.config.max_sequences) if placed else self.config.max_sequences

    def maybe_rebalance(self) -> None:
        """Once per layout, after every stage measured its step time: new layer ranges over
        the same nodes when the slowest stage would get much faster (rebalance.py)."""
        if not self.config.rebalance or self.config.replicas != 1:
            return  # replicas share one layout: their nodes' speeds would pull it apart
        if self.wired_epoch != self.epoch:
            return
        key = json.dumps(self.layout, sort_keys=True)
        if self.store.get_meta("rebalance_decided") == key:
            return
        nodes = ring(self.placed(), 0)
        if rebalance.ring_times(nodes, self.node_stats, rebalance.STATUS_MIN_STEPS) is None:
            return
        if self.named_since is None or self.named_since[0] != key:
            self.named_since = (key, time.monotonic())
        times = rebalance.ring_times(nodes, self.node_stats, rebalance.MIN_STEPS)
        if times is None or not rebalance.named_long_enough(
                self.named_since[1], time.monotonic(), self.heartbeat_interval_s()):  # fmt: skip
            return
        split = rebalance.plan(times, self.stage_costs())
        if split is None:
            self.store.set_meta("rebalance_decided", key)
            return
        layout = [dict(sh) for sh in self.layout]
        with self.store.transaction():
            for node, (lo, hi) in zip(times.nodes, split, strict=True):
                shard = {**(node.shard or {}), "layers": [lo, hi]}
                self.store.update_node(node.node_id, shard=shard)
                layout[int(shard["slot"])] = shard
            self.layout = layout
            self.store.set_meta("layout", json.dumps(layout))
            self.store.set_meta("rebalance_decided", json.dumps(layout, sort_keys=True))
        why = (f"rebalanced by measured step times {times.bottleneck()['steps_ms']} ms: "
               f"layers {[list(r) for r in split]}")  # fmt: skip
        self.log.event("rebalanced", None, steps_ms=times.bottleneck()["steps_ms"],
                       layers=[list(r) for r in split])  # fmt: skip
        log.warning(why)
        self.unwire(why)

    def _part_specs(self) -> list[dict[str, Any]]:
        """What each part server holds (addresses come at wiring time)."""
        from cellswarm.swarm.local.pipeline import part_specs

        c = self.config
        n = c.expert_nodes + c.vocab_nodes
        specs = part_specs(c.model, c.expert_nodes, c.vocab_nodes, [0] * n) if n else []
        return [s.to_dict() for s in specs]

    async def wire(self) -> None:
        """Once every slot's node serves its shard, for each replica: tell its part servers
        who may call them, then (last stage first, so that stage 0 — which starts sending as
        soon as it is reset — only ever sends to reset stages) each stage its epoch, the next
        stage's address and its part servers' addresses."""
        todo = await self.on_core(self._to_wire)
        if todo is None:
            return
        epoch, nodes = todo
        for replica in replicas(nodes):
            if not await self._wire_replica(nodes, replica, epoch):
                return
        await self.on_core(self._wired, epoch, nodes)

    def _to_wire(self) -> tuple[int, list[Node]] | None:
        """(epoch, placed nodes) when a complete, serving layout waits to be wired."""
        if self.wired_epoch == self.epoch:
            return None
        nodes = self.placed()
        live = [n for n in nodes if n.state in ("assigned", "spare")]
        if not layout_complete(live):
            return None
        if not all(n.serving for n in live if n.state == "assigned"):
            return None
        return self.epoch, nodes

    def _wired(self, epoch: int, nodes: list[Node]) -> None:
        if self.epoch == epoch:
            self.wired_epoch = epoch
            rings = [[n.node_id for n in ring(nodes, r)] for r in replicas(nodes)]
            self.log.event("wired", None, epoch=epoch, replicas=rings)
            log.info("wired (epoch %d): %s", epoch, "; ".join(" -> ".join(r) for r in rings[:4])
                     + (f"; and {len(rings) - 4} more rings" if len(rings) > 4 else ""))

    async def _wire_replica(self, nodes: list[Node], replica: int, epoch: int) -> bool:
        stages, parts = ring(nodes, replica), part_nodes(nodes, replica)
        callers = [PEER_ID, *(n.node_id for n in stages)]
        for node in parts:
            if not await self._reset(node, {"epoch": epoch, "peers": callers}):
                await self.on_core(self.lose, node, "did not answer its reset")
                return False
        addressed = [
            {**(n.shard or {})["spec"], "node_id": n.node_id, "host": n.host, "port": n.data_port}
            for n in parts
        ]
        for k in reversed(range(len(stages))):
            node, nxt, prev = stages[k], stages[(k + 1) % len(stages)], stages[k - 1]
            fields = {"epoch": epoch, "next_host": nxt.host, "next_port": nxt.data_port,
                      "peers": [PEER_ID, prev.node_id], "parts": addressed}  # fmt: skip
            if not await self._reset(node, fields):
                await self.on_core(self.lose, node, "did not answer its reset")
                return False
        return True

    async def _reset(self, node: Node, fields: dict[str, Any]) -> bool:
        assert node.data_port is not None
        if self.epoch != fields["epoch"]:  # a newer epoch (maybe a newer leader's): stop;
            return True  # a stale reset must never take a stage back to an older epoch
        return await reset_stage(node.host, node.data_port, fields, self.token, PEER_ID,
                                 tls=self.tls)  # fmt: skip

    async def on_core(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the core thread, awaited. Every database write and placement pass
        runs there, one at a time, so the event loop that receives heartbeats never waits
        on an fsync or a placement; and the calls run in arrival order, so a beat that came
        while the core was busy is recorded before the next timeout check looks."""
        return await asyncio.get_running_loop().run_in_executor(
            self.core, functools.partial(fn, *args))  # fmt: skip

    async def monitor(self) -> None:
        self.loop, self.loop_thread = asyncio.get_running_loop(), threading.get_ident()
        while True:
            try:
                if await self.on_core(self._tick):  # only the leader places, wires, expires
                    await self.wire()
                    await self.on_core(self._tick_wired)
            except StorageFullError as exc:  # said once a minute, tried again every tick
                self.disk_full.warn(str(exc))
            except Exception:  # keep watching whatever one tick ran into
                log.exception("monitor tick failed")
            await asyncio.sleep(MONITOR_TICK_S)

    def _tick(self) -> bool:
        """The monitor's first half (on the core thread): lead, time out, place."""
        if not self.lead():
            return False
        self.check_timeouts()
        self.reconcile()
        return True

    def _tick_wired(self) -> None:
        """Its second half, after wiring: rebalance, renew busy rings, expire leases."""
        if self._stall_due:  # a test's stall, once, after the first lease (--stall-core)
            self._stall_due = False
            stall_s, self.config = self.config.stall_core_s, replace(self.config, stall_core_s=0)
            log.warning("stalling the core thread for %.0f s (--stall-core)", stall_s)
            time.sleep(stall_s)
        self.maybe_rebalance()
        self.renew_busy_rings()
        if self.queue.expire():
            self.notify()

    def renew_busy_rings(self) -> None:
        """A ring one of whose nodes is in the middle of a step (its heartbeat says so, from
        a thread of its own) is making progress its head cannot see yet — a long prompt's
        prefill at a later stage: its jobs' leases are renewed rather than expired. A step
        running past STUCK_STEP_S is no progress: that node is taken for lost."""
        now, fresh_s = time.time(), 2 * self.heartbeat_interval_s()
        for n in self.placed():
            beat = self.beats.get(n.node_id)
            if beat is None or now - beat.seen_s > fresh_s:  # a silent node says nothing now
                continue
            running_s = float((self.node_stats.get(n.node_id) or {}).get("running_s") or 0.0)
            if running_s > STUCK_STEP_S:
                self.lose(n, f"one step running for {running_s:.0f} s: stuck")
            elif running_s > 0 and n.shard is not None and n.shard.get("role") == "stage":
                self.queue.extend_replica(str(n.shard.get("replica", 0)))

    # -- jobs: submitted by clients, leased by pipeline heads ------------------------------

    def submit(self, payload: dict[str, Any], request_id: str | None = None,
               kind: str = "generate", owner: str | None = None) -> Job:  # fmt: skip
        """An interactive request: a job ahead of batch work. `request_id` is its
        idempotency key (the same id twice is the same job); `owner` the hash of the API key
        that submitted it (access.py)."""
        job, new = self.queue.submit(payload, kind, request_id, priority=1, owner=owner)
        if new:
            self.log.event("submitted", job.job_id, prompt_tokens=len(payload.get("prompt", [])),
                           key=request_id)  # fmt: skip
            self.notify()  # a head waiting in a long poll takes it now
        return job

    def notify(self) -> None:
        """Wake whoever waits for news (progress readers, heads' long polls); from the
        event loop or, through it, from a worker thread."""
        loop = self.loop
        if loop is not None and threading.get_ident() != self.loop_thread:
            loop.call_soon_threadsafe(self.notify)
            return
        self.pulse.set()
        self.pulse = asyncio.Event()

    def lease(self, node: Node, n: int) -> list[dict[str, Any]]:
        """Jobs for a pipeline head: only stage 0 of a wired replica, and no more than the
        sequences its ring has KV cache for."""
        shard = node.shard or {}
        if self.wired_epoch != self.epoch or shard.get("role") != "stage" or shard.get("stage"):
            return []
        stages = ring(self.placed(), int(shard.get("replica", 0)))
        capacity = min(int(s.capabilities.get("max_sequences") or self.sequences)
                       for s in stages)  # fmt: skip
        # a job is one sequence (a scoring job's completions follow its prompt in it)
        room = capacity - self.queue.leased_count(node.node_id)
        if room <= 0:
            return []
        n_replicas, replica = len(replicas(self.placed())), str(shard.get("replica", 0))
        rank = (lambda job: self.homes.rank(job.payload, replica)) if n_replicas > 1 else None
        jobs = self.queue.lease(node.node_id, replica, min(n, room), exclusive=n_replicas > 1,
                                n_replicas=n_replicas, rank=rank)  # fmt: skip
        self._stall_due = self._stall_due or bool(jobs and self.config.stall_core_s)
        now = time.time()
        for job in jobs:
            self.requests.leased(job, now)
            self.homes.note(job.payload, replica)
            self.log.event("leased", job.job_id, worker=node.node_id, fence=job.fence,
                           resume=len(job.tokens), attempt=job.attempts + 1)  # fmt: skip
        return [j.lease_view() for j in jobs]

    def ring_sequences(self, node: Node) -> int | None:
        """The sequences the ring headed by `node` holds at once: the fewest any of its
        stages has KV cache for (a head admits no more into stage 0)."""
        shard = node.shard or {}
        if shard.get("role") != "stage":
            return None
        stages = ring(self.placed(), int(shard.get("replica", 0)))
        return min((int(s.capabilities.get("max_sequences") or self.config.max_sequences)
                    for s in stages), default=None)  # fmt: skip

    def checkpoint(self, node: Node, runs: list[dict[str, Any]]) -> list[str]:
        """Tokens so far of a head's jobs (renewing their leases); the ids it lost. One
        transaction for the lot: a commit (an fsync) per post, not per job."""
        with self.store.transaction():
            stale = [str(r["job_id"]) for r in runs
                     if not self.queue.checkpoint(str(r["job_id"]), int(r["fence"]),
                                                  [int(t) for t in r["tokens"]],
                                                  owner=node.node_id,
                                                  frontier_epoch=self.epoch if r.get("frontier")
                                                  else None)]  # fmt: skip
        now = time.time()
        for r in runs:
            self.requests.tokens(str(r["job_id"]), len(r["tokens"]), now)
        for rid in stale:
            self.log.event("stale", rid, worker=node.node_id, call="checkpoint")
        self.notify()
        return stale

    def _run_nodes(self, node: Node, job_id: str) -> tuple[str, list[str]]:
        """Which replica ran a job's lease and which nodes computed it, for the verification
        votes. The replica it was leased on (the queue's record), not the reporter's shard
        now: a head evicted or made spare mid-run still reports, and its shard no longer says
        where it ran. Its ring's members only while the reporter is one of them; else only
        the reporter is known (blaming today's members of that replica, an honest node moved
        in since, marked it for the evicted node's bits: seen under test)."""
        job = self.queue.get(job_id)
        leased = job.lease_replica if job is not None else None
        replica = leased if leased is not None else str((node.shard or {}).get("replica", 0))
        members = ([str(n.node_id) for n in ring(self.placed(), int(replica))]
                   if replica.isdigit() else [])  # fmt: skip
        return replica, members if node.node_id in members else [str(node.node_id)]

    def report(self, node: Node, items: list[tuple[str, int, dict[str, Any]]],
               runs: list[dict[str, Any]]) -> tuple[list[str], list[str]]:  # fmt: skip
        """A head's one post: results (`complete_all`), then checkpoints (`checkpoint`), in
        one transaction; (the ids it lost, the results' outcomes)."""
        with self.store.transaction():
            outcomes = self.complete_all(node, items)
            return self.checkpoint(node, runs), outcomes

    def complete_all(self, node: Node, items: list[tuple[str, int, dict[str, Any]]]) -> list[str]:
        """`complete` of each (job_id, fence, result) a head posted together, in one
        transaction: each outcome is what it would be alone, and the lot costs one commit (an
        fsync) where it cost three a job (the job, its ring's nodes, its events). A failure
        commits none: the head's post failed, and the leases run out as for a lost post."""
        with self.store.transaction():
            return [self.complete(node, *item) for item in items]

    def complete(self, node: Node, job_id: str, fence: int, result: dict[str, Any]) -> str:
        replica, members = self._run_nodes(node, job_id)
        outcome = self.queue.complete(job_id, fence, result, replica, members,
                                      owner=node.node_id)  # fmt: skip
        self.log.event("completed" if outcome != "stale" else "stale", job_id,
                       worker=node.node_id, outcome=outcome,
                       tokens=len(result.get("tokens", [])))  # fmt: skip
        if outcome == "done":
            with self.store.transaction():
                for nid in members:
                    n = self.store.node(nid)
                    if n is not None:
                        self.store.update_node(nid, served=n.served + 1, consecutive_failures=0)
            self._record_votes(job_id)
        elif outcome == "verify":
            self._record_contradiction(job_id)
        self.notify()
        return outcome

    def fail(self, node: Node, job_id: str, fence: int, reason: str, fault: str = "job") -> str:
        """A head says this attempt of the job failed: its data failed a stage, the head could
        not start it, or its ring dropped it (`fault` says which). The attempt is the job's;
        no node is charged."""
        outcome = self.queue.fail(job_id, fence, reason, owner=node.node_id)
        self.log.event("failed", job_id, worker=node.node_id, outcome=outcome, reason=reason,
                       fault=fault)  # fmt: skip
        self.notify()
        return outcome

    def release(self, node: Node, runs: list[dict[str, Any]]) -> int:
        """A head stopped serving: its jobs go back to the queue unharmed (no attempt)."""
        released = 0
        for r in runs:
            if self.queue.release(str(r["job_id"]), int(r["fence"]), owner=node.node_id):
                released += 1
                self.log.event("released", str(r["job_id"]), worker=node.node_id)
        self.notify()
        return released

    def _record_votes(self, job_id: str) -> None:
        """After a verified job: nodes of runs that agreed with the result get an agreement,
        the others a disagreement; a node that keeps disagreeing is taken out."""
        job = self.queue.get(job_id)
        if job is None or len(job.runs) < 2 or job.result is None:
            return
        for run in job.runs:
            agreed = same_result(run["result"], job.result)
            for nid in run["nodes"]:
                n = self.store.node(nid)
                if n is None:
                    continue
                if agreed:
                    self.store.update_node(nid, agreements=n.agreements + 1)
                    continue
                self._disagreed(n, job_id, "outvoted {} times by other replicas: taken out")

    def _record_contradiction(self, job_id: str) -> None:
        """A verification run that contradicts an earlier run of the job on the same nodes:
        those nodes are not deterministic (a correct node gives the same bits every time), so
        each gets a disagreement now, before the job is decided — a liar caught only by a
        later majority could meanwhile spend the job's runs."""
        job = self.queue.get(job_id)
        for nid in inconsistent(job.runs) if job is not None else []:
            n = self.store.node(nid)
            if n is not None and n.state != "evicted":
                self._disagreed(n, job_id, "gave two results for one job {} times "
                                "(outvoted by itself: not deterministic): taken out")  # fmt: skip

    def _disagreed(self, n: Node, job_id: str, why: str) -> None:
        """One disagreement more for node `n`; taken out at the configured count (`why` is
        the message, the count in its braces)."""
        n = self.store.update_node(n.node_id, disagreements=n.disagreements + 1)
        self.log.event("disagreed", job_id, worker=n.node_id, disagreements=n.disagreements)
        if n.state != "evicted" and n.disagreements >= self.config.evict_after_disagreements:
            self.store.update_node(n.node_id, state="evicted", shard=None,
                                   message=why.format(n.disagreements))  # fmt: skip
            self.unwire(f"{n.node_id} keeps disagreeing")

    # -- views -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.time()
        nodes = [
            {"node_id": n.node_id, "state": n.state,
             "layers": n.shard.get("layers") if n.shard else None,
             "holds": describe(n.shard),
             "stage": n.shard.get("stage") if n.shard else None,
             "replica": n.shard.get("replica") if n.shard else None,
             "agreements": n.agreements, "disagreements": n.disagreements,
             "memory_bytes": n.memory_bytes, "rss_bytes": n.rss_bytes,
             "peak_rss_bytes": n.peak_rss_bytes, "last_seen_s_ago": round(now - n.last_seen_s, 2),
             "served": n.served, "failures": n.failures, "message": n.message,
             "profile": n.capabilities.get("profile"), "serving": n.serving,
             "rack": n.capabilities.get("rack"),
             "stats": self.node_stats.get(n.node_id),
             "busy_s": float((self.node_stats.get(n.node_id) or {}).get("running_s") or 0.0),
             "address": f"{n.host}:{n.data_port}" if n.data_port else n.host,
             "clock_offset_s": self._clock(n.node_id)[0],
             "clock_error_s": self._clock(n.node_id)[1]}
            for n in map(self.live, self.store.nodes())
        ]  # fmt: skip
        epoch = self.epoch
        times = [rebalance.ring_times(ring(self.placed(), r), self.node_stats,
                                      rebalance.STATUS_MIN_STEPS)
                 for r in range(self.config.replicas)]  # fmt: skip
        return {"epoch": epoch, "wired": self.wired_epoch == epoch, "problem": self.problem,
                "context": self.context, "sequences": self.sequences,
                "bottlenecks": [t.bottleneck() for t in times if t is not None],
                "coordinator": self.id, "leader": self.leading,
                "model": Path(self.config.model).name, "nodes": nodes}  # fmt: skip

    def _clock(self, node_id: str) -> tuple[float | None, float | None]:
        """How far the node's clock is behind ours (s; negative: ahead), and the error."""
        return self.node_clock.get(node_id, (None, None))

    def manifest(self) -> Any:
        """The model file's content id and chunk hashes, for workers that fetch their shard
        (hashed once, then cached by path, size and mtime)."""
        if self._manifest is None:
            from cellswarm.swarm.node.fetch import build_manifest

            self._manifest = build_manifest(self.config.model)
        return self._manifest

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from cellswarm.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.model)
        return self._tokenizer

    @property
    def limits(self) -> Any:
        """What a request is checked against at submit (schema.Limits): the model's
        vocabulary, the ring's context and sequences, the longest token's text."""
        with self._limits_lock:
            if self._limits is None:
                from cellswarm.errors import CellswarmError
                from cellswarm.loader import read_config
                from cellswarm.swarm.api.schema import Limits, longest_token_bytes

                c = self.config
                try:
                    token_bytes = longest_token_bytes(self.tokenizer)
                except CellswarmError:  # no tokenizer: only token ids can be sent
                    token_bytes = 0
                self._limits = Limits(int(read_config(c.model).vocab_size), self.context,
                                      c.max_sequences, token_bytes)  # fmt: skip
            return self._limits

    def warm_up(self) -> None:
        """The tokenizer and the limits, loaded beside the event loop at start (a second of
        work the first request would otherwise hold the loop, and heartbeats, for)."""
        try:
            self.limits  # noqa: B018
        except Exception as exc:  # a bad model file: each request says so
            log.warning("could not read the model's limits: %s", exc)



def oom_message(before: dict[str, Any], now: dict[str, Any]) -> str:
    """Why a node came back, when its memory cgroup counts an OOM kill it did not have
    before: the kernel killed its last process for going over the limit."""
    kills, seen = int(now.get("oom_kills") or 0), int(before.get("oom_kills") or 0)
    if kills <= seen:
        return ""
    limit = now.get("cgroup_limit_bytes")
    where = f"its cgroup limit of {int(limit):,} bytes" if limit else "its memory limit"
    return (f"killed by the kernel for memory ({kills - seen} OOM kill(s) over {where}; "
            f"its --memory is {int(now.get('memory_bytes') or 0):,}): lower --memory")


def elect(held: dict[str, Any] | None, me: str, now: float, ttl_s: float) -> dict[str, Any]:
    """The leader's term after `me` asks for it at `now`: renewed if `me` holds it, taken if
    nobody does or its term ran out, else unchanged. (Terms are wall-clock times: the
    coordinators' clocks must agree to well within `ttl_s`.)"""
    if not held or held.get("id") == me or float(held.get("until", 0.0)) <= now:
        return {"id": me, "until": now + ttl_s}
    return held


def describe(shard: Shard | None) -> str:
    """A shard in a few words, for the status table."""
    if shard is None:
        return "-"
    if shard["role"] == "stage":
        lo, hi = shard["layers"]
        return f"layers {lo}..{hi - 1}"
    spec = shard["spec"]
    if spec.get("vocab_rows"):
        a, b = spec["vocab_rows"]
        return f"vocab rows {a}..{b - 1}"
    experts = spec.get("experts", {})
    per_layer = len(next(iter(experts.values()), []))
    return f"{per_layer} experts x {len(experts)} layers"
