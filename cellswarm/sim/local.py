"""What the simulator predicts for a *local* swarm, so a calibration can compare it with a
real run of emulated workers and fit `SimParams` (per-hop and per-step overheads).

    from cellswarm.sim.local import predict_local
    p = predict_local([(0, 10), (10, 20), (20, 30)], node="rpi4", in_flight=2, jobs=8,
                      tokens=32, prompt_tokens=16, kill_at_s=5.0, kill_stage=1)
    p.tokens_per_s, p.latency_p50_s

The replica is the one the caller really ran: one stage per layer range, in order; stage 0
also holds the embedding, the last stage the output head (as `swarm/ring/stage.py` lays a ring
out); every layer's feed-forward units stay with its attention. Its timing comes from the
planner's `cost.pipeline_decode` / `pipeline_prefill` on that placement for the profile's
node, plus the `params` overheads; the run goes through the same `Simulator` as
`cellswarm simulate` (jobs pulled by the head, a killed stage replaced by a spare that
loads its shard over the profile's link, in-flight sequences replayed).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cellswarm.errors import RequestError
from cellswarm.planner import api, cost, profiles
from cellswarm.planner.inventory import ModelInventory
from cellswarm.planner.placement import layer_placement
from cellswarm.sim.control import ControlPlane
from cellswarm.sim.engine import Simulator
from cellswarm.sim.model import ReplicaModel
from cellswarm.sim.network import NetModel
from cellswarm.sim.params import Scenario, SimParams


@dataclass(frozen=True)
class LocalPrediction:
    tokens_per_s: float  # jobs x tokens / time until the last job is done (prefill included)
    decode_tokens_per_s: float  # one sequence's decode rate (tokens / its decoding seconds)
    latency_p50_s: float  # submit (t = 0, all jobs queued at once) to done, median
    latency_p99_s: float
    makespan_s: float  # t = 0 to the last job done
    step_s: float  # the replica's per-token time with one sequence in flight
    bottleneck_s: float  # the busiest stage's busy time per token
    prefill_s: float  # one prompt's prefill
    replays: int  # sequences replayed after the kill
    replay_s: float
    jobs_done: int
    jobs_dead: int


@functools.lru_cache(maxsize=8)
def _inventory(path: str) -> ModelInventory:
    """Read once per process: a calibration calls predict_local hundreds of times."""
    return api.resolve_model(path)


# A local swarm's coordinator (swarm/local/up.py LocalSwarm: beats every 0.25 s, lost after
# 2 s), so a calibration's kill is noticed as quickly in the prediction as in the run
LOCAL_CONTROL = ControlPlane(heartbeat_s=0.25, timeout_beats=8.0)


def predict_local(
    split: Sequence[tuple[int, int]],
    *,
    node: str | profiles.NodeProfile = "rpi4",
    in_flight: int = 1,
    jobs: int = 1,
    tokens: int = 32,
    prompt_tokens: int = 8,
    kill_at_s: float | None = None,
    kill_stage: int = 1,
    params: SimParams | None = None,
    model: str | Path | ModelInventory | None = None,
    profiles_file: Path | None = None,
    network: profiles.NetworkSpec | None = None,
    opts: cost.CostOptions | None = None,
    prefix_tokens: int = 0,
) -> LocalPrediction:
    """Predict a local one-replica swarm's decode tokens/s and p50 latency.

    split: the layer ranges the stages really held, e.g. [(0, 15), (15, 30)].
    node: the planner profile the workers emulate (`cellswarm worker --profile`), or a
    profile measured on the machine the stages ran on (bench.batch).
    in_flight: sequences the head keeps in flight (S); jobs: J jobs of `tokens` (M) tokens
    each after a `prompt_tokens` prompt, all queued at t = 0.
    kill_at_s / kill_stage: kill that stage's node at that time (None: no kill); one spare
    waits to take its shard. params: the overheads being calibrated.
    model: the model file (default: the demo model, `cellswarm.demo.demo_model_path()`).
    network: the three tiers the stages sit on, numbered in rack order (default: one
    switch, as on one machine). opts: the cost model's options (default: a bare roofline).
    prefix_tokens: tokens before each prompt that the stages' prefix caches hold (the
    prompts' shared instruction): attended to, not computed.
    """
    from cellswarm.demo import demo_model_path

    params = params or SimParams()
    path = str(demo_model_path()) if model is None else model
    inv = path if isinstance(path, ModelInventory) else _inventory(str(path))
    placement = layer_placement(inv, split)
    if not 0 <= kill_stage < len(placement.slots):
        raise RequestError(f"kill_stage {kill_stage} is not a stage of a {len(split)}-stage ring")
    if kill_at_s is not None and kill_at_s < 0:
        raise RequestError(f"kill_at_s {kill_at_s} must be non-negative")
    profile = node if isinstance(node, profiles.NodeProfile) else profiles.get_profile(
        node, profiles_file)
    opts = opts or cost.CostOptions()
    rmodel = ReplicaModel(inv, placement, profile, opts, params, prefix_tokens=prefix_tokens)
    base = rmodel.base
    per_job = rmodel.prefill_s(prompt_tokens + tokens) + tokens * base.interval(in_flight)
    horizon = (jobs / in_flight + 2) * per_job * 4 + (kill_at_s or 0) + params.lease_s * 10
    sc = Scenario(
        model=inv.name, node=profile.name, count=len(placement.slots) + 1,
        context=prefix_tokens + prompt_tokens + tokens,
        concurrency=in_flight, duration_s=horizon, jobs=jobs, prompt_tokens=prompt_tokens,
        output_tokens=tokens, params=params, samples=2, control=LOCAL_CONTROL,
    )  # fmt: skip
    net = network or dataclasses.replace(profiles.load_network(profiles_file),
                                         nodes_per_access_switch=64)  # fmt: skip
    nominal = min(in_flight / base.token_s, 1.0 / base.bottleneck_s)
    netmodel = NetModel(inv, placement, opts.activation_bytes, net, nominal)
    power = profiles.load_power(profiles_file)
    sim = Simulator(sc, rmodel, netmodel, 1, power, (profile.power_busy_w, profile.power_idle_w))
    if kill_at_s is not None:
        sim.schedule_kill(kill_at_s, kill_stage)
    sim.run()
    done = [j for j in sim.jobs if j.state == "done"]
    makespan = max((j.done_at for j in done), default=0.0)
    lat = np.asarray(sim.latencies) if sim.latencies else np.asarray([np.nan])
    c = sim.c
    return LocalPrediction(
        tokens_per_s=len(done) * tokens / makespan if makespan > 0 else 0.0,
        decode_tokens_per_s=c.tokens_generated / c.decode_seq_s if c.decode_seq_s else 0.0,
        latency_p50_s=float(np.percentile(lat, 50)),
        latency_p99_s=float(np.percentile(lat, 99)),
        makespan_s=makespan, step_s=base.token_s, bottleneck_s=base.bottleneck_s,
        prefill_s=rmodel.prefill_s(prompt_tokens), replays=c.replays, replay_s=c.replay_s,
        jobs_done=len(done), jobs_dead=c.dead,
    )  # fmt: skip
