"""Heartbeats and faults: what a node's typed beat changes (its record, its clock, its
stats, a probe's or doctor round's answer), its answer (its shard, the epoch, whether the
ring is wired); a node silent past the timeout is lost; and what a fault costs the node
and the job it struck."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import replace

import msgspec

from cellswarm.errors import StorageFullError
from cellswarm.swarm.control.membership import ring
from cellswarm.swarm.control.placing import Placing
from cellswarm.swarm.control.state import Beat
from cellswarm.swarm.control.store import Node, whole_of
from cellswarm.swarm.policy import nodes as health
from cellswarm.swarm.protocol.jsonvalue import JsonObject
from cellswarm.swarm.protocol.messages import Assignment, Heartbeat, HeartbeatAnswer, encode
from cellswarm.swarm.transport.wire import port

log = logging.getLogger("cellswarm.coordinator")

class Liveness(Placing):
    """Heartbeats, faults, losses and strikes (a part of Coordinator)."""


    def heartbeat(self, node: Node, beat: Heartbeat) -> dict[str, object]:
        """Record what the node reports; answer with its shard and whether to run a probe.

        What changes every beat (when it was seen, its memory) is kept in memory; the
        database is written when something else changed, or when the row's last_seen_s is
        a third of the timeout old (so a leader elsewhere, reading the database, still sees
        the node alive). A beat is otherwise no write: an fsync per heartbeat per node was
        most of an idle coordinator's work."""
        now = time.time()
        live = Beat(now, beat.rss_bytes, beat.peak_rss_bytes, now)
        changes: dict[str, object] = {"data_port": port(beat.data_port, "data_port"),
                                   "ready": beat.ready}  # fmt: skip
        if beat.data_host:  # what the node advertises; else the address it came from
            changes["host"] = beat.data_host
        if beat.clock_offset_s is not None:  # the node's estimate of our clock - its
            self.node_clock[node.node_id] = (beat.clock_offset_s, beat.clock_error_s or 0.0)
        if beat.max_sequences:  # what its KV cache was sized for
            changes["capabilities"] = {**node.capabilities, "max_sequences": beat.max_sequences}
        if node.state == "lost":  # it is back; whatever it held went to someone else
            changes.update(state="spare", shard=None, message="")
        if beat.refused and node.state == "assigned":
            changes.update(state="refused", shard=None, message=beat.refused)
            self.unwire(f"{node.node_id} refused its shard")
        if node.state == "offline" and beat.probe_ok is not None:
            if beat.probe_ok:
                back, _ = health.apply(node.health, health.ProbePassed())
                changes.update(state="spare", consecutive_failures=back.consecutive_failures,
                               message="passed its probe")  # fmt: skip
            else:
                changes.update(message=f"failed its probe: {beat.probe_error or ''}")
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
        # encode's JSON builtins (to_builtins), kept as the JSON status shows
        self.node_stats[node.node_id] = (msgspec.to_builtins(beat.stats)
                                         if beat.stats is not None else None)  # fmt: skip
        if beat.metrics_port:
            self.metrics_ports[node.node_id] = beat.metrics_port
        if beat.check is not None:
            self.checkups.take(node.node_id, beat.check)
        epoch = self.epoch
        return encode(HeartbeatAnswer(
            shard=self._shard_for(node), epoch=epoch, probe=self._probe(node),
            wired=self.wired_epoch == epoch, lease_s=self.config.lease_s, now_s=time.time(),
            check=self.checkups.ask(node.node_id), heartbeat_s=self.heartbeat_interval_s(),
            problem=self.problem))  # fmt: skip

    def metrics_targets(self) -> list[JsonObject]:
        """Prometheus' HTTP service discovery: one group per node that said where its
        /metrics is, labelled by its id alone — stable while its state changes (a state
        label split one worker's series in two), and kept once it is lost, so that
        `up == 0` fires for it (its state is `cellswarm_node_state` on /metrics)."""
        out: list[JsonObject] = []
        for n in sorted(self.store.nodes(), key=lambda n: n.node_id):
            port = self.metrics_ports.get(n.node_id)
            if port:
                host = f"[{n.host}]" if ":" in n.host else n.host
                out.append({"targets": [f"{host}:{port}"],
                            "labels": {"job": "cellswarm-worker", "node": str(n.node_id)}})
        return out

    def _shard_for(self, node: Node) -> Assignment | None:
        if node.state != "assigned" or node.shard is None:
            return None
        # a stage is told what it does not hold (its part servers); addresses come on wiring
        parts = ([h.at(f"part-{j}", "", 0) for j, h in enumerate(self.part_specs)]
                 if node.shard.role == "stage" else [])  # fmt: skip
        return Assignment(shard=node.shard, model=self.config.model, context=self.context,
                          max_sequences=self.sequences, cache_type=self.config.cache_type,
                          parts=parts)  # fmt: skip

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
        replica = str(node.replica)
        return job is not None and job.state == "leased" and job.lease_replica == replica

    def _charge(self, node: Node, detail: str) -> None:
        """A failure that is the node's own: offline after `offline_after` in a row."""
        after, effects = health.apply(node.health, health.Charged(detail),
                                      self.config.offline_after)  # fmt: skip
        changes: dict[str, object] = {"failures": after.failures, "message": detail[:200],
                                   "consecutive_failures": after.consecutive_failures}  # fmt: skip
        for taken in effects:
            changes.update(state="offline", shard=None, message=taken.message)
        self.store.update_node(node.node_id, **changes)
        self.unwire(f"{node.node_id} failed: {detail}")

    def _suspect_next(self, node: Node) -> None:
        nodes = ring(self.placed(), node.replica)
        ids = [n.node_id for n in nodes]
        if node.node_id in ids:
            nxt = nodes[(ids.index(node.node_id) + 1) % len(nodes)]
            self.lose(nxt, f"{node.node_id} could not reach it")

    def check_timeouts(self) -> None:
        """Nodes silent past the timeout are lost. From the heartbeats held in memory (the
        rows' last_seen_s may be old by design): a dict lookup per node, no row copied.
        Walked a quarter of an interval apart (every tick in a small swarm; at 100,000 nodes
        every ~6 s, not 4 times a second: the walk was most of the coordinator's time), so
        a silent node is lost at most that much after its timeout. Silence is counted only
        while this coordinator was listening (policy/nodes.py silence_s): each tick notes
        how long since the last one."""
        now, timeout = time.time(), self.heartbeat_timeout_s()
        self.deaf, self._ticked_s = health.deaf_spells(self.deaf, self._ticked_s, now), now
        if now - self._timeouts_checked_s < self.heartbeat_interval_s() / 4:
            return
        self._timeouts_checked_s = now
        for n in self.store.nodes():
            if n.state not in ("assigned", "spare"):
                continue
            beat = self.beats.get(n.node_id)
            seen_s = max(n.last_seen_s, beat.seen_s if beat else 0.0)
            quiet_s = health.silence_s(seen_s, now, self.deaf)  # not while we were deaf
            if quiet_s > timeout:
                self.lose(self.live(n), f"no heartbeat for {quiet_s:.1f} s")

    def lose(self, node: Node, why: str) -> None:
        if node.state not in ("assigned", "spare"):
            return
        after, _ = health.apply(node.health, health.Lost(why), self.config.offline_after)
        self.store.update_node(node.node_id, state="lost", shard=None, data_port=None,
                               ready=None, message=why, failures=after.failures)
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
        replica = str(node.replica)
        self.homes.forget(replica)  # its new member starts with an empty prefix cache
        wired = self.wired_epoch
        if self.struck.get(replica) != wired:
            self.struck[replica] = wired
            self._strike_replica(replica, why, wired)
        if not (node.shard and node.shard.stage):
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


def oom_message(before: Mapping[str, object], now: Mapping[str, object]) -> str:
    """Why a node came back, when its memory cgroup counts an OOM kill it did not have
    before: the kernel killed its last process for going over the limit."""
    kills, seen = whole_of(now, "oom_kills"), whole_of(before, "oom_kills")
    if kills <= seen:
        return ""
    limit = now.get("cgroup_limit_bytes")
    where = (f"its cgroup limit of {whole_of(now, 'cgroup_limit_bytes'):,} bytes" if limit
             else "its memory limit")  # fmt: skip
    return (f"killed by the kernel for memory ({kills - seen} OOM kill(s) over {where}; "
            f"its --memory is {whole_of(now, 'memory_bytes'):,}): lower --memory")
