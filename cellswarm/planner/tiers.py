"""One box, two memory tiers: which tensors live in DRAM and what each token reads from where.

What every token needs — attention, norms, router, shared experts, embedding rows, output
head — is pinned in DRAM first; the DRAM left over caches routed experts. With uniform
routing the cache's hit rate is the fraction of expert bytes it holds (routing statistics
make the real cache better: `expert_hit_rate` overrides it). A token reads its dense weights
from DRAM and its experts from DRAM (hits) or the slow tier (misses); the tiers are read one
after the other, so their times add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cellswarm.planner import cost
from cellswarm.planner.inventory import ModelInventory

PINNED_KINDS = ("attention", "norm", "router", "shared_experts", "embedding", "output", "ffn")


@dataclass(frozen=True)
class TierPlan:
    dram_name: str
    slow_name: str
    dram_budget_bytes: int
    pinned_bytes: int  # dense tensors kept in DRAM
    pinned_kinds: tuple[str, ...]
    cached_expert_bytes: int  # DRAM left for the expert cache
    slow_bytes: int  # bytes that live only in the slow tier
    hit_rate: float
    dram_bytes_per_token: float
    slow_bytes_per_token: float
    decode: cost.StepTime
    problem: str = ""

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.decode.total_s


def plan_tiers(inv: ModelInventory, req: Any, scratch: int) -> TierPlan:
    node = req.node
    dram, slow = node.tiers[0], node.tiers[-1]
    kv = inv.kv_bytes_per_token_layer * inv.n_layers * req.context * req.concurrency
    budget = req.dram_bytes if req.dram_bytes is not None else dram.capacity_bytes
    budget = max(budget - req.runtime_overhead_bytes - scratch - kv, 0)
    dense = sum(t.nbytes for t in inv.tensors if t.kind != "experts")
    experts = inv.weight_bytes - dense
    pinned = min(dense, budget)
    cache = min(experts, budget - pinned)
    hit = (
        req.expert_hit_rate
        if req.expert_hit_rate is not None
        else cache / experts
        if experts
        else 1.0
    )
    per_token_dense = inv.decode_bytes_per_token() - _active_expert_bytes(inv)
    dense_in_dram = pinned / dense if dense else 1.0
    dram_read = per_token_dense * dense_in_dram + _active_expert_bytes(inv) * hit
    slow_read = per_token_dense * (1 - dense_in_dram) + _active_expert_bytes(inv) * (1 - hit)
    decode = _decode(inv, node, dram, slow, dram_read, slow_read)
    capacity = budget + slow.capacity_bytes
    problem = (
        ""
        if capacity >= inv.weight_bytes
        else (
            f"the weights ({inv.weight_bytes:,} bytes) exceed DRAM + {slow.name} "
            f"({capacity:,} bytes) by {inv.weight_bytes - capacity:,}"
        )
    )
    return TierPlan(
        dram.name, slow.name, budget, pinned, PINNED_KINDS, cache,
        inv.weight_bytes - pinned - cache, hit, dram_read, slow_read, decode, problem,
    )  # fmt: skip


def _active_expert_bytes(inv: ModelInventory) -> int:
    return sum(inv.expert_bytes(i) for i in range(inv.n_layers)) * inv.n_experts_used


def _decode(
    inv: ModelInventory, node: Any, dram: Any, slow: Any, dram_read: float, slow_read: float
) -> cost.StepTime:
    memory = dram_read / dram.effective_bandwidth_bytes_per_s
    memory += slow_read / slow.effective_bandwidth_bytes_per_s
    compute = 2 * inv.active_params / node.effective_flops
    if compute > memory:
        return cost.StepTime(compute_s=compute)
    return cost.StepTime(memory_s=memory)
