"""Speculative decoding (engine/speculative.py) is lossless: with drafts from the text so far
or from a draft model, greedy decoding gives the tokens decoding without drafts gives, bit
for bit, in one process and across a ring of stages (a stage killed mid-speculation too);
sampling gives the same tokens for the same seed, and so the same distribution (a
chi-square test over many seeds). The drafting itself: lookups, k, acceptance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cellswarm
from cellswarm.engine.model import GenerateOptions, Model
from cellswarm.engine.sampling import SamplingParams
from cellswarm.engine.speculative import AdaptiveK, Lookup, accept, expected_tokens
from cellswarm.errors import RequestError
from tests.bits_models import write_model

TEXT = (Path(__file__).parent / "data" / "sample_text.txt").read_text()[:1200]
# the three kinds of the bench (bench/speculative.py): a quotation, a summary, a story
KINDS = {
    "extraction": TEXT + "\n\nRepeat the first two sentences of the text above exactly.",
    "summary": TEXT + "\n\nSummarize the text above in two sentences.",
    "story": "Write a short story about a lighthouse keeper.",
}


@pytest.fixture(scope="module")
def demo(demo_path: Path) -> Model:
    return cellswarm.load(demo_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = write_model(tmp_path_factory.mktemp("spec") / "tiny.gguf", "llama", "Q8_0", seed=3)
    return cellswarm.load(path)


def _chat(model: Model, text: str) -> list[int]:
    return model.encode_prompt([{"role": "user", "content": text}])


# -- the pieces --------------------------------------------------------------------------------


def test_a_lookup_drafts_what_followed_the_longest_match() -> None:
    look = Lookup()
    look.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert look.draft(3) == [4, 5, 9]  # "1 2 3" occurred at the start (longest match)
    look.extend([7])
    assert look.draft(2) == [8, 1]  # "3 7" occurred once: what came after it
    look.extend([2, 3])
    assert look.draft(1) == [7]  # "7 2 3" never did, "2 3" did: latest, followed by 7
    look.extend([6])
    assert look.draft(4) == []  # 6 never occurred before


def test_accept_keeps_drafts_while_the_sampler_agrees_then_takes_its_own() -> None:
    rows = np.eye(6, dtype=np.float32)[[3, 4, 1, 2]]  # the argmax of each row: 3, 4, 1, 2

    def greedy(row: np.ndarray, _kept: list[int]) -> int:
        return int(np.argmax(row))

    assert accept(rows, [3, 4, 5], greedy) == [3, 4, 1]  # two kept, the third refused
    assert accept(rows, [3, 4, 1], greedy) == [3, 4, 1, 2]  # all kept, and one more
    assert accept(rows[:1], [], greedy) == [3]  # no drafts: a plain step


@pytest.mark.parametrize(("a", "k", "tokens"), [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 2, 1.75)])
def test_expected_tokens_of_a_round(a: float, k: int, tokens: float) -> None:
    assert expected_tokens(a, k) == pytest.approx(tokens)


def test_k_falls_to_zero_when_drafts_do_not_pay_and_comes_back_when_they_do() -> None:
    k = AdaptiveK(max_k=8, row_cost=0.9)  # a row costs nearly a whole step
    assert k.k() == 0  # until a step of one row has been timed: the baseline
    k.timed(1, 0.010)
    for _ in range(20):
        k.observe(4, 1)  # most refused
    assert k.k() == 0
    k.row_cost = 0.05  # a memory-bound ring: a row is nearly free
    for _ in range(20):
        k.observe(4, 4)  # all kept
    assert k.k() >= 4
    assert AdaptiveK(least=1, row_cost=1.0).k() == 1  # lookup/draft asked: at least one
    k.timed(5, 0.050)  # and measured: 5 rows cost 5 steps, so a row costs a step
    assert k.row_cost == pytest.approx(1.0) and k.k() == 0


def test_a_bad_mode_is_one_line_naming_it(demo: Model) -> None:
    with pytest.raises(RequestError, match="speculative 'fast' must be one of auto, off"):
        demo.generate("Hi", max_tokens=2, speculative="fast")
    with pytest.raises(RequestError, match="needs a draft model"):
        demo.generate("Hi", max_tokens=2, speculative="draft")


# -- lossless in one process -------------------------------------------------------------------


def test_k_plus_one_rows_are_the_bits_of_k_plus_one_steps(demo: Model, tmp_path: Path) -> None:
    """The verification's premise: a step of a few rows of one sequence gives each row the
    logits a decode step of it alone gives, to the bit (llama and DeepSeek MLA + MoE)."""
    ds = cellswarm.load(write_model(tmp_path / "ds.gguf", "deepseek2", "Q8_0", seed=1))
    for model in (demo, ds):
        ids = (np.arange(40, dtype=np.int64) * 7 + 3) % model.config.vocab_size
        one = model.new_cache(64)
        single = np.concatenate([model.step(ids[i : i + 1], one) for i in range(len(ids))])
        rows = model.new_cache(64)
        at = 0
        for n in (1, 2, 5, 9, 1, 16, 6):  # rounds of k+1 rows, then a prefill's remainder
            model.step(ids[at : at + n], rows)
            at += n
        rows.truncate(0)
        again = np.concatenate([model.step(ids[a:b], rows)
                                for a, b in ((0, 3), (3, 12), (12, 28), (28, 40))])  # fmt: skip
        assert np.array_equal(again, single), model.name


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_text_is_the_same_with_drafts_or_without(demo: Model, kind: str) -> None:
    prompt = _chat(demo, KINDS[kind])
    off = demo.generate(prompt, max_tokens=48, speculative="off")
    for mode in ("lookup", "auto"):
        spec = demo.generate(prompt, max_tokens=48, speculative=mode)
        assert spec.token_ids == off.token_ids, (kind, mode)
        assert spec.text == off.text
    assert off.stats.drafted_tokens == 0
    if kind == "extraction":  # quoting: the drafts are the text, and the model keeps them
        assert spec.stats.accepted_tokens > 0
        lookup = demo.generate(prompt, max_tokens=48, speculative="lookup").stats
        assert lookup.accepted_tokens / lookup.drafted_tokens > 0.5, lookup


def test_sampled_text_is_the_same_for_each_seed(demo: Model) -> None:
    prompt = _chat(demo, KINDS["extraction"])
    for seed in range(3):
        sampling = SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, seed=seed)
        off = demo.generate(prompt, GenerateOptions(24, sampling, speculative="off"))
        on = demo.generate(prompt, GenerateOptions(24, sampling, speculative="lookup"))
        assert on.token_ids == off.token_ids, seed
        assert on.stats.drafted_tokens > 0


def test_sampling_keeps_the_distribution(tiny: Model) -> None:
    """Token frequencies over many seeds, with drafts (a draft model that proposes the
    likeliest token: often kept, often not) and without, on other seeds: one distribution
    (chi-square over the tokens seen at each position, rare ones pooled)."""
    from scipy.stats import chi2_contingency

    tiny.draft = tiny  # its own greedy guesses (a test's shortcut past use_draft's check)
    try:
        sampling: dict[str, Any] = {"temperature": 0.7, "top_k": 12}
        prompt, n, seeds = [5, 17, 3, 99, 5, 17], 6, 300
        counts: dict[str, list[list[int]]] = {"off": [], "draft": []}
        drafted = accepted = 0
        for mode, first in (("off", 10_000), ("draft", 20_000)):
            for seed in range(first, first + seeds):
                opts = GenerateOptions(n, SamplingParams(**sampling, seed=seed),
                                       stop_ids=frozenset(), speculative=mode)  # fmt: skip
                g = tiny.generate(prompt, opts)
                counts[mode].append(g.token_ids)
                drafted += g.stats.drafted_tokens
                accepted += g.stats.accepted_tokens
        assert 0 < accepted < drafted, (accepted, drafted)
        for pos in range(1, n):
            a = [t[pos] for t in counts["off"]]
            b = [t[pos] for t in counts["draft"]]
            common = [t for t in set(a) | set(b) if a.count(t) + b.count(t) >= 10]
            table = [[sum(x == t for x in a) for t in common] + [sum(x not in common for x in a)],
                     [sum(x == t for x in b) for t in common] + [sum(x not in common for x in b)]]
            p = chi2_contingency(np.array(table)).pvalue
            assert p > 0.001, (pos, p, table)
        same = GenerateOptions(n, SamplingParams(**sampling, seed=20_000), stop_ids=frozenset(),
                               speculative="off")  # fmt: skip
        assert tiny.generate(prompt, same).token_ids == counts["draft"][0]
    finally:
        tiny.draft = None


def test_a_draft_model_of_the_same_tokenizer_drafts_and_changes_nothing(
    demo: Model, demo_path: Path, tmp_path: Path, tiny: Model
) -> None:
    from bench.speculative_peer import truncated_draft

    draft = cellswarm.load(truncated_draft(demo_path, tmp_path / "draft.gguf", 6))
    with pytest.raises(RequestError, match="another tokenizer"):
        demo.use_draft(tiny)
    demo.use_draft(draft)
    try:
        prompt = _chat(demo, KINDS["summary"])
        off = demo.generate(prompt, max_tokens=32, speculative="off")
        on = demo.generate(prompt, max_tokens=32, speculative="draft")
        assert on.token_ids == off.token_ids
        assert on.stats.drafted_tokens > 0 and on.stats.accepted_tokens > 0, on.stats
    finally:
        demo.draft = None


def test_generate_says_its_drafts_and_refuses_a_bad_mode_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from cellswarm.cli import main

    assert main(["generate", "--json", "--max-tokens", "24", "--chat", "--speculative",
                 "lookup", KINDS["extraction"]]) == 0  # fmt: skip
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["drafted_tokens"] > 0 and 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert main(["generate", "--speculative", "fast", "Hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speculative 'fast' must be one of" in err[0], err


# -- lossless across a ring ----------------------------------------------------------------------


def test_a_ring_drafts_with_its_first_stage_s_draft_model(demo: Model, demo_path: Path,
                                                          tmp_path: Path) -> None:  # fmt: skip
    """A draft model beside stage 0 (worker --draft): its drafts are verified through the
    ring and change no token; without one, 'draft' is a one-line refusal; a draft of
    another tokenizer, or one the budget cannot hold, is refused at start, saying why."""
    from bench.speculative_peer import truncated_draft
    from cellswarm.errors import CellswarmError
    from cellswarm.planner.placement import even_split
    from cellswarm.swarm.local.pipeline import LocalPipeline

    draft = str(truncated_draft(demo_path, tmp_path / "draft.gguf", 6))
    prompt = _chat(demo, KINDS["summary"])
    expected = demo.generate(prompt, GenerateOptions(24, stop_ids=frozenset())).token_ids
    with LocalPipeline(str(demo_path), even_split(30, 2), draft=draft) as pipe:
        (got,) = pipe.generate([{"prompt": prompt, "max_tokens": 24, "speculative": "draft"}])
        stats = pipe.stats()
    assert got.tokens == expected
    assert int(str(stats[0]["drafted_tokens"])) > 0, stats[0]
    assert int(str(stats[0]["accepted_tokens"])) > 0, stats[0]
    with LocalPipeline(str(demo_path), even_split(30, 2)) as pipe, \
            pytest.raises(CellswarmError, match="no draft model") as refused:
        pipe.generate([{"prompt": prompt, "max_tokens": 4, "speculative": "draft"}])
    assert "\n" not in str(refused.value)
    other = write_model(tmp_path / "other.gguf", "llama", "Q8_0", seed=3)
    with pytest.raises(CellswarmError, match="another tokenizer"):
        LocalPipeline(str(demo_path), even_split(30, 2), draft=str(other))
    from cellswarm.loader import load
    from cellswarm.swarm.ring.stage import StageConfig, shard_need_bytes, stage_selection

    needs = []  # each stage's own need, without a draft model
    for i, layers in enumerate(even_split(30, 2)):
        config = StageConfig(str(demo_path), layers, i == 0, i == 1, context=512,
                             max_sequences=2)  # fmt: skip
        shard = load(str(demo_path), selection=stage_selection(config), tokenizer=False)
        needs.append(sum(shard_need_bytes(shard, config).values()))
    with pytest.raises(CellswarmError, match=r"draft [0-9,]+.* bytes short"):
        LocalPipeline(str(demo_path), even_split(30, 2), draft=draft, memory_bytes=max(needs),
                      context=512, max_sequences=2)  # fmt: skip


def test_a_swarm_s_workers_draft_with_their_draft_model(demo: Model, demo_path: Path,
                                                       tmp_path: Path) -> None:  # fmt: skip
    """`cellswarm up --workers 4 --memory 256M --draft` (issue 56: it never served, its
    first stage placed without room for the draft): the context fitted as `up` fits it, the
    worker that runs the first stage drafts with the draft model, within its --memory (no
    node's peak over its budget); the job's text is the one-process text, and the job says
    its drafts. A draft file that is not there is one line before any start."""
    from bench.speculative_peer import truncated_draft
    from cellswarm.swarm.api import client
    from cellswarm.swarm.local.up import LocalSwarm

    draft = str(truncated_draft(demo_path, tmp_path / "draft.gguf", 6))
    messages = [{"role": "user", "content": KINDS["summary"]}]
    with LocalSwarm(str(demo_path), 4, "256M", tmp_path / "swarm", draft=draft,
                    context=None) as swarm:  # fmt: skip
        swarm.wait_ready()  # (started as `cellswarm up` starts it: the context fitted)
        said = {mode: client.call(swarm.url, "/v1/chat/completions", {
            "model": demo_path.name, "messages": messages, "max_tokens": 24,
            "temperature": 0, "speculative": mode}) for mode in ("off", "draft")}  # fmt: skip
        nodes = swarm.status()["nodes"]
    assert all(n["peak_rss_bytes"] <= n["memory_bytes"] for n in nodes), nodes
    text = {mode: r["choices"][0]["message"]["content"] for mode, r in said.items()}
    assert text["draft"] == text["off"] and text["off"], text
    expected = demo.generate(_chat(demo, KINDS["summary"]), GenerateOptions(24))
    assert text["off"] == expected.text
    kept = said["draft"]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
    assert kept > 0, said["draft"]["usage"]
    with pytest.raises(RequestError, match=r"--draft .*no such file"):
        LocalSwarm(str(demo_path), 2, "160M", tmp_path / "bad", draft=str(tmp_path / "no.gguf"))


def test_up_with_a_draft_places_the_first_stage_with_room_for_it(
    demo_path: Path, tmp_path: Path
) -> None:
    """`up --workers 4 --memory 256M --draft` (issue 56): the coordinator placed the first
    stage as if it held no draft, and its worker refused the layers ~6 MB short, on every
    spare in turn; the ring never served. Now `up` fits and the coordinator places with the
    draft on the first stage, counted as that worker counts it: its shard, with the draft,
    is within the budget."""
    from bench.speculative_peer import truncated_draft
    from cellswarm.loader import load
    from cellswarm.planner.placement import balanced_layers
    from cellswarm.swarm.local.up import LocalSwarm
    from cellswarm.swarm.ring.costs import costs_at, draft_costs_at
    from cellswarm.swarm.ring.stage import (
        StageConfig,
        load_draft,
        shard_need_bytes,
        stage_selection,
    )

    draft = str(truncated_draft(demo_path, tmp_path / "draft.gguf", 6))
    up = LocalSwarm(str(demo_path), 4, "256M", tmp_path / "up", draft=draft)
    fit = up.fit()
    assert up.coordinator_config().draft == draft
    at = costs_at(str(demo_path), draft=draft)
    (lo, hi), *_ = balanced_layers(at(fit.context_tokens, fit.sequences), 3, 256 << 20, "m")
    config = StageConfig(str(demo_path), (lo, hi), True, False, context=fit.context_tokens,
                         max_sequences=fit.sequences, memory_bytes=256 << 20,
                         draft=draft)  # fmt: skip
    shard = load(str(demo_path), selection=stage_selection(config), tokenizer=False)
    shard.draft = load_draft(draft, str(demo_path))
    need = shard_need_bytes(shard, config)
    assert sum(need.values()) <= 256 << 20, need
    assert need["draft"] == draft_costs_at(draft)(fit.context_tokens, fit.sequences)
    without = costs_at(str(demo_path))(fit.context_tokens, fit.sequences)
    assert at(fit.context_tokens, fit.sequences).ends[0] == without.ends[0] + need["draft"]


def test_a_ring_verifies_drafts_and_gives_the_one_process_tokens(
    demo: Model, demo_path: Path
) -> None:
    """Three stages: stage 0 drafts and sends rounds behind rounds, the last stage keeps
    what agrees and drops rounds built on drafts it refused; greedy and seeded sampling
    give one process's tokens, for each kind of prompt."""
    from cellswarm.planner.placement import even_split
    from cellswarm.swarm.local.pipeline import LocalPipeline

    prompts = [_chat(demo, text) for text in KINDS.values()]
    sampled = SamplingParams(temperature=0.8, top_k=40, seed=5)
    expected = [demo.generate(p, GenerateOptions(32, stop_ids=frozenset())).token_ids
                for p in prompts]  # fmt: skip
    expected.append(demo.generate(prompts[2], GenerateOptions(32, sampled,
                                                              stop_ids=frozenset())).token_ids)
    with LocalPipeline(str(demo_path), even_split(30, 3)) as pipe:
        results = [pipe.generate([{"prompt": p, "max_tokens": 32, "speculative": "lookup"}])
                   for p in prompts]  # fmt: skip
        results.append(pipe.generate([{"prompt": prompts[2], "max_tokens": 32,
                                       "sampling": sampled, "speculative": "lookup"}]))
        stats = pipe.stats()
    assert [r[0].tokens for r in results] == expected
    drafted, kept, pipelined = (int(str(stats[0][k])) for k in (
        "drafted_tokens", "accepted_tokens", "rounds_pipelined"))  # fmt: skip
    assert drafted > 0 and kept > 0 and pipelined > 0, stats[0]
    assert int(str(stats[2]["rounds_void"])) > 0, stats[2]  # some guesses were wrong
    assert not stats[1].get("drafted_tokens"), stats[1]  # stage 0 drafts; the others verify
    assert stats[0]["tokens_stray"] == 0, stats[0]  # every answer continued the text


def test_stage_0_drops_an_answer_that_does_not_continue_its_text(demo_path: Path) -> None:
    """A `token` frame for a step the text no longer has (a round stage 0 forgot, a frame
    come twice) is dropped and counted, never emitted: it would repeat or skip a token."""
    import asyncio

    from cellswarm.swarm.ring.frames import Frame
    from cellswarm.swarm.ring.rounds import continues
    from cellswarm.swarm.ring.stage import Sequence, Stage, StageConfig, load_stage_model

    assert continues(12, 7, 12, 7) and continues(12, 7, None, None) and continues(12, 7, 12, None)
    assert not continues(12, 7, 11, 7)  # a frame come twice: its token is out already
    assert not continues(12, 7, 12, 9)  # a round built on a guess the text did not keep

    async def scenario() -> tuple[Any, list[tuple[str, Any]], list[Any]]:
        config = StageConfig(str(demo_path), (0, 15), first=True, last=False)
        stage = Stage(config, load_stage_model(config))
        out: list[tuple[str, Any]] = []
        sent: list[Any] = []

        async def emit(f: Frame) -> None:
            out.append((f.type, f.fields))

        async def send_next(message: Any, array: Any = None) -> None:  # the next stage's seam
            sent.append(message)

        stage.send_next = send_next  # type: ignore[method-assign]
        s = Sequence("r", emit, [1, 2, 3], 2, frozenset(), tokens=[79])
        stage.sequences[1] = s
        await stage.on_token(1, [(100, "")], at=3, follows=3)  # position 3 holds 79: twice
        await stage.on_token(1, [(100, "")], at=4, follows=5)  # after a token not the text's
        stray = (list(out), list(s.tokens), stage.tokens_stray)
        await stage.on_token(1, [(100, "")], at=4, follows=79)  # the text's next: taken
        return stray, out, sent

    stray, out, sent = asyncio.run(scenario())
    assert stray == ([], [79], 2)
    assert [t for t, _ in out] == ["token", "done"] and out[0][1]["token"] == 100
    assert [type(m).__name__ for m in sent] == ["End"]


def test_rounds_go_behind_rounds_only_while_they_are_likely_kept() -> None:
    from cellswarm.planner.speculative import MAX_IN_FLIGHT
    from cellswarm.swarm.ring.rounds import Expect, Round, kept_whole, next_round

    a = Round(10, (7, 1, 2), 0.0)  # the last token 7 at 10, drafts 1 2 at 11 12
    look = [1, 2, 3, 4, 5, 6, 8, 9]  # what the lookup says follows the text (…, 7)
    b = next_round([a], look, 0.95, 100, 1.0)
    assert b == Round(13, (3, 4, 5), 1.0, lead=False)  # guess 3 for a's own token, 4 5 after
    assert next_round([a], look, 0.5, 100, 1.0) is None  # a kept whole: 0.125, too unlikely
    assert next_round([a], [1, 9, 3], 0.95, 100, 1.0) is None  # the lookup changed its mind
    assert next_round([a, b], look, 0.95, 14, 1.0) is None  # past max_tokens: no room
    # a round without drafts: a guess alone goes behind it (a deep ring's best, rows being dear)
    alone = [Round(10, (7,), 0.0)]
    assert next_round(alone, look, 0.9, 100, 1.0) == Round(11, (1,), 1.0, lead=False)
    assert next_round(alone, [], 0.9, 100, 1.0) is None  # no guess
    assert next_round([a] * MAX_IN_FLIGHT, look * 4, 1.0, 100, 1.0) is None
    assert kept_whole(a, [1, 2, 3], [b])  # all kept, and its own token was the guess
    assert not kept_whole(a, [1, 2, 9], [b]) and not kept_whole(a, [1, 5], [b])
    last = Expect(13, 3)  # what the last stage says after a gave [1, 2, 3]
    assert last.takes(13, 3) and not last.takes(13, 9) and not last.takes(12, 3)


def test_a_stage_killed_mid_speculation_resumes_with_the_same_text(
    demo: Model, demo_path: Path
) -> None:
    import os
    import signal

    from cellswarm.planner.placement import even_split
    from cellswarm.swarm.local.pipeline import LocalPipeline

    quote = _chat(demo, KINDS["extraction"])
    expected = demo.generate(quote, GenerateOptions(40, stop_ids=frozenset())).token_ids
    seen = [0]
    with LocalPipeline(str(demo_path), even_split(30, 3)) as pipe:

        def kill(_i: int, _token: int) -> None:
            seen[0] += 1
            if seen[0] == 12:  # tokens out, drafts in flight
                os.kill(pipe.procs[2].pid, signal.SIGKILL)

        result = pipe.generate([{"prompt": quote, "max_tokens": 40, "speculative": "lookup"}],
                               on_token=kill)  # fmt: skip
        assert pipe.restarts == 1
        drafted = int(str(pipe.stats()[0]["drafted_tokens"]))
    assert result[0].tokens == expected
    assert drafted > 0
