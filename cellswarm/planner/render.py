"""A plan for people (rich tables) and for scripts (one JSON object)."""

from __future__ import annotations

from itertools import groupby
from typing import Any

from rich.console import Console
from rich.table import Table

from cellswarm.errors import RequestError
from cellswarm.planner import speculative
from cellswarm.planner.placement import Slot
from cellswarm.planner.plan import PlanResult
from cellswarm.units import format_bytes, format_power

MAX_PLACEMENT_ROWS = 12


def as_dict(r: PlanResult) -> dict[str, Any]:
    inv, req = r.model, r.request
    out: dict[str, Any] = {
        "model": inv.name,
        "arch": inv.arch,
        "quant": inv.quant,
        "assumptions": list(inv.assumptions),
        "node": req.node.name,
        "count": req.count,
        "context": req.context,
        "concurrency": req.concurrency,
        "parallel": req.parallel,
        "fits": r.fits,
        "problem": r.problem,
        "min_nodes": r.min_nodes,
        "replicas": r.replicas,
        "total_params": inv.total_params,
        "active_params": inv.active_params,
        "weights_bytes": inv.weight_bytes,
        "weights_by_kind": dict(sorted(inv.weights_by_kind().items())),
        "kv_bytes_per_token": r.kv_bytes_per_token,
        "scratch_bytes": r.scratch_bytes,
        "runtime_overhead_bytes": req.runtime_overhead_bytes,
        "node_memory_bytes": req.node.memory_bytes,
        "node_capacity_bytes": r.capacity_bytes,
        "headroom_bytes": _min_headroom(r),
        "aggregate_memory_bytes": req.node.memory_bytes * req.count,
        "thermal": req.node.thermal.as_dict() if req.node.thermal is not None else None,
        "decode_tokens_per_s": r.decode_tokens_per_s,
        "decode_s": _step(r.decode),
        "throughput_tokens_per_s": r.throughput_tokens_per_s,
        "prefill_s": r.prefill_s,
        "prompt_tokens": req.prompt_tokens,
        "bound": r.bound,
        "network": [
            {"tier": t.tier, "bits_per_s": t.bits_per_s, "utilization": t.utilization}
            for t in r.tier_loads
        ],
        "first_saturated_tier": r.first_saturated_tier,
        "bytes_per_token_on_wire": r.bytes_per_token,
        "power_w": r.power_w,
        "node_power_w": r.node_power_w,
        "energy_j_per_token": r.energy_j_per_token,
        "cost_per_million_tokens": r.cost_per_million_tokens,
        "placement": [_slot_dict(s) for s in r.placement.slots[:1000]],
    }
    if r.tensor_parallel is not None:
        out["tensor_parallel_decode_s"] = _step(r.tensor_parallel)
    if r.pipeline is not None:
        out["pipeline_decode_s"] = _step(r.pipeline.decode)
        out["pipeline_throughput_tokens_per_s"] = r.pipeline.throughput_tokens_per_s
    if r.tiers is not None:
        t = r.tiers
        out["tiers"] = {
            "dram_budget_bytes": t.dram_budget_bytes, "pinned_bytes": t.pinned_bytes,
            "cached_expert_bytes": t.cached_expert_bytes, "slow_bytes": t.slow_bytes,
            "hit_rate": t.hit_rate, "dram_bytes_per_token": t.dram_bytes_per_token,
            "slow_bytes_per_token": t.slow_bytes_per_token, "tokens_per_s": t.tokens_per_s,
        }  # fmt: skip
    return out


def _step(s: Any) -> dict[str, float]:
    return {
        "compute": s.compute_s,
        "memory": s.memory_s,
        "network": s.network_s,
        "total": s.total_s,
    }


def _slot_dict(s: Slot) -> dict[str, Any]:
    return {
        "node": s.node,
        "holds": s.describe(),
        "weight_bytes": s.weight_bytes,
        "kv_bytes": s.kv_bytes,
    }


def _min_headroom(r: PlanResult) -> int:
    used = max((s.used_bytes for s in r.placement.slots), default=0)
    return r.capacity_bytes - used


def render(r: PlanResult, console: Console | None = None) -> None:
    con = console or Console()
    inv, req = r.model, r.request
    con.print(
        f"[bold]{inv.name}[/] ({inv.arch}, {inv.total_params / 1e9:,.1f}B parameters, "
        f"{inv.active_params / 1e9:,.2f}B active per token, {inv.quant}) on "
        f"[bold]{req.count:,} x {req.node.name}[/], context {req.context:,} x "
        f"{req.concurrency} in flight, {req.parallel} parallel"
    )
    for a in inv.assumptions:
        con.print(f"  [dim]assumption: {a}[/]")
    con.print(_verdict(r))
    con.print(_memory_table(r))
    if r.fits or r.tiers is not None:
        con.print(_speed_table(r))
    if r.placement.slots and r.tiers is None:
        con.print(_placement_table(r))
    if r.tiers is not None:
        con.print(_tiers_table(r))


def _verdict(r: PlanResult) -> str:
    req = r.request
    if not r.fits:
        return f"[bold red]Does not fit:[/] {r.problem}"
    if r.tiers is not None:
        return f"[bold green]Fits[/] on one box: {r.tiers.dram_name} + {r.tiers.slow_name}"
    return (
        f"[bold green]Fits:[/] {r.min_nodes:,} nodes per replica, {r.replicas:,} full "
        f"replicas on {req.count:,} nodes ({req.count - r.replicas * r.min_nodes:,} spare)"
    )


def _memory_table(r: PlanResult) -> Table:
    inv, req = r.model, r.request
    t = Table(title="Memory", show_header=False, title_justify="left")
    for kind, nbytes in sorted(inv.weights_by_kind().items(), key=lambda kv: -kv[1]):
        t.add_row(f"weights: {kind}", format_bytes(nbytes))
    t.add_row("weights: total", f"[bold]{format_bytes(inv.weight_bytes)}[/]")
    kv = r.kv_bytes_per_token
    t.add_row("KV cache per token", f"{kv:,} B ({inv.cache_type}, all layers)")
    t.add_row(
        f"KV cache x {req.context:,} x {req.concurrency}",
        format_bytes(kv * req.context * req.concurrency),
    )
    t.add_row("per node: memory", format_bytes(req.node.memory_bytes))
    t.add_row("per node: runtime (measured idle worker)", format_bytes(req.runtime_overhead_bytes))
    if req.draft_bytes:
        t.add_row("first node: draft model (weights + KV)", format_bytes(req.draft_bytes))
    t.add_row("per node: activations + scratch", format_bytes(r.scratch_bytes))
    if r.placement.slots:
        t.add_row("per node: least headroom left", format_bytes(_min_headroom(r)))
    t.add_row("aggregate memory", format_bytes(req.node.memory_bytes * req.count))
    return t


def _speed_table(r: PlanResult) -> Table:
    req, d = r.request, r.decode
    t = Table(title="Speed, network, power", show_header=False, title_justify="left")
    t.add_row(
        "decode, one stream",
        f"[bold]{r.decode_tokens_per_s:,.3f} tokens/s[/] ({1000 * d.total_s:,.1f} ms/token: "
        f"compute {1000 * d.compute_s:,.1f}, memory {1000 * d.memory_s:,.1f}, "
        f"network {1000 * d.network_s:,.1f}) — bound: {r.bound}",
    )
    spec = _speculative_line(r)
    if spec:
        t.add_row("speculative decoding, one stream", spec)
    t.add_row(
        f"throughput, {req.concurrency} in flight x {r.replicas:,} replicas",
        f"[bold]{r.throughput_tokens_per_s:,.2f} tokens/s[/]",
    )
    t.add_row(f"prefill of {req.prompt_tokens:,} tokens", f"{r.prefill_s:,.2f} s")
    if r.tensor_parallel is not None:
        tp = r.tensor_parallel
        t.add_row(
            "tensor parallel instead",
            f"{1000 * tp.total_s:,.1f} ms/token (network {1000 * tp.network_s:,.1f} ms: "
            f"{req.cost.tp_syncs_per_layer} all-reduces per layer)",
        )
    if r.bytes_per_token:
        hop = r.model.d_model * req.cost.activation_bytes
        t.add_row(
            "network per token",
            f"{format_bytes(hop)} per pipeline hop; {format_bytes(r.bytes_per_token)} over all "
            "links of a replica",
        )
    if r.pipeline is not None and r.pipeline.fits:
        p = r.pipeline
        t.add_row(
            "pipeline instead",
            f"{1000 * p.decode.total_s:,.1f} ms/token one stream, "
            f"{p.throughput_tokens_per_s:,.2f} tokens/s with {req.concurrency} in flight "
            f"(network {1000 * p.decode.network_s:,.1f} ms)",
        )
    for load in r.tier_loads:
        t.add_row(
            f"network: {load.tier} tier",
            f"{load.bits_per_s / 1e9:,.3f} Gbit/s per uplink ({100 * load.utilization:,.1f}%)",
        )
    if r.tier_loads:
        t.add_row("network: first tier to saturate", r.first_saturated_tier)
    t.add_row(
        "power",
        f"{format_power(r.node_power_w)} at the nodes, {format_power(r.power_w)} with PUE "
        f"{req.power.pue if req.count > 1 else 1.0}",
    )
    if req.node.thermal is not None:
        t.add_row("thermal", req.node.thermal.line())
    t.add_row("energy", f"{r.energy_j_per_token:,.1f} J/token")
    t.add_row(
        f"cost at {req.power.price_per_kwh}/kWh", f"{r.cost_per_million_tokens:,.2f} per 1M tokens"
    )
    return t


def _speculative_line(r: PlanResult, acceptance: float = 0.8) -> str:
    """Where drafting k tokens and verifying them in one pass pays on this ring;
    "" for plans without one (tiers, tensor parallel, parts off the serial path)."""
    try:
        times = speculative.ring_times(r)
    except RequestError:
        return ""
    even, k_even = speculative.lowest_break_even(times)
    swarm = speculative.swarm_speedup(times, acceptance)
    piped = (f"pipelined at {acceptance:.1f} acceptance {swarm.speedup:,.2f}x (k={swarm.k}, "
             f"{swarm.in_flight} rounds in flight)") if swarm.in_flight > 1 else ""  # fmt: skip
    if k_even == 0:
        said = "drafts do not pay on this ring: k + 1 rows cost about k + 1 steps"
        return f"{said}; {piped}" if piped else said
    k = speculative.best_k(times, acceptance)
    at = f"at {acceptance:.1f} acceptance " + (
        f"{speculative.speedup(times, acceptance, k):,.2f}x (k={k})" if k else "no gain"
    )
    said = f"pays from acceptance {even:.2f} with k={k_even}; {at}"
    return f"{said}; {piped}" if piped else said


def _placement_table(r: PlanResult) -> Table:
    t = Table("nodes", "each holds", "weights", "KV", title="Placement (one replica)")
    rows = [(list(g), key) for key, g in groupby(r.placement.slots, key=lambda s: _shape_of(s))]
    for i, (slots, _key) in enumerate(rows):
        if i == MAX_PLACEMENT_ROWS:
            t.add_row("...", f"{len(rows) - i} more groups", "", "")
            break
        first, last = slots[0], slots[-1]
        nodes = str(first.node) if first is last else f"{first.node}..{last.node}"
        what = first.describe() if first is last else f"{first.describe()} ... {last.describe()}"
        t.add_row(nodes, what, format_bytes(first.weight_bytes), format_bytes(first.kv_bytes))
    return t


def _shape_of(s: Slot) -> tuple[bool, bool, bool, tuple[str, ...]]:
    kinds = tuple(sorted({k for (_, k, _, _) in s.units}))
    return (s.embed_rows is not None, s.layers is not None, s.head_rows is not None, kinds)


def _tiers_table(r: PlanResult) -> Table:
    assert r.tiers is not None
    tp = r.tiers
    t = Table(title="Tiers (one box)", show_header=False, title_justify="left")
    t.add_row(
        f"{tp.dram_name}: pinned ({', '.join(tp.pinned_kinds)})", format_bytes(tp.pinned_bytes)
    )
    t.add_row(f"{tp.dram_name}: expert cache", format_bytes(tp.cached_expert_bytes))
    t.add_row(f"{tp.slow_name}: only there", format_bytes(tp.slow_bytes))
    t.add_row("expert-cache hit rate", f"{100 * tp.hit_rate:.1f}%")
    t.add_row(
        "read per token",
        f"{format_bytes(tp.dram_bytes_per_token)} from {tp.dram_name}, "
        f"{format_bytes(tp.slow_bytes_per_token)} from {tp.slow_name}",
    )
    t.add_row("predicted", f"[bold]{tp.tokens_per_s:,.3f} tokens/s[/]")
    return t


def side_by_side(plans: list[PlanResult]) -> Table:
    """Two (or more) setups for one model, a column each: what the seed compares — the PS3
    swarm against the Optane box — in one table."""
    t = Table("", *(f"{p.request.count:,} x {p.request.node.name}" for p in plans),
              title=f"{plans[0].model.name}: side by side", title_justify="left")  # fmt: skip

    def row(label: str, cell: Any) -> None:
        t.add_row(label, *(cell(p) for p in plans))

    row("fits", lambda p: "yes" if p.fits else f"no: {p.problem}")
    row("memory, all nodes and tiers", lambda p: format_bytes(p.capacity_bytes * p.request.count))
    row("decode, one stream", lambda p: f"{p.decode_tokens_per_s:,.3f} tokens/s"
        if p.fits else "-")  # fmt: skip
    row("throughput", lambda p: f"{p.throughput_tokens_per_s:,.2f} tokens/s" if p.fits else "-")
    row("bound by", lambda p: p.bound if p.fits else "-")
    row("power (with PUE)", lambda p: format_power(p.power_w))
    row("energy", lambda p: f"{p.energy_j_per_token:,.1f} J/token" if p.fits else "-")
    row(f"cost per 1M tokens at {plans[0].request.power.price_per_kwh}/kWh",
        lambda p: f"{p.cost_per_million_tokens:,.2f}" if p.fits else "-")  # fmt: skip
    return t
