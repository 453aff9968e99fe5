"""`cellswarm simulate`: agreement with the planner, the queue's rules under failures,
reproducibility, the network, racks, slow nodes, energy, the CLI and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cellswarm.cli import main
from cellswarm.errors import CellswarmError
from cellswarm.planner import api
from cellswarm.sim.local import predict_local
from cellswarm.sim.params import Scenario, SimParams
from cellswarm.sim.run import build, simulate, summarise
from cellswarm.sim.scenario import make_scenario, read_scenario_file

REPO = Path(__file__).resolve().parents[1]
KIMI = {"model": "kimi-k3", "node": "ps3", "context": 1024}
ONE_REPLICA = 4095  # kimi-k3 on ps3 at context 1024 x 4


def test_one_sequence_matches_planner_decode() -> None:
    sc = Scenario(**KIMI, count=ONE_REPLICA, concurrency=1, jobs=1, prompt_tokens=8,
                  output_tokens=1000, duration_s=4000)  # fmt: skip
    out = simulate(sc)
    planned = api.plan("kimi-k3", node="ps3", count=ONE_REPLICA, context=1024)
    assert out["jobs"]["done"] == 1
    assert out["decode_tokens_per_s"] == pytest.approx(planned.decode_tokens_per_s, rel=0.01)
    # the job took its prefill plus 1000 tokens at the planner's rate
    expected = planned.decode.total_s * 1000
    assert out["latency_s"]["p50"] > expected


def test_concurrency_matches_planner_throughput() -> None:
    sc = Scenario(**KIMI, count=100_000, concurrency=4, jobs=2000, prompt_tokens=1,
                  output_tokens=1000, duration_s=4 * 3600)  # fmt: skip
    out = simulate(sc)
    planned = api.plan("kimi-k3", node="ps3", count=100_000, context=1024, concurrency=4)
    assert out["plan"]["replicas"] == planned.replicas == 24
    assert out["tokens_per_s"] == pytest.approx(planned.throughput_tokens_per_s, rel=0.01)


def test_a_lone_sequence_gains_what_the_planner_says_of_speculation() -> None:
    """A replica's lone sequence decodes at the planner's pipelined speculative speed-up at
    the workload's acceptance (auto drafts only then); four at once gain next to nothing."""
    from cellswarm.planner.speculative import ring_times, swarm_speedup

    base = dict(model="mixtral-8x7b", node="rpi4", count=4, context=2048, jobs=4,
                prompt_tokens=16, output_tokens=200, duration_s=3600)  # fmt: skip
    rate = {}
    for concurrency in (1, 4):
        for acceptance in (0.0, 0.9):
            out = simulate(Scenario(**base, concurrency=concurrency,  # type: ignore[arg-type]
                                    acceptance=acceptance))  # fmt: skip
            assert out["jobs"]["done"] == 4
            rate[concurrency, acceptance] = out["decode_tokens_per_s"]
    spec = swarm_speedup(ring_times(api.plan("mixtral-8x7b", node="rpi4", count=4,
                                             context=2048)), 0.9)  # fmt: skip
    assert spec.in_flight > 1 and spec.speedup > 2.0
    assert out["plan"]["speculation"]["speedup"] == pytest.approx(spec.speedup)
    assert rate[1, 0.9] / rate[1, 0.0] == pytest.approx(spec.speedup, rel=1e-6)
    # (but for the moments one decodes alone, its prefill staggered from the others')
    assert rate[4, 0.9] == pytest.approx(rate[4, 0.0], rel=0.03)
    with pytest.raises(CellswarmError, match="--acceptance"):
        Scenario(**base, acceptance=1.5)  # type: ignore[arg-type]


def _failing(seed: int = 3, **kw: object) -> Scenario:
    # mixtral on rpi4: 4 nodes per replica, 525 replicas, 100 spares; failures galore
    base: dict[str, object] = dict(
        model="mixtral-8x7b", node="rpi4", context=2048, count=2100, concurrency=4,
        jobs=3000, prompt_tokens=64, output_tokens=128, duration_s=2 * 3600, mtbf_s=10 * 3600,
        mttr_s=1800, rack_mtbf_s=20 * 3600, rack_mttr_s=1800, poison_fraction=0.05,
        slow_fraction=0.01, seed=seed,
    )  # fmt: skip
    base.update(kw)
    return Scenario(**base)  # type: ignore[arg-type]


def test_failures_lose_nothing_and_respect_attempts() -> None:
    sim, result = build(_failing())
    sim.run()
    out = summarise(sim, result)
    jobs, fail = out["jobs"], out["failures"]
    assert fail["node_failures"] > 100 and out["replay"]["replays"] > 0
    assert jobs["lost"] == 0
    assert jobs["lease_expiries"] > 0  # heads died: their leases ran out
    assert jobs["max_leases"] <= 3 and jobs["max_attempts_used"] <= 3
    assert jobs["dead"] > 0 and jobs["retried"] > 0
    assert all(j.attempts == 3 for j in sim.jobs if j.state == "dead")
    assert all(j.attempts < 3 for j in sim.jobs if j.state != "dead")
    total = jobs["done"] + jobs["dead"] + jobs["queued"] + jobs["in_flight"]
    assert total + jobs["awaiting_lease_expiry"] == jobs["submitted"]
    assert fail["node_hours_lost"] > 0


def test_same_seed_same_json_other_seed_differs() -> None:
    a = json.dumps(simulate(_failing(seed=5)), sort_keys=True)
    b = json.dumps(simulate(_failing(seed=5)), sort_keys=True)
    c = json.dumps(simulate(_failing(seed=6)), sort_keys=True)
    assert a == b
    assert a != c


def test_squeezed_topology_names_the_saturated_tier() -> None:
    free = simulate(Scenario(**KIMI, count=100_000, concurrency=4, duration_s=1800))
    tight = simulate(Scenario(**KIMI, count=100_000, concurrency=4, duration_s=1800,
                              network=(("core_bandwidth", "2M"),)))  # fmt: skip
    assert not free["network"]["saturated"]
    assert tight["network"]["saturated"]
    assert tight["network"]["first_saturated_tier"] == "core"
    assert tight["network"]["slowdown"] > 1
    assert tight["tokens_per_s"] < free["tokens_per_s"] / 1.5
    assert max(tight["network"]["peak_utilization"].values()) <= 1.0 + 1e-9


def test_rack_failure_takes_down_the_replicas_on_it() -> None:
    sc = Scenario(**KIMI, count=24 * ONE_REPLICA, concurrency=4, duration_s=600)  # no spares
    sim, _ = build(sc)
    sim.run()
    per_switch = sim.per_switch
    sw = ONE_REPLICA // per_switch  # the switch where replica 0 ends and replica 1 begins
    hit = {sim.node_replica[n] for n in range(sw * per_switch, (sw + 1) * per_switch)}
    assert hit == {0, 1}
    sim.fail_rack(sw)
    # no spare: replica 0 is dissolved, and its surviving nodes fill replica 1's holes
    assert sim.replicas[0].state == "gone" and sim.replicas[1].state == "loading"
    assert all(r.state == "up" for r in sim.replicas[2:])
    assert sim.live == 22 and sim.down_nodes == per_switch
    assert sim.c.replicas_dissolved == 1
    assert sim.lost_jobs() == 0
    # with spares the same rack only stalls them while spares load
    sim2, _ = build(Scenario(**KIMI, count=100_000, concurrency=4, duration_s=600))
    sim2.run()
    sim2.fail_rack(sw)
    assert [r.state for r in sim2.replicas[:3]] == ["loading", "loading", "up"]
    assert sim2.c.replacements == per_switch


def test_slow_nodes_slow_their_replicas() -> None:
    base = dict(**KIMI, count=100_000, concurrency=1, duration_s=3600)
    fast = simulate(Scenario(**base))  # type: ignore[arg-type]
    slow = simulate(Scenario(**base, slow_fraction=0.1, slow_speed=0.25))  # type: ignore[arg-type]
    assert slow["decode_tokens_per_s"] < fast["decode_tokens_per_s"] * 0.9
    sim, _ = build(Scenario(**base, slow_fraction=0.1, slow_speed=0.25))  # type: ignore[arg-type]
    timing = sim.replicas[0].timing
    assert timing is not None and timing.token_s > sim.model.base.token_s
    assert timing.bottleneck_s == pytest.approx(sim.model.base.bottleneck_s * 4, rel=0.5)


def test_energy_is_power_times_time() -> None:
    sc = Scenario(**KIMI, count=100_000, concurrency=4, jobs=500, duration_s=3600)
    out = simulate(sc)
    planned = api.plan("kimi-k3", node="ps3", count=100_000, context=1024, concurrency=4)
    e = out["energy"]
    assert e["joules"] == pytest.approx(planned.power_w * 3600, rel=1e-9)
    node = planned.request.node
    by_state = (e["busy_node_hours"] * node.power_busy_w + e["idle_node_hours"]
                * node.power_idle_w) * 3600 * e["pue"]  # fmt: skip
    assert e["joules"] == pytest.approx(by_state, rel=1e-9)
    assert e["kwh"] == pytest.approx(e["joules"] / 3.6e6)
    assert e["j_per_token"] == pytest.approx(e["joules"] / out["tokens"])


def test_one_box_tiered_profile() -> None:
    out = simulate(Scenario("kimi-k3", node="xeon-optane", count=1, context=1024,
                            concurrency=1, jobs=2, duration_s=3600))  # fmt: skip
    planned = api.plan("kimi-k3", node="xeon-optane", count=1, context=1024)
    assert out["plan"]["replicas"] == 1
    assert out["decode_tokens_per_s"] == pytest.approx(planned.decode_tokens_per_s, rel=0.01)


def test_cli_json_and_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["simulate", "kimi-k3", "--count", "100000", "--context", "1024", "--duration",
            "10m", "--mtbf", "1000h", "--seed", "2"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["jobs"]["lost"] == 0 and out["scenario"]["seed"] == 2
    png = tmp_path / "sim.png"
    assert main([*args, "--plot", str(png)]) == 0
    assert "tokens/s" in capsys.readouterr().out and png.stat().st_size > 1000


def test_example_scenario_file_runs(capsys: pytest.CaptureFixture[str]) -> None:
    path = REPO / "examples" / "kimi-k3-ps3-100k.toml"
    values = read_scenario_file(path)
    assert values["model"] == "kimi-k3" and values["count"] == 100_000
    assert main(["simulate", "--workload", str(path), "--duration", "30m", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenario"]["duration_s"] == 1800 and out["jobs"]["lost"] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "kimi-k3", "--node", "nope", "--count", "3"],
        ["simulate", "kimi-k3", "--count", "100000", "--context", "1024", "--mtbf=-5h"],
        ["simulate", "kimi-k3", "--count", "100000", "--context", "1024", "--mttr", "soon"],
        ["simulate", "kimi-k3", "--count", "10", "--context", "1024"],
        ["simulate", "kimi-k3", "--count", "100000", "--context", "1024", "--topology", "x=1"],
        ["simulate", "--count", "3"],
    ],
)
def test_bad_input_is_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cellswarm: error:") and "\n" not in err


def test_bad_values_raise_cellswarm_error() -> None:
    with pytest.raises(CellswarmError):
        Scenario("kimi-k3", mtbf_s=-1.0)
    with pytest.raises(CellswarmError):
        SimParams(hop_overhead_s=-0.1)
    with pytest.raises(CellswarmError):
        make_scenario({"model": "kimi-k3", "slow_fraction": 2})
    with pytest.raises(CellswarmError):
        predict_local([(0, 10), (12, 30)])


@pytest.mark.slow
def test_predict_local_demo_model() -> None:
    split = [(0, 10), (10, 20), (20, 30)]
    one = predict_local(split, node="rpi4", in_flight=1, jobs=1, tokens=64)
    assert one.decode_tokens_per_s == pytest.approx(1 / one.step_s, rel=1e-6)
    many = predict_local(split, node="rpi4", in_flight=3, jobs=12, tokens=64)
    assert many.tokens_per_s > one.tokens_per_s
    killed = predict_local(split, node="rpi4", in_flight=3, jobs=12, tokens=64, kill_at_s=2.0)
    assert killed.replays == 3 and killed.jobs_done == 12
    assert killed.latency_p99_s > many.latency_p99_s
    slower = predict_local(split, node="rpi4", params=SimParams(hop_overhead_s=0.01), tokens=64)
    assert slower.step_s == pytest.approx(one.step_s + 3 * 0.01)


def test_prefills_share_the_stages_they_run_on() -> None:
    """A batch of long prompts and one token each (classification) is bound by prefill: a
    ring runs one prompt per stage at a time, so the items/s cannot pass stages / prefill_s
    however many are in flight (they overlapped freely before: ~10x too fast here)."""
    split = [(0, 10), (10, 20), (20, 30)]
    p = predict_local(split, node="rpi4", in_flight=32, jobs=64, tokens=1, prompt_tokens=200)
    assert p.jobs_done == 64
    assert p.tokens_per_s <= 3 / p.prefill_s * 1.001
    assert p.tokens_per_s > 0.8 * 3 / p.prefill_s  # and the stages stay busy


@pytest.mark.parametrize(
    ("nodes", "max_beats", "interval_s", "detect_s", "saturated"),
    [
        (3, 4000.0, 0.5, 3.0, False),  # a small swarm: the configured heartbeat
        (10_000, 4000.0, 2.5, 15.0, False),
        (100_000, 4000.0, 25.0, 150.0, False),  # the seed: beats capped at 4,000/s
        (100_000, 40_000.0, 2.5, 15.0, True),  # 40,000 beats/s x 54 us: 2.2 cores
    ],
)
def test_the_control_plane_policy_at_each_size(
    nodes: int, max_beats: float, interval_s: float, detect_s: float, saturated: bool
) -> None:
    from cellswarm.sim.control import ControlPlane

    cp = ControlPlane(max_beats_per_s=max_beats)
    assert (cp.interval_s(nodes), cp.detect_s(nodes)) == (interval_s, detect_s)
    assert cp.saturated(nodes) is saturated
    assert cp.jobs_per_s(nodes) == (0.0 if saturated else pytest.approx(
        (1 - cp.beat_load(nodes)) / cp.job_cpu_s))  # fmt: skip


def test_a_saturated_coordinator_runs_nothing_and_says_so() -> None:
    values = {"model": "kimi-k3", "count": 100_000, "context": 1024, "duration": "10m",
              "control": {"max_beats_per_s": 40_000}}  # fmt: skip
    out = simulate(make_scenario(values))
    assert out["control"]["saturated"] and out["tokens"] == 0 and out["jobs"]["done"] == 0
    assert out["jobs"]["lost"] == 0  # queued, not lost


def test_a_bigger_swarm_notices_failures_later_and_so_serves_less() -> None:
    """The same failures, noticed after 150 s (100,000 nodes at 4,000 beats/s) or after 3 s
    (a coordinator taking every node's beat each 0.5 s, with the cores for it)."""
    base = {"model": "kimi-k3", "count": 100_000, "context": 1024, "duration": "2h",
            "mtbf": "500h", "seed": 3}  # fmt: skip
    slow = simulate(make_scenario(base))
    fast = simulate(make_scenario({**base, "control": {"max_beats_per_s": 200_000,
                                                       "cores": 20.0}}))  # fmt: skip
    assert slow["control"]["detect_s"] == 150.0 and fast["control"]["detect_s"] == 3.0
    assert slow["failures"]["node_failures"] == fast["failures"]["node_failures"] > 0
    assert slow["tokens"] < fast["tokens"]


def test_a_scenario_file_s_unknown_control_key_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('model = "kimi-k3"\ncount = 100000\ncontext = 1024\n[control]\nbeats = 5\n')
    with pytest.raises(CellswarmError, match=r"\[control\] keys \['beats'\] are unknown"):
        make_scenario(read_scenario_file(path))
