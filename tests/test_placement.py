"""One placement (planner/placement.py) for the planner, the coordinator and the simulator:
its swarm mode as tables, and the three agreeing on the demo model's layer ranges."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from cellswarm.errors import BudgetError
from cellswarm.planner import api, inventory
from cellswarm.planner import plan as plan_mod
from cellswarm.planner.placement import (
    StageCosts,
    balanced_layers,
    expert_parts,
    fewest_stages,
    layer_placement,
    place,
    stage_costs_of,
    vocab_parts,
)
from cellswarm.swarm.control import membership
from cellswarm.swarm.control.store import Node, NodeId

# 6 layers of 10 bytes (weights 8 + KV 2), 5 fixed per stage, embedding 7, head 9
COSTS = StageCosts(weights=(8,) * 6, kv=2, fixed=5, ends=(7, 9))


@pytest.mark.parametrize(
    ("stages", "capacity", "expected"),
    [(1, 200, [(0, 6)]),                   # 5 + 7 + 60 + 9 = 81 on one
     (2, 200, [(0, 3), (3, 6)]),           # 42 and 44
     (3, 200, [(0, 2), (2, 4), (4, 6)]),   # the head's stage holds two layers too: 34
     (6, 200, [(i, i + 1) for i in range(6)]),
     (4, 34, [(0, 1), (1, 3), (3, 5), (5, 6)]),  # balanced at the least for 4: 25
     (7, 200, [(i, i + 1) for i in range(6)])],  # more nodes than layers: one each
)  # fmt: skip
def test_balanced_layers(stages: int, capacity: int, expected: list[tuple[int, int]]) -> None:
    assert balanced_layers(COSTS, stages, capacity, "m") == expected


def test_balanced_layers_says_how_much_is_missing() -> None:
    with pytest.raises(BudgetError, match=r"2 workers need 44 bytes each for m; --memory is 40 "
                                          r"\(4 short\)"):  # fmt: skip
        balanced_layers(COSTS, 2, 40, "m")


@pytest.mark.parametrize(("capacity", "stages"), [(81, 1), (80, 2), (44, 2), (43, 3), (34, 3),
                                                  (25, 4), (24, 6), (23, None)])  # fmt: skip
def test_fewest_stages(capacity: int, stages: int | None) -> None:
    split = fewest_stages(COSTS, capacity)
    assert (len(split) if split else None) == stages


def test_parts() -> None:
    assert expert_parts([1, 3], 5, 2) == [{1: (0, 2, 4), 3: (0, 2, 4)}, {1: (1, 3), 3: (1, 3)}]
    assert vocab_parts(10, 3) == [(0, 3), (3, 7), (7, 10)] and vocab_parts(10, 0) == []


def node(i: int, memory: int) -> Node:
    return Node(NodeId(f"n{i}"), "spare", "s", {"memory_bytes": memory}, "h", float(i), 0.0)


def test_the_head_needs_room_on_the_last_stage() -> None:
    """More room per stage must never need more stages: a greedy fill from the front packed
    the layers into two stages whose last had no room left for the head, and took 69 MB
    where three stages of 46 MB hold the demo model."""
    costs = StageCosts(weights=(10,) * 10, kv=0, fixed=0, ends=(30, 30))
    assert fewest_stages(costs, 60) == [(0, 3), (3, 9), (9, 10)]  # 60, 60, 40
    stages = [len(fewest_stages(costs, c) or ()) for c in (40, 50, 59, 60, 70, 80, 130, 160)]
    assert stages == [4, 4, 4, 3, 3, 2, 2, 1]  # more room, never more stages


@pytest.mark.parametrize("memory_mib", [40, 72, 90, 120, 200])
def test_plan_coordinator_and_simulator_place_the_same_layers(
    demo_path: Path, memory_mib: int
) -> None:
    """`cellswarm plan` on nodes of this memory, the coordinator's membership over as many
    workers, and the simulator (which runs the plan's placement) give the same ranges."""
    inv = inventory.from_gguf(demo_path)
    base = api.plan(inv, node="ps3", count=16, context=256)
    req = dataclasses.replace(
        base.request, node=dataclasses.replace(base.request.node, memory_bytes=memory_mib << 20)
    )
    planned = plan_mod.plan(inv, req).placement
    runtime, scratch = req.runtime_overhead_bytes, inv.scratch_bytes(1, 256, 0)
    costs = stage_costs_of(inv, 256, runtime + scratch)

    def split(count: int, memory: int) -> list[tuple[int, int]]:  # the coordinator's _split
        return balanced_layers(costs, count, memory, "demo")

    layout, _ = membership.place([node(i, memory_mib << 20) for i in range(16)], split, None)
    if not layout:  # no stage can hold the tied head: the swarm needs vocab nodes, and the
        # plan places its rows on a node of their own (the fill mode)
        assert planned.slots[-1].layers is None and planned.slots[-1].head_rows
        return
    assert [s.layers for s in layout] == [s.layers for s in planned.slots]
    assert planned == place(inv, memory_mib * 2**20 - runtime - scratch, 256)
    assert planned == layer_placement(inv, [s.layers for s in planned.slots], 256)  # sim's


def test_a_layout_shrunk_by_losses_grows_back_when_nodes_return() -> None:
    """--stages 3 on three nodes; two are lost and a repair runs the model on the one left
    (fewer stages rather than stall); when two spares join, the full three stages come back
    (issue 30: the layout stayed below --stages for good)."""
    from dataclasses import replace

    from cellswarm.swarm.control.membership import repair

    def split(count: int, memory_bytes: int) -> list[tuple[int, int]]:
        return [(k * 30 // count, (k + 1) * 30 // count) for k in range(count)]

    nodes = [node(i, 1 << 30) for i in range(3)]
    layout, target = repair(nodes, [], split, stages=3)
    assert len(layout) == 3
    nodes = [replace(n, state="assigned", shard=target[n.node_id]) for n in nodes]
    left = [replace(nodes[0], shard=None, state="spare"),
            *(replace(n, state="lost", shard=None) for n in nodes[1:])]
    layout, target = repair(left, layout, split, stages=3)
    assert len(layout) == 1  # shrunk: one stage on the one node left
    back = [replace(left[0], state="assigned", shard=target[left[0].node_id]),
            node(3, 1 << 30), node(4, 1 << 30)]  # fmt: skip
    layout, target = repair(back, layout, split, stages=3)
    assert len(layout) == 3 and sum(s is not None for s in target.values()) == 3


def racked(i: int, rack: str, memory: int = 1 << 30) -> Node:
    return Node(NodeId(f"n{i}"), "spare", "s", {"memory_bytes": memory, "rack": rack}, "h",
                float(i), 0.0)  # fmt: skip


def _split(count: int, memory_bytes: int) -> list[tuple[int, int]]:
    return [(k * 30 // count, (k + 1) * 30 // count) for k in range(count)]


def _rings(target: dict[NodeId, Any], nodes: list[Node]) -> dict[int, list[str]]:
    rack = {n.node_id: n.rack for n in nodes}
    rings: dict[int, list[str]] = {}
    for node_id, shard in sorted(target.items(), key=lambda kv: kv[1].slot if kv[1] else -1):
        if shard is not None:
            rings.setdefault(shard.replica, []).append(rack[node_id])
    return rings


def test_a_replica_s_stages_sit_in_one_rack_where_one_can_hold_them() -> None:
    """Nodes of two racks joined in turn (a, b, a, b, ...): each of two 3-stage replicas is
    placed on one rack, as the planner's network model assumes; without racks the join order
    is the layout, as before."""
    from cellswarm.swarm.control.membership import place

    nodes = [racked(i, "ab"[i % 2]) for i in range(6)]
    layout, target = place(nodes, _split, stages=3, replicas=2)
    assert len(layout) == 6
    assert sorted(_rings(target, nodes).values()) == [["a"] * 3, ["b"] * 3]
    plain = [node(i, 1 << 30) for i in range(6)]
    _, target = place(plain, _split, stages=3, replicas=2)
    assert [target[n.node_id].slot for n in plain] == list(range(6))  # type: ignore[union-attr]


def test_racks_too_small_for_a_replica_fill_the_last_ones_and_spares_stay_in_rack() -> None:
    """Racks of 3, 2 and 1 nodes for two 3-stage replicas: the 3-node rack holds one whole,
    the rest spans the others. A lost stage is refilled by a spare of its replica's rack when
    one waits, before an earlier-joined spare of another rack."""
    from dataclasses import replace

    from cellswarm.swarm.control.membership import place, repair

    nodes = [racked(0, "b"), racked(1, "a"), racked(2, "a"), racked(3, "b"), racked(4, "a"),
             racked(5, "c")]  # fmt: skip
    layout, target = place(nodes, _split, stages=3, replicas=2)
    assert sorted(_rings(target, nodes).values()) == [["a"] * 3, ["b", "b", "c"]]
    placed = [replace(n, state="assigned", shard=target[n.node_id]) for n in nodes]
    spares = [racked(6, "c"), racked(7, "a")]
    lost = next(n for n in placed if n.rack == "a" and n.shard and n.shard.stage == 1)
    live = [replace(n, state="lost", shard=None) if n is lost else n for n in placed] + spares
    _, after = repair(live, layout, _split, stages=3, replicas=2)
    assert after[NodeId("n7")] == lost.shard and after[NodeId("n6")] is None
