"""A replica's timing, taken from the planner: per-token time, per-node busy time, prefill.

Nothing here re-derives a formula: the per-token step comes from `cost.pipeline_decode`
(its total is the serial time of one token, its `node_busy_s` what each node spends on it),
prefill and replay from `cost.pipeline_prefill`, shard sizes from the placement's slots. What
is added: the calibration overheads of `SimParams`, and slow nodes (a node at speed s spends
busy/s on its part, so the token waits busy x (1/s - 1) longer and the bottleneck may move).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from cellswarm.planner import cost
from cellswarm.planner.inventory import ModelInventory
from cellswarm.planner.placement import Placement
from cellswarm.sim.params import SimParams


@dataclass(frozen=True)
class StepTiming:
    token_s: float  # one token through the replica, one sequence in flight (serial time)
    bottleneck_s: float  # the busiest node's time per token (pipelining cannot beat it)
    stages: int = 1
    # (token_s, bottleneck_s) of one pass of 2, 3, ... sequences (continuous batching)
    batched: tuple[tuple[float, float], ...] = ()
    # a lone sequence's speed-up from speculative decoding (planner/speculative.py
    # swarm_speedup at the workload's acceptance): `auto` drafts only for a ring's lone
    # sequence, since with others the ring's passes are full already
    lone_speedup: float = 1.0

    def interval(self, in_flight: int) -> float:
        """Seconds between two tokens of one sequence when `in_flight` are decoding: K in
        flight keep K stages busy until the busiest node is always busy, each stage stepping
        its share of them as one pass (the planner's `_pipelined_tokens_per_s`, per
        sequence, at `cost.batch_size`); one alone, its serial time over speculation's gain."""
        if in_flight <= 1:
            return self.token_s / self.lone_speedup
        b = min(cost.batch_size(in_flight, self.stages), len(self.batched) + 1)
        token_s, bottleneck_s = (self.token_s, self.bottleneck_s) if b == 1 else self.batched[b - 2]
        return max(token_s, in_flight * bottleneck_s / b)


class ReplicaModel:
    """The timing of one placed replica on nodes of one profile."""

    def __init__(
        self,
        inv: ModelInventory,
        placement: Placement,
        node: Any,
        opts: cost.CostOptions,
        params: SimParams,
        decode: cost.StepTime | None = None,
        one_box: bool = False,
        prefix_tokens: int = 0,
        lone_speedup: float = 1.0,
    ) -> None:
        """one_box: a tiered single machine (the planner's `tiers`): one node per replica,
        its decode given by the tier plan; prefill still from the placement's layers.
        prefix_tokens: every prompt starts with this many tokens the stages' prefix caches
        hold (a batch's shared instruction): a prefill computes the rest, attending to all.
        lone_speedup: StepTiming's (slow nodes keep it: a ring's gain, not a node's)."""
        self.inv, self.placement, self.node, self.opts = inv, placement, node, opts
        self.params, self.prefix_tokens = params, prefix_tokens
        self.decode = decode or cost.pipeline_decode(inv, placement, node, opts)
        self.nodes = 1 if one_box else placement.nodes_per_replica
        busy = np.asarray(self.decode.node_busy_s or (self.decode.total_s,), dtype=np.float64)
        self.stages, self.hops = (1, 0) if one_box else cost.serial_path(inv, placement)
        self.shard_bytes = [s.weight_bytes for s in placement.slots]
        if one_box:
            self.shard_bytes = [sum(self.shard_bytes)]
        floor = np.zeros_like(busy)
        if params.host_bytes_per_s > 0 and len(self.shard_bytes) == len(busy):
            floor = np.maximum(np.asarray(self.shard_bytes, np.float64)
                               / params.host_bytes_per_s - busy, 0.0)  # fmt: skip
        self.busy = busy + floor + params.step_overhead_s
        fixed = float(floor.sum()) + self.stages * params.step_overhead_s \
            + self.hops * params.hop_overhead_s  # fmt: skip
        # a pass of b sequences (decode given: a tiered box, which steps one at a time)
        passes = [] if decode is not None else [
            cost.pipeline_decode(inv, placement, node, opts, b)
            for b in range(2, cost.MAX_BATCH + 1)]  # fmt: skip
        self.batched = [(p.total_s + fixed, np.asarray(p.node_busy_s, np.float64) + floor
                         + params.step_overhead_s) for p in passes]  # fmt: skip
        self.base = StepTiming(self.decode.total_s + fixed, float(self.busy.max()), self.stages,
                               tuple((t, float(b.max())) for t, b in self.batched),
                               lone_speedup)  # fmt: skip
        self._prefill = lru_cache(maxsize=4096)(self._prefill_s)

    def timing(self, speeds: np.ndarray | None) -> StepTiming:
        """Per-position speed factors (1 = the profile) -> this replica's timing."""
        if speeds is None or bool(np.all(speeds >= 1.0)):
            return self.base
        stretched = self.busy / speeds
        extra = float((stretched - self.busy).sum())
        batched = tuple((t + float((b / speeds - b).sum()), float((b / speeds).max()))
                        for t, b in self.batched)  # fmt: skip
        return StepTiming(self.base.token_s + extra, float(stretched.max()), self.stages, batched,
                          self.base.lone_speedup)  # fmt: skip

    def prefill_s(self, tokens: int) -> float:
        """A prompt (or a replay: prompt + tokens so far) through the replica in one chunk."""
        return float(self._prefill(int(tokens)))

    def _prefill_s(self, tokens: int) -> float:
        step = cost.pipeline_prefill(self.inv, self.placement, self.node, self.opts, tokens,
                                     self.prefix_tokens)  # fmt: skip
        p = self.params
        return step.total_s + self.stages * p.step_overhead_s + self.hops * p.hop_overhead_s

    def load_s(self, position: int) -> float:
        """A spare fetching one position's shard over its own link."""
        return self.shard_bytes[position] / self.node.link_bytes_per_s

    def load_all_s(self, positions: Iterable[int]) -> float:
        """Shards fetched at once, each by its node over its own link: the slowest bounds
        them (a model whose fetches share one path adds them up instead)."""
        return max(map(self.load_s, positions), default=0.0)
