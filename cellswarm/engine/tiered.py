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

from __future__ import annotations

import json
import mmap
import os
import resource
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cellswarm.engine.memory import proc_status
from cellswarm.engine.model import PREFILL_CHUNK, Model
from cellswarm.errors import RequestError
from cellswarm.io.gguf_file import GGUFFile, TensorInfo, to_tensor
from cellswarm.io.names import tensor_kind
from cellswarm.io.weights import Selection, WeightStore
from cellswarm.models import module_of
from cellswarm.quant import PackedExperts, PackedMatrix, format_for

PAGE = mmap.PAGESIZE
# A fault on a file mapping maps more than the faulting page: fault-around (64 KiB of cached
# pages) and, where the filesystem caches the file in large folios (ext4 on Linux 6.x: up
# to 2 MiB), the whole folio. A release covers the aligned 2 MiB windows a range touched;
# dropping a neighbour's mapping is harmless (it is read-only and re-faults if needed).
RELEASE_ALIGN = max(PAGE, 2 << 20)
SAFETY_BYTES = 4 << 20  # malloc slack and small Python objects made while running
STREAM_BUFFERS = 2  # experts read past the cache: one is read while the other computes
PROJ = ("gate", "up", "down")


def faults() -> tuple[int, int]:
    """(major, minor) page faults of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return int(r.ru_majflt), int(r.ru_minflt)


# ----------------------------------------------------------------------------- slow tier


class SlowTier:
    """The model file, memory-mapped read-only; expert bytes are copied out of it and their
    pages released after each copy. `bandwidth`: pace reads to this many bytes/s (None:
    as fast as the device gives them)."""

    def __init__(self, path: Path, bandwidth: float | None = None) -> None:
        self.path = path
        self._fh = path.open("rb")
        self.fd = self._fh.fileno()
        self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        self.view = np.frombuffer(self.map, dtype=np.uint8)
        self.bandwidth = bandwidth
        self.bytes_read = 0
        self.seconds = 0.0  # time spent reading, throttle sleep included

    def read_into(self, ranges: list[tuple[int, int]], out: np.ndarray) -> None:
        """Copy the file ranges (offset, nbytes), back to back, into `out` (uint8), then
        release their pages from the mapping and the page cache."""
        t0 = time.perf_counter()
        pos = 0
        for off, n in ranges:
            out[pos : pos + n] = self.view[off : off + n]
            pos += n
        for off, n in ranges:
            self.release(off, n)
        elapsed = time.perf_counter() - t0
        if self.bandwidth:
            wait = pos / self.bandwidth - elapsed
            if wait > 0:
                time.sleep(wait)
        self.bytes_read += pos
        self.seconds += time.perf_counter() - t0

    def release(self, off: int, n: int) -> None:
        start = off - off % RELEASE_ALIGN
        length = off + n - start
        length += -length % RELEASE_ALIGN
        length = min(length, len(self.map) - start)
        self.map.madvise(mmap.MADV_DONTNEED, start, length)
        first = off - off % PAGE  # the page cache: only the pages read
        os.posix_fadvise(self.fd, first, off + n - first, os.POSIX_FADV_DONTNEED)

    def page_cache_bytes(self) -> int:
        """Bytes of the model file in the page cache now (mincore over the whole mapping):
        whether the page cache is quietly acting as a DRAM tier. -1 where unavailable."""
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pages = -(-len(self.map) // PAGE)
            vec = (ctypes.c_ubyte * pages)()
            addr = ctypes.c_void_p(self.view.ctypes.data)
            if libc.mincore(addr, ctypes.c_size_t(len(self.map)), vec) != 0:
                return -1
            return int((np.frombuffer(bytes(vec), np.uint8) & 1).sum()) * PAGE
        except (OSError, AttributeError):
            return -1

    def release_all(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED, 0, len(self.map))
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)


# ----------------------------------------------------------------------------- expert cache


@dataclass
class TierCounters:
    uses: int = 0  # one use: one expert of one layer run at one step
    hits: int = 0
    misses: int = 0
    admitted: int = 0
    evicted: int = 0
    dram_expert_bytes: int = 0  # expert bytes served from the cache
    slow_bytes: int = 0  # expert bytes read from the slow tier
    steps: int = 0  # forward steps (counted at the first MoE layer)
    tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class ExpertCache:
    """`n_slots` experts of `slot_bytes` each (gate | up | down packed back to back) in one
    anonymous buffer, LFU with admission (see the module docstring)."""

    n_slots: int
    slot_bytes: int
    pool: np.ndarray = field(init=False)
    scratch: list[np.ndarray] = field(init=False)  # two: one read while one computes
    slot_of: dict[tuple[int, int], int] = field(default_factory=dict)
    key_of: list[tuple[int, int] | None] = field(init=False)
    counts: dict[tuple[int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # np.empty: pages become resident as slots are filled, never beyond n_slots.
        self.pool = np.empty((self.n_slots, self.slot_bytes), np.uint8)
        self.scratch = [np.empty(self.slot_bytes, np.uint8) for _ in range(STREAM_BUFFERS)]
        self.key_of = [None] * self.n_slots
        self._slot_count = np.zeros(self.n_slots, np.int64)  # count of the key in each slot

    def note(self, key: tuple[int, int]) -> int:
        c = self.counts.get(key, 0) + 1
        self.counts[key] = c
        slot = self.slot_of.get(key)
        if slot is not None:
            self._slot_count[slot] = c
        return c

    def victim(self, count: int, busy: frozenset[int] | set[int] = frozenset()) -> int | None:
        """The slot a newly read expert routed `count` times should take, or None (stream).
        `busy` slots (in use by the step being planned) are never taken."""
        if self.n_slots == 0 or len(busy) >= self.n_slots:
            return None
        counts = self._slot_count
        if busy:
            counts = counts.copy()
            counts[list(busy)] = np.iinfo(np.int64).max
        slot = int(np.argmin(counts))  # free slots have count 0
        return slot if counts[slot] < count else None

    def put(self, slot: int, key: tuple[int, int], count: int) -> bool:
        """Store `key` in `slot`; True when it evicted another expert."""
        old = self.key_of[slot]
        if old is not None:
            del self.slot_of[old]
        self.key_of[slot] = key
        self.slot_of[key] = slot
        self._slot_count[slot] = count
        return old is not None


class TieredExperts:
    """`RemoteExperts` for a tiered box: every routed expert, from the DRAM cache or the slow
    tier. Counts hits, misses and bytes per tier; samples RssAnon / RssFile."""

    def __init__(
        self,
        model_config: Any,
        slow: SlowTier,
        infos: dict[str, TensorInfo],
        cache: ExpertCache,
        moe_layers: list[int],
    ) -> None:
        self.config = model_config
        self.slow = slow
        self.cache = cache
        self.first_moe = moe_layers[0] if moe_layers else -1
        self.fmt: dict[tuple[int, str], Any] = {}
        self.layout: dict[tuple[int, str], tuple[int, int, int, int]] = {}
        for layer in moe_layers:  # (file offset, bytes per expert, rows, row bytes)
            for proj in PROJ:
                info = infos[f"blk.{layer}.ffn_{proj}_exps.weight"]
                fmt = format_for(_ggml_type(info))
                _n_exp, rows, cols = info.shape
                row_bytes = fmt.row_bytes(cols)
                self.fmt[layer, proj] = fmt
                self.layout[layer, proj] = (info.offset, rows * row_bytes, rows, row_bytes)
        self.total = TierCounters()
        self.decode = TierCounters()  # steps of one token only
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="slow-tier")
        self.peak_anon = 0
        self.peak_file = 0

    def expert_bytes(self, layer: int) -> int:
        return sum(self.layout[layer, p][1] for p in PROJ)

    def sample_memory(self) -> None:
        s = proc_status()
        self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))
        self.peak_file = max(self.peak_file, s.get("RssFile", 0))

    def preload(self, keys: list[tuple[int, int]]) -> int:
        """Fill free slots with these experts (hottest first); bytes read. Not counted as
        token reads."""
        n = 0
        for key in keys[: self.cache.n_slots]:
            if key in self.cache.slot_of or key[0] not in {k[0] for k in self.layout}:
                continue
            slot = self.cache.victim(10**12)
            if slot is None:
                break
            self.slow.read_into(self._ranges(*key), self.cache.pool[slot])
            self.cache.put(slot, key, self.cache.counts.get(key, 0))
            n += self.expert_bytes(key[0])
        return n

    def _ranges(self, layer: int, e: int) -> list[tuple[int, int]]:
        out = []
        for proj in PROJ:
            off, per, _, _ = self.layout[layer, proj]
            out.append((off + e * per, per))
        return out

    def _matrices(self, layer: int, buf: np.ndarray) -> list[PackedMatrix]:
        out, pos = [], 0
        for proj in PROJ:
            _, per, rows, row_bytes = self.layout[layer, proj]
            data = buf[pos : pos + per].reshape(rows, row_bytes)
            out.append(PackedMatrix(data, self.fmt[layer, proj]))
            pos += per
        return out

    def _plan(
        self, layer: int, e: int, counters: list[TierCounters], busy: set[int]
    ) -> tuple[int | None, bool]:
        """Count one use of expert `e`; (cache slot, whether it must be read first). A miss
        gets a slot if admitted (reserved now, so two misses never pick the same one), else
        None: it streams through a scratch buffer."""
        key = (layer, e)
        count = self.cache.note(key)
        size = self.expert_bytes(layer)
        slot = self.cache.slot_of.get(key)
        for c in counters:
            c.uses += 1
            if slot is not None:
                c.hits += 1
                c.dram_expert_bytes += size
            else:
                c.misses += 1
                c.slow_bytes += size
        if slot is not None:
            busy.add(slot)
            return slot, False
        victim = self.cache.victim(count, busy)
        if victim is not None:
            busy.add(victim)
            evicted = self.cache.put(victim, key, count)
            for c in counters:
                c.admitted += 1
                c.evicted += int(evicted)
        return victim, True

    def scatter(
        self, layer: int, h: np.ndarray, routing: Any
    ) -> Callable[[], dict[int, np.ndarray]]:
        """Every routed expert of this layer: cached ones computed at once while the first
        miss is read on the reader thread; each later miss read while the one before it
        computes (prefetch within the layer). Each weighted output is handed back apart;
        the model adds them in ascending expert order, as `apply_experts` does, so the
        result is the same bits."""
        from cellswarm.models import ops

        counters = [self.total] + ([self.decode] if h.shape[0] == 1 else [])
        if layer == self.first_moe:
            for c in counters:
                c.steps += 1
                c.tokens += h.shape[0]
        order = [int(e) for e in np.unique(routing.expert_ids).tolist()]
        busy: set[int] = set()  # slots this step reads from: no miss may overwrite them
        plans = {e: self._plan(layer, e, counters, busy) for e in order}
        misses = [e for e in order if plans[e][1]]
        bufs: dict[int, np.ndarray] = {}
        for i, e in enumerate(misses):
            slot = plans[e][0]
            bufs[e] = self.cache.pool[slot] if slot is not None else self.cache.scratch[i % 2]

        def read(e: int) -> Future[None]:
            return self.reader.submit(self.slow.read_into, self._ranges(layer, e), bufs[e])

        ys: dict[int, np.ndarray] = {}

        def run(e: int, buf: np.ndarray) -> None:
            gate, up, down = self._matrices(layer, buf)
            tokens, _ = np.nonzero(routing.expert_ids == e)
            ys[e] = ops.swiglu(h[tokens], gate, up, down)

        pending = read(misses[0]) if misses else None
        for e in order:
            slot, _ = plans[e]
            if not plans[e][1] and slot is not None:
                run(e, self.cache.pool[slot])
        for i, e in enumerate(misses):
            assert pending is not None
            pending.result()
            # the next read may reuse only the scratch buffer two misses back: computed by now
            pending = read(misses[i + 1]) if i + 1 < len(misses) else None
            run(e, bufs[e])
        for e in order:  # in place: one multiply, as `apply_experts` rounds it
            tokens, slots = np.nonzero(routing.expert_ids == e)
            ys[e] *= routing.weights[tokens, slots][:, None]
        self.sample_memory()
        return lambda: ys

    def save_counts(self, path: Path) -> None:
        rows = [[k[0], k[1], c] for k, c in sorted(self.cache.counts.items())]
        path.write_text(json.dumps({"routing_counts": rows}))

    def load_counts(self, path: Path) -> None:
        for layer, e, c in json.loads(path.read_text())["routing_counts"]:
            self.cache.counts[int(layer), int(e)] = int(c)


def _ggml_type(info: TensorInfo) -> Any:
    import gguf

    return gguf.GGMLQuantizationType(info.ggml_type)


# ----------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    dram_budget: int
    runtime_bytes: int  # RssAnon before the pinned tensors (interpreter, numpy, ...)
    pinned_by_kind: dict[str, int]
    mapped_by_kind: dict[str, int]  # kept memory-mapped (the embedding)
    absorbed_bytes: int  # decoded W_UK / W_UV, float32, per attention layer
    reserved_bytes: int  # KV cache + scratch for `context` tokens
    expert_bytes_total: int
    expert_slot_bytes: int
    cache_slots: int
    n_experts_total: int
    preloaded_bytes: int

    @property
    def pinned_bytes(self) -> int:
        return sum(self.pinned_by_kind.values())

    @property
    def cache_bytes(self) -> int:
        return self.cache_slots * self.expert_slot_bytes

    @property
    def slow_only_bytes(self) -> int:
        return self.expert_bytes_total - self.cache_bytes

    def describe(self) -> str:
        from cellswarm.units import format_bytes as fb

        kinds = ", ".join(f"{k} {fb(v)}" for k, v in sorted(self.pinned_by_kind.items()))
        mapped = ", ".join(f"{k} {fb(v)}" for k, v in sorted(self.mapped_by_kind.items()))
        return (
            f"[tiered placement | DRAM budget {fb(self.dram_budget)}: runtime "
            f"{fb(self.runtime_bytes)}, pinned {fb(self.pinned_bytes)} ({kinds}), decoded "
            f"attention {fb(self.absorbed_bytes)}, KV+scratch {fb(self.reserved_bytes)}, "
            f"expert cache {self.cache_slots} of {self.n_experts_total} experts "
            f"({fb(self.cache_bytes)}) | mapped: {mapped or '-'} | slow tier: "
            f"{fb(self.slow_only_bytes)} of experts not cached]"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "dram_budget": self.dram_budget,
            "runtime_bytes": self.runtime_bytes,
            "pinned_by_kind": self.pinned_by_kind,
            "mapped_by_kind": self.mapped_by_kind,
            "absorbed_bytes": self.absorbed_bytes,
            "reserved_bytes": self.reserved_bytes,
            "cache_slots": self.cache_slots,
            "cache_bytes": self.cache_bytes,
            "n_experts_total": self.n_experts_total,
            "expert_bytes_total": self.expert_bytes_total,
            "slow_only_bytes": self.slow_only_bytes,
            "preloaded_bytes": self.preloaded_bytes,
        }


@dataclass
class TieredModel:
    model: Model
    experts: TieredExperts
    placement: Placement
    slow: SlowTier
    faults_at_load: tuple[int, int] = (0, 0)  # (major, minor) page faults when loaded
    numa_note: str | None = None

    def stats(self, decode_s: float | None = None) -> dict[str, Any]:
        """Counters of the whole run and per decode token (dense DRAM reads included)."""
        ex = self.experts
        d = ex.decode
        per = max(d.steps, 1)
        dense = self.placement.pinned_bytes - self.placement.pinned_by_kind.get("embedding", 0)
        row = self.model.config.d_model * 4  # ~ one embedding row (f32 upper bound)
        st = proc_status()
        major, minor = faults()
        return {
            "majflt": major - self.faults_at_load[0],  # since load: the run's page faults
            "minflt": minor - self.faults_at_load[1],
            "total": ex.total.as_dict(),
            "decode": d.as_dict(),
            "hit_rate": ex.total.hits / ex.total.uses if ex.total.uses else 0.0,
            "decode_hit_rate": d.hits / d.uses if d.uses else 0.0,
            "dram_bytes_per_token": dense + row + d.dram_expert_bytes / per,
            "slow_bytes_per_token": d.slow_bytes / per,
            "slow_read_s": self.slow.seconds,
            "slow_bytes_read": self.slow.bytes_read,
            "peak_rss_anon": ex.peak_anon,
            "peak_rss_file": ex.peak_file,
            "rss_anon": st.get("RssAnon", 0),
            "rss_file": st.get("RssFile", 0),
            "page_cache_bytes": self.slow.page_cache_bytes(),
        }


def load_tiered(
    path: str | os.PathLike[str],
    dram_budget: int,
    *,
    slow_bandwidth: float | None = None,
    context: int = 512,
    routing_stats: Path | None = None,
    tokenizer: bool = True,
    selection: Selection | None = None,
) -> TieredModel:
    """Load a MoE GGUF file for a box whose DRAM holds `dram_budget` bytes of this process's
    anonymous memory in all; see the module docstring. `selection`: a swarm worker's shard
    (its layer range, embedding / head or not), tiered the same way."""
    sel = selection or Selection()
    from cellswarm.loader import check_tensors, gguf_config, gguf_tokenizer

    p = Path(path)
    f = GGUFFile(p)
    entry, config = gguf_config(p, f)
    if not getattr(config, "n_experts", 0):
        raise RequestError(f"{p} has no routed experts; --dram-budget tiers MoE models only")
    infos = {n: f._reader_tensor(n) for n in f.tensor_names() if sel.keeps(n)}
    check_tensors(p, config, sel, {n: i.shape for n, i in infos.items()})
    runtime = proc_status().get("RssAnon", 0)
    slow = SlowTier(p, slow_bandwidth)

    tensors: dict[str, Any] = {}
    pinned: dict[str, int] = {}
    mapped: dict[str, int] = {}
    expert_total = 0
    for name, info in infos.items():
        kind = tensor_kind(name)
        view = slow.view[info.offset : info.offset + info.n_bytes]
        if kind == "experts":
            stack = to_tensor(info, view)
            assert isinstance(stack, PackedExperts)
            tensors[name] = stack.select(())  # the stack stays in the file: served by the cache
            expert_total += info.n_bytes
        elif kind == "embedding":
            tensors[name] = to_tensor(info, view)  # a token reads one row: stays mapped
            mapped[kind] = mapped.get(kind, 0) + info.n_bytes
        else:
            t = to_tensor(info, np.array(view))  # copied out: anonymous memory
            tensors[name] = np.array(t) if isinstance(t, np.ndarray) else t
            pinned[kind] = pinned.get(kind, 0) + info.n_bytes
            slow.release(info.offset, info.n_bytes)
    weights = WeightStore(tensors)
    tok = gguf_tokenizer(f.metadata, config.vocab_size) if tokenizer else None
    arch = module_of(entry).MODEL(config, weights)
    model = Model(config, arch, weights, tok, sel, None)
    moe_layers = [i for i in model.layers if config.is_moe(i)]
    if not moe_layers:
        raise RequestError(f"layers {model.layers} of {p} hold no routed experts to tier")
    absorbed = config.absorbed_bytes_per_layer() * len(model.layers)
    kv = model.kv_bytes_per_token() * context
    scratch = config.scratch_bytes(min(context, PREFILL_CHUNK), context)
    reserved = kv + scratch
    used = proc_status().get("RssAnon", 0)  # runtime + pinned copies
    slot = sum(infos[f"blk.{moe_layers[0]}.ffn_{q}_exps.weight"].n_bytes for q in PROJ)
    slot //= config.n_experts
    # the streaming buffers come out of the budget too
    free = dram_budget - used - absorbed - reserved - SAFETY_BYTES - STREAM_BUFFERS * slot
    n_total = config.n_experts * len(moe_layers)
    if free < 0:
        from cellswarm.units import format_bytes as fb

        raise RequestError(
            f"--dram-budget {fb(dram_budget)} is below what every token needs: runtime and "
            f"pinned tensors {fb(used)}, decoded attention {fb(absorbed)}, KV cache and scratch "
            f"for {context} tokens {fb(reserved)}; give at least {fb(dram_budget - free)}"
        )
    n_slots = min(free // slot, n_total)
    cache = ExpertCache(int(n_slots), int(slot))
    experts = TieredExperts(config, slow, infos, cache, moe_layers)
    preloaded = 0
    if routing_stats is not None and routing_stats.is_file():
        experts.load_counts(routing_stats)
        hottest = sorted(cache.counts, key=lambda k: -cache.counts[k])
        preloaded = experts.preload(hottest)
        slow.bytes_read = 0
        slow.seconds = 0.0
    arch.remote_experts = experts
    for layer in model.layers:  # decode W_UK / W_UV now: they are pinned too
        arch.absorbed(layer)
    experts.sample_memory()
    placement = Placement(
        dram_budget, runtime, pinned, mapped, absorbed, reserved, expert_total, int(slot),
        int(n_slots), n_total, preloaded,
    )  # fmt: skip
    return TieredModel(model, experts, placement, slow, faults())


# ----------------------------------------------------------------------------- NUMA


def numa_nodes() -> list[int]:
    base = Path("/sys/devices/system/node")
    return sorted(int(d.name[4:]) for d in base.glob("node[0-9]*")) if base.is_dir() else []


def _cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_numa(node: int) -> str:
    """Run this process's threads on NUMA node `node`'s CPUs and bind its new allocations
    to that node's memory (set_mempolicy MPOL_BIND). A no-op, said so, on a one-node box.
    Call before loading: pages are placed when first touched."""
    nodes = numa_nodes()
    if len(nodes) <= 1:
        return f"numa: {max(len(nodes), 1)} node on this machine; --numa is a no-op"
    if node not in nodes:
        raise RequestError(f"--numa {node}: this machine has NUMA nodes {nodes}")
    cpus = _cpulist(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())
    os.sched_setaffinity(0, cpus)
    bound = _bind_memory(node)
    return f"numa: threads on node {node} ({len(cpus)} CPUs), memory {bound}"


def _bind_memory(node: int) -> str:
    import ctypes
    import platform

    nr = {"x86_64": 238, "aarch64": 237}.get(platform.machine())
    if nr is None:
        return "first-touch (set_mempolicy unknown on this CPU)"
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    mpol_bind = 2
    if libc.syscall(nr, mpol_bind, ctypes.byref(mask), ctypes.c_ulong(64)) != 0:
        return f"first-touch (set_mempolicy failed: errno {ctypes.get_errno()})"
    return "bound (MPOL_BIND)"


# ----------------------------------------------------------------------------- planner


def dram_bandwidth(nbytes: int = 32 << 20) -> float:
    """Bytes/s of one large copy within DRAM, best of three (a read and a write per byte;
    weights are only read, so this is a conservative read bandwidth)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
