"""Shared prefixes computed once (issue 33): a later sequence that starts with the tokens of
an earlier one's whole blocks copies their KV instead of computing it, and gets the bits it
gets without the cache — in the engine (PrefixCache) and through a pipeline's stages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cellswarm
from cellswarm import kernels
from cellswarm.engine.model import GenerateOptions, Model
from cellswarm.engine.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys
from cellswarm.planner.placement import even_split
from cellswarm.swarm.local.pipeline import LocalPipeline
from tests.bits_models import write_model

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="needs the C kernels")


@pytest.fixture(scope="module", params=[("llama", "Q4_K_M"), ("deepseek2", "Q4_0")],
                ids=lambda c: f"{c[0]}-{c[1]}")  # fmt: skip
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    family, quant = request.param
    path = write_model(tmp_path_factory.mktemp("prefix") / f"{family}.gguf", family, quant)
    return cellswarm.load(str(path), tokenizer=False)


def _prefill(model: Model, ids: np.ndarray, shared: PrefixCache | None) -> np.ndarray:
    """The last layer's rows of a prompt, through the cache as a stage uses it: restore what
    it holds (up to the last position), compute the rest, remember the whole blocks."""
    cache = model.new_cache(len(ids) + 1)
    kept = shared.restore(list(ids), cache, len(ids) - 1) if shared else None
    skip = 0 if kept is None else kept.shape[0]
    cache.length = skip
    rows = model.forward(model.arch.embed(ids[skip:]), cache)
    out = rows if kept is None else np.concatenate([kept, rows])
    if shared is not None:
        shared.remember(list(ids), cache, out)
    return out


def test_a_hit_gives_the_bits_of_computing_the_prefix_again(model: Model) -> None:
    rng = np.random.default_rng(3)
    head = rng.integers(3, model.config.vocab_size, 2 * BLOCK_TOKENS + 10)
    first, second = np.concatenate([head, [5, 6, 7]]), np.concatenate([head[:-3], [9, 9]])
    shared = PrefixCache(1 << 30)
    _prefill(model, first, shared)
    assert shared.stats()["prefix_blocks"] == 2 and shared.misses == 2
    got = _prefill(model, second, shared)
    assert shared.hits == 2  # both whole blocks of `second`'s shared part came from the cache
    assert np.array_equal(got, _prefill(model, second, None))  # every row, to the bit


def test_blocks_are_found_only_by_the_same_whole_prefix() -> None:
    a = list(range(3 * BLOCK_TOKENS))
    b = [7, *a[1:]]  # differs in the first token only: no block of a is a block of b
    assert len(block_keys(a)) == 3 and not set(block_keys(a)) & set(block_keys(b))
    assert block_keys(a[: 2 * BLOCK_TOKENS + 5]) == block_keys(a)[:2]


def test_the_budget_holds_and_a_chain_is_evicted_from_its_end(model: Model) -> None:
    ids = np.random.default_rng(4).integers(3, model.config.vocab_size, 3 * BLOCK_TOKENS + 1)
    probe = PrefixCache(1 << 30)
    _prefill(model, ids, probe)
    one = probe.bytes // 3
    shared = PrefixCache(2 * one)  # room for two of the three blocks
    _prefill(model, ids, shared)
    assert shared.bytes <= 2 * one and shared.evictions == 1
    cache = model.new_cache(len(ids) + 1)
    kept = shared.restore(list(ids), cache, len(ids) - 1)
    assert kept is not None and kept.shape[0] == 2 * BLOCK_TOKENS  # the first two survive


def sharing_an_instruction(
    demo_path: Path, n: int, max_tokens: int
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """A 140-token instruction, n requests that start with it, and each one's greedy tokens
    alone in one process."""
    model = cellswarm.load(demo_path)
    instruction = model.tokenizer.encode("Classify the sentiment of the review. " * 20)
    prompts = [instruction + model.tokenizer.encode(f" Review {i}: it was fine.")
               for i in range(n)]  # fmt: skip
    opts = GenerateOptions(max_tokens, stop_ids=frozenset())
    return instruction, prompts, [model.generate(p, opts).token_ids for p in prompts]


def test_sequences_sharing_an_instruction_hit_the_cache_at_every_stage(demo_path: Path) -> None:
    """A 140-token instruction shared by 6 requests through 2 stages: each stage computes its
    blocks once, and every request's tokens are the ones it gets alone in one process."""
    instruction, prompts, expected = sharing_an_instruction(demo_path, 6, 4)
    with LocalPipeline(str(demo_path), even_split(30, 2)) as pipe:
        got = [pipe.generate([{"prompt": p, "max_tokens": 4}])[0].tokens for p in prompts]
        stats = pipe.stats()
    assert got == expected
    blocks = len(instruction) // BLOCK_TOKENS
    for st in stats:
        assert st["prefix_hits"] == 5 * blocks and st["prefix_blocks"] >= blocks, st
    # stage 0 sent stage 1 each later request without the rows stage 1 held
    assert stats[0]["rows_unsent"] == 5 * blocks * BLOCK_TOKENS and not stats[0]["rows_resent"]


@pytest.mark.parametrize("held", ["evicted", "no cache"])
def test_rows_a_stage_was_not_sent_and_does_not_hold_are_sent_when_it_asks(
    demo_path: Path, held: str
) -> None:
    """Stage 0 sends a first step on without the rows its prefix cache gave; stage 1 lacks
    them (its cache holds nothing: a one-byte budget evicts every block; or it has none) and
    asks for them on the link: the step runs on them, and every token is the one-process
    token. A stage that has no cache says so, and gets every row from then on."""
    instruction, prompts, expected = sharing_an_instruction(demo_path, 4, 3)
    budget = {1: 1 if held == "evicted" else 0}
    with LocalPipeline(str(demo_path), even_split(30, 3), prefix_cache_bytes=budget) as pipe:
        got = [pipe.generate([{"prompt": p, "max_tokens": 3}])[0].tokens for p in prompts]
        stats = pipe.stats()
    assert got == expected
    rows = len(instruction) // BLOCK_TOKENS * BLOCK_TOKENS
    asked = 3 if held == "evicted" else 1  # each later request; or the first, then none
    assert stats[0]["rows_unsent"] == stats[0]["rows_resent"] == asked * rows, stats[0]
    assert stats[1]["rows_unsent"] == 0 and stats[2]["prefix_hits"] > 0, stats


def test_rows_not_sent_that_a_peer_announces_wrong_are_its_fault(demo_path: Path) -> None:
    """A 'hidden' frame's "cached" that is no whole number of blocks of its prompt, or a
    'prefix' frame of another size than the rows the step lacks, is malformed: the connection
    goes and nothing runs. What a peer learns by announcing rows the stage does not hold is a
    "need" naming its own sequence. The stage serves on."""
    import asyncio

    from cellswarm.swarm.ring.frames import Frame, read_frame, write_frame

    d = cellswarm.load(demo_path).config.d_model
    prompt = list(range(100, 100 + BLOCK_TOKENS + 5))
    first = {"prompt": prompt, "capacity": 256, "req": "r"}

    async def probe(port: int, cached: object, prefix_rows: int | None) -> list[Frame | None]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        rows = np.zeros((5, d), np.float32)
        fields = {"seq": 7, "pos": 0, "ep": 0, "first": first, "cached": cached}
        await write_frame(writer, Frame("hidden", fields, rows))
        got = [await asyncio.wait_for(read_frame(reader), 30)]
        if prefix_rows is not None:
            extra = np.zeros((prefix_rows, d), np.float32)
            await write_frame(writer, Frame("prefix", {"seq": 7, "ep": 0}, extra))
            got.append(await asyncio.wait_for(read_frame(reader), 30))
        writer.close()
        return got

    with LocalPipeline(str(demo_path), even_split(30, 2)) as pipe:
        port = pipe.configs[1].listen_port
        assert asyncio.run(probe(port, 5, None)) == [None]  # not a whole block: hung up
        assert asyncio.run(probe(port, len(prompt), None)) == [None]  # all of it: no row left
        need, cut = asyncio.run(probe(port, BLOCK_TOKENS, 3))
        assert need is not None and need.type == "need" and need.fields["seq"] == 7, need
        assert cut is None  # 3 rows for a step that lacks 64: hung up
        ids = prompt[:20]
        assert pipe.generate([{"prompt": ids, "max_tokens": 2}])[0].tokens


def test_scoring_fields_a_peer_sends_wrong_are_its_fault_not_the_stage_s(demo_path: Path) -> None:
    """A `generate` frame whose completions are not a list of lengths is malformed (the
    connection goes, nothing runs); lengths that do not fit the prompt are the job's error;
    the stage serves on and scores in one pass what is right."""
    import asyncio

    from cellswarm.swarm.ring.frames import Frame, read_frame, write_frame

    async def send(port: int, fields: dict, ids: list[int]) -> Frame | None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        base = {"req": "r", "max_tokens": 1, "sampling": {}, "stop_ids": [], "replay": []}
        await write_frame(writer, Frame("generate", {**base, **fields}, np.asarray(ids)))
        try:
            return await asyncio.wait_for(read_frame(reader), 30)
        finally:
            writer.close()

    ids = list(range(100, 110))
    with LocalPipeline(str(demo_path), even_split(30, 1)) as pipe:
        bad = asyncio.run(send(pipe.port, {"score_from": 6, "completions": ["2", 2]}, ids))
        assert bad is None  # hung up on: a malformed frame
        wrong = asyncio.run(send(pipe.port, {"score_from": 6, "completions": [3, 3]}, ids))
        assert wrong is not None and wrong.type == "error" and wrong.fields["fault"] == "job"
        good = asyncio.run(send(pipe.port, {"score_from": 6, "completions": [2, 2]}, ids))
        assert good is not None and good.type == "score" and len(good.fields["logprobs"]) == 2


def test_one_pass_scoring_through_three_stages_gives_each_option_s_own_bits(
    demo_path: Path,
) -> None:
    """Completions of 1 to 3 tokens after one prompt, scored in one sequence through 3 stages:
    a completion's last token is not run through the layers (it predicts nothing scored, so a
    one-token label costs no pass), and every score is the bits of scoring it alone."""
    import asyncio

    from cellswarm.engine.scoring import log_likelihood
    from cellswarm.swarm.ring.frames import Frame, read_frame, write_frame
    from cellswarm.swarm.ring.stage import scoring_rows

    assert scoring_rows(3, [1, 3, 2]).tolist() == [0, 1, 2, 4, 5, 7]
    model = cellswarm.load(demo_path)
    prompt = model.tokenizer.encode("The capital of France is")
    options = [[281], [1012, 77, 305], [19], [640, 41]]
    ids = prompt + [t for o in options for t in o]
    fields = {"req": "r", "max_tokens": 1, "sampling": {}, "stop_ids": [], "replay": [],
              "score_from": len(prompt), "completions": [len(o) for o in options]}  # fmt: skip

    async def send(port: int) -> Frame | None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await write_frame(writer, Frame("generate", fields, np.asarray(ids)))
        try:
            return await asyncio.wait_for(read_frame(reader), 60)
        finally:
            writer.close()

    with LocalPipeline(str(demo_path), even_split(30, 3)) as pipe:
        got = asyncio.run(send(pipe.port))
    assert got is not None and got.type == "score", got
    for option, score in zip(options, got.fields["logprobs"], strict=True):
        alone = prompt + option
        logits = model.logits(alone)[len(prompt) - 1 : len(alone) - 1].astype(np.float64)
        assert score == log_likelihood(logits, np.asarray(option)), option
