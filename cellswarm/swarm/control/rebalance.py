"""Placement by measured step times: a ring whose slowest stage is much slower than the
byte-balanced split assumed (a throttled CPU, a busy or older host) gets new layer ranges
over the same nodes, fewer layers on the slow one.

    stage stats (decode seconds / steps, per node) -> seconds per byte read, per node
    -> time_balanced_split (planner/placement.py) -> worth it? (predicted slowest step
    <= GAIN x measured) -> the coordinator stores the new layout, the nodes reload, the
    ring rewires

Decided once per layout: measured again after a rebalance, the ring is left as it is, so
noise cannot make it oscillate; a new placement (a node lost, a rejoin) starts over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cellswarm.planner.placement import StageCosts, time_balanced_split
from cellswarm.swarm.control.membership import bottleneck
from cellswarm.swarm.control.store import Node, whole_of
from cellswarm.swarm.protocol.jsonvalue import JsonObject

MIN_STEPS = 24  # decode steps each stage must have measured before anything is decided
STATUS_MIN_STEPS = MIN_STEPS // 2  # ... before status names a bottleneck (the first steps
# carry page faults and warm-up: a stage's first step is no measure of it)
NAMED_BEATS = 2  # ... and status must have named the bottleneck for this many heartbeat
# intervals: an operator sees why layers move before they do, even when a slow node's late
# beat carries it from too few steps to name straight past MIN_STEPS
GAIN = 0.75  # rebalance only when the slowest stage gets at least this much faster ...
SLOW = 2.0  # ... and some node this many times slower per byte read and per step than the
# median:
# nodes of one speed keep the byte-balanced split (their small differences are noise, and
# a reload costs the ring seconds)


@dataclass(frozen=True)
class RingTimes:
    nodes: tuple[Node, ...]  # in ring order
    step_s: tuple[float, ...]  # measured seconds per decode step, per stage

    def bottleneck(self) -> JsonObject:
        k, ratio = bottleneck(self.step_s)
        return {"node_id": self.nodes[k].node_id, "stage": k,
                "step_ms": round(1000 * self.step_s[k], 3), "times_median": round(ratio, 2),
                "steps_ms": [round(1000 * s, 3) for s in self.step_s]}  # fmt: skip


def ring_times(ring: Sequence[Node], stats: Mapping[str, Mapping[str, object] | None],
               min_steps: int = 1) -> RingTimes | None:  # fmt: skip
    """Each stage's measured step time, when every stage has reported at least `min_steps`
    decode steps of the layers it holds now (a stage's counters start with its shard)."""
    steps = []
    for n in ring:
        s = stats.get(n.node_id) or {}
        layers = list(n.shard.layers or ()) if n.shard else []
        if s.get("layers") != layers or whole_of(s, "decode_steps") < max(min_steps, 1):
            return None
        steps.append(seconds_of(s, "decode_s", None) / whole_of(s, "decode_steps"))
    return RingTimes(tuple(ring), tuple(steps)) if ring else None


def seconds_of(stats: Mapping[str, object] | None, key: str,
               default: float | None = 0.0) -> float:
    """A number of a node's stats as a float: `default` when it lacks it or it is 0 (None:
    a KeyError when it lacks it)."""
    stats = stats or {}
    value = stats[key] if default is None else stats.get(key) or default
    if not isinstance(value, int | float | str):
        raise TypeError(f"stat {key} is {type(value).__name__}, not a number")
    return float(value)


def named_long_enough(first_named_s: float | None, now_s: float, beat_s: float) -> bool:
    """Whether status has named this layout's bottleneck (since `first_named_s`, monotonic)
    for NAMED_BEATS heartbeat intervals."""
    return first_named_s is not None and now_s - first_named_s >= NAMED_BEATS * beat_s


def plan(times: RingTimes, costs: StageCosts, gain: float = GAIN) -> list[tuple[int, int]] | None:
    """New layer ranges for the ring, or None when no node is much slower than the others
    (SLOW), the current ranges are as good (within `gain`) or nothing else fits."""
    ranges = [n.shard.layers for n in times.nodes if n.shard and n.shard.layers]
    last = len(ranges) - 1
    pairs = enumerate(zip(ranges, times.step_s, strict=True))
    per_byte = [t / max(costs.read(lo, hi, k == last), 1) for k, ((lo, hi), t) in pairs]
    # slow per byte AND slow per step: a stage of one small layer is slow per byte only
    # because a step has a fixed cost (Python, framing) that its few bytes do not amortize
    median_byte = sorted(per_byte)[len(per_byte) // 2]
    median_step = sorted(times.step_s)[len(times.step_s) // 2]
    if not any(b >= SLOW * median_byte and t >= SLOW * median_step
               for b, t in zip(per_byte, times.step_s, strict=True)):  # fmt: skip
        return None
    budgets = [n.memory_bytes for n in times.nodes]

    def fits(k: int, lo: int, hi: int) -> bool:
        return costs.held(lo, hi, k == 0, k == last) <= budgets[k]

    split = time_balanced_split(len(costs.weights), costs.read, per_byte, fits)
    if split is None or split == [tuple(r) for r in ranges]:
        return None
    predicted = max(per_byte[k] * costs.read(lo, hi, k == last) for k, (lo, hi) in enumerate(split))
    return split if predicted <= gain * max(times.step_s) else None
