"""predict_local with a host killed and a rack cut (what `python -m bench.lab --chaos`
compares with the lab): no lab, the simulator only."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from cellswarm.errors import RequestError
from cellswarm.planner import profiles
from cellswarm.sim.control import ControlPlane
from cellswarm.sim.local import predict_local

SPLIT = [(0, 10), (10, 20), (20, 30)]
CONTROL = ControlPlane(heartbeat_s=0.25, timeout_beats=24.0)  # lost after 6 s of silence


def _net() -> profiles.NetworkSpec:  # 2 racks of 4
    return dataclasses.replace(profiles.load_network(None), nodes_per_access_switch=4)


def test_a_rack_cut_is_seen_after_the_timeout_and_the_ring_loads_anew() -> None:
    calm = predict_local(SPLIT, node="ps3/40", in_flight=2, jobs=12, tokens=8,
                         prompt_tokens=5, nodes=8, network=_net(), control=CONTROL)  # fmt: skip
    assert calm.rewired_at_s == () and calm.jobs_done == 12
    cut = predict_local(SPLIT, node="ps3/40", in_flight=2, jobs=12, tokens=8,
                        prompt_tokens=5, nodes=8, network=_net(), control=CONTROL,
                        rack_cuts=[(5.0, 0)])  # fmt: skip
    assert len(cut.rewired_at_s) == 1
    # every stage sat in rack 0: detected after 6 s, then the shards loaded in rack 1
    assert cut.rewired_at_s[0] >= 5.0 + 6.0 + 1.0
    assert cut.jobs_done == 12 and cut.jobs_dead == 0
    assert cut.tokens_per_s < calm.tokens_per_s
    assert all(t <= 5.0 or t > cut.rewired_at_s[0] for t in cut.done_at_s)  # none while down


def test_a_kill_then_a_cut_rewire_twice_in_order() -> None:
    both = predict_local(SPLIT, node="ps3/40", in_flight=2, jobs=12, tokens=8,
                         prompt_tokens=5, nodes=8, network=_net(), control=CONTROL,
                         kill_at_s=2.0, kill_stage=1, rack_cuts=[(40.0, 0)])  # fmt: skip
    first, second = both.rewired_at_s
    assert 2.0 + 6.0 < first < 40.0 < 40.0 + 6.0 < second
    assert both.jobs_done == 12 and both.jobs_dead == 0


def test_a_rack_the_nodes_do_not_fill_is_refused() -> None:
    with pytest.raises(RequestError, match="rack 2"):
        predict_local(SPLIT, node="ps3/40", nodes=8, network=_net(), rack_cuts=[(1.0, 2)])
    with pytest.raises(RequestError, match="non-negative"):
        predict_local(SPLIT, node="ps3/40", nodes=8, network=_net(), rack_cuts=[(-1.0, 0)])


def test_shards_fetched_over_a_shared_uplink_queue_on_it() -> None:
    """A slow path to the coordinator (the lab's aggregation uplink): one spare's fetch takes
    its shard over it; after a rack cut the ring's three shards share it, so the cut costs
    the sum of their fetches, not the slowest."""
    kw: dict[str, Any] = dict(node="ps3/40", in_flight=2, jobs=12, tokens=8, prompt_tokens=5,
                              nodes=8, network=_net(), control=CONTROL)  # fmt: skip
    link = profiles.get_profile("ps3/40").link_bits_per_s
    own = predict_local(SPLIT, rack_cuts=[(5.0, 0)], **kw)
    shared = predict_local(SPLIT, rack_cuts=[(5.0, 0)], fetch_bits_per_s=link,
                           **kw)  # fmt: skip
    own_load = own.rewired_at_s[0] - 5.0 - 6.0
    shared_load = shared.rewired_at_s[0] - 5.0 - 6.0
    # the sum of three shards: more than twice the largest (the ends hold the embedding and
    # the head, the middle its layers), at most three times it
    assert 2 * own_load < shared_load <= 3 * own_load
    kill = predict_local(SPLIT, kill_at_s=2.0, kill_stage=1, fetch_bits_per_s=link / 2,
                         **kw)  # fmt: skip
    calm = predict_local(SPLIT, kill_at_s=2.0, kill_stage=1, **kw)
    assert kill.rewired_at_s[0] - 8.0 == pytest.approx(2 * (calm.rewired_at_s[0] - 8.0), rel=0.01)
    with pytest.raises(RequestError, match="positive"):
        predict_local(SPLIT, fetch_bits_per_s=0.0, **kw)
