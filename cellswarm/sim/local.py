"""What the simulator predicts for a *local* swarm, so a calibration can compare it with a
real run of emulated workers and fit `SimParams` (per-hop and per-step overheads).

    from cellswarm.sim.local import predict_local
    p = predict_local([(0, 10), (10, 20), (20, 30)], node="rpi4", in_flight=2, jobs=8,
                      tokens=32, prompt_tokens=16, kill_at_s=5.0, kill_stage=1)
    p.tokens_per_s, p.latency_p50_s

A chaos run (bench.lab --chaos) also gives `nodes` (the ring and its spares, racks of the
network's `nodes_per_access_switch`, the earliest joined first), `rack_cuts` (a rack's uplink
cut at a time, its nodes lost at once, not back within the run) and the `control` plane
whose heartbeat timeout is the detection time; `rewired_at_s` then says when the ring
served again after each loss.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    rewired_at_s: tuple[float, ...] = ()  # when the ring was up again (shards loaded), each time
    done_at_s: tuple[float, ...] = ()  # each job's completion, in order


class _FetchedReplica(ReplicaModel):
    """A replica whose spares fetch their shard at `fetch_bytes_per_s` (the slowest link
    between a spare and the coordinator that serves the shards) rather than at the node's
    own link rate; None: the node's link, as ReplicaModel."""

    fetch_bytes_per_s: float | None = None

    def load_s(self, position: int) -> float:
        if self.fetch_bytes_per_s is None:
            return super().load_s(position)
        return self.shard_bytes[position] / self.fetch_bytes_per_s

    def load_all_s(self, positions: Iterable[int]) -> float:
        """Shards fetched at once: over one shared path they queue on it (bytes add up);
        over the nodes' own links they load side by side (the slowest bounds it)."""
        if self.fetch_bytes_per_s is None:
            return max(map(self.load_s, positions), default=0.0)
        return sum(self.shard_bytes[p] for p in positions) / self.fetch_bytes_per_s


class _ChaosSimulator(Simulator):
    """The same Simulator, plus a rack cut at a set time (the engine's rack failures come at
    random) and a note of each time the ring comes up again. The cut rides on the "kill"
    event (arg ("rack", switch)) so that engine.py needs no new event kind."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.up_at: list[float] = []

    def schedule_rack_cut(self, t: float, rack: int) -> None:
        self.push(t, "kill", ("rack", rack))

    def _on_kill(self, arg: tuple[Any, int]) -> None:
        if arg[0] == "rack":
            self._cut(arg[1])
        else:
            super()._on_kill(arg)

    def _cut(self, rack: int) -> None:
        """Rack `rack` is cut off: every node on it is lost at once."""
        self.fail_rack(rack)

    def _on_replica_up(self, arg: tuple[int, int]) -> None:
        live = self.live
        super()._on_replica_up(arg)
        if self.live > live:
            self.up_at.append(self.now)


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
    nodes: int | None = None,
    rack_cuts: Sequence[tuple[float, int]] = (),
    control: ControlPlane | None = None,
    fetch_bits_per_s: float | None = None,
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
    nodes: how many nodes in all (default: the ring and one spare). rack_cuts: (time, rack)
    pairs, rack r being nodes r x nodes_per_access_switch onwards: every node on it is lost
    then (its uplink cut) and stays lost. control: the coordinator's heartbeat policy, whose
    timeout is how late a loss is seen (default: a local swarm's, LOCAL_CONTROL).
    fetch_bits_per_s: the rate a spare fetches a shard at, when the path to the coordinator
    serving the shards is slower than the node's link (a lab's aggregation uplink); shards
    fetched at once after a rack cut share it. None: each at the node's own link rate.
    """
    from cellswarm.demo import demo_model_path

    params = params or SimParams()
    path = str(demo_model_path()) if model is None else model
    inv = path if isinstance(path, ModelInventory) else _inventory(str(path))
    placement = layer_placement(inv, split)
    if not 0 <= kill_stage < len(placement.slots):
        raise RequestError(f"kill_stage {kill_stage} is not a stage of a {len(split)}-stage ring")
    for t in [kill_at_s, *(t for t, _ in rack_cuts)]:
        if t is not None and t < 0:
            raise RequestError(f"a kill or cut at {t} s: times must be non-negative")
    count = len(placement.slots) + 1 if nodes is None else nodes
    if count < len(placement.slots):
        raise RequestError(f"{count} nodes cannot hold a {len(placement.slots)}-stage ring")
    profile = node if isinstance(node, profiles.NodeProfile) else profiles.get_profile(
        node, profiles_file)
    opts = opts or cost.CostOptions()
    rmodel = _FetchedReplica(inv, placement, profile, opts, params, prefix_tokens=prefix_tokens)
    if fetch_bits_per_s is not None:
        if not fetch_bits_per_s > 0:
            raise RequestError(f"fetch_bits_per_s {fetch_bits_per_s} must be positive")
        rmodel.fetch_bytes_per_s = fetch_bits_per_s / 8
    base = rmodel.base
    per_job = rmodel.prefill_s(prompt_tokens + tokens) + tokens * base.interval(in_flight)
    last = max([kill_at_s or 0.0, *(t for t, _ in rack_cuts)])
    horizon = (jobs / in_flight + 2) * per_job * 4 + last + params.lease_s * 10
    horizon += len(rack_cuts) * rmodel.load_all_s(range(len(placement.slots)))
    sc = Scenario(
        model=inv.name, node=profile.name, count=count,
        context=prefix_tokens + prompt_tokens + tokens,
        concurrency=in_flight, duration_s=horizon, jobs=jobs, prompt_tokens=prompt_tokens,
        output_tokens=tokens, params=params, samples=2, control=control or LOCAL_CONTROL,
        rack_mttr_s=1e12,  # a cut rack is not back within the run
    )  # fmt: skip
    net = network or dataclasses.replace(profiles.load_network(profiles_file),
                                         nodes_per_access_switch=64)  # fmt: skip
    nominal = min(in_flight / base.token_s, 1.0 / base.bottleneck_s)
    netmodel = NetModel(inv, placement, opts.activation_bytes, net, nominal)
    power = profiles.load_power(profiles_file)
    sim = _ChaosSimulator(sc, rmodel, netmodel, 1, power,
                          (profile.power_busy_w, profile.power_idle_w))  # fmt: skip
    if kill_at_s is not None:
        sim.schedule_kill(kill_at_s, kill_stage)
    for t, rack in rack_cuts:
        if not 0 <= rack < sim.switches:
            raise RequestError(f"rack {rack}: the {count} nodes sit in {sim.switches} racks")
        sim.schedule_rack_cut(t, rack)
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
        jobs_done=len(done), jobs_dead=c.dead, rewired_at_s=tuple(sim.up_at),
        done_at_s=tuple(j.done_at for j in done),
    )  # fmt: skip
