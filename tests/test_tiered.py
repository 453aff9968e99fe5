"""A tiered box: a ~338 MB random MoE model under a 100 MiB DRAM budget generates what the
unconstrained run does, with RssAnon within the budget and consistent cache counters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cellswarm
from bench.tiered import build_model
from cellswarm.engine.memory import proc_status
from cellswarm.engine.model import GenerateOptions
from cellswarm.engine.tiered import ExpertCache, load_tiered
from cellswarm.errors import RequestError
from cellswarm.loader import load

BUDGET = 100 << 20
PROMPT = [3, 17, 101, 5, 64, 200, 9]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_model(tmp_path_factory.mktemp("tiered") / "moe.gguf")
    assert path.stat().st_size >= 3 * BUDGET
    return path


def _cli(path: Path, *extra: str) -> dict[str, Any]:
    ids = ",".join(map(str, PROMPT))
    cmd = [sys.executable, "-m", "cellswarm", "generate", ids, "--ids", "--model", str(path)]
    out = subprocess.run(
        [*cmd, "--json", "--max-tokens", "10", *extra], check=True, capture_output=True, text=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_logits_equal_unconstrained(model_file: Path) -> None:
    ref = load(model_file, tokenizer=False).logits(PROMPT)
    # In-process RssAnon holds whatever earlier tests left: give the budget on top of it.
    budget = proc_status()["RssAnon"] + 60_000_000
    tm = load_tiered(model_file, budget, tokenizer=False)
    assert 0 < tm.placement.cache_slots < tm.placement.n_experts_total
    for _ in range(2):  # a second pass hits the cache
        out = tm.model.logits(PROMPT)
        # the same kernels over the same expert bytes, summed in the same order: bit for bit
        np.testing.assert_array_equal(out, ref)
    t = tm.experts.total
    assert t.uses == t.hits + t.misses > 0 and t.hits > 0 and t.misses > 0
    assert tm.slow.bytes_read >= t.slow_bytes  # + nothing preloaded


def test_generate_within_budget(model_file: Path, tmp_path: Path) -> None:
    ref = _cli(model_file)
    stats_file = tmp_path / "routing.json"
    run = _cli(model_file, "--dram-budget", "100M", "--routing-stats", str(stats_file))
    assert run["token_ids"] == ref["token_ids"]
    t = run["tiered"]
    assert 0 < t["peak_rss_anon"] <= BUDGET
    assert t["rss_anon"] <= BUDGET
    for bucket in (t["total"], t["decode"]):
        assert bucket["hits"] + bucket["misses"] == bucket["uses"] > 0
        assert bucket["slow_bytes"] > 0
    assert t["slow_bytes_per_token"] > 0 and t["dram_bytes_per_token"] > 0
    assert t["predicted_tokens_per_s"] > 0
    assert t["peak_rss_file"] < 64 << 20  # the mapped experts were released, not kept
    # Saved routing counts pre-fill the cache: the next run starts hot.
    warm = _cli(model_file, "--dram-budget", "100M", "--routing-stats", str(stats_file))
    assert warm["token_ids"] == ref["token_ids"]
    assert warm["tiered"]["placement"]["preloaded_bytes"] > 0
    assert warm["tiered"]["hit_rate"] > t["hit_rate"]
    assert warm["tiered"]["peak_rss_anon"] <= BUDGET


def test_budget_too_small_is_refused(model_file: Path) -> None:
    with pytest.raises(RequestError, match="dram-budget"):
        load_tiered(model_file, 10 << 20, tokenizer=False)


def test_lfu_admits_only_hotter_experts() -> None:
    cache = ExpertCache(1, 8)
    a, b = (1, 0), (1, 1)
    for _ in range(3):
        cache.note(a)
    slot = cache.victim(cache.counts[a])
    assert slot == 0
    cache.put(0, a, cache.counts[a])
    assert cache.victim(cache.note(b)) is None  # b (1 use) is colder than a (3): streamed
    for _ in range(3):
        count = cache.note(b)
    assert cache.victim(count) == 0  # b (4) now beats a (3)


def test_swarm_workers_tier_their_shards(model_file: Path, tmp_path: Path) -> None:
    """`cellswarm worker --dram-budget`: two workers each hold half the layers, their
    experts tiered between 100 MiB of DRAM and the file; tokens equal one process's."""
    from cellswarm.swarm.api import client
    from cellswarm.swarm.local.up import LocalSwarm

    model = cellswarm.load(model_file, tokenizer=False)
    prompts = [[1, 5, 9, 14, 3], [7, 7, 2]]
    opts = GenerateOptions(6, stop_ids=frozenset())
    expected = [model.generate(p, opts).token_ids for p in prompts]
    with LocalSwarm(str(model_file), 2, "600M", tmp_path, stages=2, context=64,
                    dram_budget="100M") as swarm:  # fmt: skip
        swarm.wait_ready(timeout_s=120)
        ids = [client.submit(swarm.url, {"prompt": p, "max_tokens": 6}) for p in prompts]
        assert [client.wait(swarm.url, rid)["tokens"] for rid in ids] == expected
        assert all(any("tiered placement" in line for line in swarm.output[f"worker-{i}"])
                   for i in range(2))  # each printed its placement


def test_a_low_bit_dynamic_mix_tiers_as_any_other(tmp_path: Path) -> None:
    """The tiered engine takes every type: a DeepSeek-V3-shaped model whose routed experts are
    IQ1_S / TQ1_0 (the rest Q6_K / Q8_0), its experts served from the slow tier through a
    cache that holds only some of them, gives the unconstrained logits bit for bit."""
    from tests.bits_models import write_model

    path = write_model(tmp_path / "dynamic.gguf", "deepseek2", "DYNAMIC")
    ref = load(path, tokenizer=False).logits(PROMPT)
    budget = proc_status()["RssAnon"]
    while True:  # the smallest budget (in 1 MiB steps) that tiers it: a cache of a few experts
        budget += 1 << 20
        try:
            tm = load_tiered(path, budget, tokenizer=False, context=64)
            break
        except RequestError:
            continue
    assert 0 < tm.placement.cache_slots < tm.placement.n_experts_total
    for _ in range(2):
        np.testing.assert_array_equal(tm.model.logits(PROMPT), ref)
    assert tm.experts.total.misses > 0
