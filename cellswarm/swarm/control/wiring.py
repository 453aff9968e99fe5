"""Wiring and the monitor: a `reset` frame to each stage of a placed ring with the new epoch
and its neighbours' addresses; the core thread every state change runs on; the leader's
tick (timeouts, placement, wiring, lease expiry)."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ParamSpec, TypeVar

import msgspec

from cellswarm.errors import StorageFullError, SwarmError
from cellswarm.swarm.auth import NO_TOKEN, new_link_key, node_key, seal_key
from cellswarm.swarm.control import rebalance
from cellswarm.swarm.control.joining import Joining
from cellswarm.swarm.control.membership import layout_complete, part_nodes, replicas, ring
from cellswarm.swarm.control.state import PEER_ID
from cellswarm.swarm.control.store import Node
from cellswarm.swarm.protocol.dataplane import PartAddress, PartReset, Reset
from cellswarm.swarm.ring.frames import reset_stage

log = logging.getLogger("cellswarm.coordinator")

T = TypeVar("T")
P = ParamSpec("P")
# The leader's watch (timeouts, placement, wiring, lease expiry): 4 a second reacts well
# within a heartbeat timeout; 10 a second was a third of an idle coordinator's CPU.
MONITOR_TICK_S = 0.25


# A step that runs longer than this (heartbeats say so) is a stuck node, not a slow one: the
# longest honest step — a 512-position prefill chunk of a big shard on a slow node — is
# seconds to a minute
STUCK_STEP_S = 300.0


class Wiring(Joining):
    """Wiring rings and the monitor loop (a part of Coordinator)."""

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
        if not layout_complete(live, self.layout):
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
        links = deal_links(epoch, stages, parts, self.token or NO_TOKEN)
        for node in parts:
            if not await self._reset(node, links.part_reset(node)):
                await self.on_core(self.lose, node, "did not answer its reset")
                return False
        for k in reversed(range(len(stages))):
            if not await self._reset(stages[k], links.stage_reset(k)):
                await self.on_core(self.lose, stages[k], "did not answer its reset")
                return False
        return True

    async def _reset(self, node: Node, reset: Reset | PartReset) -> bool:
        assert node.data_port is not None
        if self.epoch != reset.epoch:  # a newer epoch (maybe a newer leader's): stop;
            return True  # a stale reset must never take a stage back to an older epoch
        key = node_key(self.token or NO_TOKEN, node.session)
        return await reset_stage(node.host, node.data_port, reset, key, PEER_ID, tls=self.tls)

    async def on_core(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on the core thread, awaited. Every database write and
        placement pass runs there, one at a time, so the event loop that receives heartbeats
        never waits on an fsync or a placement; and the calls run in arrival order, so a beat
        that came while the core was busy is recorded before the next timeout check looks."""
        return await asyncio.get_running_loop().run_in_executor(
            self.core, functools.partial(fn, *args, **kwargs))  # fmt: skip

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
            running_s = rebalance.seconds_of(self.node_stats.get(n.node_id), "running_s")
            if running_s > STUCK_STEP_S:
                self.lose(n, f"one step running for {running_s:.0f} s: stuck")
            elif running_s > 0 and n.shard is not None and n.shard.role == "stage":
                self.queue.extend_replica(str(n.shard.replica))


@dataclass(frozen=True)
class Links:
    """One wiring of a ring: a fresh key for each link (stage k -> k + 1, every stage -> each
    of its part servers), dealt to both ends in their resets, sealed to each under its own
    node key (swarm/auth.py; without a cluster token, a loopback swarm, under auth.NO_TOKEN)."""

    epoch: int
    stages: list[Node]
    parts: list[Node]
    token: bytes  # the cluster token (auth.NO_TOKEN without one)
    ring_keys: list[bytes]  # [k]: stage k -> stage k + 1
    part_keys: dict[tuple[str, str], bytes]  # (stage id, part id) -> key

    def _seal(self, to: Node, label: str, key: bytes) -> str:
        return seal_key(node_key(self.token, to.session), f"{self.epoch}|{label}", key)

    def part_reset(self, part: Node) -> PartReset:
        callers = [str(s.node_id) for s in self.stages]
        keys = {s: str(self._seal(part, s, self.part_keys[(s, part.node_id)])) for s in callers}
        return PartReset(epoch=self.epoch, keys=keys)

    def stage_reset(self, k: int) -> Reset:
        node, n = self.stages[k], len(self.stages)
        nxt, prev = self.stages[(k + 1) % n], self.stages[k - 1]
        parts = [msgspec.structs.replace(part_address(p), key=self._seal(
                     node, p.node_id, self.part_keys[(node.node_id, p.node_id)]))
                 for p in self.parts]  # fmt: skip
        return Reset(
            epoch=self.epoch, next_host=nxt.host, next_port=nxt.data_port, parts=parts,
            prev=prev.node_id, prev_key=self._seal(node, "prev", self.ring_keys[k - 1]),
            next_key=self._seal(node, "next", self.ring_keys[k]),
        )  # fmt: skip


def deal_links(epoch: int, stages: list[Node], parts: list[Node], token: bytes) -> Links:
    """A wiring's keys: new ones every epoch, so a node dropped from a ring holds none that
    still open a link."""
    return Links(epoch, stages, parts, token, [new_link_key() for _ in stages],
                 {(s.node_id, p.node_id): new_link_key() for s in stages for p in parts})


def part_address(node: Node) -> PartAddress:
    """A part server's holding (its shard's spec) and where it listens, as its stages are
    told in the wiring's reset (ring/parts.py: PartSpec.from_wire)."""
    shard = node.shard
    if shard is None or shard.spec is None or node.data_port is None:
        raise SwarmError(f"part node {node.node_id} holds no part or has no port: a bug")
    return shard.spec.at(node.node_id, node.host, node.data_port)
