"""The DRAM tier: an LFU cache of routed experts in fixed slots, and TieredExperts, the
remote-experts seam that serves a layer's experts from it or streams them from the slow tier."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cellswarm.engine.memory import proc_status
from cellswarm.engine.tiered.slow import SlowTier
from cellswarm.io.gguf_file import TensorInfo
from cellswarm.quant import PackedMatrix, format_for

if TYPE_CHECKING:
    from cellswarm.models.deepseek2_config import DeepseekConfig

STREAM_BUFFERS = 2  # experts read past the cache: one is read while the other computes
PROJ = ("gate", "up", "down")


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
        model_config: DeepseekConfig,
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
    from cellswarm.quant.ggml_types import GGMLQuantizationType

    return GGMLQuantizationType(info.ggml_type)
