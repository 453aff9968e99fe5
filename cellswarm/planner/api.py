"""`cellswarm.plan(model, node=..., count=...)`: resolve names and paths, then plan."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from cellswarm.cache_types import DEFAULT_CACHE_TYPE
from cellswarm.errors import RequestError
from cellswarm.planner import inventory, presets, profiles
from cellswarm.planner.cost import CostOptions
from cellswarm.planner.inventory import ModelInventory, QuantSpec, TensorSpec
from cellswarm.planner.overhead import control_traffic, runtime_overhead_bytes, software_cost
from cellswarm.planner.placement import place
from cellswarm.planner.plan import PlanRequest, PlanResult
from cellswarm.planner.plan import plan as _plan
from cellswarm.planner.profiles import NetworkSpec

ACTIVATION_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}


def resolve_model(
    model: str, quant: str | None = None, cache_type: str = DEFAULT_CACHE_TYPE
) -> ModelInventory:
    """A GGUF path, a Hugging Face folder, or a preset name -> inventory (no weights read),
    its KV bytes those of a cache of `cache_type`."""
    return inventory.with_cache_type(_resolve(model, quant), cache_type)


def _resolve(model: str, quant: str | None) -> ModelInventory:
    path = Path(model)
    spec = QuantSpec.parse(quant) if quant else None
    if path.is_dir():
        from cellswarm.io.hf_dir import read_config

        return inventory.from_hf_config(path.name, read_config(path), spec)
    if path.suffix == ".gguf" or path.is_file():
        inv = inventory.from_gguf(path)
        return _resize(inv, spec) if spec else inv
    try:
        preset = presets.get_preset(model)
    except RequestError:
        raise RequestError(
            f"model {model!r} is neither a file, a folder nor a preset; presets: "
            f"{', '.join(sorted(presets.load_presets()))}"
        ) from None
    spec = spec or QuantSpec.parse(preset.default_quant)
    return inventory.from_hf_config(preset.name, preset.hf_config, spec, preset.assumptions)


def _resize(inv: ModelInventory, spec: QuantSpec) -> ModelInventory:
    """The sizes the engine's `load(path, quant=...)` re-packing would give."""
    moe = inv.n_experts > 0
    tensors = tuple(
        TensorSpec(t.name, t.shape, spec.tensor_bytes(t.name, t.shape, moe)) for t in inv.tensors
    )
    return dataclasses.replace(inv, tensors=tensors, quant=spec.label)


def plan(
    model: str | ModelInventory,
    *,
    node: str = "ps3",
    count: int = 1,
    quant: str | None = None,
    context: int = 4096,
    concurrency: int = 1,
    parallel: str = "pipeline",
    prompt_tokens: int = 512,
    profiles_file: Path | None = None,
    dram_bytes: int | None = None,
    expert_hit_rate: float | None = None,
    activations: str = "f32",
    runtime_overhead: int | None = None,
    stages: int | None = None,
    network: NetworkSpec | None = None,
    heartbeat_s: float | None = None,
    draft: str | ModelInventory | None = None,
    cache_type: str = DEFAULT_CACHE_TYPE,
) -> PlanResult:
    """Will `model` run on `count` nodes of kind `node`, how fast, at what power? Pure."""
    inv = model if isinstance(model, ModelInventory) else resolve_model(model, quant, cache_type)
    if activations not in ACTIVATION_BYTES:
        raise RequestError(f"--activations {activations!r}: choose one of {list(ACTIVATION_BYTES)}")
    if expert_hit_rate is not None and not 0 <= expert_hit_rate <= 1:
        raise RequestError(f"--hit-rate {expert_hit_rate} must be within 0..1")
    req = PlanRequest(
        node=profiles.get_profile(node, profiles_file),
        count=count,
        context=context,
        concurrency=concurrency,
        parallel=parallel,
        prompt_tokens=prompt_tokens,
        runtime_overhead_bytes=runtime_overhead_bytes()
        if runtime_overhead is None
        else runtime_overhead,
        network=network or profiles.load_network(profiles_file),
        power=profiles.load_power(profiles_file),
        cost=software_cost(CostOptions(activation_bytes=ACTIVATION_BYTES[activations])),
        control=control_traffic(heartbeat_s),
        dram_bytes=dram_bytes,
        expert_hit_rate=expert_hit_rate,
        stages=stages,
        draft_bytes=draft_bytes(draft, context, concurrency),
    )
    return _plan(inv, req)


def draft_bytes(draft: str | ModelInventory | None, context: int, concurrency: int) -> int:
    """What a draft model needs on the first node of a replica (stage.py shard_need_bytes
    counts the same at the worker): its weights, and its own KV cache for every sequence."""
    if draft is None:
        return 0
    inv = draft if isinstance(draft, ModelInventory) else resolve_model(draft)
    kv = inv.kv_bytes_per_token_layer * inv.n_layers * context * concurrency
    return inv.weight_bytes + kv


def largest_context_that_fits(result: PlanResult) -> int:
    """When the KV cache is what does not fit, the longest context (a multiple of 256) that
    does at the same concurrency, found by placing only; 0 if none does."""
    req, inv = result.request, result.model
    context = req.context - 256
    while context >= 256:
        scratch = inv.scratch_bytes(req.concurrency, context, 0)
        capacity = req.node.memory_bytes - req.runtime_overhead_bytes - scratch
        if capacity > 0 and place(inv, capacity, context * req.concurrency).placeable:
            return context
        context -= 256
    return 0


def predict_tiered_tokens_per_s(
    path: str | os.PathLike[str],
    stats: dict[str, Any],
    dram_bw: float,
    flops: float | None = None,
    node: str = "xeon-optane",
) -> float:
    """The planner's tiered decode tokens/s (`plan_tiers`) for this file, with this run's
    measured tiers: `dram_bw`, the slow tier's achieved read rate, the decode hit rate.
    `flops`: effective FLOP/s of this host (None: the `node` profile's)."""
    from cellswarm.planner.profiles import MemoryTier

    slow_bw = stats["slow_bytes_read"] / stats["slow_read_s"] if stats["slow_read_s"] else 1e12
    pl = stats["placement"]
    base = plan(os.fspath(path), node=node, dram_bytes=pl["dram_budget"])
    profile = base.request.node
    profile = dataclasses.replace(
        profile,
        flops=flops if flops is not None else profile.effective_flops,
        compute_efficiency=1.0,
        tiers=(
            MemoryTier("dram", 1 << 40, dram_bw, 1.0, 1e-7),
            MemoryTier("slow", 1 << 40, slow_bw, 1.0, 1e-6),
        ),
    )
    req = dataclasses.replace(
        base.request,
        node=profile,
        expert_hit_rate=stats["decode_hit_rate"],
        runtime_overhead_bytes=pl["runtime_bytes"],
    )
    result = _plan(base.model, req)
    assert result.tiers is not None
    return float(result.tiers.tokens_per_s)
