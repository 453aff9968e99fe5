"""One big box, two memory tiers: the weights every token needs in DRAM, routed experts read
from a slow tier (a DAX-mounted PMem namespace, an SSD) through a DRAM expert cache.

Placement (`load_tiered`):
  - pinned: attention, norms, router, shared experts, dense FFNs and the output head are
    *copied* out of the file into anonymous memory (they are read by every token);
  - the token embedding stays memory-mapped: a token reads one row of it;
  - routed experts stay in the file. The DRAM left under the budget after the pinned
    tensors, the decoded attention up-projections, the KV cache, scratch and the runtime
    already resident becomes a pool of expert slots (`ExpertCache`).

The MoE layer reaches the experts through `Deepseek2.remote_experts` (the seam expert nodes
use): the model's own stacks are `select`ed down to no experts, so it computes none itself;
`TieredExperts.scatter` computes every routed expert with the same float32 arithmetic as
`apply_experts`, and the model adds them in its ascending order — the output is bitwise the
untiered one.

Replacement policy: LFU over routing counts, with admission. A decode step touches each MoE
layer once, so expert accesses cycle over the layers: between two uses of one layer's expert
every other layer's experts are read. That cyclic pattern is LRU's worst case (a cache
smaller than the working set evicts each expert just before it is wanted again); MoE routing
is also skewed and stable (some experts are chosen far more than others, and stay so). So a
missed expert takes a slot only when it has been routed to more often than the coldest
cached expert; otherwise it is streamed through one scratch slot and the cache is left
alone. Counts never decay (a generation is short next to routing drift); they can be saved
and loaded (`--routing-stats`) so a new run starts with the hottest experts already cached.

Budget enforcement, honestly:
  - anonymous memory: the pool is sized from the budget minus what is resident (`RssAnon`)
    once the pinned tensors are in, minus the KV cache and scratch the architecture reports;
    `RssAnon` is sampled at every MoE layer and its peak reported (`peak_anon_bytes`). It is
    planned and measured, not a hard limit (no cgroup): Python allocations beyond the
    architecture's scratch estimate would show up in the sample, not be refused;
  - file-backed pages: after an expert is copied out of the mapping, its pages are dropped
    from this process's mapping (`madvise(MADV_DONTNEED)`) and from the page cache
    (`posix_fadvise(POSIX_FADV_DONTNEED)`), so the page cache does not silently become the
    DRAM tier. `RssFile` is sampled too. The embedding rows read stay mapped (tiny).

Slow-tier throttle: `slow_bandwidth` paces expert reads to that many bytes/s by sleeping
after each copy (we cannot mount PMem here); bench/tiered.py uses it.
"""

from cellswarm.engine.tiered.cache import ExpertCache, TierCounters, TieredExperts
from cellswarm.engine.tiered.load import Placement, TieredModel, load_tiered
from cellswarm.engine.tiered.numa import dram_bandwidth, numa_nodes, pin_numa
from cellswarm.engine.tiered.slow import SlowTier, faults

__all__ = ["ExpertCache", "Placement", "SlowTier", "TierCounters", "TieredExperts",
           "TieredModel", "dram_bandwidth", "faults", "load_tiered", "numa_nodes", "pin_numa"]
