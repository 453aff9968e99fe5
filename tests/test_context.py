"""The context a swarm serves (issue 30, item 4): the model's own by default, fitted to the
workers' memory by the planner (placement.fit_context), `--context` on `up`, `coordinator`
and `generate`, shown by /v1/models and status, and a request over it refused naming both
numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cellswarm.errors import BudgetError, RequestError
from cellswarm.planner.placement import (
    FLOOR_CONTEXT_TOKENS,
    USEFUL_CONTEXT_TOKENS,
    ContextFit,
    StageCosts,
    fit_context,
    largest_context,
)

KV_PER_TOKEN_LAYER = 10  # bytes


def toy_costs(context: int, sequences: int) -> StageCosts:
    """Ten layers of 1,000 bytes, 10 bytes of KV per token per layer, 500 bytes fixed."""
    return StageCosts(weights=(1000,) * 10, kv=KV_PER_TOKEN_LAYER * context * sequences,
                      fixed=500, ends=(0, 0))  # fmt: skip


def toy_capacity(stages: int, context: int, sequences: int) -> int:
    """The bytes per stage that `stages` even stages need for context x sequences."""
    per_layer = 1000 + KV_PER_TOKEN_LAYER * context * sequences
    return 500 + per_layer * 10 // stages


def test_the_model_s_own_context_when_the_memory_holds_it_with_every_sequence() -> None:
    capacity = toy_capacity(2, 8192, 8)
    assert fit_context(toy_costs, 2, capacity, 8192, 8) == ContextFit(8192, 8)


def test_a_useful_context_before_sequences_then_the_rest_of_the_model_s() -> None:
    """Room for 4 x 4096 tokens: 4 sequences of 4096 (not 8 of 2048), and room for 2.5 x
    4096: 2 sequences, each stretched to 5120 tokens."""
    assert USEFUL_CONTEXT_TOKENS == 4096
    assert fit_context(toy_costs, 2, toy_capacity(2, 4096, 4), 8192, 8) == ContextFit(4096, 4)
    assert fit_context(toy_costs, 2, toy_capacity(2, 10240, 1), 8192, 8) == ContextFit(5120, 2)


def test_below_a_useful_context_one_sequence_a_stage_then_one_as_long_as_fits() -> None:
    """Room for 3,000 tokens on two stages: two sequences of 1,500 (each stage busy), not
    one of 3,000; room for 800: one of 800 (two of 400 is under FLOOR_CONTEXT_TOKENS)."""
    assert FLOOR_CONTEXT_TOKENS == 512
    assert fit_context(toy_costs, 2, toy_capacity(2, 3000, 1), 8192, 8) == ContextFit(1500, 2)
    assert fit_context(toy_costs, 2, toy_capacity(2, 800, 1), 8192, 8) == ContextFit(800, 1)
    assert fit_context(toy_costs, 1, toy_capacity(1, 1000, 1), 2048, 8) == ContextFit(1000, 1)


def test_a_short_model_context_is_never_exceeded() -> None:
    capacity = toy_capacity(1, 100_000, 1)
    assert fit_context(toy_costs, 1, capacity, 2048, 8) == ContextFit(2048, 8)


def test_a_context_asked_for_keeps_fewer_sequences_or_says_what_fits() -> None:
    capacity = toy_capacity(2, 4096, 3)
    assert fit_context(toy_costs, 2, capacity, 8192, 8, 4096) == ContextFit(4096, 3)
    assert largest_context(toy_costs, 1, 2, capacity, 100_000) == 3 * 4096
    with pytest.raises(BudgetError) as exc:
        fit_context(toy_costs, 2, capacity, 8192, 8, 20_000)
    message = str(exc.value)
    assert "20,000 tokens" in message and "at most 12,288 tokens" in message
    assert "--context 12288" in message and "\n" not in message


def test_no_context_at_all_says_the_weights_do_not_fit() -> None:
    with pytest.raises(BudgetError, match="even with a 1-token context: a stage needs "
                       "10,600 bytes \\(5,600 short\\)"):  # fmt: skip
        fit_context(toy_costs, 1, 5000, 8192, 8)


def test_the_demo_model_on_up_s_default_workers_serves_a_long_prompt(
    demo_path: Path, tmp_path: Path
) -> None:
    """3 stages of 256M, an f32 KV cache: 3 sequences (one a stage) of 2,603 tokens — a
    stage's scratch is a 512-position prefill chunk's, its queries attended 128 at a time
    against the whole context, the step that peaks, and a first step's rows (a whole
    prompt's, in, out and on the wire: costs.py first_step_bytes); `--context 4096` fits 3
    workers of 256M with one sequence, 3 of 300M with two, not 3 of 160M. `cellswarm up`'s
    default (3 workers of 256M) fits 2 of them and keeps one spare: 2 sequences of 2,391
    tokens (the keys' padding counted, as each worker counts it); with the default f16
    cache, 3,664 (tests/test_cache_types.py)."""
    from cellswarm.swarm.local.up import LocalSwarm
    from cellswarm.swarm.ring.costs import costs_at

    at = costs_at(str(demo_path), cache_type="f32")
    fit = fit_context(at, 3, 256 << 20, 8192, 8)
    assert fit == ContextFit(2603, 3)
    assert fit_context(at, 3, 256 << 20, 8192, 8, 4096) == ContextFit(4096, 1)
    assert fit_context(at, 3, 300 << 20, 8192, 8, 4096) == ContextFit(4096, 2)
    with pytest.raises(BudgetError, match="4,096 tokens does not fit 3 stage"):
        fit_context(at, 3, 160 << 20, 8192, 8, 4096)
    up = LocalSwarm(str(demo_path), 3, "256M", tmp_path, context=None, cache_type="f32")
    assert up.fit_to_workers() == ContextFit(2391, 2) == ContextFit(up.context or 0,
                                                                    up.max_sequences)
    assert fit_context(at, 2, 256 << 20, 8192, 8) == ContextFit(2391, 2)  # the spare's out


# -- the flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["up", "--context", "lots"], ["up", "--context", "0"], ["coordinator", "--context", "-5"],
    ["generate", "hi", "--context", "1.5"], ["up", "--max-sequences", "0"],
])  # fmt: skip
def test_a_bad_context_is_one_line_naming_the_value(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from cellswarm.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    flag, value = argv[-2], argv[-1]
    assert err.startswith(f"cellswarm: error: {flag} ") and value in err and "\n" not in err
    assert "at least 1" in err


def test_the_coordinator_config_refuses_a_zero_context() -> None:
    from cellswarm.swarm.settings import CoordinatorConfig

    with pytest.raises(RequestError, match="--context 0 must be at least 1"):
        CoordinatorConfig(model="m.gguf", context=0)


def test_up_refuses_a_context_its_workers_cannot_hold_in_one_line(
    demo_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cellswarm.cli import main

    argv = ["up", "--model", str(demo_path), "--workers", "2", "--memory", "128M",
            "--context", "8192", "--state-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "8,192 tokens does not fit 2 stage(s)" in err and "--context " in err
    assert "\n" not in err


def test_generate_refuses_a_prompt_over_its_context_naming_both_numbers(
    demo_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cellswarm.cli import main

    assert main(["generate", "Hello there", "--model", str(demo_path), "--context", "5",
                 "--max-tokens", "4"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "the context is 5 tokens, but 6 were asked" in err and "4 in max_tokens" in err
    assert "\n" not in err


def test_the_engine_checks_a_context_it_is_given(demo_path: Path) -> None:
    import cellswarm
    from cellswarm.engine.model import GenerateOptions

    model = cellswarm.load(demo_path)
    ids = model.tokenizer.encode("one two three four five")
    with pytest.raises(RequestError, match=f"but {len(ids) + 3} were asked"):
        model.generate(ids, GenerateOptions(max_tokens=3, context=len(ids) + 2))
    assert len(model.generate(ids, GenerateOptions(max_tokens=3, context=len(ids) + 3,
                                                   stop_ids=frozenset())).token_ids) == 3


# -- the coordinator ---------------------------------------------------------------------------


def coordinator(demo_path: Path, tmp_path: Path, **config: object) -> object:
    """A coordinator of the demo model; an f32 KV cache unless told (these tests' byte
    arithmetic was made for it)."""
    from cellswarm.swarm.control.coordinator import Coordinator, CoordinatorConfig

    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {"cache_type": "f32", **config}
    return Coordinator(CoordinatorConfig(str(demo_path), db=str(tmp_path / "c.db"),
                                         **config))  # type: ignore[arg-type]  # fmt: skip


def test_the_coordinator_serves_the_model_s_own_context_by_default(
    demo_path: Path, tmp_path: Path
) -> None:
    """A 401-token prompt was refused at the old fixed 256; the demo model takes 8192."""
    from cellswarm.swarm.api.schema import BadRequest, limits_of

    coord = coordinator(demo_path, tmp_path)
    assert coord.context == 8192  # type: ignore[attr-defined]
    limits = limits_of(coord)
    assert limits.context == 8192
    limits.generate([1] * 401, 64)
    with pytest.raises(BadRequest) as exc:
        limits.generate([1] * 8000, 200)
    assert exc.value.code == "context_length_exceeded" and exc.value.status == 400
    assert "maximum context length is 8192 tokens" in exc.value.message
    assert "requested 8200 tokens (8000 in the prompt, 200 in the completion)" in exc.value.message


def nodes(n: int, memory_mib: int) -> list[Any]:
    from cellswarm.swarm.control.store import Node, NodeId

    return [Node(NodeId(f"n{i}"), "spare", "s", {"memory_bytes": memory_mib << 20}, "h",
                 float(i), 0.0) for i in range(n)]  # fmt: skip


def test_the_placement_keeps_fewer_sequences_rather_than_refuse(
    demo_path: Path, tmp_path: Path
) -> None:
    """The model's own 8192 tokens fit not even one sequence on 3 or 2 workers of 256M, nor
    on 3 of 300M: the context is capped by what their budgets leave for KV (fit_context: one
    sequence a stage, the coordinator's placement the same); with --context 8192 it is not,
    and status names the context and what fits."""
    from cellswarm.swarm.ring.costs import costs_at

    at = costs_at(str(demo_path), cache_type="f32")
    for workers, memory in ((3, 300), (3, 256), (2, 256)):
        fresh = coordinator(demo_path, tmp_path / f"{workers}-{memory}")
        layout, target, sequences = fresh._repair(nodes(workers, memory))  # type: ignore[attr-defined]
        fit = fit_context(at, workers, memory << 20, 8192, 8)
        assert layout and any(target.values())
        assert (sequences, fresh.context) == (  # type: ignore[attr-defined]
            fit.sequences, fit.context_tokens)
        assert fit.sequences == workers and 512 <= fit.context_tokens < 8192
    asked = coordinator(demo_path, tmp_path / "c", context=8192)
    assert asked._repair(nodes(2, 256))[1] == {}  # type: ignore[attr-defined]
    why = asked._why_unplaced(nodes(2, 256))  # type: ignore[attr-defined]
    assert "8,192 tokens does not fit 2 stage(s)" in why and "--context " in why


def test_a_context_asked_for_waits_for_nodes_that_hold_its_sequences(
    demo_path: Path, tmp_path: Path
) -> None:
    """--context 4096 --max-sequences 2 (what `up` fits to its workers): 3 workers of 140M
    hold one such sequence, not two — the coordinator waits, and says what does fit, rather
    than place for fewer (workers join one by one: the first ones would decide)."""
    coord = coordinator(demo_path, tmp_path, context=4096, max_sequences=2)
    assert coord._repair(nodes(3, 140))[1] == {}  # type: ignore[attr-defined]
    why = coord._why_unplaced(nodes(3, 140))  # type: ignore[attr-defined]
    assert "4,096 tokens does not fit 3 stage(s) of 146,800,640 bytes" in why
    assert "(2 sequences)" in why and "fewer --max-sequences" in why
    layout, _, sequences = coord._repair(nodes(3, 400))  # type: ignore[attr-defined]
    assert len(layout) == 2 and sequences == 2  # the fewest stages that hold them


def test_models_and_status_show_the_served_context(
    demo_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fastapi.testclient import TestClient

    from cellswarm.swarm.api.server import build_app
    from cellswarm.swarm.commands import print_status

    coord = coordinator(demo_path, tmp_path, context=4096)
    with TestClient(build_app(coord)) as http:  # type: ignore[arg-type]
        card = http.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == 4096
        assert card["meta"] == {"n_ctx": 4096, "n_ctx_train": 8192}
        assert http.get(f"/v1/models/{demo_path.name}").json()["max_model_len"] == 4096
        r = http.post("/v1/completions", json={"model": demo_path.name, "prompt": [1] * 4000,
                                               "max_tokens": 100})  # fmt: skip
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "4096 tokens" in error["message"] and "4100 tokens" in error["message"]
        status = http.get("/v1/status").json()
    assert (status["context"], status["sequences"]) == (4096, 8)
    print_status(status)
    assert "context 4,096 tokens a sequence, 8 in flight" in capsys.readouterr().out


# -- a long prompt through a swarm --------------------------------------------------------------

LONG_PROMPT_TOKENS = 3000
SMALLEST_MEMORY = "256M"  # 3 workers: the PS3's memory, and --context 4096 (issue 55)


@pytest.mark.slow
def test_a_3000_token_prompt_through_a_swarm_at_context_4096(
    demo_path: Path, tmp_path: Path
) -> None:
    """`cellswarm up --context 4096 --memory 256M`: a 3,000-token prompt (refused until the
    KV cache was f16 and a prefill's scratch counted as attention runs it) gives the
    single-process engine's greedy tokens, at the default heartbeat timeout (the stages
    prefill it in 512-position chunks, their heartbeats on a thread of their own), and no
    worker's peak RSS goes over its budget (the contract)."""
    import cellswarm
    from cellswarm.engine.model import GenerateOptions
    from cellswarm.swarm.api import client
    from cellswarm.swarm.local.up import LocalSwarm

    model = cellswarm.load(demo_path)
    words = " ".join(f"item {i} is the number {i * 7 % 1000};" for i in range(LONG_PROMPT_TOKENS))
    prompt = model.tokenizer.encode(words)[:LONG_PROMPT_TOKENS]
    expected = model.generate(prompt, GenerateOptions(4, stop_ids=frozenset())).token_ids
    del model
    swarm = LocalSwarm(str(demo_path), 3, SMALLEST_MEMORY, tmp_path, context=4096)
    assert swarm.fit_to_workers() == ContextFit(4096, 3)  # as `cellswarm up` starts it
    with swarm:
        status = swarm.wait_ready()
        assert (status["context"], sum(n["state"] == "assigned" for n in status["nodes"])) == \
            (4096, 3)  # fmt: skip
        rid = client.submit(swarm.url, {"prompt": prompt, "max_tokens": 4, "stop_ids": []})
        result = client.wait(swarm.url, rid, timeout_s=600)
        assert result["state"] == "done", result
        assert result["tokens"] == expected
        status = swarm.status()
    assert status["sequences"] == 3 and all(n["state"] == "assigned" for n in status["nodes"])
    assert all(n["failures"] == 0 and n["peak_rss_bytes"] <= n["memory_bytes"]
               for n in status["nodes"]), status["nodes"]  # fmt: skip


def test_generate_against_a_swarm_checks_the_context_it_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cellswarm.swarm import commands
    from cellswarm.swarm.api import client

    def models(url: str, path: str, **_: object) -> dict[str, object]:
        assert path == "/v1/models"
        return {"data": [{"id": "m.gguf", "max_model_len": 256}]}

    monkeypatch.setattr(client, "call", models)
    commands.check_served_context("http://swarm", 256, None, None)
    with pytest.raises(RequestError) as exc:
        commands.check_served_context("http://swarm", 4096, None, None)
    assert "--context 4096: the swarm at http://swarm serves 256 tokens" in str(exc.value)


def test_the_readmes_up_fits_what_each_worker_will_reserve(demo_path: Path, tmp_path: Path) -> None:
    """`cellswarm up --workers 4 --memory 128M` (the README's): the context `up` fits is one
    each worker's own budget check accepts — the keys' padding counted on both sides (before,
    the fit left it out, and two of the three stages refused their layers by ~128 KB)."""
    import cellswarm
    from cellswarm.io.weights import Selection
    from cellswarm.swarm.local.up import LocalSwarm
    from cellswarm.swarm.ring.costs import costs_at

    at = costs_at(str(demo_path))
    shard = cellswarm.load(demo_path, selection=Selection(layers=(0, 3)), tokenizer=False)
    for context in (100, 688, 689, 1797, 4096):
        assert 3 * at(context, 1).kv == shard.kv_sequence_bytes(context), context
    with LocalSwarm(str(demo_path), 4, "128M", tmp_path) as swarm:
        status = swarm.wait_ready()
        states = sorted(n["state"] for n in status["nodes"])
        assert states == ["assigned", "assigned", "assigned", "spare"], status["nodes"]
