"""load_tiered: a MoE GGUF file laid out for one box — dense tensors pinned, the embedding
mapped, routed experts behind the DRAM cache — and what it holds where."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cellswarm.cache_types import DEFAULT_CACHE_TYPE
from cellswarm.engine import PREFILL_CHUNK
from cellswarm.engine.memory import proc_status
from cellswarm.engine.model import Model
from cellswarm.engine.tiered.cache import PROJ, STREAM_BUFFERS, ExpertCache, TieredExperts
from cellswarm.engine.tiered.slow import SlowTier, faults
from cellswarm.errors import RequestError
from cellswarm.io.gguf_file import GGUFFile, to_tensor
from cellswarm.io.names import tensor_kind
from cellswarm.io.tokenizer import gguf_tokenizer
from cellswarm.io.weights import Selection, WeightStore
from cellswarm.models import module_of
from cellswarm.models.from_file import check_tensors, gguf_config
from cellswarm.quant import PackedExperts

SAFETY_BYTES = 4 << 20  # malloc slack and small Python objects made while running


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
    cache_type: str = DEFAULT_CACHE_TYPE,
) -> TieredModel:
    """Load a MoE GGUF file for a box whose DRAM holds `dram_budget` bytes of this process's
    anonymous memory in all; see the module docstring. `selection`: a swarm worker's shard
    (its layer range, embedding / head or not), tiered the same way."""
    sel = selection or Selection()
    p = Path(path)
    f = GGUFFile(p)
    entry, config = gguf_config(p, f)
    if not getattr(config, "n_experts", 0):
        raise RequestError(f"{p} has no routed experts; --dram-budget tiers MoE models only")
    infos = {n: f._reader_tensor(n) for n in f.tensor_names() if sel.keeps(n)}
    check_tensors(p, config, sel, {n: i.shape for n, i in infos.items()})
    runtime = proc_status().get("RssAnon", 0)
    slow = SlowTier(p, slow_bandwidth)

    tensors, pinned, mapped, expert_total = _lay_out(infos, slow)
    weights = WeightStore(tensors)
    tok = gguf_tokenizer(f.metadata, config.vocab_size) if tokenizer else None
    arch = module_of(entry).MODEL(config, weights)
    model = Model(config, arch, weights, tok, sel, None)
    model.set_cache_type(cache_type)  # before the KV reservation below: its bytes
    moe_layers = [i for i in model.layers if config.is_moe(i)]
    if not moe_layers:
        raise RequestError(f"layers {model.layers} of {p} hold no routed experts to tier")
    absorbed = config.absorbed_bytes_per_layer() * len(model.layers)
    reserved = model.kv_sequence_bytes(context) + config.scratch_bytes(
        min(context, PREFILL_CHUNK), context)  # fmt: skip
    slot = sum(infos[f"blk.{moe_layers[0]}.ffn_{q}_exps.weight"].n_bytes for q in PROJ)
    slot //= config.n_experts
    n_total = config.n_experts * len(moe_layers)
    n_slots = _cache_slots(dram_budget, absorbed, reserved, slot, n_total, context)
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


def _lay_out(
    infos: dict[str, Any], slow: SlowTier
) -> tuple[dict[str, Any], dict[str, int], dict[str, int], int]:
    """The shard's tensors where they will live: routed expert stacks left in the file (the
    cache serves them), the embedding mapped (a token reads one row), the rest copied into
    anonymous memory and its pages released; bytes pinned and mapped by kind, expert bytes."""
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
            tensors[name] = stack.select(())
            expert_total += info.n_bytes
        elif kind == "embedding":
            tensors[name] = to_tensor(info, view)
            mapped[kind] = mapped.get(kind, 0) + info.n_bytes
        else:
            t = to_tensor(info, np.array(view))
            tensors[name] = np.array(t) if isinstance(t, np.ndarray) else t
            pinned[kind] = pinned.get(kind, 0) + info.n_bytes
            slow.release(info.offset, info.n_bytes)
    return tensors, pinned, mapped, expert_total


def _cache_slots(
    dram_budget: int, absorbed: int, reserved: int, slot: int, n_total: int, context: int
) -> int:
    """Expert slots the budget leaves after what every token needs — this process's anonymous
    memory now (runtime + pinned copies), the decoded attention, KV cache and scratch, the
    streaming buffers, a safety margin — or a RequestError saying how much more to give."""
    used = proc_status().get("RssAnon", 0)
    free = dram_budget - used - absorbed - reserved - SAFETY_BYTES - STREAM_BUFFERS * slot
    if free < 0:
        from cellswarm.units import format_bytes as fb

        raise RequestError(
            f"--dram-budget {fb(dram_budget)} is below what every token needs: runtime and "
            f"pinned tensors {fb(used)}, decoded attention {fb(absorbed)}, KV cache and scratch "
            f"for {context} tokens {fb(reserved)}; give at least {fb(dram_budget - free)}"
        )
    return min(free // slot, n_total)
