"""The planner's model of speculative decoding on a pipeline (issue 36): acceptance rate x
draft depth against what k + 1 rows cost each stage and hop. Pure arithmetic, no wall clock."""

from __future__ import annotations

import dataclasses

import pytest

from cellswarm.errors import RequestError
from cellswarm.planner import api, render
from cellswarm.planner.speculative import (
    MAX_IN_FLIGHT,
    RingTimes,
    best_k,
    break_even_acceptance,
    expected_tokens,
    in_flight,
    lowest_break_even,
    pipelined_speedup,
    ring_times,
    round_s,
    speedup,
    swarm_speedup,
)


def compute_bound_one_stage() -> RingTimes:
    """Every row costs a whole step: k + 1 rows cost k + 1 steps."""
    return RingTimes(memory_s=(0.0,), per_row_s=(0.01,), fixed_s=(0.0,), hop_s=0.0,
                     row_bytes=0, link_bytes_per_s=1e9)  # fmt: skip


def bandwidth_bound_ring(hop_s: float = 0.5e-3) -> RingTimes:
    """Four stages that wait on their weights (10 ms) far more than on a row's FLOPs."""
    return RingTimes(memory_s=(0.010,) * 4, per_row_s=(0.0005,) * 4, fixed_s=(0.001,) * 4,
                     hop_s=hop_s, row_bytes=576 * 4, link_bytes_per_s=125e6)  # fmt: skip


@pytest.mark.parametrize(
    ("acceptance", "k", "tokens"),
    [
        (0.0, 0, 1.0),
        (0.0, 4, 1.0),  # nothing accepted: the last stage's own token
        (1.0, 0, 1.0),
        (1.0, 3, 4.0),  # everything accepted: k + 1
        (1.0, 8, 9.0),
        (0.5, 2, 1.75),  # 1 + 0.5 + 0.25
        (0.8, 1, 1.8),
    ],
)
def test_expected_tokens(acceptance: float, k: int, tokens: float) -> None:
    assert expected_tokens(acceptance, k) == pytest.approx(tokens)


def test_a_compute_bound_stage_never_pays() -> None:
    times = compute_bound_one_stage()
    assert round_s(times, 1) == pytest.approx(0.01)  # one stage: no hop
    assert round_s(times, 5) == pytest.approx(0.05)
    for k in range(1, 9):
        assert speedup(times, 1.0, k) == pytest.approx(1.0)
        assert speedup(times, 0.9, k) < 1.0
        assert break_even_acceptance(times, k) == 1.0
    assert best_k(times, 0.99) == 0
    assert lowest_break_even(times) == (1.0, 0)


def test_a_bandwidth_bound_ring_pays_at_high_acceptance() -> None:
    times = bandwidth_bound_ring()
    assert times.path_hops == 4  # three forward, one back
    k = best_k(times, 0.9)
    assert k > 0
    assert speedup(times, 0.9, k) > 2.0
    assert speedup(times, 0.9, k) >= max(speedup(times, 0.9, j) for j in range(9)) - 1e-12
    even = break_even_acceptance(times, k)
    assert 0.0 < even < 0.9
    assert speedup(times, even, k) > 1.0 >= speedup(times, even - 2e-4, k)


def test_speedup_at_depth_zero_is_one() -> None:
    assert speedup(bandwidth_bound_ring(), 0.5, 0) == pytest.approx(1.0)
    assert best_k(bandwidth_bound_ring(), 0.0) == 0  # nothing accepted: drafts only cost


@pytest.mark.parametrize("k", [1, 3, 6])
def test_more_hop_latency_lowers_the_break_even(k: int) -> None:
    """A round's fixed costs (latency) are paid once per round whatever its rows: the more
    of them, the less the extra rows cost relatively, and the sooner drafting pays."""
    evens = [break_even_acceptance(bandwidth_bound_ring(h), k) for h in (0.0, 1e-3, 1e-2, 0.1)]
    assert evens == sorted(evens, reverse=True)
    assert evens[0] > evens[-1]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"memory_s": ()}, "at least one stage"),
        ({"per_row_s": (0.1,)}, "per_row_s has 1 stages, not 4"),
        ({"fixed_s": (0.0,) * 5}, "fixed_s has 5 stages, not 4"),
        ({"unpack_s": (0.0,) * 3}, "unpack_s has 3 stages, not 4"),
        ({"memory_s": (0.01, -1.0, 0.01, 0.01)}, "memory_s"),
        ({"per_row_s": (float("nan"),) * 4}, "per_row_s"),
        ({"hop_s": -0.001}, "hop_s"),
        ({"row_bytes": -1}, "row_bytes"),
        ({"link_bytes_per_s": 0.0}, "link_bytes_per_s"),
        ({"hops": -1}, "hops"),
    ],
)
def test_a_bad_ring_is_a_one_line_error(change: dict[str, object], fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment) as err:
        dataclasses.replace(bandwidth_bound_ring(), **change)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens(1.5, 2),
        lambda: expected_tokens(-0.1, 2),
        lambda: expected_tokens(0.5, -1),
        lambda: best_k(bandwidth_bound_ring(), 0.5, max_k=-1),
        lambda: round_s(bandwidth_bound_ring(), 0),
    ],
)
def test_bad_arguments_are_request_errors(call: object) -> None:
    with pytest.raises(RequestError):
        call()  # type: ignore[operator]


# -- from a real plan -------------------------------------------------------------------------


@pytest.mark.parametrize("node", ["rpi4", "rpi5", "laptop"])
def test_ring_times_of_a_plan_is_the_planners_own_step(node: str) -> None:
    """One row through the ring costs what the planner's decode step does (the token back
    carries its id's 8 bytes here, none there)."""
    r = api.plan("smollm2-135m", node=node, count=4, stages=4)
    times = ring_times(r)
    assert times.stages == 4 and times.path_hops == 4
    assert round_s(times, 1) == pytest.approx(r.decode.total_s, rel=1e-3)
    assert times.row_bytes == r.model.d_model * 4  # f32 activations
    assert times.fixed_s == (r.request.cost.stage_step_s,) * 4


def test_a_faster_node_gains_more_from_drafts() -> None:
    """The rpi4 computes a row more slowly than it reads the weights; the laptop reads
    them far slower than it computes a row, so its verification rows come nearly free."""
    rpi4 = ring_times(api.plan("smollm2-135m", node="rpi4", count=4, stages=4))
    laptop = ring_times(api.plan("smollm2-135m", node="laptop", count=4, stages=4))
    assert lowest_break_even(laptop)[0] < lowest_break_even(rpi4)[0]
    assert best_k(laptop, 0.8) > 0
    assert speedup(laptop, 0.8, best_k(laptop, 0.8)) > speedup(rpi4, 0.8, best_k(rpi4, 0.8))


def test_one_stage_plan_has_no_hop() -> None:
    times = ring_times(api.plan("smollm2-135m", node="laptop", count=1))
    assert times.stages == 1 and times.path_hops == 0


def test_parts_off_the_path_are_not_modelled() -> None:
    r = api.plan("kimi-k2", node="ps3", count=10_000)
    with pytest.raises(RequestError, match="only whole-layer stages"):
        ring_times(r)
    assert render._speculative_line(r) == ""


def test_the_plan_says_where_speculation_pays() -> None:
    r = api.plan("smollm2-135m", node="laptop", count=4, stages=4)
    line = render._speculative_line(r)
    assert line.startswith("pays from acceptance 0.")
    assert "at 0.8 acceptance" in line


# -- pipelined: rounds behind rounds (swarm/ring/rounds.py) --------------------------------------


def compute_bound_ring(stages: int = 4) -> RingTimes:
    """Stages whose every row costs a whole step, and hops that cost nothing."""
    return RingTimes(memory_s=(0.0,) * stages, per_row_s=(0.01,) * stages,
                     fixed_s=(0.0,) * stages, hop_s=0.0, row_bytes=0,
                     link_bytes_per_s=1e9)  # fmt: skip


@pytest.mark.parametrize(("acceptance", "rows", "stages", "n"), [
    (0.94, 1, 4, 4), (0.94, 5, 4, 4), (0.9, 5, 4, 2), (0.5, 1, 4, 2), (0.3, 1, 4, 1),
    (1.0, 9, 8, MAX_IN_FLIGHT), (0.99, 1, 1, 1),
])  # fmt: skip
def test_rounds_in_flight_follow_the_chance_they_hold(acceptance: float, rows: int, stages: int,
                                                      n: int) -> None:  # fmt: skip
    assert in_flight(acceptance, rows, stages) == n


def test_the_ring_sends_as_many_rounds_as_the_planner_counts() -> None:
    """What the planner and the simulator predict is what stage 0 does: next_round, fed an
    endless agreeing lookup, sends rounds until in_flight's count."""
    from cellswarm.swarm.ring.rounds import Round, next_round

    for acceptance in (0.2, 0.4, 0.6, 0.8, 0.9, 0.97):
        for rows in (1, 2, 3, 5):
            rounds = [Round(100, tuple(range(rows)), 0.0)]
            look = list(range(1, 200))
            while (r := next_round(rounds, look, acceptance, 10_000, 0.0)) is not None:
                rounds.append(r)
            assert len(rounds) == in_flight(acceptance, rows, 4), (acceptance, rows)


def test_one_round_in_flight_is_the_plain_speedup() -> None:
    for times in (bandwidth_bound_ring(), compute_bound_ring(), compute_bound_one_stage()):
        for k in (0, 1, 4):
            assert in_flight(0.3, k + 1, times.stages) == 1
            assert pipelined_speedup(times, 0.3, k) == pytest.approx(speedup(times, 0.3, k))


def test_a_deep_compute_bound_ring_gains_from_guesses_alone() -> None:
    """Drafts never pay where a row costs a step; a guess sent behind each round does: the
    stages that would idle step it. Bounded by the ring's depth; nothing at acceptance 0."""
    times = compute_bound_ring()
    assert best_k(times, 0.9) == 0 and speedup(times, 0.9, 1) < 1.0
    gain = pipelined_speedup(times, 0.9, 0)
    assert 2.0 < gain < times.stages
    assert pipelined_speedup(times, 0.0, 0) == 1.0
    spec = swarm_speedup(times, 0.9)
    assert (spec.k, spec.in_flight, spec.speedup) == (0, 4, pytest.approx(gain))
    # deeper acceptance, more gain; one stage, none
    assert pipelined_speedup(times, 0.99, 0) > gain
    assert swarm_speedup(compute_bound_one_stage(), 0.99).speedup == 1.0


def test_the_plan_says_what_pipelining_makes() -> None:
    r = api.plan("mixtral-8x7b", node="rpi4", count=4, context=2048)
    line = render._speculative_line(r)
    assert "pipelined at 0.8 acceptance" in line and "rounds in flight" in line, line


def test_a_draft_model_takes_its_room_on_the_first_node() -> None:
    """`plan --draft`: the first node of each replica holds the draft model (its weights and
    its KV cache, as the worker's budget counts them) beside a smaller share of the layers;
    a draft no node can hold is one line naming it."""
    kw: dict[str, object] = dict(node="rpi4", count=4, stages=4, context=1024)
    base = api.plan("smollm2-135m", **kw)  # type: ignore[arg-type]
    drafted = api.plan("smollm2-135m", draft="smollm2-135m", **kw)  # type: ignore[arg-type]
    need = api.draft_bytes("smollm2-135m", 1024, 1)
    first, *rest = drafted.placement.slots
    assert drafted.fits and first.draft_bytes == need > 0
    assert all(s.draft_bytes == 0 for s in rest)
    assert first.layers is not None and base.placement.slots[0].layers is not None
    assert first.layers[1] < base.placement.slots[0].layers[1]  # fewer layers, to make room
    assert first.used_bytes <= drafted.capacity_bytes
    assert "draft model" in render._placement_table(drafted).columns[1]._cells[0]
    big = api.plan("smollm2-135m", node="ps3", count=64, draft="mixtral-8x7b")
    assert not big.fits and "draft model needs" in big.problem, big.problem
    with pytest.raises(RequestError, match="--draft is for --parallel pipeline"):
        api.plan("smollm2-135m", node="rpi4", count=4, parallel="tensor", draft="smollm2-135m")
