"""Traffic of a placed swarm on a three-tier network (access, aggregation, core).

Two kinds: the data plane (activations between the stages and part holders of a replica,
per token made) and the control plane (heartbeats, shipped logs, a head's leases and
checkpoints, per second whatever the token rate), which every node exchanges with the
coordinators on the core, so it crosses every uplink above it. On a thin uplink the
control plane alone can fill it (docs/lab.md, the 300:1 runs).

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

from cellswarm.planner.cost import answer_rows, holders, share
from cellswarm.planner.inventory import ModelInventory
from cellswarm.planner.placement import Placement

Flow = tuple[int, int, float]  # (source node, destination node, bytes per token)


@dataclass(frozen=True)
class ControlTraffic:
    """Bytes per second both ways, on the wire, that a node exchanges with the coordinator
    besides activations (data/runtime.toml [control] has what was measured)."""

    node_bytes_per_s: float = 0.0  # every node: heartbeats and their answers, shipped logs
    head_bytes_per_s: float = 0.0  # a replica's head on top: leases and checkpoints

    def total_bytes_per_s(self, nodes: int, replicas: int) -> float:
        return nodes * self.node_bytes_per_s + replicas * self.head_bytes_per_s


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
                    flows.append((node, owners[layer], answer_rows(group, held) * act))
    flows += [(a, b, act) for a, b in itertools.pairwise(path)]
    last = path[-1]
    heads = [s.node for s in placement.slots if s.head_rows and s.node != last]
    flows += [(last, h, act) for h in heads] + [(h, last, 8.0) for h in heads]
    flows.append((heads[-1] if heads else last, path[0], 8.0))  # the sampled token id
    return flows


def tier_loads(
    flows: list[Flow],
    nodes_per_replica: int,
    replicas: int,
    tokens_per_s: float,
    net: Any,
    control: ControlTraffic = ControlTraffic(),
) -> list[TierLoad]:
    """Average load per uplink of each tier when every replica makes tokens_per_s tokens,
    with the control plane of every node on top (it goes to the core, so it crosses its
    access and aggregation uplinks once each way)."""
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
    ctl = 8 * control.total_bytes_per_s(n_nodes, replicas)  # bits per second, all nodes
    return [
        TierLoad("access", (crossing["access"] * rate + ctl) / n_access,
                 net.access_uplink_total_bits_per_s),
        TierLoad("aggregation", (crossing["aggregation"] * rate + ctl) / n_agg,
                 net.aggregation_uplink_total_bits_per_s),
        TierLoad("core", crossing["core"] * rate + ctl, net.core_bandwidth_bits_per_s),
    ]  # fmt: skip


def network_cap(
    flows: list[Flow],
    nodes_per_replica: int,
    replicas: int,
    net: Any,
    control: ControlTraffic = ControlTraffic(),
) -> float:
    """Tokens/s per replica at which the first tier fills: what the control plane leaves
    of each uplink over the data plane's bits per token there (inf: no data crosses one;
    0: the control plane alone fills it)."""
    idle = tier_loads(flows, nodes_per_replica, replicas, 0.0, net, control)
    one = tier_loads(flows, nodes_per_replica, replicas, 1.0, net, control)
    caps = [max(t0.capacity_bits_per_s - t0.bits_per_s, 0.0) / (t1.bits_per_s - t0.bits_per_s)
            for t0, t1 in zip(idle, one, strict=True) if t1.bits_per_s > t0.bits_per_s]  # fmt: skip
    full = [t for t in idle if t.capacity_bits_per_s and t.utilization >= 1.0]
    return 0.0 if full else min(caps, default=float("inf"))


def first_saturated(loads: list[TierLoad]) -> TierLoad:
    """The tier closest to (or past) its capacity."""
    return max(loads, key=lambda t: t.utilization)
