"""Joining: challenges, a node's proof over a single-use nonce, its protocol version and then
its typed capabilities; sessions, and the sealed beats' keys (NATS)."""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import replace

import msgspec

from cellswarm.errors import RequestError
from cellswarm.swarm.auth import RESERVED_IDS, digest, verify
from cellswarm.swarm.control.liveness import Liveness, oom_message
from cellswarm.swarm.control.state import Beat
from cellswarm.swarm.control.store import Node, NodeId
from cellswarm.swarm.protocol import VersionMismatch, check_version
from cellswarm.swarm.protocol.jsonvalue import JsonObject
from cellswarm.swarm.protocol.messages import Capabilities, HeartbeatAnswer, decode, encode
from cellswarm.swarm.transport.beats import beat_key, holds, seal
from cellswarm.units import format_bytes

log = logging.getLogger("cellswarm.coordinator")


class Joining(Liveness):
    """Challenges, joins and sessions (a part of Coordinator)."""


    def challenge(self, address: str = "127.0.0.1") -> str:
        return self.challenges(1, address)[0]

    def challenges(self, count: int, address: str = "127.0.0.1") -> list[str]:
        """`count` fresh nonces for a caller at `address` (nonces.py: stateless, rate-limited
        per address)."""
        return self.nonces.issue(count, address, time.monotonic())

    def join_many(self, joins: list[object], host: str) -> list[JsonObject]:
        """A rack's joins in one transaction (one commit, not one each: 100,000 joins one
        by one were ~300 a second on SQLite). Each proves the token over its own nonce and
        gets its own session or its own error; `host` is the relay's address, used for a
        join that does not say its own."""
        answers: list[JsonObject] = []
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

    def join(self, node_id: str, nonce: str, proof: str, caps: dict[str, object],
             host: str) -> str:  # fmt: skip
        """A session for a node that proved the cluster token over a fresh nonce."""
        now_s = time.monotonic()
        if node_id in RESERVED_IDS:  # the data plane's names for the coordinator and clients
            raise RequestError(f"node id {node_id!r} is reserved; start the worker with "
                               "another --node-id")  # fmt: skip
        if not self.nonces.good(nonce, now_s):  # single use: a replayed proof finds it spent
            raise PermissionError("unknown, expired or used nonce: ask /v1/challenge for a "
                                  "fresh one")  # fmt: skip
        if self.token is not None and not verify(self.token, nonce, node_id, proof):
            self.log.event("join_denied", None, worker=node_id)
            raise PermissionError("proof does not match the cluster token")
        self.nonces.spend(nonce, now_s)  # only a proof that held spends one (nonces.py)
        check_version(caps.get("protocol"), node_id)  # after the proof: strangers learn none
        have = decode(Capabilities, caps)  # only then its fields: typed, or refused
        if have.memory_bytes <= 0:
            raise RequestError("capabilities.memory_bytes must be a positive byte count")
        old = self.store.node(node_id)
        bound = digest(have.binding) if have.binding else None
        held = old.capabilities.get("binding") if old is not None else None
        # the id's node still alive (heard within the timeout, not lost): only it re-joins
        alive = old is not None and old.state != "lost" and \
            time.time() - self.live(old).last_seen_s < self.heartbeat_timeout_s()  # fmt: skip
        if held and bound != held and alive:
            self.log.event("join_denied", None, worker=node_id, why="binding")
            raise PermissionError(f"node id {node_id!r} is another node's (this one does not hold "
                                  "its key, kept in that node's home): start this worker with "
                                  "another --node-id")  # fmt: skip
        caps = encode(msgspec.structs.replace(have, binding=bound))
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

    def authenticate_sealed(self, beat: Mapping[str, object], mac: str,
                            raw: bytes) -> tuple[Node, bytes, int]:  # fmt: skip
        """The node of a sealed NATS beat (transport/beats.py), its beat key and sequence
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

    def held_sealed(self, env: Mapping[str, object], mac: str, raw: bytes) -> bytes | None:
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

    def _held(self) -> dict[str, object]:
        return encode(HeartbeatAnswer(held=True, now_s=time.time(),
                                      heartbeat_s=self.heartbeat_interval_s()))  # fmt: skip

    def held_answer(self, node_id: str, session: str) -> dict[str, object] | None:
        """A heartbeat's answer while the core thread is busy (from the event loop: no
        database): "heard you, nothing new" for a node whose session was good last time,
        so a slow fsync or placement pass never makes a node give up on its coordinator;
        the beat itself is recorded when the core gets to it. None for anyone else."""
        kept = self.sessions.get(node_id)
        if kept is None or not hmac.compare_digest(kept, digest(session)):
            return None
        return self._held()
