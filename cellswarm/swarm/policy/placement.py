"""Who holds which shard: placement and repair as pure functions, the one copy the
coordinator (control/placing.py, through membership.py) and the simulator (sim/engine.py)
both run.

A layout is a list of stages (layer ranges, in ring order) and part servers per replica;
each slot is held by one member. When a member is lost, a spare takes its shard unchanged
(cheapest: nobody else reloads), from the replica's own rack when one waits there. Without a
spare, a replica whose hole cannot be filled is dropped — its members become spares for the
other replicas' holes, and every other replica keeps its shards (none reloads) — and once
enough spares wait, a dropped replica is formed again from them. The last replica is never
dropped: the layout is placed again over the members that are left (fewer stages rather
than stall) and grown back to what was asked once members return.

A member is anything with a node id, a state, the shard it holds, its memory, when it joined
and its rack: the store's `Node` for the coordinator, a light record for the simulator.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol, TypeVar

import msgspec

from cellswarm.errors import BudgetError
from cellswarm.swarm.protocol.messages import PartHolding, Shard

K = TypeVar("K", bound=Hashable)  # a member's id: the store's NodeId, the simulator's index
K_co = TypeVar("K_co", bound=Hashable, covariant=True)


class Member(Protocol[K_co]):
    """What placement reads of a node."""

    @property
    def node_id(self) -> K_co: ...
    @property
    def state(self) -> str: ...  # "spare", "assigned" (placeable), or anything else
    @property
    def shard(self) -> Shard | None: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def joined_s(self) -> float: ...
    @property
    def rack(self) -> str: ...


M = TypeVar("M", bound=Member[Hashable])

PartSpecs = Sequence[PartHolding]  # what each part server of a replica holds (parts.py)
# (number of stages, per-node memory) -> layer ranges, or BudgetError if they cannot fit
Splitter = Callable[[int, int], list[tuple[int, int]]]

PLACEABLE = ("spare", "assigned")


def shards(
    split: Sequence[tuple[int, int]], parts: PartSpecs = (), replicas: int = 1
) -> list[Shard]:
    """Every slot of a layout: per replica, its stages then its part servers."""
    s, per = len(split), len(split) + len(parts)
    n = per * replicas
    out: list[Shard] = []
    for r in range(replicas):
        out += [
            Shard(slot=r * per + k, n=n, replica=r, role="stage", stage=k, layers=(lo, hi),
                  first=k == 0, last=k == s - 1)
            for k, (lo, hi) in enumerate(split)
        ]  # fmt: skip
        out += [Shard(slot=r * per + s + j, n=n, replica=r, role="part", spec=spec)
                for j, spec in enumerate(parts)]  # fmt: skip
    return out


def layout_complete(nodes: Sequence[Member[K]], layout: Sequence[Shard] | None = None) -> bool:
    """Every slot of the current layout (`layout`: its slots; else all `n` of the shards
    held) is held by exactly one assigned node."""
    held = [n.shard for n in nodes if n.state == "assigned" and n.shard is not None]
    if not held:
        return False
    n_slots = held[0].n
    want = sorted(s.slot for s in layout) if layout is not None else list(range(n_slots))
    return sorted(s.slot for s in held) == want and all(s.n == n_slots for s in held)


def repair(
    nodes: Sequence[Member[K]], layout: Sequence[Shard], split: Splitter, stages: int | None,
    parts: PartSpecs = (), replicas: int = 1, max_stages: int | None = None,
) -> tuple[list[Shard], dict[K, Shard | None]]:
    """The layout and the shard every placeable node should hold (None: a spare). A complete
    layout stays as it is (grown back to the ask when a repair shrank it); a hole is filled
    by a spare with as much memory as the node it replaces, or its replica dropped (never the
    last); otherwise the model is placed from scratch. ([], {}) if nothing fits yet."""
    live = [n for n in nodes if n.state in PLACEABLE]
    current = {n.node_id: n.shard for n in live}
    if layout and layout_complete(live, layout):
        if _short_of_ask(layout, stages, replicas):  # a repair shrank it: grow back when
            grown = _grow(live, layout, split, stages, parts, replicas, max_stages)  # it can
            if grown[1]:
                return grown
        return list(layout), current
    if layout:
        filled = _fill_holes(live, layout)
        if filled is not None:
            return filled
    return place(live, split, stages, shrink=bool(layout), parts=parts, replicas=replicas,
                 max_stages=max_stages)


def _short_of_ask(layout: Sequence[Shard], stages: int | None, replicas: int) -> bool:
    """The layout has fewer rings than `replicas`, or a ring fewer stages than `stages` (a
    repair took fewer rather than stall): once the nodes are back, the full ask is placed."""
    rings = {s.replica for s in layout if s.role == "stage"}
    return len(rings) < replicas or (stages is not None and _stages(layout) < stages)


def _stages(layout: Sequence[Shard]) -> int:
    """Stages per ring (every ring of a layout has as many)."""
    one = min(s.replica for s in layout)
    return sum(1 for s in layout if s.role == "stage" and s.replica == one)


def _grow(
    live: Sequence[Member[K]], layout: Sequence[Shard], split: Splitter, stages: int | None,
    parts: PartSpecs, replicas: int, max_stages: int | None,
) -> tuple[list[Shard], dict[K, Shard | None]]:
    """Back toward the ask: a layout with every ring of it and fewer stages is placed anew
    (every stage's layers change); one that dropped rings gets them back, the lowest first,
    each from the earliest joined spares once a ring's worth waits (no other node moves)."""
    per = len(layout) // len({s.replica for s in layout})
    if (stages is not None and _stages(layout) < stages) or layout[0].n != per * replicas:
        return place(live, split, stages, parts=parts, replicas=replicas, max_stages=max_stages)
    budget = min(n.memory_bytes for n in live if n.state == "assigned")
    spares = _spares(live, budget)
    present = {s.replica for s in layout}
    template = [s for s in layout if s.replica == min(present)]
    out: dict[K, Shard | None] = {n.node_id: n.shard for n in live}
    grown = list(layout)
    for r in range(replicas):
        if r in present or len(spares) < per:
            continue
        ring = [msgspec.structs.replace(s, replica=r, slot=r * per + s.slot % per)
                for s in template]  # fmt: skip
        chosen, spares = by_rack(spares[:per], per), spares[per:]
        for node, shard in zip(chosen, ring, strict=True):
            out[node.node_id] = shard
        grown += ring
    if len(grown) == len(layout):
        return [], {}
    return sorted(grown, key=lambda s: s.slot), out


def _spares(live: Sequence[Member[K]], budget: int) -> list[Member[K]]:
    """The spares that can hold a slot sized for `budget`, the earliest joined first."""
    return sorted((n for n in live if n.state == "spare" and n.memory_bytes >= budget),
                  key=lambda n: (n.joined_s, n.node_id))  # fmt: skip


class Spares(Protocol[K]):
    """The spares a repair gives its holes, the earliest joined first. The core's is a list
    (`_Queue`); the simulator's, heaps per rack (O(log n) a take, for 100,000 nodes)."""

    def take(self, rack: Hashable | None) -> K | None:
        """The earliest joined spare in `rack` if one waits there, else the earliest joined
        anywhere (None: no spare is left); it is a spare no longer."""
        ...

    def give(self, nodes: Sequence[K]) -> None:
        """`nodes` (a dropped replica's) are spares again, for the holes after it."""
        ...


def mend(
    holes: Sequence[tuple[int, int]], rings: Mapping[int, Sequence[K]],
    rack: Callable[[K], Hashable], spares: Spares[K], live_rings: int,
) -> tuple[dict[int, K], list[int]] | None:
    """The rule of a repair, for the core and the simulator alike: every hole, (replica,
    slot) in slot order, gets a spare from the rack most of its replica's slots sit in
    where one waits there, else the earliest joined. A hole no spare is left for drops its
    replica: what held (or was just given) its other slots goes back to the spares, for the
    holes after it. `rings`: each replica with a hole (the core: every replica), its holders
    in slot order. The slots filled and the replicas dropped; None when the last of
    `live_rings` would be dropped, or no replica holds anything (the caller places anew).

    A replica's rack is counted once, then kept as spares join it (O(replica) per replica
    mended, not per hole: a simulated replica holds thousands of nodes); of racks holding
    as many, the one seen first (its lowest slot, then the order its spares came)."""
    if len(rings) == live_rings and not any(rings.values()):
        return None
    racks: dict[int, Counter[Hashable]] = {}
    given: dict[int, dict[int, K]] = {}
    dropped: list[int] = []
    for replica, slot in holes:
        if replica in dropped:
            continue
        if replica not in racks:
            racks[replica] = Counter(map(rack, rings.get(replica, ())))
            given[replica] = {}
        count = racks[replica]
        spare = spares.take(count.most_common(1)[0][0] if count else None)
        if spare is not None:
            count[rack(spare)] += 1
            given[replica][slot] = spare
            continue
        if live_rings - len(dropped) == 1:
            return None
        dropped.append(replica)
        spares.give([*rings.get(replica, ()), *given.pop(replica).values()])
    return {slot: k for ring in given.values() for slot, k in ring.items()}, dropped


class _Queue(Spares[K]):
    """The core's spares: members in join order (a repair walks them; O(nodes))."""

    def __init__(self, members: Sequence[Member[K]]) -> None:
        self.members = list(members)  # earliest joined first
        self.by_id = {m.node_id: m for m in members}

    def take(self, rack: Hashable | None) -> K | None:
        if not self.members:
            return None
        spare = min(self.members, key=lambda n: n.rack != rack)  # its rack's, if one waits
        self.members.remove(spare)
        return spare.node_id

    def give(self, nodes: Sequence[K]) -> None:
        self.members += [self.by_id[k] for k in nodes]
        self.members.sort(key=lambda n: (n.joined_s, n.node_id))


def _fill_holes(
    live: Sequence[Member[K]], layout: Sequence[Shard]
) -> tuple[list[Shard], dict[K, Shard | None]] | None:
    """The layout's holes mended by `mend`, over the members: the layout without the
    replicas it dropped, and each member's shard (a dropped replica's members are spares,
    unless a later hole took them). None when `mend` says place anew."""
    replica_of = {s.slot: s.replica for s in layout}
    holders = sorted((n for n in live if n.state == "assigned" and n.shard
                      and n.shard.slot in replica_of), key=_slot)  # fmt: skip
    if not holders:
        return None
    rings: dict[int, list[K]] = {s.replica: [] for s in layout}
    for n in holders:
        rings[replica_of[_slot(n)]].append(n.node_id)
    held = {_slot(n) for n in holders}
    budget = min(n.memory_bytes for n in holders)  # what a stage was sized for
    pool = _Queue(_spares(live, budget))
    pool.by_id.update((n.node_id, n) for n in holders)  # a dropped ring's go back to it
    holes = [(s.replica, s.slot) for s in layout if s.slot not in held]
    mended = mend(holes, rings, lambda k: pool.by_id[k].rack, pool, len(rings))
    if mended is None:
        return None
    filled, dropped = mended
    out: dict[K, Shard | None] = {n.node_id: n.shard for n in live}
    for r in dropped:
        for k in rings[r]:
            out[k] = None
    shard_of = {s.slot: s for s in layout}
    for slot, k in filled.items():
        out[k] = shard_of[slot]
    return [s for s in layout if s.replica not in dropped], out


def _slot(n: Member[K]) -> int:
    assert n.shard is not None
    return n.shard.slot


def place(
    live: Sequence[Member[K]], split: Splitter, stages: int | None, shrink: bool = False,
    parts: PartSpecs = (), replicas: int = 1, max_stages: int | None = None,
) -> tuple[list[Shard], dict[K, Shard | None]]:
    """A fresh layout over the live nodes: `replicas` rings of `stages` stages (or the fewest
    that fit, up to `max_stages`: one a layer) and their part servers, the earliest joined
    nodes first, the rest spares; within them, each replica's slots go to nodes of one rack
    where a rack has enough of them (`by_rack`). ([], {}) when they cannot hold the model.
    A first placement waits for what was asked; a repair (`shrink`) takes fewer replicas,
    then fewer stages, rather than stall. O(nodes) per call (a 100,000-node swarm asks on
    every change): the smallest memory of each prefix of the join order is computed once."""
    if not live:
        return [], {}
    order = sorted(live, key=lambda n: (n.joined_s, n.node_id))
    smallest = list(itertools.accumulate((n.memory_bytes for n in order), min))
    if stages:  # what was asked; a repair steps down from it rather than jump to the fewest
        counts = [stages, *(range(stages - 1, 0, -1) if shrink else [])]
    else:
        counts = list(range(1, min(len(order), max_stages or len(order)) + 1))
    for r in range(replicas, 0 if shrink else replicas - 1, -1):
        for count in counts:
            need = r * (count + len(parts))
            if need > len(order):
                continue
            chosen = by_rack(order[:need], count + len(parts))
            try:
                split_ = split(count, smallest[need - 1])
            except BudgetError:
                continue
            if len(split_) != count:  # e.g. more nodes than layers: not this many stages
                continue
            layout = shards(split_, parts, r)
            out: dict[K, Shard | None] = {n.node_id: None for n in order}
            for node, shard in zip(chosen, layout, strict=True):
                out[node.node_id] = shard
            return layout, out
    return [], {}


def by_rack(chosen: Sequence[Member[K]], per_replica: int) -> list[Member[K]]:
    """`chosen` reordered so that each run of `per_replica` slots (one replica: its stages in
    ring order, then its part servers) lies in one rack where it can, as the planner's
    network model assumes (a replica's hops stay under one switch): every rack, in the order
    its first node joined, gives whole replicas of its nodes first; what is left of every
    rack (too few for a replica) fills the last replicas, rack by rack. The same nodes, so
    the same smallest budget; with no racks said, the join order unchanged."""
    racks: dict[str, list[Member[K]]] = {}
    for n in chosen:
        racks.setdefault(n.rack, []).append(n)
    whole: list[Member[K]] = []
    rest: list[Member[K]] = []
    for members in racks.values():
        cut = len(members) // per_replica * per_replica
        whole += members[:cut]
        rest += members[cut:]
    return whole + rest
