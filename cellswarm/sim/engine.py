"""The discrete-event loop: replicas, the pull-mode job queue, failures, spares, power.

Own loop on `heapq`, not SimPy: a SimPy process per replica costs a generator switch and an
event object per yield, and the state changes here are few and coarse, so a plain heap of
(time, sequence number, kind, args) tuples keeps the 100,000-node hour well under a second
and stays bit-reproducible (ties break by the sequence number, randomness comes from one
seeded `random.Random`).

Granularity — a fluid model per replica, events only where a rate changes:
- a replica holds up to `concurrency` sequences; between two of its events the number
  decoding (k) is constant, so each decoding sequence gains (t - t0) / interval(k) tokens,
  interval(k) = max(token time, k x busiest node's time) x network slowdown: the planner's
  pipelined rate, but integrated, so a replica that is loading a spare, replaying a prefix or
  waiting for work visibly stalls. A replica's next event is the earliest of: a sequence
  finishing, a prefill/replay finishing. No event per token, none per node per token.
- failures are events on nodes (exponential MTBF, thinned over all nodes so one event
  process serves 100,000 of them) and on access switches (a rack); a node maps to its
  replica and position. Repairs are events too.
- swarm-wide integrals (tokens, energy, node-seconds down) advance at every event from
  running totals (the sum of the replicas' current rates, the count of busy/idle/down
  nodes), so the time series costs nothing per replica.

Rules, as the real swarm (swarm/control/jobs.py, membership.py): a replica's head pulls jobs while
it has free sequence slots; a lost non-head node is replaced by a spare (the replica is down
while the spare loads its shard: bytes / link bandwidth) and the head replays each sequence's
prompt + tokens so far (a prefill of that length) under the same lease; a lost head cannot
renew its leases, so they expire after `lease_s`, which counts as a failed attempt: back to
the queue after the backoff 0.5 x 2^(n-1) s, dead after 3. No spare left: the replica is
dropped (its nodes become spares, its jobs' leases expire; never the last one, which waits)
and formed again once enough spares exist — policy/placement.py's rules: a hole is mended
by its `mend` (which spare, which replica dropped) over this loop's spares kept in heaps
per rack (O(log n) a take, where the core walks them), a replica formed again through its
`by_rack`, and its `repair` itself asked where the rule says place anew; the two agree after
every change over a day of failures (tests/test_policy_core.py). A node's
health follows swarm/policy/nodes.py, as the coordinator's: a node that is lost (it
failed, its rack was cut) is not charged, and comes back as a spare once repaired; only
failures that are its own count toward `offline_after` in a row.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cellswarm.errors import BudgetError
from cellswarm.sim.model import ReplicaModel, StepTiming
from cellswarm.sim.network import TIERS, NetModel
from cellswarm.sim.params import Scenario
from cellswarm.swarm.policy import jobs as core
from cellswarm.swarm.policy import nodes as health
from cellswarm.swarm.policy import placement
from cellswarm.swarm.protocol.messages import Shard

EPS_TOKENS = 1e-6
HOLE = -1  # a slot of a replica no node holds (its node was lost; no spare yet)


@dataclass
class Job:
    id: int
    arrival: float
    prompt: int
    output: int
    poison: bool = False
    state: str = "queued"  # queued, backoff, running, orphaned, done, dead
    attempts: int = 0
    leases: int = 0
    tokens: int = 0  # checkpointed tokens (a retry resumes from them)
    done_at: float = -1.0


@dataclass
class Seq:
    job: Job
    ready_at: float  # decoding starts after the prefill / replay
    progress: float  # tokens so far (fractional between events)
    decoding: bool = False


@dataclass
class Replica:
    idx: int
    nodes: list[int]
    state: str = "loading"  # loading, up, gone
    timing: StepTiming | None = None
    seqs: list[Seq] = field(default_factory=list)
    t0: float = 0.0
    interval: float = math.inf
    rate: float = 0.0  # tokens/s now
    busy: bool = False  # its nodes draw busy power
    gen: int = 0
    ready_at: float = 0.0
    needs_replay: bool = False
    # its stages are busy with earlier prefills until then: a prompt goes through the ring
    # in one chunk, a stage at a time, so prefills pipeline but never overlap on a stage
    prefill_free_at: float = 0.0


@dataclass(frozen=True)
class Member:
    """A simulated node as the placement core reads it (policy/placement.py: Member): nodes
    join in index order, all of one memory, and sit in rack index // nodes per switch."""

    node_id: int
    state: str
    shard: Shard | None
    memory_bytes: int
    joined_s: float
    rack: str


@dataclass
class Counters:
    submitted: int = 0
    done: int = 0
    dead: int = 0
    retried: int = 0  # failed attempts that went back to the queue
    lease_expiries: int = 0
    node_failures: int = 0
    rack_failures: int = 0
    repairs: int = 0
    replacements: int = 0
    replicas_dissolved: int = 0
    replicas_formed: int = 0
    core_placements: int = 0  # decisions the simulator asked the placement core itself
    offline_nodes: int = 0
    replays: int = 0
    replay_s: float = 0.0
    prefill_s: float = 0.0
    decode_seq_s: float = 0.0  # sequence-seconds spent decoding
    tokens_generated: float = 0.0
    max_leases: int = 0
    events: int = 0


class Simulator:
    def __init__(
        self,
        scenario: Scenario,
        model: ReplicaModel,
        net: NetModel,
        replicas: int,
        power: Any,
        node_power: tuple[float, float],
    ) -> None:
        self.sc, self.model, self.net = scenario, model, net
        self.p = scenario.params
        self.rules = self.p.rules
        self.rng = random.Random(scenario.seed)
        self.npr = model.nodes
        self.count = scenario.count
        self.pue = power.pue if scenario.count > 1 else 1.0
        self.p_busy, self.p_idle = node_power
        self.c = Counters()
        self.heap: list[tuple[float, int, str, Any]] = []
        self.seq_no = 0
        self.now = 0.0
        # per node: replica (-1 spare/out), position, speed, own failure, failures so far
        self.node_replica = [-1] * self.count
        self.node_pos = [0] * self.count
        self.node_failed = [False] * self.count
        self.node_health: dict[int, health.Health] = {}  # nodes that ever failed
        self.node_offline = [False] * self.count
        per_switch = net.net.nodes_per_access_switch
        self.per_switch = per_switch
        self.switches = -(-self.count // per_switch)
        self.switch_down = [False] * self.switches
        self.speed = self._speeds()
        self.spares: list[int] = []  # a heap: the earliest joined first
        self.rack_spares: list[list[int]] = [[] for _ in range(self.switches)]  # per rack
        self.is_spare = [False] * self.count
        self.n_spares = 0
        self.holes: set[int] = set()  # slots (replica x nodes + position) no node holds
        self.down_nodes = 0
        self.busy_nodes = 0
        self.jobs: list[Job] = []
        self.ready: deque[Job] = deque()
        self.n_backoff = 0
        self.hungry: list[int] = []  # replica ids that may have free slots (lazy heap)
        self.in_hungry: list[bool] = []
        self.replicas: list[Replica] = []
        self.live = 0
        self.slowdown = 1.0
        # integrals
        self.t_int = 0.0
        self.rate_total = 0.0
        self.tokens_int = 0.0
        self.energy_j = 0.0
        self.down_node_s = 0.0
        self.busy_node_s = 0.0
        self.idle_node_s = 0.0
        self.latencies: list[float] = []
        self.series: dict[str, list[float]] = {
            "t_s": [], "tokens_per_s": [], "live_replicas": [], "queue_depth": [],
            "in_flight": [], "down_nodes": [], "power_w": [],
        }  # fmt: skip
        self.tier_series: dict[str, list[float]] = {t: [] for t in TIERS}
        self._last_sample = (0.0, 0.0)
        # the coordinator (sim/control.py): failures are seen detect_s late; leases are served
        # one at a time, job_s each, on what the heartbeats leave of its cores
        control = scenario.control
        self.detect_s = control.detect_s(self.count)
        self.job_s = control.job_s(self.count)
        self.control_saturated = control.saturated(self.count)
        self.lease_free_at = 0.0  # when the coordinator can grant the next lease
        self.lease_waits: list[float] = []
        self._place_initial(0 if self.control_saturated else replicas)

    # -- setup ------------------------------------------------------------------------------

    def _speeds(self) -> list[float]:
        speed = [1.0] * self.count
        if self.sc.slow_fraction > 0:
            n = round(self.sc.slow_fraction * self.count)
            rng = np.random.default_rng(self.sc.seed)
            for i in rng.choice(self.count, size=n, replace=False).tolist():
                speed[i] = self.sc.slow_speed
        return speed

    def members(self) -> list[Member]:
        """The placeable nodes as the placement core sees them: up and not taken offline,
        holding their replica's slot or spare (a lost node is neither)."""
        return [self._member(n) for n in range(self.count)
                if self._node_up(n) and not self.node_offline[n]]  # fmt: skip

    def _member(self, n: int) -> Member:
        r = self.node_replica[n]
        held = r >= 0 and self.replicas[r].state != "gone"
        shard = self.layout[r * self.npr + self.node_pos[n]] if held else None
        return Member(n, "assigned" if held else "spare", shard, 1, float(n),
                      str(n // self.per_switch))  # fmt: skip

    def live_layout(self) -> list[Shard]:
        """The layout as the coordinator keeps it: the slots of the replicas not dropped."""
        return [s for s in self.layout if self.replicas[s.replica].state != "gone"]

    def split(self, stages: int, _memory_bytes: int) -> list[tuple[int, int]]:
        """The placement core's splitter: the simulated model is placed at one depth (its
        ReplicaModel's), so any other is "does not fit"."""
        if stages != self.npr:
            raise BudgetError(f"the simulated replica has {self.npr} slots, not {stages}")
        return [(k, k + 1) for k in range(self.npr)]

    def _place_initial(self, replicas: int) -> None:
        """The replicas as the coordinator places them (policy/placement.py: place): the
        earliest joined nodes, a replica's slots within one rack where a rack has room."""
        self.layout: list[Shard] = []
        chosen: dict[int, list[int]] = {}
        if replicas:
            self.layout, out = placement.place(
                [Member(n, "spare", None, 1, float(n), str(n // self.per_switch))
                 for n in range(self.count)], self.split, self.npr, replicas=replicas)  # fmt: skip
            for n, shard in out.items():
                if shard is not None:
                    chosen.setdefault(shard.replica, [0] * self.npr)[shard.slot % self.npr] = n
        for r in range(len(chosen)):
            nodes = chosen[r]
            rep = Replica(r, nodes)
            self.replicas.append(rep)
            self.in_hungry.append(False)
            for pos, n in enumerate(nodes):
                self.node_replica[n], self.node_pos[n] = r, pos
            rep.timing = self._timing(rep)
            rep.state = "up"
            self.live += 1
            self._set_busy(rep, True)
        placed = {n for nodes in chosen.values() for n in nodes}
        for n in range(self.count):
            if n not in placed:
                self._add_spare(n)
        self.slowdown = self.net.slowdown(self.live)
        for rep in self.replicas:
            rep.interval = rep.timing.interval(1) * self.slowdown if rep.timing else math.inf

    def _timing(self, rep: Replica) -> StepTiming:
        if self.sc.slow_fraction == 0:
            return self.model.base
        speeds = np.fromiter((self.speed[n] for n in rep.nodes), np.float64, len(rep.nodes))
        return self.model.timing(speeds)

    # -- the loop ---------------------------------------------------------------------------

    def push(self, t: float, kind: str, arg: Any = None) -> None:
        self.seq_no += 1
        heapq.heappush(self.heap, (t, self.seq_no, kind, arg))

    def run(self) -> None:
        sc, end = self.sc, self.sc.duration_s
        self._schedule_workload()
        if sc.mtbf_s is not None:
            self.push(self._exp(sc.mtbf_s / self.count), "node_fail")
        if sc.rack_mtbf_s is not None:
            self.push(self._exp(sc.rack_mtbf_s / self.switches), "rack_fail")
        step = end / (sc.samples - 1)
        for i in range(1, sc.samples):
            self.push(min(i * step, end), "sample")
        for rep in self.replicas:
            self._update(rep)
        handlers: dict[str, Any] = {
            "round": self._on_round, "replica_up": self._on_replica_up,
            "node_fail": self._on_node_fail, "node_repair": self._on_node_repair,
            "rack_fail": self._on_rack_fail, "rack_repair": self._on_rack_repair,
            "arrival": self._on_arrival, "release": self._on_release,
            "expire": self._on_expire,
            "kill": self._on_kill, "sample": self._on_sample,
        }  # fmt: skip
        self._sample_now()
        heap = self.heap
        while heap and heap[0][0] <= end:
            t, _, kind, arg = heapq.heappop(heap)
            self.c.events += 1
            self._integrate(t)
            handlers[kind](arg)
        self._integrate(end)
        for rep in self.replicas:
            if rep.state == "up":
                self._advance(rep, end)

    def _exp(self, mean: float) -> float:
        return self.now + self.rng.expovariate(1.0 / mean)

    def _integrate(self, t: float) -> None:
        dt = t - self.t_int
        if dt > 0:
            self.tokens_int += self.rate_total * dt
            idle = self.count - self.busy_nodes - self.down_nodes
            self.energy_j += (self.busy_nodes * self.p_busy + idle * self.p_idle) * self.pue * dt
            self.down_node_s += self.down_nodes * dt
            self.busy_node_s += self.busy_nodes * dt
            self.idle_node_s += idle * dt
            self.t_int = t
        self.now = t

    # -- workload and queue -----------------------------------------------------------------

    def _new_job(self) -> Job:
        sc = self.sc
        poison = sc.poison_fraction > 0 and self.rng.random() < sc.poison_fraction
        job = Job(len(self.jobs), self.now, sc.prompt_tokens, sc.output_tokens, poison)
        self.jobs.append(job)
        self.c.submitted += 1
        return job

    def _schedule_workload(self) -> None:
        if self.sc.rate is None:
            for _ in range(self.sc.jobs):
                self.ready.append(self._new_job())
        else:
            self.push(self._exp(1.0 / self.sc.rate), "arrival")

    def _on_arrival(self, _: Any) -> None:
        self._enqueue(self._new_job())
        self.push(self._exp(1.0 / self.sc.rate if self.sc.rate else math.inf), "arrival")

    def _enqueue(self, job: Job) -> None:
        job.state = "queued"
        self.ready.append(job)
        while self.ready and self.hungry:
            r = heapq.heappop(self.hungry)
            self.in_hungry[r] = False
            rep = self.replicas[r]
            if rep.state == "up" and len(rep.seqs) < self.sc.concurrency:
                self._update(rep)

    def _mark_hungry(self, rep: Replica) -> None:
        if not self.in_hungry[rep.idx]:
            self.in_hungry[rep.idx] = True
            heapq.heappush(self.hungry, rep.idx)

    def _on_release(self, job: Job) -> None:
        self.n_backoff -= 1
        self._enqueue(job)

    def _fail_attempt(self, job: Job, reason: str) -> None:
        """What the real queue does with a failed attempt: the policy core decides."""
        held = core.Job(state="leased", fence=1, attempts=job.attempts)
        after, effects = core.apply(held, core.Fail(self.now, 1, reason), self.rules)
        job.attempts = after.attempts
        if after.state == "dead":
            job.state = "dead"
            self.c.dead += 1
            return
        job.state = "backoff"
        self.c.retried += 1
        self.n_backoff += 1
        (retried,) = (e for e in effects if isinstance(e, core.Retried))
        self.push(retried.at_s, "release", job)

    def _orphan(self, seq: Seq) -> None:
        """The holder can no longer renew: the lease runs out lease_s from now."""
        job = seq.job
        job.tokens = min(int(seq.progress + EPS_TOKENS), job.output)
        job.state = "orphaned"
        self.push(self.now + self.p.lease_s, "expire", job)

    def _on_expire(self, job: Job) -> None:
        self.c.lease_expiries += 1
        self._fail_attempt(job, "lease expired")

    # -- replicas ---------------------------------------------------------------------------

    def _advance(self, rep: Replica, t: float) -> None:
        dt = t - rep.t0
        if dt > 0 and rep.state == "up":
            gained = dt / rep.interval
            k = 0
            for s in rep.seqs:
                if s.decoding:
                    s.progress += gained
                    k += 1
            self.c.tokens_generated += k * gained
            self.c.decode_seq_s += k * dt
        rep.t0 = t

    def _start(self, rep: Replica, job: Job) -> None:
        job.state = "running"
        job.leases += 1
        self.c.max_leases = max(self.c.max_leases, job.leases)
        replay = job.tokens > 0
        seq = Seq(job, self.now, float(job.tokens))
        rep.seqs.append(seq)
        self._begin_prefill(rep, seq, replay)
        wait = self._lease_wait()
        seq.ready_at += wait  # the prefill starts once the coordinator granted the lease

    def _lease_wait(self) -> float:
        """Seconds until the coordinator grants a lease asked now: one server, FIFO."""
        grant = max(self.now, self.lease_free_at) + self.job_s
        self.lease_free_at = grant
        self.lease_waits.append(grant - self.now)
        return grant - self.now

    def _begin_prefill(self, rep: Replica, seq: Seq, replay: bool) -> None:
        assert rep.timing is not None
        stretch = rep.timing.token_s / self.model.base.token_s if self.model.base.token_s else 1
        length = seq.job.prompt + int(seq.progress + EPS_TOKENS)
        secs = self.model.prefill_s(length) * stretch * self.slowdown
        if replay:
            self.c.replays += 1
            self.c.replay_s += secs
        else:
            self.c.prefill_s += secs
        start = max(self.now, rep.prefill_free_at)
        rep.prefill_free_at = start + secs / self.model.stages  # each stage's share
        seq.ready_at, seq.decoding = start + secs, False

    def _update(self, rep: Replica) -> None:
        """Bring a replica to now: finish, fail and start sequences, set its rate, and
        schedule its next event (the earliest finish or prefill end)."""
        now = self.now
        self._advance(rep, now)
        if rep.state != "up":
            return
        conc = self.sc.concurrency
        while True:
            keep: list[Seq] = []
            for s in rep.seqs:
                if s.decoding and s.progress >= s.job.output - EPS_TOKENS:
                    self._complete(s.job)
                elif not s.decoding and s.ready_at <= now and s.job.poison:
                    s.job.tokens = 0
                    self._fail_attempt(s.job, "poison input: the step failed")
                else:
                    if not s.decoding and s.ready_at <= now:
                        s.decoding = True
                    keep.append(s)
            rep.seqs = keep
            started = False
            while len(rep.seqs) < conc and self.ready:
                self._start(rep, self.ready.popleft())
                started = True
            if not started or all(s.ready_at > now for s in rep.seqs if not s.decoding):
                break
        k = sum(1 for s in rep.seqs if s.decoding)
        assert rep.timing is not None
        rep.interval = rep.timing.interval(max(k, 1)) * self.slowdown
        self._set_rate(rep, k / rep.interval)
        self._set_busy(rep, bool(rep.seqs))
        if len(rep.seqs) < conc:
            self._mark_hungry(rep)
        nxt = math.inf
        for s in rep.seqs:
            if s.decoding:
                nxt = min(nxt, now + max(s.job.output - s.progress, 0.0) * rep.interval)
            else:
                nxt = min(nxt, s.ready_at)
        rep.gen += 1
        if nxt < math.inf:
            self.push(nxt, "round", (rep.idx, rep.gen))

    def _complete(self, job: Job) -> None:
        job.state, job.done_at, job.tokens = "done", self.now, job.output
        self.c.done += 1
        self.latencies.append(self.now - job.arrival)

    def _on_round(self, arg: tuple[int, int]) -> None:
        r, gen = arg
        rep = self.replicas[r]
        if rep.gen == gen and rep.state == "up":
            self._update(rep)

    def _set_rate(self, rep: Replica, rate: float) -> None:
        self.rate_total += rate - rep.rate
        rep.rate = rate

    def _set_busy(self, rep: Replica, busy: bool) -> None:
        if busy != rep.busy:
            self.busy_nodes += self.npr if busy else -self.npr
            rep.busy = busy

    def _set_live(self, delta: int) -> None:
        self.live += delta
        slowdown = self.net.slowdown(self.live)
        if slowdown != self.slowdown:
            for rep in self.replicas:
                if rep.state == "up":
                    self._advance(rep, self.now)
            self.slowdown = slowdown
            for rep in self.replicas:
                if rep.state == "up":
                    self._update(rep)

    def _take_down(self, rep: Replica, head_lost: bool) -> None:
        """A node of this replica is gone: stop it; keep or orphan its sequences."""
        self._advance(rep, self.now)
        was_up = rep.state == "up"
        rep.state = "loading"
        rep.gen += 1
        self._set_rate(rep, 0.0)
        if head_lost:
            for s in rep.seqs:
                self._orphan(s)
            rep.seqs = []
        else:
            for s in rep.seqs:  # the head keeps its leases and replays them after rewiring
                s.decoding = False
                s.progress = float(int(s.progress + EPS_TOKENS))
            rep.needs_replay = rep.needs_replay or bool(rep.seqs)
        if was_up:
            self._set_live(-1)

    def _lose(self, nodes: list[int]) -> None:
        """Nodes are gone (failed, or their rack cut): each leaves a hole in its replica,
        which stops; then the holes are mended as the coordinator mends them."""
        for n in nodes:
            self._unspare(n)
            r = self.node_replica[n]
            if r < 0:
                continue
            rep, pos = self.replicas[r], self.node_pos[n]
            self.node_replica[n] = -1
            rep.nodes[pos] = HOLE
            self.holes.add(r * self.npr + pos)
            self._take_down(rep, head_lost=pos == 0)
        self._mend()
        self._form_replicas()  # replicas dropped for a hole may leave enough spares for one

    # -- placement: the policy core's (policy/placement.py: repair), O(log n) a hole ---------

    def _mend(self) -> None:
        """Every hole mended by the core's own rule (policy/placement.py: mend), over this
        engine's spares kept in heaps per rack (`_HeapSpares`: O(log n) a take). Where the
        rule says place anew (the last replica cannot be mended, or nothing is held), the
        spares it took go back and the core itself is asked: rare, and O(nodes) (`_adopt`)."""
        if not self.holes:
            return
        holes = [(slot // self.npr, slot) for slot in sorted(self.holes)]
        rings = {r: list(filter(HOLE.__ne__, self.replicas[r].nodes)) for r, _ in holes}
        live = sum(1 for rep in self.replicas if rep.state != "gone")
        pool = _HeapSpares(self)
        rack = self.per_switch.__rfloordiv__  # n // per_switch, at C speed: a replica of
        mended = placement.mend(holes, rings, rack, pool, live)  # thousands is counted
        if mended is None:
            pool.undo()
            self._adopt(*self._core_repair())
            return
        filled, dropped = mended
        for r in dropped:  # (what it held is a spare already: the rule gave it back)
            self._dissolve(self.replicas[r], spares=False)
        touched: dict[int, Replica] = {}
        for slot, n in filled.items():
            r, pos = divmod(slot, self.npr)
            rep = touched[r] = self.replicas[r]
            self._hold(rep, pos, n)
            self.c.replacements += 1
            rep.ready_at = max(rep.ready_at, self.now + self.detect_s
                               + self.p.replace_overhead_s + self.model.load_s(pos))  # fmt: skip
        for rep in touched.values():
            self._ready_when_loaded(rep)

    def _hold(self, rep: Replica, pos: int, n: int) -> None:
        rep.nodes[pos] = n
        self.node_replica[n], self.node_pos[n] = rep.idx, pos
        self.holes.discard(rep.idx * self.npr + pos)

    def _ready_when_loaded(self, rep: Replica) -> None:
        """A replica whose every slot is held again is up once its shards are loaded."""
        if HOLE in rep.nodes:
            return
        rep.timing = self._timing(rep)
        self.push(rep.ready_at, "replica_up", (rep.idx, rep.gen))

    def _dissolve(self, rep: Replica, spares: bool = True) -> None:
        """`rep` is dropped: its sequences wait for another; its nodes are spares (`spares`:
        made so here; else the placement rule made them so, and a later hole took some)."""
        for s in rep.seqs:
            self._orphan(s)
        rep.seqs = []
        rep.state = "gone"
        self._set_busy(rep, False)
        self.c.replicas_dissolved += 1
        for pos, n in enumerate(rep.nodes):
            self.holes.discard(rep.idx * self.npr + pos)
            if n != HOLE and self.node_replica[n] == rep.idx:
                self.node_replica[n] = -1
                if spares:
                    self._add_spare(n)

    def _on_replica_up(self, arg: tuple[int, int]) -> None:
        r, gen = arg
        rep = self.replicas[r]
        if rep.gen != gen or rep.state != "loading" or self.now < rep.ready_at:
            return
        rep.state = "up"
        rep.t0 = self.now
        if rep.needs_replay:
            for s in rep.seqs:
                self._begin_prefill(rep, s, replay=True)
            rep.needs_replay = False
        self._set_live(+1)
        self._update(rep)

    def _form_replicas(self) -> None:
        """A layout with every slot held and a replica's worth of spares waiting: a dropped
        replica is formed again, the lowest first, from the earliest joined spares in rack
        order (placement: _grow). A layout the core placed smaller is placed anew by it."""
        if self.control_saturated:  # the coordinator cannot keep its nodes: none is placed
            return
        if self.holes or self.n_spares < self.npr:
            return
        if self.layout[0].n != self.npr * len(self.replicas):
            self._adopt(*self._core_repair())
            return
        for rep in self.replicas:
            if rep.state != "gone" or self.n_spares < self.npr:
                continue
            popped = [self._pop_spare() for _ in range(self.npr)]
            picked = [self._member(n) for n in popped if n is not None]
            rep.nodes = [m.node_id for m in placement.by_rack(picked, self.npr)]
            for pos, n in enumerate(rep.nodes):
                self._hold(rep, pos, n)
            self._load(rep, range(self.npr))
            self.c.replicas_formed += 1

    def _load(self, rep: Replica, positions: Iterable[int], detect_s: float = 0.0) -> None:
        """`rep` loads the shards at `positions` at once, `detect_s` after now (a loss is
        seen that late; a node back or a replica formed of spares, at once)."""
        rep.state, rep.gen = "loading", rep.gen + 1
        rep.ready_at = (self.now + detect_s + self.p.replace_overhead_s
                        + self.model.load_all_s(positions))  # fmt: skip
        self._set_busy(rep, True)
        self._ready_when_loaded(rep)

    # -- placement by the core itself (rare: O(nodes) a call) -------------------------------

    def _core_repair(self) -> tuple[list[Shard], dict[int, Shard | None]]:
        self.c.core_placements += 1
        return placement.repair(self.members(), self.live_layout(), self.split, self.npr,
                                replicas=len(self.replicas))  # fmt: skip

    def _adopt(self, layout: list[Shard], out: dict[int, Shard | None]) -> None:
        """Apply a placement of the core: a replica it left out is dropped; one whose nodes
        moved stops and loads the shards that moved; every node it gives none is a spare.
        Nothing placed ({}): nothing moves (the coordinator waits, its holes open)."""
        if not out:
            return
        if layout[0].n != len(self.layout):  # placed anew, with fewer replicas: the slots
            self.layout = placement.shards(self.split(self.npr, 1), replicas=layout[0].n
                                           // self.npr)  # fmt: skip
        rings: dict[int, list[int]] = {}
        for n, shard in out.items():
            if shard is not None:
                rings.setdefault(shard.replica, [HOLE] * self.npr)[shard.slot % self.npr] = n
        for rep in self.replicas:
            new = rings.get(rep.idx)
            if new is None:
                if rep.state != "gone":
                    self._dissolve(rep)
                continue
            held = rep.state != "gone"
            old = list(rep.nodes) if held else [HOLE] * self.npr
            if new == old:
                continue
            if held:
                self._take_down(rep, head_lost=new[0] != old[0])
            for pos, n in enumerate(old):
                if n != HOLE and self.node_replica[n] == rep.idx and new[pos] != n:
                    self.node_replica[n] = -1
            for pos, n in enumerate(new):
                if n == HOLE:
                    self.holes.add(rep.idx * self.npr + pos)
                else:
                    self._unspare(n)
                    self._hold(rep, pos, n)
            rep.nodes = new
            self._load(rep, [pos for pos in range(self.npr) if new[pos] != old[pos]],
                       self.detect_s if held else 0.0)  # fmt: skip
        for n, shard in out.items():
            if shard is None and self.node_replica[n] < 0:
                self._add_spare(n)

    # -- spares -----------------------------------------------------------------------------

    def _add_spare(self, n: int) -> None:
        if not self.is_spare[n]:
            self.is_spare[n] = True
            self.n_spares += 1
            heapq.heappush(self.spares, n)
            heapq.heappush(self.rack_spares[n // self.per_switch], n)

    def _unspare(self, n: int) -> None:
        """`n` is no longer a spare (it holds a slot now, or it is gone); its heap entries
        are skipped when popped."""
        if self.is_spare[n]:
            self.is_spare[n] = False
            self.n_spares -= 1

    def _pop_spare(self, heap: list[int] | None = None) -> int | None:
        heap = self.spares if heap is None else heap
        while heap:
            n = heapq.heappop(heap)
            # a spare on a rack that is going down is not taken (its loss is counted next)
            if self.is_spare[n] and self._node_up(n):
                self._unspare(n)
                return n
        return None

    # -- failures ---------------------------------------------------------------------------

    def _node_up(self, n: int) -> bool:
        return not self.node_failed[n] and not self.switch_down[n // self.per_switch]

    def _on_node_fail(self, _: Any) -> None:
        assert self.sc.mtbf_s is not None
        self.push(self._exp(self.sc.mtbf_s / self.count), "node_fail")
        n = self.rng.randrange(self.count)
        if self.fail_node(n):
            self.push(self._exp(self.sc.mttr_s), "node_repair", n)

    def fail_node(self, n: int) -> bool:
        """Node `n` fails (False: it is down or out already, and cannot fail again)."""
        if not self._node_up(n) or self.node_offline[n]:
            return False
        self.c.node_failures += 1
        self.node_failed[n] = True
        self._judge(n, health.Lost("failed"))
        self.down_nodes += 1
        self._lose([n])
        return True

    def schedule_kill(self, t: float, position: int, replica: int = 0) -> None:
        """Kill the node holding `position` of `replica` at time t (no repair)."""
        self.push(t, "kill", (replica, position))

    def _on_kill(self, arg: tuple[int, int]) -> None:
        n = self.replicas[arg[0]].nodes[arg[1]]
        if n != HOLE and self._node_up(n):
            self.c.node_failures += 1
            self.node_failed[n] = True
            self._judge(n, health.Lost("killed"))
            self.down_nodes += 1
            self._lose([n])

    def _on_node_repair(self, n: int) -> None:
        self.node_failed[n] = False
        self.c.repairs += 1
        if self.switch_down[n // self.per_switch]:
            return
        self.down_nodes -= 1
        self._back([n])

    def _judge(self, n: int, event: health.Event) -> None:
        """The coordinator's verdict on a node (the policy core): taken out, or not."""
        before = self.node_health.get(n, health.Health())
        self.node_health[n], taken = health.apply(before, event, self.p.offline_after)
        if taken and not self.node_offline[n]:
            self.node_offline[n] = True
            self.c.offline_nodes += 1

    def _back(self, nodes: list[int]) -> None:
        """Nodes are up again (repaired, their rack back): spares, at once."""
        for n in nodes:
            if not self.node_offline[n]:
                self._add_spare(n)
        self._mend()
        self._form_replicas()

    def _on_rack_fail(self, _: Any) -> None:
        assert self.sc.rack_mtbf_s is not None
        self.push(self._exp(self.sc.rack_mtbf_s / self.switches), "rack_fail")
        self.fail_rack(self.rng.randrange(self.switches))

    def fail_rack(self, sw: int) -> None:
        """Access switch `sw` goes down: every node on it is lost at once."""
        if self.switch_down[sw]:
            return
        self.c.rack_failures += 1
        nodes = range(sw * self.per_switch, min((sw + 1) * self.per_switch, self.count))
        up = [n for n in nodes if not self.node_failed[n]]
        self.switch_down[sw] = True
        self.down_nodes += len(up)
        self._lose(up)
        self.push(self._exp(self.sc.rack_mttr_s), "rack_repair", sw)

    def _on_rack_repair(self, sw: int) -> None:
        self.switch_down[sw] = False
        nodes = range(sw * self.per_switch, min((sw + 1) * self.per_switch, self.count))
        up = [n for n in nodes if not self.node_failed[n]]
        self.down_nodes -= len(up)
        self._back(up)

    # -- observation ------------------------------------------------------------------------

    def _on_sample(self, _: Any) -> None:
        self._sample_now()

    def _sample_now(self) -> None:
        t0, tok0 = self._last_sample
        dt = self.now - t0
        tps = (self.tokens_int - tok0) / dt if dt > 0 else self.rate_total
        s = self.series
        s["t_s"].append(self.now)
        s["tokens_per_s"].append(tps)
        s["live_replicas"].append(float(self.live))
        s["queue_depth"].append(float(len(self.ready) + self.n_backoff))
        s["in_flight"].append(float(sum(len(r.seqs) for r in self.replicas)))
        s["down_nodes"].append(float(self.down_nodes))
        idle = self.count - self.busy_nodes - self.down_nodes
        s["power_w"].append((self.busy_nodes * self.p_busy + idle * self.p_idle) * self.pue)
        unit = self.net.unit_utilization(self.live)
        per_replica = tps / self.live if self.live else 0.0
        for tier, u in zip(TIERS, unit, strict=True):
            self.tier_series[tier].append(u * per_replica)
        self._last_sample = (self.now, self.tokens_int)

    def lost_jobs(self) -> int:
        """Jobs in no place they should be (must be 0): a running job not in a replica, a
        queued one not in the queue, a done/dead one counted twice or never."""
        where = {id(s.job): "running" for r in self.replicas for s in r.seqs}
        where |= {id(j): "queued" for j in self.ready}
        lost = 0
        for j in self.jobs:
            if j.state in ("running", "queued"):
                lost += where.get(id(j)) != j.state
            else:
                lost += j.state not in ("backoff", "orphaned", "done", "dead")
        backoff = sum(1 for j in self.jobs if j.state == "backoff")
        by_state = sum(1 for j in self.jobs if j.state in ("done", "dead"))
        return lost + abs(by_state - self.c.done - self.c.dead) + abs(backoff - self.n_backoff)


class _HeapSpares:
    """The engine's spares as the placement rule takes them (placement.Spares): a heap of
    node indices (join order) per rack and one for all, entries of nodes no longer spare
    skipped when popped. Every take and give is kept, for `undo`."""

    def __init__(self, engine: Simulator) -> None:
        self.engine = engine
        self.done: list[tuple[bool, int]] = []  # (taken, node)

    def take(self, rack: Hashable | None) -> int | None:
        e = self.engine
        n = e._pop_spare(e.rack_spares[rack]) if isinstance(rack, int) else None
        n = e._pop_spare() if n is None else n
        if n is not None:
            self.done.append((True, n))
        return n

    def give(self, nodes: Sequence[int]) -> None:
        for n in nodes:
            if not self.engine.is_spare[n]:
                self.engine._add_spare(n)
                self.done.append((False, n))

    def undo(self) -> None:
        for taken, n in reversed(self.done):
            if taken:
                self.engine._add_spare(n)
            else:
                self.engine._unspare(n)
        self.done.clear()
