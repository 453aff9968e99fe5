"""Traffic of a placed swarm on a three-tier network (access, aggregation, core).

Nodes are numbered in rack order: node i sits on access switch i // nodes_per_access_switch,
whose uplinks go to aggregation switch (access switch // access_switches_per_aggregation);
aggregation uplinks meet in the core. Replicas occupy consecutive nodes, so a pipeline's
hops mostly stay inside an access switch; what crosses an uplink is what the tiers carry.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from cellswarm.planner.cost import holders, share
from cellswarm.planner.inventory import ModelInventory
from cellswarm.planner.placement import Placement

Flow = tuple[int, int, float]  # (source node, destination node, bytes per token)


@dataclass(frozen=True)
class TierLoad:
    tier: str
    bits_per_s: float  # carried by the busiest uplink of the tier (average over uplinks)
    capacity_bits_per_s: float

    @property
    def utilization(self) -> float:
        return self.bits_per_s / self.capacity_bits_per_s if self.capacity_bits_per_s else 0.0


def replica_flows(inv: ModelInventory, placement: Placement, activation_bytes: float) -> list[Flow]:
    """Bytes per generated token between the nodes of one replica (node index within it)."""
    act = inv.d_model * activation_bytes
    flows: list[Flow] = []
    path = [s.node for s in placement.slots if s.embed_rows][:1]
    owners = {layer: s.node for s in placement.slots if s.layers for layer in range(*s.layers)}
    for layer in range(inv.n_layers):
        if path[-1:] != [owners[layer]]:
            path.append(owners[layer])
        for group in inv.groups(layer):
            for node, held in holders(placement, layer, group.kind).items():
                if node != owners[layer]:
                    flows.append((owners[layer], node, share(group, held) * act))
                    flows.append((node, owners[layer], share(group, held) * act))
    flows += [(a, b, act) for a, b in itertools.pairwise(path)]
    last = path[-1]
    heads = [s.node for s in placement.slots if s.head_rows and s.node != last]
    flows += [(last, h, act) for h in heads] + [(h, last, 8.0) for h in heads]
    flows.append((heads[-1] if heads else last, path[0], 8.0))  # the sampled token id
    return flows


def tier_loads(
    flows: list[Flow], nodes_per_replica: int, replicas: int, tokens_per_s: float, net: Any
) -> list[TierLoad]:
    """Average load per uplink of each tier when every replica makes tokens_per_s tokens."""
    per_access, per_agg = net.nodes_per_access_switch, net.nodes_per_aggregation
    src, dst, nbytes = (np.asarray(col, dtype=np.float64) for col in zip(*flows, strict=True))
    base = (np.arange(replicas) * nodes_per_replica)[:, None]  # (replicas, 1)
    a, b = base + src[None, :], base + dst[None, :]  # (replicas, flows) global node numbers
    cross_access = (a // per_access != b // per_access) * nbytes
    cross_agg = (a // per_agg != b // per_agg) * nbytes
    crossing = {
        "access": 2 * float(cross_access.sum()),  # up one access uplink, down another
        "aggregation": 2 * float(cross_agg.sum()),
        "core": float(cross_agg.sum()),
    }
    n_nodes = max(replicas * nodes_per_replica, 1)
    n_access = -(-n_nodes // per_access)
    n_agg = -(-n_nodes // per_agg)
    rate = 8 * tokens_per_s  # bytes per token -> bits per second
    return [
        TierLoad(
            "access", crossing["access"] * rate / n_access, net.access_uplink_total_bits_per_s
        ),
        TierLoad(
            "aggregation",
            crossing["aggregation"] * rate / n_agg,
            net.aggregation_uplink_total_bits_per_s,
        ),
        TierLoad("core", crossing["core"] * rate, net.core_bandwidth_bits_per_s),
    ]


def first_saturated(loads: list[TierLoad]) -> TierLoad:
    """The tier closest to (or past) its capacity."""
    return max(loads, key=lambda t: t.utilization)
