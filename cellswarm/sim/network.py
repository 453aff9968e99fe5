"""Shared links: per-tier load of the live replicas, from the planner's `replica_flows` and
`tier_loads`, recomputed only when the number of live replicas changes.

When a tier's busiest uplink would carry more than its capacity at the replicas' nominal
rate, every replica's tokens slow down by that ratio (the planner's `_network_capped`, as a
factor the engine applies to each token interval). Approximation: `tier_loads` lays the live
replicas out on consecutive nodes; a spare that replaced a node elsewhere adds crossings
this ignores (a few flows per replacement against thousands per replica).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cellswarm.errors import RequestError
from cellswarm.planner import network
from cellswarm.planner.inventory import ModelInventory
from cellswarm.planner.placement import Placement
from cellswarm.planner.profiles import NETWORK_KEYS

TIERS = ("access", "aggregation", "core")


def apply_topology(net: Any, overrides: tuple[tuple[str, str | float], ...]) -> Any:
    """[defaults.network] keys (nodes_per_access_switch=24, core_bandwidth=100G, ...)."""
    changes: dict[str, Any] = {}
    for key, value in overrides:
        if key not in NETWORK_KEYS:
            raise RequestError(
                f"--topology key {key!r} is unknown; known: {', '.join(sorted(NETWORK_KEYS))}"
            )
        attr, convert = NETWORK_KEYS[key]
        try:
            changes[attr] = convert(value)
        except (TypeError, ValueError):
            raise RequestError(f"--topology {key}={value!r} is not a valid value") from None
    return dataclasses.replace(net, **changes)


def parse_topology(text: str) -> tuple[tuple[str, str], ...]:
    """'core_bandwidth=100G,nodes_per_access_switch=24' -> pairs."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise RequestError(f"--topology part {part!r} is not KEY=VALUE")
        out.append((key.strip(), value.strip()))
    return tuple(out)


class NetModel:
    def __init__(
        self,
        inv: ModelInventory,
        placement: Placement | None,
        activation_bytes: float,
        net: Any,
        nominal_tokens_per_s: float,
    ) -> None:
        """placement None: one box per replica, nothing on the wire between nodes."""
        self.flows = network.replica_flows(inv, placement, activation_bytes) if placement else []
        self.nodes_per_replica = placement.nodes_per_replica if placement else 1
        self.net = net
        self.nominal = nominal_tokens_per_s  # per replica, uncapped
        self._unit: dict[int, tuple[float, ...]] = {}

    def unit_utilization(self, live: int) -> tuple[float, ...]:
        """Per tier: utilisation of the busiest uplink when each live replica makes 1 tok/s."""
        if live not in self._unit:
            if live == 0 or not self.flows:
                self._unit[live] = (0.0,) * len(TIERS)
            else:
                loads = network.tier_loads(self.flows, self.nodes_per_replica, live, 1.0, self.net)
                self._unit[live] = tuple(t.utilization for t in loads)
        return self._unit[live]

    def slowdown(self, live: int) -> float:
        """>= 1: how much longer each token takes because a tier is past its capacity."""
        worst = max(self.unit_utilization(live)) * self.nominal
        return worst if worst > 1.0 else 1.0
