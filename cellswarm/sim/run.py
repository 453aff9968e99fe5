"""`simulate(scenario) -> dict`: plan with the planner, simulate, summarise (JSON-ready).

The result holds no wall-clock figure, so the same scenario and seed give the same JSON
bit for bit; `timed_simulate` adds the wall time and events/s beside it for benches.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from cellswarm.errors import RequestError
from cellswarm.planner import api, profiles
from cellswarm.planner.plan import PlanResult
from cellswarm.planner.plan import plan as plan_with
from cellswarm.planner.speculative import Speculation, ring_times, swarm_speedup
from cellswarm.sim.engine import Simulator
from cellswarm.sim.model import ReplicaModel
from cellswarm.sim.network import TIERS, NetModel, apply_topology
from cellswarm.sim.params import Scenario


def plan_for(sc: Scenario) -> PlanResult:
    """The planner's result for the scenario (with its network overrides)."""
    inv = api.resolve_model(sc.model, sc.quant)
    result = api.plan(
        inv, node=sc.node, count=sc.count, context=sc.context, concurrency=sc.concurrency,
        prompt_tokens=sc.prompt_tokens,
    )  # fmt: skip
    if sc.network:
        net = apply_topology(profiles.load_network(), sc.network)
        result = plan_with(inv, dataclasses.replace(result.request, network=net))
    if not result.fits:
        raise RequestError(f"{sc.model} on {sc.count:,} {sc.node} nodes: {result.problem}")
    return result


def build(sc: Scenario) -> tuple[Simulator, PlanResult]:
    result = plan_for(sc)
    req = result.request
    one_box = result.tiers is not None
    spec = speculation(result, sc.acceptance)
    model = ReplicaModel(result.model, result.placement, req.node, req.cost, sc.params,
                         result.decode, one_box, lone_speedup=spec.speedup)  # fmt: skip
    nominal = min(sc.concurrency / model.base.token_s, 1.0 / model.base.bottleneck_s)
    net = NetModel(
        result.model, None if one_box else result.placement, req.cost.activation_bytes,
        req.network, nominal,
    )  # fmt: skip
    sim = Simulator(
        sc, model, net, result.replicas, req.power, (req.node.power_busy_w, req.node.power_idle_w)
    )
    return sim, result


def speculation(result: PlanResult, acceptance: float) -> Speculation:
    """A lone sequence's speculative decoding on this plan's ring at the workload's
    acceptance (planner/speculative.py); none where the planner has no ring to model (a
    tiered box, parts off the serial path) or drafts are never kept."""
    try:
        times = ring_times(result)
    except RequestError:
        return Speculation(0, 1, 1.0)
    return swarm_speedup(times, acceptance)


def simulate(sc: Scenario) -> dict[str, Any]:
    sim, result = build(sc)
    sim.run()
    return summarise(sim, result)


def timed_simulate(sc: Scenario) -> tuple[dict[str, Any], float, int]:
    """(result, wall seconds, events processed)."""
    start = time.perf_counter()
    sim, result = build(sc)
    sim.run()
    out = summarise(sim, result)
    return out, time.perf_counter() - start, sim.c.events


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if values else None


def control_summary(sim: Simulator) -> dict[str, Any]:
    """The coordinator as a resource: its policy at this size, its load, the leases' waits,
    and whether it (rather than the network or the nodes) limits the swarm."""
    cp, n, sc = sim.sc.control, sim.count, sim.sc
    leases = len(sim.lease_waits)
    job_load = leases * cp.job_cpu_s / cp.cores / sc.duration_s
    load = cp.beat_load(n) + job_load
    return {
        "heartbeat_interval_s": cp.interval_s(n), "detect_s": cp.detect_s(n),
        "beat_load": cp.beat_load(n), "job_load": job_load, "load": load,
        "jobs_per_s_capacity": 0.0 if sim.control_saturated else cp.jobs_per_s(n),
        "leases": leases, "lease_wait_s": {"p50": _pct(sim.lease_waits, 50),
                                           "p99": _pct(sim.lease_waits, 99)},
        "saturated": sim.control_saturated, "bottleneck": sim.control_saturated or load >= 0.9,
        "cores": cp.cores,
    }  # fmt: skip


def summarise(sim: Simulator, result: PlanResult) -> dict[str, Any]:
    sc, c = sim.sc, sim.c
    hours = sc.duration_s / 3600
    tokens = c.tokens_generated
    in_flight = sum(len(r.seqs) for r in sim.replicas)
    states: dict[str, int] = {}
    for j in sim.jobs:
        states[j.state] = states.get(j.state, 0) + 1
    tier_mean = {t: float(np.mean(sim.tier_series[t])) for t in TIERS}
    tier_peak = {t: float(np.max(sim.tier_series[t])) for t in TIERS}
    planned = sim.net.unit_utilization(result.replicas)
    planned_util = {t: u * sim.net.nominal for t, u in zip(TIERS, planned, strict=True)}
    first = max(TIERS, key=lambda t: (planned_util[t], tier_peak[t]))
    energy_kwh = sim.energy_j / 3.6e6
    return {
        "scenario": {
            "model": result.model.name, "quant": result.model.quant, "node": sc.node,
            "count": sc.count, "context": sc.context, "concurrency": sc.concurrency,
            "duration_s": sc.duration_s, "seed": sc.seed,
            "workload": {"rate_jobs_per_s": sc.rate, "batch_jobs": None if sc.rate else sc.jobs,
                         "prompt_tokens": sc.prompt_tokens, "output_tokens": sc.output_tokens,
                         "poison_fraction": sc.poison_fraction, "acceptance": sc.acceptance},
            "failures": {"mtbf_s": sc.mtbf_s, "mttr_s": sc.mttr_s, "rack_mtbf_s": sc.rack_mtbf_s,
                         "rack_mttr_s": sc.rack_mttr_s, "slow_fraction": sc.slow_fraction,
                         "slow_speed": sc.slow_speed},
            "network_overrides": dict(sc.network),
            "params": dataclasses.asdict(sc.params),
        },
        "plan": {
            "min_nodes": result.min_nodes, "replicas": result.replicas,
            "spares": sc.count - result.replicas * sim.npr,
            "decode_tokens_per_s": result.decode_tokens_per_s,
            "throughput_tokens_per_s": result.throughput_tokens_per_s,
            "prefill_s": result.prefill_s, "power_w": result.power_w,
            "step_s": sim.model.base.token_s, "bottleneck_s": sim.model.base.bottleneck_s,
            "stages": sim.model.stages, "hops": sim.model.hops,
            "speculation": dataclasses.asdict(speculation(result, sc.acceptance)),
        },
        "tokens": tokens,
        "tokens_per_s": tokens / sc.duration_s,
        "decode_tokens_per_s": tokens / c.decode_seq_s if c.decode_seq_s > 0 else 0.0,
        "latency_s": {"p50": _pct(sim.latencies, 50), "p99": _pct(sim.latencies, 99),
                      "mean": float(np.mean(sim.latencies)) if sim.latencies else None},
        "jobs": {
            "submitted": c.submitted, "done": c.done, "retried": c.retried, "dead": c.dead,
            "lost": sim.lost_jobs(), "queued": states.get("queued", 0) + states.get("backoff", 0),
            "in_flight": in_flight, "awaiting_lease_expiry": states.get("orphaned", 0),
            "lease_expiries": c.lease_expiries, "max_leases": c.max_leases,
            "max_attempts_used": max((j.attempts for j in sim.jobs), default=0),
        },
        "failures": {
            "node_failures": c.node_failures, "rack_failures": c.rack_failures,
            "failures_per_hour": (c.node_failures + c.rack_failures) / hours,
            "node_failures_per_hour": c.node_failures / hours,
            "repairs": c.repairs, "spare_replacements": c.replacements,
            "replicas_dissolved": c.replicas_dissolved, "replicas_formed": c.replicas_formed,
            "offline_nodes": c.offline_nodes, "node_hours_lost": sim.down_node_s / 3600,
            "min_live_replicas": min(sim.series["live_replicas"]),
        },
        "replay": {"replays": c.replays, "replay_s": c.replay_s, "prefill_s": c.prefill_s},
        "network": {
            "planned_utilization": planned_util,
            "mean_utilization": tier_mean,
            "peak_utilization": tier_peak,
            "first_saturated_tier": first,
            "saturated": planned_util[first] >= 1.0,
            "slowdown": sim.net.slowdown(result.replicas),
        },
        "energy": {
            "kwh": energy_kwh,
            "joules": sim.energy_j,
            "j_per_token": sim.energy_j / tokens if tokens > 0 else None,
            "mean_power_w": sim.energy_j / sc.duration_s,
            "mwh_per_day": energy_kwh / 1000 / hours * 24,
            "busy_node_hours": sim.busy_node_s / 3600,
            "idle_node_hours": sim.idle_node_s / 3600,
            "pue": sim.pue,
        },
        "control": control_summary(sim),
        "events": c.events,
        "series": {**sim.series, **{f"util_{t}": sim.tier_series[t] for t in TIERS}},
    }  # fmt: skip
