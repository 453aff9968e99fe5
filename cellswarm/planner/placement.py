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

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from cellswarm.errors import BudgetError, RequestError
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
    # a draft model beside the first node's share (speculative decoding: its weights and its
    # KV cache), read by the drafts, not by a step of the model: not in weight_bytes
    draft_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.draft_bytes

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
        if self.draft_bytes:
            parts.append("the draft model")
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

    def add_draft(self, draft_bytes: int) -> None:
        """A draft model's weights and cache, whole on the current node."""
        self.cur["draft_bytes"] = self.cur.get("draft_bytes", 0) + draft_bytes
        self.used += draft_bytes

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
    inv: ModelInventory, capacity_bytes: int, kv_tokens: int, separate_experts: bool = False,
    draft_bytes: int = 0,
) -> Placement:
    """kv_tokens: context x concurrency, the tokens of KV cache each layer's owner keeps;
    draft_bytes: a draft model's, on the first node, before anything else."""
    b = _Builder(capacity_bytes)
    if draft_bytes > capacity_bytes:
        return Placement((), capacity_bytes, f"the draft model needs {draft_bytes:,} bytes; "
                         f"a node has {capacity_bytes:,}")  # fmt: skip
    if draft_bytes:
        b.add_draft(draft_bytes)
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


# ---- the swarm's mode: contiguous layer ranges, what the coordinator builds ---------------
# The coordinator, `cellswarm plan` and the simulator all place through the functions below:
# balanced layer ranges by bytes (a first placement, re-placement after a loss) or by measured
# step time (rebalance), routed experts and vocabulary rows on part servers of their own.
# The fill mode above (place_pipeline) is for models whose single layers do not fit a node.


def even_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, sizes differing by at most one."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"{n_stages} stages for {n_layers} layers")
    bounds = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True)
class StageCosts:
    """What a pipeline stage holds, by layer, in bytes (the planner's byte-exact inventory):
    `weights[i]` are layer i's weights a stage keeps (read once per decode step), `kv` each
    layer's KV cache reservation, `fixed` what every stage holds besides (runtime, scratch,
    shared tensors), `ends` the embedding (first stage) and output head (last stage)."""

    weights: tuple[int, ...]
    kv: int
    fixed: int
    ends: tuple[int, int]

    @property
    def memory(self) -> list[int]:
        return [w + self.kv for w in self.weights]

    def held(self, lo: int, hi: int, first: bool, last: bool) -> int:
        """Bytes a stage holding layers [lo, hi) needs."""
        return (self.fixed + sum(self.memory[lo:hi]) + (self.ends[0] if first else 0)
                + (self.ends[1] if last else 0))  # fmt: skip

    def read(self, lo: int, hi: int, last: bool) -> int:
        """Weight bytes a decode step of a stage reads — its layers, the head on the last
        (the first reads one embedding row a token: nothing) — what its time goes by."""
        return sum(self.weights[lo:hi]) + (self.ends[1] if last else 0)


def stage_costs_of(
    inv: ModelInventory, kv_tokens: int, fixed_bytes: int,
    remote_experts: bool = False, remote_vocab: bool = False, first_bytes: int = 0,
) -> StageCosts:  # fmt: skip
    """What each stage of `inv` holds and reads: `kv_tokens` of KV cache per layer (context x
    sequences in flight), `fixed_bytes` on every stage besides the tensors outside the layers
    (runtime and scratch, for the swarm; 0 for a plan, whose capacity has them taken out).
    With part servers holding the routed experts / the vocabulary rows, stages hold neither.
    `first_bytes`: what the first stage holds besides (a draft model)."""

    def held(i: int) -> int:
        return sum(t.nbytes for t in inv.layer_tensors(i)
                   if not (remote_experts and t.kind == "experts"))  # fmt: skip

    shared = sum(t.nbytes for t in inv.global_tensors() if t.kind not in ("embedding", "output"))
    return StageCosts(
        weights=tuple(held(i) for i in range(inv.n_layers)),
        kv=inv.kv_bytes_per_token_layer * kv_tokens,
        fixed=fixed_bytes + shared,
        ends=(first_bytes, 0) if remote_vocab else (inv.embedding_bytes() + first_bytes,
                                                      inv.head_bytes()),
    )  # fmt: skip


def smallest_capacity(costs: StageCosts, stages: int) -> tuple[int, list[Range]]:
    """The least bytes per stage with which a split into at most `stages` contiguous layer
    ranges holds everything, and that split: ranges balance what each stage holds — its
    layers and their KV cache, the embedding on the first, the head on the last, `fixed` on
    all (binary search on the capacity; for each, the fewest stages by dynamic programming —
    a greedy fill from the front is not enough: at a larger capacity it can pack the layers
    into fewer stages whose last then has no room for the head)."""
    layer, fixed, ends = costs.memory, costs.fixed, costs.ends
    lo, hi = 0, fixed + sum(layer) + sum(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fewest_within(layer, fixed, ends, mid, stages) else (mid + 1, hi)
    split = _fewest_within(layer, fixed, ends, lo, stages)
    assert split is not None
    return lo, split


def _fewest_within(
    layer: Sequence[int], fixed: int, ends: tuple[int, int], cap: int, stages: int
) -> list[Range] | None:
    """The split into the fewest contiguous stages, each holding at most `cap`, or None if
    that takes more than `stages`. best[i]: fewest stages holding layers [0, i)."""
    n = len(layer)
    start = [0]
    for b in layer:
        start.append(start[-1] + b)
    best, prev = [0] + [n + 1] * n, [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i - 1, -1, -1):  # stage [j, i): more layers as j falls
            held = fixed + start[i] - start[j] + (ends[0] if j == 0 else 0)
            if held + (ends[1] if i == n else 0) > cap:
                break
            if best[j] + 1 < best[i]:
                best[i], prev[i] = best[j] + 1, j
    if best[n] > stages:
        return None
    out, i = [], n
    while i > 0:
        out.append((prev[i], i))
        i = prev[i]
    return out[::-1]


def balanced_layers(costs: StageCosts, stages: int, capacity_bytes: int, what: str) -> list[Range]:
    """Contiguous layer ranges for `stages` nodes of `capacity_bytes`, balanced by bytes held
    (smallest_capacity), every node given a share when there are fewer ranges than nodes;
    BudgetError, saying by how much, when they cannot hold it. `what` names the model."""
    need, split = smallest_capacity(costs, stages)
    if need > capacity_bytes:
        raise BudgetError(
            f"{stages} workers need {need:,} bytes each for {what}; --memory is "
            f"{capacity_bytes:,} ({need - capacity_bytes:,} short): add workers or memory"
        )
    while len(split) < min(stages, len(costs.weights)):  # fewer fit: still give all a share
        k = max(range(len(split)), key=lambda i: split[i][1] - split[i][0])
        a, b = split[k]
        if b - a < 2:
            break
        split[k : k + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return split


def fewest_stages(costs: StageCosts, capacity_bytes: int) -> list[Range] | None:
    """The fewest contiguous stages of `capacity_bytes` that hold the model (as the
    coordinator places when told no stage count), balanced; None when none do."""
    n = len(costs.weights)
    if n == 0 or smallest_capacity(costs, n)[0] > capacity_bytes:
        return None
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if smallest_capacity(costs, mid)[0] <= capacity_bytes else (mid + 1, hi)
    return smallest_capacity(costs, lo)[1]


# ---- the context a swarm serves --------------------------------------------------------
# A sequence's KV cache is reserved whole (models/kv_cache.py), so context x sequences in
# flight is what a stage's budget holds after its weights, runtime and scratch: one trades
# against the other. The rule (fit_context): a useful context first — the model's own up to
# USEFUL_CONTEXT tokens — then as many sequences as --max-sequences asks at it, then the
# rest of the model's context those sequences leave room for. A request longer than 4096
# tokens is rare in chat; 8 sequences at 256 tokens refused a 401-token prompt.

USEFUL_CONTEXT_TOKENS = 4096
# ... but a pipeline of S stages is busy only with S sequences in flight (one a stage): with
# fewer, the context is cut to what S sequences fit, down to this; below it, fewer sequences
FLOOR_CONTEXT_TOKENS = 512

CostsAt = Callable[[int, int], StageCosts]  # (context tokens, sequences) -> what stages hold


@dataclass(frozen=True)
class ContextFit:
    """What a swarm serves on some stages of some budget: each sequence's context (prompt +
    completion) and how many sequences are in flight at once."""

    context_tokens: int
    sequences: int

    def __post_init__(self) -> None:
        if self.context_tokens < 1 or self.sequences < 1:
            raise ValueError(f"{self} serves nothing")


def fits(costs: StageCosts, stages: int, capacity_bytes: int) -> bool:
    """Whether at most `stages` nodes of `capacity_bytes` hold the model (balanced ranges)."""
    return smallest_capacity(costs, stages)[0] <= capacity_bytes


def largest_context(
    costs_at: CostsAt, sequences: int, stages: int, capacity_bytes: int, most_tokens: int
) -> int:
    """The longest context <= most_tokens at which `sequences` fit (0: not even one token):
    binary search, a stage's bytes grow with the context."""
    lo, hi = 0, most_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        held = fits(costs_at(mid, sequences), stages, capacity_bytes)
        lo, hi = (mid, hi) if held else (lo, mid - 1)
    return lo


def most_sequences(
    costs_at: CostsAt, context_tokens: int, stages: int, capacity_bytes: int, max_sequences: int
) -> int:
    """The most sequences <= max_sequences of `context_tokens` that fit (0: not one)."""
    for n in range(max_sequences, 0, -1):
        if fits(costs_at(context_tokens, n), stages, capacity_bytes):
            return n
    return 0


def fit_context(
    costs_at: CostsAt, stages: int, capacity_bytes: int, model_context_tokens: int,
    max_sequences: int, wanted_tokens: int | None = None,
) -> ContextFit:  # fmt: skip
    """What `stages` nodes of `capacity_bytes` serve. `wanted_tokens` (--context) is kept,
    with as many sequences as fit; without it the rule above. BudgetError, naming the
    context asked and the longest that fits, when not one sequence does."""
    if wanted_tokens is not None:
        n = most_sequences(costs_at, wanted_tokens, stages, capacity_bytes, max_sequences)
        if n == 0:
            raise BudgetError(too_long(costs_at, wanted_tokens, stages, capacity_bytes))
        return ContextFit(wanted_tokens, n)
    useful = min(model_context_tokens, USEFUL_CONTEXT_TOKENS)
    n = most_sequences(costs_at, useful, stages, capacity_bytes, max_sequences)
    full = min(stages, max_sequences)  # one sequence a stage keeps every stage busy
    if n < full:  # a shorter context for a full pipeline, while it stays a useful one
        longest = largest_context(costs_at, full, stages, capacity_bytes, useful)
        if longest >= FLOOR_CONTEXT_TOKENS:
            return ContextFit(longest, full)
    if n == 0:  # not even the useful context: one sequence, as long as fits
        longest = largest_context(costs_at, 1, stages, capacity_bytes, useful)
        if longest == 0:
            raise BudgetError(too_long(costs_at, 1, stages, capacity_bytes))
        return ContextFit(longest, 1)
    return ContextFit(largest_context(costs_at, n, stages, capacity_bytes, model_context_tokens), n)


def too_long(
    costs_at: CostsAt, context_tokens: int, stages: int, capacity_bytes: int, sequences: int = 1
) -> str:
    """Why a context does not fit, in one line naming it and the longest that does."""
    longest = largest_context(costs_at, sequences, stages, capacity_bytes, context_tokens)
    where = f"{stages} stage(s) of {capacity_bytes:,} bytes"
    if longest == 0:
        need = smallest_capacity(costs_at(1, sequences), stages)[0]
        return (f"the model does not fit {where} even with a 1-token context: a stage needs "
                f"{need:,} bytes ({need - capacity_bytes:,} short); add workers or memory")
    what, fewer = ("one sequence", "") if sequences == 1 else \
        (f"{sequences} sequences", ", fewer --max-sequences")  # fmt: skip
    return (f"a context of {context_tokens:,} tokens does not fit {where}: at most "
            f"{longest:,} tokens ({what}) do; pass --context {longest} or less{fewer}, or "
            "add workers or memory")  # fmt: skip


StageCost = Callable[[int, int, int, bool], float]  # (stage, lo, hi, last) -> seconds a step
StageFits = Callable[[int, int, int], bool]  # (stage, lo, hi) -> whether its node holds it


def cost_balanced_split(
    n_layers: int, n_stages: int, cost: StageCost, fits: StageFits | None = None,
    even: bool = True,
) -> list[Range] | None:
    """Contiguous layer ranges for `n_stages` stages, in ring order, whose slowest stage is
    as fast as can be (a pipeline's rate is its slowest stage's): stage k holding layers
    [lo, hi) takes `cost(k, lo, hi, last)` seconds a step (`last`: it holds the head too)
    and must fit its node, `fits(k, lo, hi)` (always, without it); every stage gets a layer.
    None when no split fits. Of the splits that fast, the most even: the least sum of the
    stages' squared times, not all the slack on the last stages as a greedy fill from the
    front leaves it (ties, to a part in 1e12: the earlier stages get more layers); with
    `even` False, the greedy fill's own (each stage as many layers as it may take).

    `cost` and `fits` must be monotone: a stage is never faster, nor fits where a part of
    it does not, for holding more layers. The slowest stage's time T is bisected, each
    probe deciding exactly from the back whether every stage can stay within it (stage k
    may start at layer p when its fewest layers from p reach a start of stage k + 1 within
    T): n_stages x n_layers cost calls a probe, some 40 probes. The even split at T is a
    dynamic programme over only the ends each stage may reach within T: n_stages x n_layers
    x the layers a stage holds within T (about n_layers / n_stages), not a full n_stages x
    n_layers^2."""
    if not 1 <= n_stages <= n_layers:
        return None
    last = n_stages - 1
    holds = fits or (lambda k, lo, hi: True)

    def secs(k: int, lo: int, hi: int) -> float:
        return cost(k, lo, hi, k == last)

    def starts(k: int) -> range:  # stage k's first layer, leaving one for each other stage
        return range(k, n_layers - last + k) if k else range(1)

    def within(t: float) -> float | None:
        """The slowest stage of a split with every stage within t — from the front, each
        stage's fewest layers from which the later stages still can be — or None when no
        split keeps within t."""
        may = [False] * n_layers + [True]  # [p]: the stages after this one can start at p
        firsts = []  # per stage, from the last: [p] the first start of the next stage > p
        for k in range(last, -1, -1):
            first, nxt = [n_layers + 1] * (n_layers + 1), n_layers + 1
            for p in range(n_layers, -1, -1):
                first[p], nxt = nxt, (p if may[p] else nxt)
            firsts.append(first)
            may = [False] * (n_layers + 1)
            for p in starts(k):
                q = first[p]
                may[p] = q <= n_layers and secs(k, p, q) <= t and holds(k, p, q)
        if not may[0]:
            return None
        lo, worst = 0, 0.0
        for k, first in enumerate(reversed(firsts)):
            worst, lo = max(worst, secs(k, lo, first[lo])), first[lo]
        return worst

    top = max(max(secs(k, 0, n_layers), cost(k, 0, n_layers, False)) for k in range(n_stages))
    t = within(top)
    if t is None:
        return None
    lo_t = 0.0
    while t - lo_t > 1e-12 * t:  # t: always a feasible split's own slowest stage
        mid = (lo_t + t) / 2
        worst = within(mid)
        lo_t, t = (lo_t, worst) if worst is not None else (mid, t)

    # the most even split within t: best[k][p], the least sum of squared times of stages
    # k.. holding layers [p, n); end[k][p], where stage k then ends
    best = [dict.fromkeys(starts(k), math.inf) for k in range(n_stages)] + [{n_layers: 0.0}]
    end = [dict.fromkeys(starts(k), -1) for k in range(n_stages)]
    for k in range(last, -1, -1):
        for p in starts(k):
            options = []
            for q in range(p + 1, n_layers - last + k + 1) if k < last else (n_layers,):
                s = secs(k, p, q)
                if s > t or not holds(k, p, q):
                    break
                if best[k + 1].get(q, math.inf) < math.inf:
                    options.append((s * s + best[k + 1][q], q))
            if options:
                least = min(v for v, _ in options)
                near = [q for v, q in options if v <= least * (1 + 1e-12) or not even]
                best[k][p], end[k][p] = least, max(near)
    assert best[0][0] < math.inf  # t is a split's own slowest stage
    split, lo = [], 0
    for k in range(n_stages):
        split.append((lo, end[k][lo]))
        lo = end[k][lo]
    return split


def time_balanced_split(
    n_layers: int,
    read: Callable[[int, int, bool], float],
    seconds_per_byte: Sequence[float],
    fits: Callable[[int, int, int], bool],
) -> list[tuple[int, int]] | None:
    """Layer ranges for the stages of a ring by measured speed (rebalance.py): stage k's
    step takes seconds_per_byte[k] x read(lo, hi, last), the bytes its decode step reads at
    its node's measured speed, and must fit its node (`fits(k, lo, hi)`) — the slowest
    stage as fast as can be (cost_balanced_split), so a slow node ends up with fewer
    layers, a fast one with more; each stage as many as it may take, in ring order (the
    split a rebalance has always made: what a ring runs changes only when its slowest
    stage's time does). None when no split fits."""
    return cost_balanced_split(
        n_layers, len(seconds_per_byte),
        lambda k, lo, hi, last: seconds_per_byte[k] * read(lo, hi, last), fits, even=False,
    )  # fmt: skip


def expert_parts(
    moe_layers: Sequence[int], n_experts: int, expert_nodes: int
) -> list[dict[int, tuple[int, ...]]]:
    """Every MoE layer's routed experts dealt round-robin over `expert_nodes` part servers
    (expert e of each layer on node e mod N, so a token's k experts usually land on k
    different nodes and work in parallel): per node, layer -> the experts it holds."""
    return [{i: tuple(range(j, n_experts, expert_nodes)) for i in moe_layers}
            for j in range(expert_nodes)]  # fmt: skip


def vocab_parts(vocab_size: int, vocab_nodes: int) -> list[Range]:
    """The embedding's and head's rows in `vocab_nodes` contiguous ranges, sizes within one."""
    return even_split(vocab_size, vocab_nodes) if vocab_nodes else []


def layer_placement(
    inv: ModelInventory, split: Sequence[Range], kv_tokens: int = 0, draft_bytes: int = 0
) -> Placement:
    """One stage per half-open layer range [lo, hi) (they must cover 0..n_layers in order),
    each holding its layers whole with `kv_tokens` of KV cache; the embedding on the first,
    the head on the last: the Placement of a split the swarm runs."""
    ranges = [(int(lo), int(hi)) for lo, hi in split]
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != inv.n_layers:
        raise RequestError(
            f"split {ranges} must start at layer 0 and end at {inv.n_layers} (half-open ranges)"
        )
    for (_, a), (b, c) in itertools.pairwise(ranges):
        if a != b or c <= b:
            raise RequestError(f"split {ranges}: ranges must be contiguous and non-empty")
    if ranges[0][1] <= 0:
        raise RequestError(f"split {ranges}: ranges must be non-empty")
    slots = []
    vocab = (0, inv.vocab_size)
    for i, (lo, hi) in enumerate(ranges):
        units = tuple(
            (layer, g.kind, 0, g.n_units) for layer in range(lo, hi) for g in inv.groups(layer)
        )
        nbytes = sum(inv.core(layer)[0] for layer in range(lo, hi))
        nbytes += sum(g.total_bytes for layer in range(lo, hi) for g in inv.groups(layer))
        first, last = i == 0, i == len(ranges) - 1
        nbytes += (inv.embedding_bytes() if first else 0) + (inv.head_bytes() if last else 0)
        slots.append(
            Slot(
                node=i,
                layers=(lo, hi),
                units=units,
                embed_rows=vocab if first else None,
                head_rows=vocab if last else None,
                weight_bytes=nbytes,
                kv_bytes=(hi - lo) * inv.kv_bytes_per_token_layer * kv_tokens,
                draft_bytes=draft_bytes if first else 0,
            )
        )
    return Placement(tuple(slots), capacity_bytes=max(s.used_bytes for s in slots))


def place(
    inv: ModelInventory, capacity_bytes: int, kv_tokens: int, separate_experts: bool = False,
    stages: int | None = None, draft_bytes: int = 0,
) -> Placement:
    """A plan's placement: the swarm's own (the fewest balanced contiguous stages, as the
    coordinator places; exactly `stages` of them when asked, as `cellswarm up --stages`
    does) when whole layers fit a node, else the fill mode that splits a layer's
    feed-forward units and the vocabulary rows over nodes (place_pipeline). `draft_bytes`:
    a draft model the first node holds too (speculative decoding)."""
    if stages is not None:
        return _place_stages(inv, capacity_bytes, kv_tokens, stages, draft_bytes)
    if not separate_experts and capacity_bytes > 0:
        costs = stage_costs_of(inv, kv_tokens, 0, first_bytes=draft_bytes)
        split = fewest_stages(costs, capacity_bytes)
        if split is not None:
            return layer_placement(inv, split, kv_tokens, draft_bytes)
    return place_pipeline(inv, capacity_bytes, kv_tokens, separate_experts, draft_bytes)


def _place_stages(inv: ModelInventory, capacity_bytes: int, kv_tokens: int,
                  stages: int, draft_bytes: int = 0) -> Placement:  # fmt: skip
    """`stages` balanced contiguous stages: the split the coordinator places when its
    --stages asks for them (control/placing.py: balanced_layers on the same costs; the
    fixed bytes a node also holds are taken out of `capacity_bytes` here, added there)."""
    if not 1 <= stages <= inv.n_layers:
        raise RequestError(f"--stages {stages}: give 1 to {inv.n_layers} (the model's layers)")
    try:
        split = balanced_layers(stage_costs_of(inv, kv_tokens, 0, first_bytes=draft_bytes),
                                stages, max(capacity_bytes, 0), inv.name)  # fmt: skip
    except BudgetError as exc:
        return Placement((), capacity_bytes, str(exc).replace("--memory is", "a node gives"))
    return layer_placement(inv, split, kv_tokens, draft_bytes)
