"""The policy core (swarm/policy/jobs.py) and the real queue (SQLite) agree.

Hypothesis draws one sequence of timed events — leases, checkpoints with and without
progress, completions, failures, strikes, releases, expiries, cancels, holders' calls under
an old fence — and both run it: the core as `apply`, the queue as the calls the coordinator
makes. After every event the job's state, fence, attempts, strikes, backoff and error are the
same in both. The simulator decides failed attempts with the same `apply` (sim/engine.py).
A node's health likewise: the core (swarm/policy/nodes.py) beside the real coordinator.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cellswarm.sim.engine import HOLE, Simulator
from cellswarm.sim.params import Scenario
from cellswarm.sim.run import build
from cellswarm.swarm.control.db import SQLiteDatabase
from cellswarm.swarm.control.jobs import JobQueue
from cellswarm.swarm.policy import Retry, placement
from cellswarm.swarm.policy import jobs as core
from cellswarm.swarm.policy import nodes as health
from cellswarm.swarm.protocol.messages import Shard

KINDS = ("lease", "checkpoint", "progress", "complete", "fail", "strike", "release",
         "expire", "cancel")  # fmt: skip
HOLDER = "h0"

steps = st.lists(
    st.tuples(st.sampled_from(KINDS), st.floats(0.0, 14.0), st.booleans()),
    min_size=1, max_size=30,
)  # fmt: skip


def _comparable(job: core.Job) -> tuple[object, ...]:
    # a completed job's tokens are its result's (the queue stores them); the rest is policy
    n_tokens = None if job.state == "done" else job.n_tokens
    return (job.state, job.fence, job.attempts, job.strikes, n_tokens,
            round(job.not_before_s, 6), job.error if job.state != "done" else "")  # fmt: skip


def _model(job: core.Job, kind: str, now: float, stale: bool) -> core.Job:
    """What the queue's call does, in events: a lease first expires what ran out (lease())."""
    fence = job.fence - 1 if stale else job.fence
    events: list[core.Event] = {
        "lease": [core.Expire(now, HOLDER), core.Lease(now)],
        "checkpoint": [core.Checkpoint(now, fence, job.n_tokens)],
        "progress": [core.Checkpoint(now, fence, job.n_tokens + 1)],
        "complete": [core.Complete(now, fence)],
        "fail": [core.Fail(now, fence, "a step failed")],
        "strike": [core.Strike(now, "a node went silent")],
        "release": [core.Release(now, fence)],
        "expire": [core.Expire(now, HOLDER)],
        "cancel": [core.Cancel(now)],
    }[kind]
    for event in events:
        job, _ = core.apply(job, event)
    return job


def _real(queue: JobQueue, job_id: str, kind: str, now: float, stale: bool) -> None:
    row = queue.get(job_id)
    assert row is not None
    fence = row.fence - 1 if stale else row.fence
    tokens = list(range(len(row.tokens)))
    if kind == "lease":
        queue.lease(HOLDER, "r0", now=now)
    elif kind in ("checkpoint", "progress"):
        queue.checkpoint(job_id, fence, tokens + ([7] if kind == "progress" else []), now=now)
    elif kind == "complete":
        queue.complete(job_id, fence, {"tokens": tokens}, now=now)
    elif kind == "fail":
        queue.fail(job_id, fence, "a step failed", now=now)
    elif kind == "strike":
        queue.strike([job_id], "a node went silent", now=now)
    elif kind == "release":
        queue.release(job_id, fence, now=now)
    elif kind == "expire":
        queue.expire(now)
    else:
        queue.cancel_job(job_id)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])  # fmt: skip
@given(seq=steps)
def test_the_core_and_the_sqlite_queue_agree_at_every_step(
    tmp_path: Path, seq: list[tuple[str, float, bool]]
) -> None:
    db = SQLiteDatabase(":memory:")
    queue = JobQueue(db)
    job, _ = queue.submit({"prompt": "x"})
    model, now = job.facts, 1000.0
    for kind, dt, stale in seq:
        now += dt
        model = _model(model, kind, now, stale)
        _real(queue, job.job_id, kind, now, stale)
        got = queue.get(job.job_id)
        assert got is not None
        assert _comparable(got.facts) == _comparable(model), (kind, now, stale)


def test_exactly_one_terminal_state_whatever_arrives_late() -> None:
    job = core.Job()
    job, _ = core.apply(job, core.Lease(0.0))
    done, effects = core.apply(job, core.Complete(1.0, job.fence))
    assert done.state == "done" and effects == (core.Ended("done", ""),)
    for late in (core.Fail(2.0, job.fence, "x"), core.Expire(99.0), core.Cancel(3.0),
                 core.Strike(4.0, "x"), core.Release(5.0, job.fence), core.Lease(6.0)):  # fmt: skip
        after, effects = core.apply(done, late)
        assert after == done and effects == (core.Stale(),)


def test_a_failed_attempt_backs_off_then_dies_with_its_reason() -> None:
    rules = core.Rules(max_attempts=3, retry=Retry(lease_s=10.0, backoff_s=0.5))
    job, t = core.Job(), 0.0
    for attempt in (1, 2):
        job, _ = core.apply(job, core.Lease(t), rules)
        job, effects = core.apply(job, core.Fail(t, job.fence, "boom"), rules)
        assert job.state == "queued" and effects == (core.Retried(t + 0.5 * 2 ** (attempt - 1)),)
        assert core.apply(job, core.Lease(t), rules)[1] == (core.Stale(),)  # still backing off
        t = job.not_before_s
    job, _ = core.apply(job, core.Lease(t), rules)
    job, effects = core.apply(job, core.Fail(t, job.fence, "boom"), rules)
    assert job.state == "dead" and job.error == "failed 3 times; last: boom"
    assert effects == (core.Ended("dead", "failed 3 times; last: boom"),)


def test_progress_clears_strikes_and_poison_is_quarantined() -> None:
    rules = core.Rules(poison_after=3)
    job, _ = core.apply(core.Job(), core.Lease(0.0), rules)
    for _ in range(2):
        job, _ = core.apply(job, core.Strike(1.0, "silent"), rules)
    job, _ = core.apply(job, core.Checkpoint(2.0, job.fence, 1), rules)
    assert job.strikes == 0
    for _ in range(3):
        job, _ = core.apply(job, core.Strike(3.0, "silent"), rules)
    assert job.state == "dead" and job.error.startswith("quarantined as poison: present at 3")


@pytest.mark.parametrize("bad", [{"attempts": -1}, {"fence": -2}])
def test_a_job_with_negative_counters_is_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="never negative"):
        core.Job(**bad)  # type: ignore[arg-type]


def test_a_node_is_taken_out_for_its_own_failures_in_a_row_not_for_being_lost() -> None:
    h = health.Health()
    for _ in range(5):  # killed, rebooted, its rack cut: it comes back each time
        h, taken = health.apply(h, health.Lost("no heartbeat"), offline_after=2)
        assert not taken and not h.offline
    h, taken = health.apply(h, health.Charged("step 3 raised"), offline_after=2)
    h, _ = health.apply(h, health.Served(), offline_after=2)  # served: the count starts again
    assert h.consecutive_failures == 0 and h.failures == 6
    h, _ = health.apply(h, health.Charged("step 3 raised"), offline_after=2)
    h, taken = health.apply(h, health.Charged("step 4 raised"), offline_after=2)
    assert h.offline and taken == (health.TakenOffline(
        "offline after 2 failures in a row: step 4 raised"),)  # fmt: skip
    assert health.apply(h, health.Served())[0] == h  # out: nothing moves it but its probe
    back, _ = health.apply(h, health.ProbePassed())
    assert not back.offline and back.consecutive_failures == 0


def test_a_node_is_silent_only_while_the_coordinator_could_hear_it() -> None:
    """Issue 56: a coordinator held 5 s by one request lost every worker at its next tick,
    before reading the beats that had waited for it."""
    spells = health.deaf_spells((), 0.0, 100.0)  # the first tick: nothing to compare
    spells = health.deaf_spells(spells, 100.0, 100.25)  # ticks 0.25 s apart: listening
    assert spells == ()
    spells = health.deaf_spells(spells, 100.25, 105.5)  # held 5.25 s
    assert spells == ((100.25, 105.5),)
    assert health.silence_s(99.0, 105.5, spells) == 1.25  # beat at 99: heard until 100.25
    assert health.silence_s(106.0, 108.0, spells) == 2.0  # a beat after it: all counted
    assert health.silence_s(90.0, 110.0, spells) == 14.75  # silent long before: still lost
    for t in range(100):  # a coordinator deaf every other tick keeps a bounded memory
        spells = health.deaf_spells(spells, 200.0 + 3 * t, 202.0 + 3 * t)
    assert len(spells) == health.DEAF_KEPT and spells[-1] == (497.0, 499.0)


def test_the_simulator_keeps_lost_nodes_as_the_swarm_does() -> None:
    # the simulator once took a node out after `offline_after` hardware failures, which the
    # coordinator never does (a node back from a crash beats, and is a spare again)
    sc = Scenario(model="mixtral-8x7b", node="rpi4", context=2048, count=400, concurrency=4,
                  jobs=400, prompt_tokens=64, output_tokens=64, duration_s=4 * 3600,
                  mtbf_s=3600, mttr_s=600, seed=5)  # fmt: skip
    sim, _ = build(sc)
    sim.run()
    repeat = [h for h in sim.node_health.values() if h.failures >= sc.params.offline_after]
    assert repeat and sim.c.offline_nodes == 0


NODE_KINDS = ("charged", "lost", "back", "probe_passed", "placed")


def test_the_core_and_the_real_coordinator_judge_a_node_alike(
    demo_path: Path, tmp_path: Path
) -> None:
    """Random sequences of a node's own failures (a fault it reports), losses, returns,
    probes and placements, through the coordinator's own entry points (SQLite), beside the
    core's `apply` on the same events: the same counts and the same verdict at every step."""
    from cellswarm.swarm.control.coordinator import Coordinator, CoordinatorConfig
    from cellswarm.swarm.protocol import PROTOCOL
    from cellswarm.swarm.protocol.messages import Heartbeat, Shard

    coord = Coordinator(CoordinatorConfig(str(demo_path), db=str(tmp_path / "c.db")))
    whole = Shard(slot=0, n=1, role="stage", stage=0, layers=(0, 30))
    caps = {"memory_bytes": 1 << 20, "protocol": PROTOCOL}
    examples = iter(range(10**6))

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(kinds=st.lists(st.sampled_from(NODE_KINDS), min_size=1, max_size=25))
    def agree(kinds: list[str]) -> None:
        node_id = f"n{next(examples)}"
        session = coord.join(node_id, coord.challenge(), "", caps, "127.0.0.1")
        model = health.Health()
        for kind in kinds:
            node = coord.store.node(node_id)
            assert node is not None
            if kind == "charged":  # a step of its own failed, in the current wiring
                coord.fault(node, "forward", "a step raised", epoch=coord.epoch)
                if node.state == "assigned":
                    model, _ = health.apply(model, health.Charged("a step raised"),
                                            coord.config.offline_after)  # fmt: skip
            elif kind == "lost":
                coord.lose(node, "no heartbeat")
                if node.state in ("assigned", "spare"):
                    model, _ = health.apply(model, health.Lost("no heartbeat"))
            elif kind in ("back", "probe_passed"):  # it beats again (with its probe's result)
                probe = True if kind == "probe_passed" else None
                coord.heartbeat(node, Heartbeat(node_id=node_id, session=session,
                                                probe_ok=probe))  # fmt: skip
                if node.state == "offline" and probe:
                    model, _ = health.apply(model, health.ProbePassed())
            elif node.state == "spare":  # placement gives it the shard
                coord.store.update_node(node_id, state="assigned", shard=whole)
            got = coord.store.node(node_id)
            assert got is not None and got.health == model, (kinds, got, model)

    agree()


class _Checked(Simulator):
    """A simulator that asks the placement core (policy/placement.py: repair, on a snapshot
    of its nodes) for every single hole it mends, and records both answers: the core's
    pick, and the spare the simulator's own heaps gave the same rule."""

    compared: list[tuple[int | None, int | None]]

    def _mend(self) -> None:
        members = self.members()
        held = {m.shard.slot for m in members if m.shard is not None}
        live = {r.idx for r in self.replicas if r.state != "gone"}
        holes = {s.slot for s in self.layout if s.replica in live} - held
        core_pick, slot = None, -1
        if len(holes) == 1 and len(live) == len(self.replicas):  # one hole: one decision
            [slot] = holes
            layout, out = placement.repair(members, self.layout, self.split, self.npr,
                                           replicas=len(self.replicas))  # fmt: skip
            if layout == self.layout:  # a spare fills it (else the core places anew)
                core_pick = next(n for n, s in out.items() if s is not None and s.slot == slot)
        super()._mend()
        if core_pick is not None:
            chose = self.replicas[slot // self.npr].nodes[slot % self.npr]
            self.compared.append((core_pick, None if chose == HOLE else chose))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(("node", "node", "back", "back", "rack", "rack_back")),
                          st.integers(0, 10**6)), min_size=1, max_size=40),
       st.integers(20, 60))  # fmt: skip
def test_the_simulator_fills_a_hole_with_the_spare_the_core_picks(
    ops: list[tuple[str, int]], replicas: int
) -> None:
    """Rack-aware spares (the replica's own rack first, then the earliest joined): the
    simulator's O(log n) choice is the core's, on 400 nodes in racks of 16."""
    sc = Scenario(model="mixtral-8x7b", node="rpi4", context=2048, count=400, concurrency=4,
                  jobs=10, prompt_tokens=64, output_tokens=64, duration_s=600,
                  network=(("nodes_per_access_switch", 16),))  # fmt: skip
    base, result = build(sc)
    req = result.request
    sim = _Checked(sc, base.model, base.net, replicas, req.power,
                   (req.node.power_busy_w, req.node.power_idle_w))  # fmt: skip
    sim.compared = []
    assert {len(set(sim.per_switch and n // 16 for n in r.nodes)) for r in sim.replicas} == {1}
    for op, x in ops:
        if op == "node":  # a node holding a slot (where a choice is made)
            held = [n for r in sim.replicas if r.state != "gone" for n in r.nodes
                    if sim._node_up(n)]  # fmt: skip
            sim.fail_node(held[x % len(held)] if held else x % sim.count)
        elif op == "back":
            down = [n for n in range(sim.count) if sim.node_failed[n]]
            if down:
                sim._on_node_repair(down[x % len(down)])
        elif op == "rack":
            sim.fail_rack(x % sim.switches)
        else:
            cut = [k for k in range(sim.switches) if sim.switch_down[k]]
            if cut:
                sim._on_rack_repair(cut[x % len(cut)])
        assert sim.lost_jobs() == 0
    assert all(core_pick == chose for core_pick, chose in sim.compared), sim.compared


def test_the_spare_check_compares_something() -> None:
    """The property above is not vacuous: single failures with spares are compared, and a
    spare from the replica's own rack is preferred to an earlier one elsewhere."""
    sc = Scenario(model="mixtral-8x7b", node="rpi4", context=2048, count=400, concurrency=4,
                  jobs=10, prompt_tokens=64, output_tokens=64, duration_s=600,
                  network=(("nodes_per_access_switch", 16),))  # fmt: skip
    base, result = build(sc)
    req = result.request
    sim = _Checked(sc, base.model, base.net, 38, req.power,
                   (req.node.power_busy_w, req.node.power_idle_w))  # fmt: skip
    sim.compared = []
    # 38 replicas of 4 in racks of 16: rack 9 holds replicas 36 and 37, then spares 152..159
    sim.fail_node(1)  # rack 0 has no spare: the earliest joined, 152, takes the hole
    assert sim.replicas[0].nodes[1] == 152
    sim._on_node_repair(1)  # node 1 is back: a spare, the earliest joined of all
    sim.fail_node(149)  # replica 37, rack 9: a spare of its own rack, not node 1
    assert sim.replicas[37].nodes[1] == 153
    assert len(sim.compared) == 2 and all(a == b for a, b in sim.compared), sim.compared


class _Agreeing(Simulator):
    """A simulator that, at every change of who is placeable (nodes lost, a node back),
    asks the placement core what the coordinator would make of it — `repair` over the
    simulator's own members, run until it changes nothing more, as the coordinator's
    reconcile does tick after tick — and checks that its O(log n) mending made the same:
    the same layout, every node the same shard."""

    agreed: int

    def _settled(self) -> tuple[list[Shard], dict[int, Shard | None]]:
        members, layout = self.members(), self.live_layout()
        for _ in range(4):
            new_layout, out = placement.repair(members, layout, self.split, self.npr,
                                               replicas=len(self.replicas))  # fmt: skip
            if not out:
                break
            moved = [replace(m, state="assigned" if out[m.node_id] else "spare",
                             shard=out[m.node_id]) for m in members]  # fmt: skip
            if moved == members and new_layout == layout:
                break
            members, layout = moved, new_layout
        return layout, {m.node_id: m.shard for m in members}

    def _check(self, expected: tuple[list[Shard], dict[int, Shard | None]]) -> None:
        got = (self.live_layout(), {m.node_id: m.shard for m in self.members()})
        assert got == expected, (self.now, self.c)
        self.agreed += 1

    def _lose(self, nodes: list[int]) -> None:
        expected = self._settled()  # the lost nodes are down already: not members
        super()._lose(nodes)
        self._check(expected)

    def _back(self, nodes: list[int]) -> None:
        expected = self._settled()  # they are up again: spares, to the core
        super()._back(nodes)
        self._check(expected)


@pytest.mark.parametrize(("count", "replicas"), [(400, 60), (400, 90), (16, 3)])
def test_the_simulated_swarm_is_placed_as_the_core_places_it_all_day(
    count: int, replicas: int
) -> None:
    """A day of seeded node and rack failures and repairs (racks of 16; a node is down a
    third of the time): 400 nodes holding 60 or 90 replicas of 4, or 16 holding 3, so that
    spares run out and replicas are dropped and formed again, and the last one waits for
    nodes. After each change the simulator's replicas — up, loading or dropped, which node
    holds which slot — are what the policy core makes of the same nodes. So the simulated
    availability over the day is the core's, and its spares, drops and re-formed replicas
    are the coordinator's."""
    sc = Scenario(model="mixtral-8x7b", node="rpi4", context=2048, count=count,
                  concurrency=4, jobs=20, prompt_tokens=64, output_tokens=64,
                  duration_s=86_400, mtbf_s=4 * 3600, mttr_s=2 * 3600, rack_mtbf_s=6 * 3600,
                  rack_mttr_s=1800, seed=11,
                  network=(("nodes_per_access_switch", 16),))  # fmt: skip
    base, result = build(sc)
    req = result.request
    sim = _Agreeing(sc, base.model, base.net, replicas, req.power,
                    (req.node.power_busy_w, req.node.power_idle_w))  # fmt: skip
    sim.agreed = 0
    sim.run()
    c = sim.c
    assert sim.agreed > 100 and sim.lost_jobs() == 0
    assert c.replacements and c.replicas_dissolved and c.replicas_formed, c  # not vacuous
    assert c.core_placements > 0 or count > 16  # the last replica waited: the core asked


class _Fifo:
    """Spares as the rule takes them (placement.Spares), over ids whose first letter is
    their rack: the earliest (by name) of the asked rack, else the earliest."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = sorted(ids)

    def take(self, rack: object) -> str | None:
        pick = next((k for k in self.ids if k[0] == rack), self.ids[0] if self.ids else None)
        if pick is not None:
            self.ids.remove(pick)
        return pick

    def give(self, nodes: list[str]) -> None:
        self.ids = sorted([*self.ids, *nodes])


def test_mend_fills_from_the_replicas_rack_drops_what_it_cannot_and_never_the_last() -> None:
    """The rule itself (placement.mend), on a fake set of spares."""
    rings = {0: ["x0", "x1"], 1: ["y3"]}  # two replicas of three slots: holes 2, 4 and 5
    holes = [(0, 2), (1, 4), (1, 5)]
    spares = _Fifo(["a7", "x9"])  # x9: replica 0's rack; a7 to 4, then 5 finds none:
    first = placement.mend(holes, rings, lambda k: k[0], spares, 2)  # replica 1 goes,
    assert first == ({2: "x9"}, [1]) and spares.ids == ["a7", "y3"]  # a7 and y3 back
    spares = _Fifo(["b1"])  # the first hole takes b1; 4 has none: replica 1 goes, y3 back
    assert placement.mend(holes, rings, lambda k: k[0], spares, 2) == ({2: "b1"}, [1])
    assert spares.ids == ["y3"] and rings == {0: ["x0", "x1"], 1: ["y3"]}  # inputs untouched
    assert placement.mend([(0, 2)], {0: ["x0"]}, lambda k: k[0], _Fifo([]), 1) is None
    assert placement.mend([(0, 0)], {0: []}, lambda k: k[0], _Fifo(["x1"]), 1) is None
