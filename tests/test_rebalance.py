"""Placement by measured step times (swarm/control/rebalance.py,
planner/placement.time_balanced_split): pure functions, checked with tables."""

from __future__ import annotations

import itertools
import random

import pytest

from cellswarm.planner.placement import StageCosts, cost_balanced_split, time_balanced_split
from cellswarm.swarm.control.membership import bottleneck
from cellswarm.swarm.control.rebalance import RingTimes, named_long_enough, plan, ring_times
from cellswarm.swarm.control.store import Node, NodeId
from cellswarm.swarm.protocol.messages import Shard


def _read(weights: list[int], head: int = 0):  # type: ignore[no-untyped-def]
    return lambda lo, hi, last: sum(weights[lo:hi]) + (head if last else 0)


def _always(k: int, lo: int, hi: int) -> bool:
    return True


@pytest.mark.parametrize(
    ("weights", "head", "speeds", "expected"),
    [
        ([1] * 12, 0, [1, 1, 1], [(0, 4), (4, 8), (8, 12)]),  # equal nodes: equal shares
        ([1] * 12, 0, [1, 5, 1], [(0, 6), (6, 7), (7, 12)]),  # a 5x slower middle node
        ([1] * 12, 0, [1, 1, 2], [(0, 5), (5, 10), (10, 12)]),  # a 2x slower last
        ([1] * 12, 6, [1, 1, 1], [(0, 7), (7, 11), (11, 12)]),  # the head weighs 6 layers
        ([4, 1, 1, 1, 1, 4], 0, [1, 1], [(0, 3), (3, 6)]),  # uneven layers
        ([1, 1], 0, [1, 100], [(0, 1), (1, 2)]),  # every stage keeps a layer
    ],
)
def test_time_balanced_split(
    weights: list[int], head: int, speeds: list[float], expected: list[tuple[int, int]]
) -> None:
    assert time_balanced_split(len(weights), _read(weights, head), speeds, _always) == expected


def test_memory_limits_what_a_fast_node_may_take() -> None:
    # node 0 is 10x faster but holds at most 3 layers
    split = time_balanced_split(8, _read([1] * 8), [0.1, 1.0],
                                lambda k, lo, hi: k != 0 or hi - lo <= 3)  # fmt: skip
    assert split == [(0, 3), (3, 8)]
    assert time_balanced_split(8, _read([1] * 8), [1, 1], lambda k, lo, hi: hi - lo <= 3) is None
    assert time_balanced_split(2, _read([1, 1]), [1, 1, 1], _always) is None  # more stages


def test_the_slack_is_shared_not_left_on_the_last_stages() -> None:
    # 12 layers on 5 equal stages: 3 at most (the slowest), and then 3 3 2 2 2, not the
    # greedy fill's 3 3 3 2 1; a head of 2 layers' weight: its stage keeps 1 layer
    def cost(head: int):  # type: ignore[no-untyped-def]
        return lambda k, lo, hi, last: hi - lo + (head if last else 0)

    assert cost_balanced_split(12, 5, cost(0)) == [(0, 3), (3, 6), (6, 8), (8, 10), (10, 12)]
    assert cost_balanced_split(12, 4, cost(2)) == [(0, 4), (4, 8), (8, 11), (11, 12)]


def test_the_split_is_the_fastest_and_then_the_most_even_of_all() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 8)
        _against_every_split(rng, n, rng.randint(1, n))


def _against_every_split(rng: random.Random, n: int, stages: int) -> None:
    """cost_balanced_split against all splits of n layers into `stages`: the least slowest
    stage, and of those, the least sum of squared stage times (random weights, head, node
    speeds and room)."""
    weights = [rng.choice([0.5, 1, 1, 2, 3, 5]) for _ in range(n)]
    head, speed = rng.choice([0, 1, 4]), [rng.choice([0.3, 1, 1, 2, 5]) for _ in range(stages)]
    room = [rng.choice([3, 5, n]) for _ in range(stages)]

    def cost(k: int, lo: int, hi: int, last: bool) -> float:
        return speed[k] * (sum(weights[lo:hi]) + (head if last else 0))

    def fits(k: int, lo: int, hi: int) -> bool:
        return hi - lo <= room[k]

    def times(split: list[tuple[int, int]]) -> list[float]:
        return [cost(k, lo, hi, k == stages - 1) for k, (lo, hi) in enumerate(split)]

    every = [list(itertools.pairwise((0, *cuts, n)))
             for cuts in itertools.combinations(range(1, n), stages - 1)]  # fmt: skip
    every = [s for s in every if all(fits(k, lo, hi) for k, (lo, hi) in enumerate(s))]
    split = cost_balanced_split(n, stages, cost, fits)
    if not every:
        assert split is None
        return
    assert split is not None
    fastest = min(max(times(s)) for s in every)
    assert max(times(split)) == pytest.approx(fastest, rel=1e-9)
    even = min(sum(t * t for t in times(s)) for s in every
               if max(times(s)) <= fastest * (1 + 1e-9))  # fmt: skip
    assert sum(t * t for t in times(split)) == pytest.approx(even, rel=1e-9)


@pytest.mark.parametrize(
    ("steps", "slowest", "ratio"),
    [([1.0, 1.0, 1.0], 0, 1.0), ([1.0, 5.0, 1.0], 1, 5.0), ([2.0, 1.0, 1.0, 1.0], 0, 2.0)],
)
def test_bottleneck(steps: list[float], slowest: int, ratio: float) -> None:
    assert bottleneck(steps) == (slowest, pytest.approx(ratio))


def _node(name: str, layers: tuple[int, int], memory: int = 1 << 30) -> Node:
    shard = Shard(slot=int(name[1:]), n=3, role="stage", layers=layers)
    return Node(NodeId(name), "assigned", "s", {"memory_bytes": memory}, "h", 0.0, 0.0, shard)


COSTS = StageCosts(weights=(10,) * 12, kv=0, fixed=0, ends=(0, 0))


def test_a_slow_node_gets_fewer_layers_once_measured() -> None:
    ring = [_node("n0", (0, 4)), _node("n1", (4, 8)), _node("n2", (8, 12))]
    stats = {"n0": {"layers": [0, 4], "decode_steps": 30, "decode_s": 30 * 0.004},
             "n1": {"layers": [4, 8], "decode_steps": 30, "decode_s": 30 * 0.020},
             "n2": {"layers": [8, 12], "decode_steps": 30, "decode_s": 30 * 0.004}}  # fmt: skip
    times = ring_times(ring, stats, min_steps=24)
    assert times is not None and times.bottleneck()["node_id"] == "n1"
    assert plan(times, COSTS) == [(0, 6), (6, 7), (7, 12)]
    assert ring_times(ring, stats, min_steps=31) is None  # not measured enough yet
    stale = {**stats, "n1": {**stats["n1"], "layers": [4, 9]}}  # from another shard
    assert ring_times(ring, stale) is None


def test_nothing_moves_when_the_gain_is_small_or_memory_forbids() -> None:
    ring = [_node("n0", (0, 6)), _node("n1", (6, 12))]
    even = RingTimes(tuple(ring), (0.0060, 0.0066))
    assert plan(even, COSTS) is None  # 10% apart: not worth a reload
    lopsided = [_node("n0", (0, 4)), _node("n1", (4, 12))]
    assert plan(RingTimes(tuple(lopsided), (0.004, 0.008)), COSTS) is None  # same speed/byte
    small = [_node("n0", (0, 1)), _node("n1", (1, 12))]  # slow per byte, fast per step: a
    assert plan(RingTimes(tuple(small), (0.002, 0.011)), COSTS) is None  # step's fixed cost
    tight = [_node("n0", (0, 6), memory=60), _node("n1", (6, 12), memory=60)]
    assert plan(RingTimes(tuple(tight), (0.002, 0.02)), COSTS) is None  # cannot take more


@pytest.mark.parametrize(
    ("first_named_s", "now_s", "beat_s", "ready"),
    [
        (None, 100.0, 0.5, False),  # status never named a bottleneck under this layout
        (100.0, 100.0, 0.5, False),  # named at this very tick (a late beat jumped past 24)
        (100.0, 100.9, 0.5, False),  # named for less than two beats
        (100.0, 101.0, 0.5, True),
        (100.0, 140.0, 25.0, False),  # a big swarm's beats are 25 s apart: two of them
    ],
)
def test_layers_move_only_after_status_named_the_bottleneck(
    first_named_s: float | None, now_s: float, beat_s: float, ready: bool
) -> None:
    assert named_long_enough(first_named_s, now_s, beat_s) is ready
