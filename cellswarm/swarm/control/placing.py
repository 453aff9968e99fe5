"""Placement: the nodes as placement sees them, how often they beat (by the swarm's size),
the layout over the live ones (membership.py's pure functions, the planner's splits), the
context and sequences it serves, and a rebalance by measured step times."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import msgspec

from cellswarm.errors import BudgetError
from cellswarm.planner.placement import StageCosts, balanced_layers, fit_context, fits, too_long
from cellswarm.swarm.control import rebalance
from cellswarm.swarm.control.election import Election
from cellswarm.swarm.control.membership import (
    Shard,
    dump_layout,
    load_layout,
    repair,
    ring,
)
from cellswarm.swarm.control.store import Node, NodeId
from cellswarm.swarm.protocol.messages import PartHolding
from cellswarm.swarm.ring.costs import costs_at

log = logging.getLogger("cellswarm.coordinator")


class Placing(Election):
    """Liveness timeouts, placement and rebalancing (a part of Coordinator)."""


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
        self.layout = load_layout(layout_text)
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
            self.store.set_meta("layout", dump_layout(layout))
            self.store.set_meta("sequences", str(sequences))
        placed = {k: list(v.layers or (0, 0)) for k, v in target.items() if v is not None}
        self.log.event("placed", None, layout=placed, context=self.context, sequences=sequences)
        shown = ", ".join(f"{k} {v[0]}..{v[1] - 1}" for k, v in list(placed.items())[:8])
        more = f" and {len(placed) - 8} more" if len(placed) > 8 else ""
        log.info("placed the model on %d nodes (%s%s), %d sequences of %d tokens",
                 len(placed), shown, more, sequences, self.context)  # fmt: skip
        self.unwire("new placement")

    def _repair(self, nodes: list[Node]
                ) -> tuple[list[Shard], dict[NodeId, Shard | None], int]:  # fmt: skip
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
        self._context = context
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
            self._costs_at = costs_at(c.model, c.expert_nodes > 0, c.vocab_nodes > 0,
                                      c.cache_type, c.draft)  # fmt: skip
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
        key = dump_layout(self.layout)
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
        layout = list(self.layout)
        with self.store.transaction():
            for node, (lo, hi) in zip(times.nodes, split, strict=True):
                assert node.shard is not None  # a stage of the ring
                shard = msgspec.structs.replace(node.shard, layers=(lo, hi))
                self.store.update_node(node.node_id, shard=shard)
                layout[shard.slot] = shard
            self.layout = layout
            self.store.set_meta("layout", dump_layout(layout))
            self.store.set_meta("rebalance_decided", dump_layout(layout))
        why = (f"rebalanced by measured step times {times.bottleneck()['steps_ms']} ms: "
               f"layers {[list(r) for r in split]}")  # fmt: skip
        self.log.event("rebalanced", None, steps_ms=times.bottleneck()["steps_ms"],
                       layers=[list(r) for r in split])  # fmt: skip
        log.warning(why)
        self.unwire(why)

    def _part_specs(self) -> list[PartHolding]:
        """What each part server holds (addresses come at wiring time)."""
        from cellswarm.swarm.ring.costs import part_specs

        c = self.config
        n = c.expert_nodes + c.vocab_nodes
        specs = part_specs(c.model, c.expert_nodes, c.vocab_nodes, [0] * n) if n else []
        return [s.holding() for s in specs]
