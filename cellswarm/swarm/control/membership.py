"""Who holds which shard, as the coordinator reads and keeps it: the layout as stored text,
a replica's ring in stage order, its part servers, the slowest stage. The decisions
themselves (placement, spares, repair) are the policy core's (policy/placement.py), which
the simulator runs too; they are re-exported here for the coordinator's modules.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from cellswarm.swarm.control.store import Node
from cellswarm.swarm.policy.placement import (
    PLACEABLE,
    PartSpecs,
    Splitter,
    by_rack,
    layout_complete,
    place,
    repair,
    shards,
)
from cellswarm.swarm.protocol.messages import Shard

__all__ = ["PLACEABLE", "PartSpecs", "Shard", "Splitter", "by_rack", "layout_complete", "place",
           "repair", "shards"]  # fmt: skip


def dump_layout(layout: Sequence[Shard]) -> str:
    """A layout as the text kept in the store's meta table (and compared as a key)."""
    return msgspec.json.encode(list(layout)).decode()


def load_layout(text: str) -> list[Shard]:
    """The stored layout; one an older protocol wrote (a shard of another shape) is no
    layout: the nodes are placed again, as on a first start."""
    try:
        return msgspec.json.decode(text, type=list[Shard])
    except msgspec.ValidationError:
        return []


def _held(nodes: Sequence[Node], role: str, replica: int) -> list[Node]:
    return [n for n in nodes if n.state == "assigned" and n.shard
            and n.shard.role == role and n.shard.replica == replica]  # fmt: skip


def ring(nodes: Sequence[Node], replica: int = 0) -> list[Node]:
    """The nodes holding a replica's pipeline stages, in stage order."""
    return sorted(_held(nodes, "stage", replica), key=lambda n: _slot(n, "stage"))


def part_nodes(nodes: Sequence[Node], replica: int = 0) -> list[Node]:
    """The nodes holding a replica's part servers, in slot order."""
    return sorted(_held(nodes, "part", replica), key=lambda n: _slot(n, "slot"))


def _slot(node: Node, key: str) -> int:
    assert node.shard is not None  # held: _held keeps only nodes with a shard
    return (node.shard.stage or 0) if key == "stage" else node.shard.slot


def replicas(nodes: Sequence[Node]) -> list[int]:
    return sorted({n.shard.replica for n in nodes
                   if n.state == "assigned" and n.shard})  # fmt: skip


def bottleneck(steps_s: Sequence[float]) -> tuple[int, float]:
    """The slowest stage of a ring by measured step time, and how many times the median."""
    k = max(range(len(steps_s)), key=lambda i: steps_s[i])
    ordered = sorted(steps_s)
    median = ordered[len(ordered) // 2]
    return k, steps_s[k] / median if median > 0 else 1.0
