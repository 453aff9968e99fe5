"""GET /metrics on a live swarm: Prometheus' text format, parsed with prometheus_client's own
parser, and values that move when work runs."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.units import parse_bytes
from tests.waiting import wait_until

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def per_node(samples: Samples, name: str) -> dict[str, float]:
    return {dict(labels)["node"]: v for (n, labels), v in samples.items() if n == name}


def worker_urls(url: str) -> dict[str, str]:
    """Every worker's /metrics base URL by its target, from the coordinator's service
    discovery (Prometheus' http_sd_configs format)."""
    groups = httpx.get(f"{url}/v1/metrics/targets", timeout=30).json()
    assert all(g["labels"]["job"] == "cellswarm-worker" for g in groups)
    return {t: f"http://{t}" for g in groups for t in g["targets"]}


def test_metrics_parse_and_move_when_work_runs(demo_path: Path, tmp_path: Path) -> None:
    with LocalSwarm(str(demo_path), 3, "160M", tmp_path, stages=2) as swarm:
        said: list[str] = []  # what `cellswarm up` prints while it waits
        swarm.wait_ready(on_change=said.append)
        assert any(line.startswith("node worker-2 joined") for line in said), said
        assert said[-1].startswith("wired: epoch"), said
        wait_until(lambda: len(worker_urls(swarm.url)) == 3, 20)
        workers = worker_urls(swarm.url)
        workers_before = {t: scrape(u) for t, u in workers.items()}
        before = scrape(swarm.url)
        assert before[("cellswarm_wired", ())] == 1.0
        assert before[("cellswarm_nodes", (("state", "assigned"),))] == 2
        assert before[("cellswarm_nodes", (("state", "spare"),))] == 1
        budgets = per_node(before, "cellswarm_node_memory_budget_bytes")
        assert sorted(budgets) == ["worker-0", "worker-1", "worker-2"]
        assert set(budgets.values()) == {parse_bytes("160M")}

        ids = [client.submit(swarm.url, {"prompt": [1, 2, 3], "max_tokens": 6}) for _ in range(3)]
        for rid in ids:
            assert client.wait(swarm.url, rid, timeout_s=120)["state"] == "done"
        # the stages' counters come with their heartbeats (every 0.25 s here)
        wait_until(lambda: total(scrape(swarm.url), "cellswarm_node_decode_steps_total") >= 15, 20)
        after = scrape(swarm.url)
        assert after[("cellswarm_jobs", (("state", "done"),))] == 3
        assert after[("cellswarm_jobs", (("state", "queued"),))] == 0
        assert after[("cellswarm_job_duplicate_commits", ())] == 0
        # the requests, as vLLM counts them: each one's first lease, first token and end
        assert after[("cellswarm_job_outcomes_total", (("state", "done"),))] == 3
        for hist in ("cellswarm_request_queue_time_seconds", "cellswarm_e2e_request_latency_"
                     "seconds", "cellswarm_time_to_first_token_seconds"):  # fmt: skip
            assert after[(hist + "_count", ())] == 3, hist
        assert after[("cellswarm_prompt_tokens_total", ())] == 9
        assert after[("cellswarm_generation_tokens_total", ())] == 18
        assert after[("cellswarm_num_requests_waiting", ())] == 0
        steps = "cellswarm_node_steps_total"
        assert total(after, steps) > total(before, steps)
        used = per_node(after, "cellswarm_node_memory_used_bytes")
        peak = per_node(after, "cellswarm_node_memory_peak_bytes")
        for node, budget in budgets.items():
            assert 0 < used[node] <= peak[node] <= budget, node
        assert total(after, "cellswarm_node_step_seconds_count") >= 15
        assert total(after, "cellswarm_node_energy_joules_total") > 0
        # each stage's prefix cache is reported (these prompts hold no whole 64-token block)
        serving = set(per_node(after, "cellswarm_node_steps_total"))
        assert serving and set(per_node(after, "cellswarm_node_prefix_cache_bytes")) == serving

        # every worker's own /metrics: the same kinds of figures, its step-time histogram
        served = 0.0
        for target, url in workers.items():
            w0, w1 = workers_before[target], scrape(url)
            budget = w1[("cellswarm_worker_memory_budget_bytes", ())]
            assert budget == parse_bytes("160M")
            assert 0 < w1[("cellswarm_worker_memory_used_bytes", ())] <= budget
            assert w1[("cellswarm_worker_memory_peak_bytes", ())] <= budget
            energy = [v for (n, _), v in w1.items() if n == "cellswarm_worker_energy_joules_total"]
            assert energy and energy[0] > 0
            if w1[("cellswarm_worker_serving", ())]:
                steps = w1[("cellswarm_worker_step_seconds_count", ())]
                assert steps > w0.get(("cellswarm_worker_step_seconds_count", ()), 0), target
                assert w1[("cellswarm_worker_step_seconds_bucket", (("le", "+Inf"),))] == steps
                assert w1[("cellswarm_worker_step_seconds_sum", ())] > 0
                served += w1[("cellswarm_worker_tokens_total", ())]
                assert ("cellswarm_worker_prefix_cache_misses_total", ()) in w1
        assert served >= 15  # decode steps on the two stages: 3 requests x (6 - 1) tokens


def test_the_workers_hand_written_text_format_parses_as_prometheus_reads_it() -> None:
    """A worker writes its text format by hand (no prometheus_client in a 256 MB node):
    every kind, a label that needs escaping, a histogram, read back by the real parser."""
    from cellswarm.swarm.node.metrics import family, histogram
    from cellswarm.swarm.ring.step_times import StepTimes

    times = StepTimes()
    for s in (0.0004, 0.003, 0.003, 2.0, 99.0):
        times.observe(s)
    text = (family("a_bytes", "gauge", "a gauge\nover two lines", [({}, 5.0)])
            + family("b", "counter", "a counter", [({"part": 'x"y\\z'}, 2.5)])
            + histogram("c_seconds", "a histogram", times.as_dict()))  # fmt: skip
    got = {f.name: f for f in text_string_to_metric_families(text)}
    assert got["a_bytes"].samples[0].value == 5.0
    assert got["b"].type == "counter" and got["b"].samples[0].labels == {"part": 'x"y\\z'}
    samples = {(s.name, s.labels.get("le")): s.value for s in got["c_seconds"].samples}
    assert samples[("c_seconds_bucket", "0.0005")] == 1
    assert samples[("c_seconds_bucket", "0.005")] == 3
    assert samples[("c_seconds_bucket", "+Inf")] == samples[("c_seconds_count", None)] == 5
    assert abs(samples[("c_seconds_sum", None)] - 101.0064) < 1e-9
