"""The coordinator: membership, placement, the ring's wiring, and the requests it drives.

    worker --HTTP join/heartbeat/fault--> coordinator (SQLite) --TCP frames--> stage 0 ... ring

Workers join with an HMAC proof of the cluster token, heartbeat their memory and readiness,
and learn their shard from the heartbeat's answer. The coordinator places shards with the
planner's inventory (`budget_split`), fills a lost node's stage with a spare or re-places,
and — once every stage of the layout is loaded — wires the ring with one `reset` frame per
stage (new epoch, next stage's address, who may connect). It is also the ring's client: it
sends requests to stage 0 and checkpoints their tokens, so after any failure (or its own
restart) each open request is resent with the tokens it already has, which stage 0 replays.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from cellswarm.errors import BudgetError, ProtocolError, RequestError
from cellswarm.swarm.auth import load_token, new_nonce, verify
from cellswarm.swarm.frames import Frame, connect, read_frame, write_frame
from cellswarm.swarm.logs import JsonLog
from cellswarm.swarm.membership import Shard, layout_complete, part_nodes, repair, ring
from cellswarm.swarm.store import Node, NodeId, Request, Store

log = logging.getLogger("cellswarm.coordinator")

MAX_ATTEMPTS = 3  # per request, in total
NONCE_TTL_S = 30.0
CHECKPOINT_EVERY_S = 0.2
PEER_ID = "coordinator"  # how the coordinator names itself on the data plane


@dataclass(frozen=True)
class CoordinatorConfig:
    model: str
    db: str = "cellswarm.db"
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8470
    token_file: str | None = None  # without one, any node may join (a warning says so)
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    # A node failing this many steps in a row goes offline. Below MAX_ATTEMPTS on purpose: a
    # broken node is taken out while the requests it broke still have an attempt left.
    offline_after: int = 2
    probe_every_s: float = 2.0
    stages: int | None = None  # default: the fewest that fit the workers' budgets
    expert_nodes: int = 0  # part servers holding every MoE layer's routed experts
    vocab_nodes: int = 0  # part servers holding the embedding and head, split by rows
    context: int = 256  # tokens of KV cache a stage reserves per sequence
    max_sequences: int = 8  # sequences in flight a stage reserves KV cache for
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise RequestError(
                f"heartbeat timeout {self.heartbeat_timeout_s} s must exceed the heartbeat "
                f"interval {self.heartbeat_s} s"
            )


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.store = Store(config.db)
        self.token = load_token(config.token_file) if config.token_file else None
        self.nonces: dict[str, float] = {}  # nonce -> expiry; each is good for one proof
        self.layout: list[Shard] = json.loads(self.store.get_meta("layout", "[]"))
        self.epoch = self.store.next_epoch()  # a restart rewires whatever was there
        self.wired_epoch: int | None = None
        self.progress: dict[str, list[int]] = {}  # tokens so far of open requests
        self.dirty: set[str] = set()  # requests whose tokens are not checkpointed yet
        self.incoming: asyncio.Queue[str] = asyncio.Queue()
        self.wired = asyncio.Event()
        self.pulse = asyncio.Event()  # set and replaced whenever a request makes progress
        self.last_probe: dict[str, float] = {}
        self.log = JsonLog(config.log_dir, "coordinator")
        self._tokenizer: Any = None
        self._manifest: Any = None
        self.part_specs = self._part_specs()
        self.node_stats: dict[str, Any] = {}  # the latest stage stats each node reported
        self.problem = ""  # why nothing is placed, when nothing can be
        now = time.time()
        for n in self.store.nodes():  # a restart is not the nodes' fault: give them a grace
            self.store.update_node(n.node_id, last_seen_s=now)

    # -- joining ---------------------------------------------------------------------------

    def challenge(self) -> str:
        now = time.monotonic()
        self.nonces = {k: t for k, t in self.nonces.items() if t > now}
        nonce = new_nonce()
        self.nonces[nonce] = now + NONCE_TTL_S
        return nonce

    def join(self, node_id: str, nonce: str, proof: str, caps: dict[str, Any], host: str) -> str:
        """A session for a node that proved the cluster token over a fresh nonce."""
        expiry = self.nonces.pop(nonce, None)  # single use: a replayed proof finds no nonce
        if expiry is None or expiry < time.monotonic():
            raise PermissionError("unknown or used nonce: ask /v1/challenge for a fresh one")
        if self.token is not None and not verify(self.token, nonce, node_id, proof):
            self.log.event("join_denied", None, node=node_id)
            raise PermissionError("proof does not match the cluster token")
        if int(caps.get("memory_bytes") or 0) <= 0:
            raise RequestError("capabilities.memory_bytes must be a positive byte count")
        old = self.store.node(node_id)
        session, now = uuid.uuid4().hex, time.time()
        state = "offline" if old is not None and old.state == "offline" else "spare"
        node = Node(NodeId(node_id), state, session, caps, host, now, now)
        if old is not None:  # a re-join: it dropped whatever it served; keep its record
            node = replace(old, state=state, session=session, capabilities=caps, host=host,
                           last_seen_s=now, shard=None, data_port=None, ready=None)
        self.store.put_node(node)
        if old is not None and old.state == "assigned":
            self.unwire(f"{node_id} re-joined")
        self.log.event("join", None, node=node_id, memory_bytes=node.memory_bytes)
        return session

    def authenticate(self, node_id: str, session: str) -> Node:
        node = self.store.node(node_id)
        if node is None or node.session != session:
            raise PermissionError(f"node {node_id} has no such session: join again")
        return node

    # -- heartbeats and faults -------------------------------------------------------------

    def heartbeat(self, node: Node, beat: dict[str, Any]) -> dict[str, Any]:
        """Record what the node reports; answer with its shard and whether to run a probe."""
        changes: dict[str, Any] = {
            "last_seen_s": time.time(),
            "rss_bytes": int(beat.get("rss_bytes", 0)),
            "peak_rss_bytes": int(beat.get("peak_rss_bytes", 0)),
            "data_port": beat.get("data_port"),
            "ready": beat.get("ready"),
        }
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
        node = self.store.update_node(node.node_id, **changes)
        self.node_stats[node.node_id] = beat.get("stats")
        return {"shard": self._shard_for(node), "epoch": self.epoch, "probe": self._probe(node)}

    def _shard_for(self, node: Node) -> dict[str, Any] | None:
        if node.state != "assigned" or node.shard is None:
            return None
        c = self.config
        out = {**node.shard, "model": c.model, "context": c.context,
               "max_sequences": c.max_sequences}  # fmt: skip
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

    def fault(self, node: Node, kind: str, detail: str, epoch: int | None = None) -> None:
        """A stage failed a step ("forward"), or found the next stage gone ("next"). Only
        a fault in the current epoch counts: the steps in flight when the first one struck
        fail too, and are one failure, not several."""
        self.log.event("fault", None, node=node.node_id, kind=kind, detail=detail, epoch=epoch)
        if epoch is not None and epoch != self.epoch:
            return
        if kind == "next":
            return self._suspect_next(node)
        if kind == "part":  # a part server it calls broke the step: that one is suspect
            suspect = self.store.node(detail)
            if suspect is not None:
                self.lose(suspect, f"{node.node_id} could not reach it")
            else:
                self.unwire(f"{node.node_id} lost a part server")
            return
        failures = node.consecutive_failures + 1
        changes: dict[str, Any] = {"failures": node.failures + 1, "consecutive_failures": failures,
                                   "message": detail[:200]}  # fmt: skip
        if failures >= self.config.offline_after:
            changes.update(state="offline", shard=None,
                           message=f"offline after {failures} failures in a row: {detail[:160]}")
        self.store.update_node(node.node_id, **changes)
        self.unwire(f"{node.node_id} failed: {detail}")

    def _suspect_next(self, node: Node) -> None:
        nodes = ring(self.store.nodes())
        ids = [n.node_id for n in nodes]
        if node.node_id in ids:
            nxt = nodes[(ids.index(node.node_id) + 1) % len(nodes)]
            self.lose(nxt, f"{node.node_id} could not reach it")

    def lose(self, node: Node, why: str) -> None:
        if node.state not in ("assigned", "spare"):
            return
        self.store.update_node(node.node_id, state="lost", shard=None, data_port=None,
                               ready=None, message=why, failures=node.failures + 1)
        self.log.event("lost", None, node=node.node_id, why=why)
        log.warning("node %s lost: %s", node.node_id, why)
        if node.state == "assigned":
            self.unwire(f"{node.node_id} lost")

    def unwire(self, why: str) -> None:
        """The layout changed: a new epoch; stage frames of the old one are void."""
        self.epoch = self.store.next_epoch()
        self.wired_epoch = None
        self.wired.clear()
        self.log.event("unwire", None, epoch=self.epoch, why=why)

    # -- placement and wiring --------------------------------------------------------------

    def check_timeouts(self) -> None:
        now = time.time()
        for n in self.store.nodes():
            quiet_s = now - n.last_seen_s
            if n.state in ("assigned", "spare") and quiet_s > self.config.heartbeat_timeout_s:
                self.lose(n, f"no heartbeat for {quiet_s:.1f} s")

    def reconcile(self) -> None:
        nodes = self.store.nodes()
        layout, target = repair(nodes, self.layout, self._split, self.config.stages,
                                self.part_specs)  # fmt: skip
        if not target:
            self.problem = self._why_unplaced(nodes)
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
        placed = {k: v["layers"] for k, v in target.items() if v is not None}
        self.log.event("placed", None, layout=placed)
        self.unwire("new placement")

    def _why_unplaced(self, nodes: list[Node]) -> str:
        live = [n for n in nodes if n.state in ("spare", "assigned")]
        if not live:
            return "no live workers"
        try:
            self._split(len(live), min(n.memory_bytes for n in live))
        except BudgetError as exc:
            return str(exc)
        return ""

    def _split(self, stages: int, memory_bytes: int) -> list[tuple[int, int]]:
        from cellswarm.swarm.local import budget_split

        c = self.config
        return budget_split(c.model, stages, memory_bytes, c.context, c.max_sequences,
                            remote_experts=c.expert_nodes > 0, remote_vocab=c.vocab_nodes > 0)

    def _part_specs(self) -> list[dict[str, Any]]:
        """What each part server holds (addresses come at wiring time)."""
        from cellswarm.swarm.local import part_specs

        c = self.config
        n = c.expert_nodes + c.vocab_nodes
        specs = part_specs(c.model, c.expert_nodes, c.vocab_nodes, [0] * n) if n else []
        return [s.to_dict() for s in specs]

    async def wire(self) -> None:
        """Once every slot's node serves its shard: tell part servers who may call them,
        then each stage its epoch, the next stage's address and the part servers'."""
        nodes = self.store.nodes()
        live = [n for n in nodes if n.state in ("assigned", "spare")]
        if self.wired_epoch == self.epoch or not layout_complete(live):
            return
        stages, parts = ring(nodes), part_nodes(nodes)
        if not all(n.serving for n in [*stages, *parts]):
            return
        epoch = self.epoch
        callers = [PEER_ID, *(n.node_id for n in stages)]
        for node in parts:
            if not await self._reset(node, {"epoch": epoch, "peers": callers}):
                return self.lose(node, "did not answer its reset")
        addressed = [
            {**(n.shard or {})["spec"], "node_id": n.node_id, "host": n.host, "port": n.data_port}
            for n in parts
        ]
        for k, node in enumerate(stages):
            nxt, prev = stages[(k + 1) % len(stages)], stages[k - 1]
            fields = {"epoch": epoch, "next_host": nxt.host, "next_port": nxt.data_port,
                      "peers": [PEER_ID, prev.node_id], "parts": addressed}  # fmt: skip
            if not await self._reset(node, fields):
                return self.lose(node, "did not answer its reset")
        if self.epoch == epoch:
            self.wired_epoch = epoch
            self.wired.set()
            self.log.event("wired", None, epoch=epoch, ring=[n.node_id for n in stages],
                           parts=[n.node_id for n in parts])  # fmt: skip

    async def _reset(self, node: Node, fields: dict[str, Any]) -> bool:
        assert node.data_port is not None
        try:
            reader, writer = await asyncio.wait_for(
                connect(node.host, node.data_port, self.token, PEER_ID), 5.0
            )
            await write_frame(writer, Frame("reset", fields))
            answer = await asyncio.wait_for(read_frame(reader), 5.0)
            writer.close()
            return answer is not None and answer.type == "reset_done"
        except (OSError, TimeoutError, ConnectionError, ProtocolError):
            return False

    async def monitor(self) -> None:
        while True:
            try:
                self.check_timeouts()
                self.reconcile()
                await self.wire()
            except Exception:  # keep watching whatever one tick ran into
                log.exception("monitor tick failed")
            await asyncio.sleep(0.1)

    # -- requests --------------------------------------------------------------------------

    def submit(self, payload: dict[str, Any], request_id: str | None = None) -> Request:
        rid = request_id or uuid.uuid4().hex[:16]
        req, new = self.store.add_request(rid, payload)
        if new:
            self.incoming.put_nowait(rid)
            self.log.event("submitted", rid, prompt_tokens=len(payload["prompt"]))
        return req

    def tokens_of(self, req: Request) -> list[int]:
        return self.progress.get(req.request_id, req.tokens) if not req.terminal else req.tokens

    def _notify(self) -> None:
        self.pulse.set()
        self.pulse = asyncio.Event()

    async def drive(self) -> None:
        """Send open requests through the wired ring; on any break, wait for the next wiring
        and resend them (with their tokens so far, which stage 0 replays)."""
        while True:
            await self.wired.wait()
            epoch = self.epoch
            try:
                await self._round(epoch)
            except (OSError, ConnectionError, TimeoutError, ProtocolError) as exc:
                if self.epoch == epoch:
                    head = ring(self.store.nodes())
                    if head:
                        self.lose(head[0], f"its connection broke ({type(exc).__name__})")
            finally:
                self._checkpoint()
            await asyncio.sleep(0.02)

    async def _round(self, epoch: int) -> None:
        """One wiring's worth of work: keep up to the ring's capacity of requests in flight
        (the fewest sequences any stage has KV cache for), the rest queued, until a break."""
        stages = ring(self.store.nodes())
        head = stages[0]
        assert head.data_port is not None
        capacity = min(int(n.capabilities.get("max_sequences") or self.config.max_sequences)
                       for n in stages)  # fmt: skip
        reader, writer = await connect(head.host, head.data_port, self.token, PEER_ID)
        try:
            pending: deque[str] = deque(r.request_id for r in self.store.open_requests())
            inflight: set[str] = set()
            last = time.monotonic()
            while self.epoch == epoch:
                while not self.incoming.empty():
                    pending.append(self.incoming.get_nowait())
                while pending and len(inflight) < capacity:
                    req = self.store.request(pending.popleft())
                    fresh = req is not None and not req.terminal and req.request_id not in inflight
                    if fresh and req is not None and await self._send(writer, req):
                        inflight.add(req.request_id)
                try:
                    frame = await asyncio.wait_for(read_frame(reader), 0.05)
                except TimeoutError:
                    frame = None
                else:
                    if frame is None:
                        raise ConnectionError("stage 0 closed the connection")
                    self._on_frame(frame)
                    if frame.type in ("done", "error"):
                        inflight.discard(str(frame.fields.get("req", "")))
                if time.monotonic() - last > CHECKPOINT_EVERY_S:
                    self._checkpoint()
                    last = time.monotonic()
        finally:
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, req: Request) -> bool:
        """Send one attempt of a request (with the tokens it already has, to replay); False
        if its attempts are spent and it went to its terminal state instead."""
        rid = req.request_id
        attempts = self.store.start_attempt(rid)
        tokens = self.progress.setdefault(rid, list(req.tokens))
        if attempts > MAX_ATTEMPTS:
            self._finish(rid, "failed", f"failed {MAX_ATTEMPTS} times (the last after "
                         f"{len(tokens)} tokens); giving up")  # fmt: skip
            return False
        p = req.payload
        fields = {"req": rid, "max_tokens": p["max_tokens"], "sampling": p.get("sampling", {}),
                  "stop_ids": p.get("stop_ids", []), "replay": tokens}  # fmt: skip
        self.log.event("send", rid, attempt=attempts, replay=len(tokens), epoch=self.epoch)
        await write_frame(writer, Frame("generate", fields, np.asarray(p["prompt"], np.int64)))
        return True

    def _on_frame(self, frame: Frame) -> None:
        rid = str(frame.fields.get("req", ""))
        if frame.type == "token" and rid in self.progress:
            self.progress[rid].append(int(frame.fields["token"]))
            self.dirty.add(rid)
        elif frame.type == "done":
            self._finish(rid, "done", str(frame.fields["reason"]))
            with self.store.transaction():
                for n in ring(self.store.nodes()):
                    self.store.update_node(n.node_id, served=n.served + 1, consecutive_failures=0)
        elif frame.type == "error":
            self._finish(rid, "failed", str(frame.fields["message"]))
        self._notify()

    def _finish(self, rid: str, state: str, reason: str) -> None:
        tokens = self.progress.pop(rid, None)
        if tokens is None:
            req = self.store.request(rid)
            tokens = req.tokens if req else []
        self.dirty.discard(rid)
        self.store.finish(rid, state, reason, tokens)
        self.log.event("finished", rid, state=state, reason=reason, tokens=len(tokens))
        self._notify()

    def _checkpoint(self) -> None:
        if self.dirty:
            self.store.checkpoint({rid: self.progress[rid] for rid in self.dirty
                                   if rid in self.progress})  # fmt: skip
            self.dirty.clear()

    # -- views -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.time()
        nodes = [
            {"node_id": n.node_id, "state": n.state,
             "layers": n.shard.get("layers") if n.shard else None,
             "holds": describe(n.shard),
             "stage": n.shard.get("stage") if n.shard else None,
             "memory_bytes": n.memory_bytes, "rss_bytes": n.rss_bytes,
             "peak_rss_bytes": n.peak_rss_bytes, "last_seen_s_ago": round(now - n.last_seen_s, 2),
             "served": n.served, "failures": n.failures, "message": n.message,
             "profile": n.capabilities.get("profile"), "serving": n.serving,
             "stats": self.node_stats.get(n.node_id)}
            for n in self.store.nodes()
        ]  # fmt: skip
        return {"epoch": self.epoch, "wired": self.wired_epoch == self.epoch,
                "problem": self.problem,
                "model": Path(self.config.model).name, "nodes": nodes}  # fmt: skip

    def manifest(self) -> Any:
        """The model file's content id and chunk hashes, for workers that fetch their shard
        (hashed once, then cached by path, size and mtime)."""
        if self._manifest is None:
            from cellswarm.swarm.fetch import build_manifest

            self._manifest = build_manifest(self.config.model)
        return self._manifest

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from cellswarm.io.gguf_file import GGUFFile
            from cellswarm.io.tokenizer import Tokenizer

            meta = GGUFFile(self.config.model).metadata
            if "tokenizer.ggml.model" not in meta:
                raise RequestError(f"{self.config.model} has no tokenizer: send token ids")
            self._tokenizer = Tokenizer.from_gguf_metadata(meta)
        return self._tokenizer



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
