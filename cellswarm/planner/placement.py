"""Placement: which node of a replica holds which layers, experts and vocabulary rows.

A pure function of the model inventory and the bytes a node can give to weights and KV
cache. Pipeline placement walks the model in order — embedding rows, then each layer's core
(attention, norms, router, its KV cache), then its feed-forward units (slices of a dense FFN
or of the shared experts, routed experts), then the output head's rows — filling one node
before starting the next. Vocabulary rows and feed-forward units are split across nodes when
they do not fit one; a layer's attention never is (that would be tensor parallelism, which
1 GbE cannot carry — see cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from cellswarm.planner.inventory import ModelInventory, UnitGroup

Range = tuple[int, int]  # half-open


@dataclass(frozen=True)
class Slot:
    """What one node of a replica holds; bytes exclude the runtime and scratch reserve."""

    node: int
    layers: Range | None = None  # layer cores held
    units: tuple[tuple[int, str, int, int], ...] = ()  # (layer, group kind, first, end)
    embed_rows: Range | None = None
    head_rows: Range | None = None
    weight_bytes: int = 0
    kv_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        parts = []
        if self.embed_rows:
            parts.append(f"embedding rows {self.embed_rows[0]}..{self.embed_rows[1] - 1}")
        if self.layers:
            lo, hi = self.layers
            parts.append(f"layer {lo}" if hi == lo + 1 else f"layers {lo}..{hi - 1}")
        for layer, kind, a, b in self.units:
            what = "experts" if kind == "experts" else f"{kind} slices"
            parts.append(f"layer {layer} {what} {a}..{b - 1}")
        if self.head_rows:
            parts.append(f"head rows {self.head_rows[0]}..{self.head_rows[1] - 1}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Placement:
    slots: tuple[Slot, ...]
    capacity_bytes: int  # per node, for weights + KV
    problem: str = ""  # why it cannot be placed at all ("" when it can)

    @property
    def placeable(self) -> bool:
        return not self.problem

    @property
    def nodes_per_replica(self) -> int:
        return len(self.slots)

    @cached_property
    def unit_holders(self) -> dict[tuple[int, str], dict[int, int]]:
        """(layer, group kind) -> {node: units held}."""
        out: dict[tuple[int, str], dict[int, int]] = {}
        for s in self.slots:
            for layer, kind, a, b in s.units:
                held = out.setdefault((layer, kind), {})
                held[s.node] = held.get(s.node, 0) + b - a
        return out


@dataclass
class _Builder:
    capacity: int
    slots: list[Slot] = field(default_factory=list)
    cur: dict[str, Any] = field(default_factory=dict)
    used: int = 0

    def room(self) -> int:
        return self.capacity - self.used

    def new_node(self) -> None:
        self._close()
        self.cur, self.used = {}, 0

    def _close(self) -> None:
        if self.cur:
            self.slots.append(Slot(node=len(self.slots), **self.cur))

    def add(self, weight: int, kv: int = 0, **what: object) -> None:
        for key, value in what.items():
            self._merge(key, value)
        self.cur["weight_bytes"] = self.cur.get("weight_bytes", 0) + weight
        self.cur["kv_bytes"] = self.cur.get("kv_bytes", 0) + kv
        self.used += weight + kv

    def _merge(self, key: str, value: object) -> None:
        if key == "units":
            self.cur["units"] = (*self.cur.get("units", ()), value)
        elif key in self.cur and isinstance(value, tuple):
            self.cur[key] = (self.cur[key][0], value[1])  # extend a contiguous range
        else:
            self.cur[key] = value

    def finish(self) -> list[Slot]:
        self._close()
        return self.slots


def place_pipeline(
    inv: ModelInventory, capacity_bytes: int, kv_tokens: int, separate_experts: bool = False
) -> Placement:
    """kv_tokens: context x concurrency, the tokens of KV cache each layer's owner keeps."""
    b = _Builder(capacity_bytes)
    problem = _place_rows(b, "embed_rows", inv.vocab_size, inv.embedding_bytes())
    for layer in range(inv.n_layers):
        problem = problem or _place_layer(b, inv, layer, kv_tokens, separate_experts)
    head = inv.head_bytes() + sum(
        t.nbytes for t in inv.global_tensors() if t.kind not in ("embedding", "output")
    )
    problem = problem or _place_rows(b, "head_rows", inv.vocab_size, head)
    return Placement(tuple(b.finish()), capacity_bytes, problem)


def _place_rows(b: _Builder, key: str, rows: int, total_bytes: int) -> str:
    row_bytes = max(-(-total_bytes // max(rows, 1)), 1)  # rounded up: never over-fill
    if row_bytes > b.capacity:
        return f"one vocabulary row needs {row_bytes:,} bytes; a node has {b.capacity:,}"
    start = 0
    while start < rows:
        n = min(rows - start, b.room() // row_bytes)
        if n <= 0:
            b.new_node()
            continue
        rows_held = (start, start + n)
        nbytes = total_bytes * (start + n) // rows - total_bytes * start // rows
        if key == "embed_rows":
            b.add(nbytes, embed_rows=rows_held)
        else:
            b.add(nbytes, head_rows=rows_held)
        start += n
    return ""


def _place_layer(
    b: _Builder, inv: ModelInventory, layer: int, kv_tokens: int, separate: bool
) -> str:
    core = inv.core(layer)[0] + _absorbed_bytes(inv)
    kv = inv.kv_bytes_per_token_layer * kv_tokens
    if core + kv > b.capacity:
        short = core + kv - b.capacity
        fit = (b.capacity - core) // max(inv.kv_bytes_per_token_layer, 1)
        hint = (
            f"at most {fit:,} tokens of KV cache (context x concurrency) fit"
            if fit > 0
            else ("no context fits")
        )
        return (
            f"layer {layer}'s attention weights ({core:,} bytes) plus its KV cache "
            f"({kv:,} bytes) exceed a node's {b.capacity:,} bytes by {short:,} ({hint}); "
            "shorten the context or concurrency, quantize further, or use bigger nodes"
        )
    if core + kv > b.room():
        b.new_node()
    b.add(core, kv, layers=(layer, layer + 1))
    for group in inv.groups(layer):
        if group.unit_bytes > b.capacity:
            return (
                f"one unit of layer {layer}'s {group.kind} needs {group.unit_bytes:,} bytes; "
                f"a node has {b.capacity:,}"
            )
        if separate and group.kind == "experts":
            b.new_node()
        _place_units(b, layer, group)
    return ""


def _place_units(b: _Builder, layer: int, group: UnitGroup) -> None:
    start = 0
    while start < group.n_units:
        n = min(group.n_units - start, b.room() // group.unit_bytes)
        if n <= 0:
            b.new_node()
            continue
        b.add(group.bytes_of(start, start + n), units=(layer, group.kind, start, start + n))
        start += n


def _absorbed_bytes(inv: ModelInventory) -> int:
    fn = getattr(inv.config, "absorbed_bytes_per_layer", None)
    return int(fn()) if fn else 0
