"""A pipeline of real stage processes over real sockets equals the single-process engine."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

import cellswarm
from cellswarm.engine.model import GenerateOptions
from cellswarm.engine.sampling import SamplingParams
from cellswarm.planner.placement import even_split
from cellswarm.swarm.local.pipeline import LocalPipeline

TEXTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3,"]


@pytest.fixture(scope="module")
def reference(demo_path: Path) -> tuple[list[list[int]], list[list[int]]]:
    model = cellswarm.load(demo_path)
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    opts = GenerateOptions(10, stop_ids=frozenset())
    return prompts, [model.generate(p, opts).token_ids for p in prompts]


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
def test_pipeline_equals_single_process(demo_path: Path, reference, stages: int) -> None:  # type: ignore[no-untyped-def]
    prompts, expected = reference
    with LocalPipeline(str(demo_path), even_split(30, stages)) as pipe:
        results = pipe.generate([{"prompt": p, "max_tokens": 10} for p in prompts])
    assert [r.tokens for r in results] == expected  # four sequences in flight together
    assert all(r.reason == "max_tokens" for r in results)


@pytest.mark.parametrize("stages", [1, 3])
def test_sequences_in_flight_are_decoded_in_batches_with_their_own_bits(
    demo_path: Path, stages: int
) -> None:
    """12 sequences of different lengths in flight: each stage steps the ones ready together
    (one pass over its layers), and every sequence's tokens are the ones it gets alone in
    one process — batching depends on timing, results must not."""
    model = cellswarm.load(demo_path)
    texts = [*TEXTS, "Water boils at", "The quick brown fox", "import numpy as np", "Dear Sir,",
             "Paris is", "In 1492,", "The best way to learn", "Q: What is 2+2?\nA:"]  # fmt: skip
    prompts = [model.tokenizer.encode(t) for t in texts]
    opts = GenerateOptions(12, stop_ids=frozenset())
    expected = [model.generate(p, opts).token_ids for p in prompts]
    with LocalPipeline(str(demo_path), even_split(30, stages), max_sequences=12) as pipe:
        results = pipe.generate([{"prompt": p, "max_tokens": 12} for p in prompts])
        stats = pipe.stats()
    assert [r.tokens for r in results] == expected
    for st in stats:  # every stage batched: more than one sequence per pass
        assert st["batches"] > 0 and st["widest_batch"] > 1, st


def test_seeded_sampling_does_not_depend_on_the_layout(demo_path: Path) -> None:
    model = cellswarm.load(demo_path)
    prompt = model.tokenizer.encode("Tell me a story:")
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    expected = model.generate(prompt, GenerateOptions(8, sampling, stop_ids=frozenset())).token_ids
    with LocalPipeline(str(demo_path), even_split(30, 3)) as pipe:
        [result] = pipe.generate([{"prompt": prompt, "max_tokens": 8, "sampling": sampling}])
    assert result.tokens == expected


def test_stop_tokens_end_a_sequence(demo_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    prompts, expected = reference
    seq = expected[0]
    at = next(i for i in range(1, len(seq)) if seq[i] not in seq[:i])  # first fresh token
    with LocalPipeline(str(demo_path), even_split(30, 2)) as pipe:
        [r] = pipe.generate([{"prompt": prompts[0], "max_tokens": 10, "stop_ids": [seq[at]]}])
    assert r.tokens == seq[:at] and r.reason == "stop_token"


def test_even_split_table() -> None:
    assert even_split(30, 1) == [(0, 30)]
    assert even_split(30, 4) == [(0, 8), (8, 15), (15, 22), (22, 30)]
    with pytest.raises(ValueError, match="31 stages"):
        even_split(30, 31)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_stage_killed_mid_generation_costs_a_replay_not_a_request(
    demo_path: Path, victim: int
) -> None:
    """20 sequences in flight, stepped in batches; SIGKILL a stage (a middle one, then stage
    0 itself) after the first tokens arrive; the recovery replays each sequence's own tokens
    into the batches, and every request finishes token-identical to the failure-free run."""
    import os
    import signal

    model = cellswarm.load(demo_path)
    prompts = [model.tokenizer.encode(f"Item {i}: the colour of the sky is") for i in range(20)]
    opts = GenerateOptions(12, stop_ids=frozenset())
    expected = [model.generate(p, opts).token_ids for p in prompts]
    seen = [0]

    def kill_after_some_tokens(_i: int, _token: int) -> None:
        seen[0] += 1
        if seen[0] == 30:  # mid-generation: 30 of 240 tokens are out
            os.kill(pipe.procs[victim].pid, signal.SIGKILL)

    with LocalPipeline(str(demo_path), even_split(30, 3)) as pipe:
        requests = [{"prompt": p, "max_tokens": 12} for p in prompts]
        results = pipe.generate(requests, on_token=kill_after_some_tokens)
        assert pipe.restarts == 1
        stats = pipe.stats()
    assert [r.tokens for r in results] == expected
    assert all(st["widest_batch"] > 1 for st in stats), stats  # the replays were batched too


def test_a_deepseek_moe_model_pipelines_like_one_process(tmp_path: Path) -> None:
    """MLA + routed experts (random weights) split over 3 stages equals one process."""
    from tests.hf_reference import build_hf_model, save_hf
    from tests.test_deepseek2 import DEEPSEEK_V3

    folder = save_hf(build_hf_model(DEEPSEEK_V3, seed=5), tmp_path / "ds")
    model = cellswarm.load(folder)
    prompts = [[1, 5, 9, 14, 3], [7, 7, 2]]
    opts = GenerateOptions(8, stop_ids=frozenset())
    expected = [model.generate(p, opts).token_ids for p in prompts]
    with LocalPipeline(str(folder), even_split(3, 3)) as pipe:
        results = pipe.generate([{"prompt": p, "max_tokens": 8} for p in prompts])
    assert [r.tokens for r in results] == expected


def test_seeded_sampling_survives_a_kill(demo_path: Path) -> None:
    import os
    import signal

    model = cellswarm.load(demo_path)
    prompt = model.tokenizer.encode("Write a short poem about rain:")
    sampling = SamplingParams(temperature=0.8, top_k=40, seed=3)
    expected = model.generate(prompt, GenerateOptions(16, sampling, stop_ids=frozenset())).token_ids

    def kill(_i: int, _t: int) -> None:
        if len(seen) == 5:
            os.kill(pipe.procs[1].pid, signal.SIGKILL)
        seen.append(_t)

    seen: list[int] = []
    with LocalPipeline(str(demo_path), even_split(30, 3)) as pipe:
        [r] = pipe.generate([{"prompt": prompt, "max_tokens": 16, "sampling": sampling}], kill)
        assert pipe.restarts == 1
    assert r.tokens == expected


def test_memory_budgets_hold_and_a_too_small_budget_is_refused(demo_path: Path) -> None:
    """Each stage's peak RSS (VmHWM, Python included) stays within its --memory; a budget
    that cannot hold the shard is refused at start with the shortfall."""
    budget = 128 << 20
    with LocalPipeline(str(demo_path), even_split(30, 3), memory_bytes=budget, context=256,
                       max_sequences=4) as pipe:  # fmt: skip
        pipe.generate([{"prompt": [1, 2, 3, 4, 5], "max_tokens": 20}] * 4)
        stats = pipe.stats()
    assert all(0 < s["peak_rss_bytes"] <= budget for s in stats), stats
    with pytest.raises(cellswarm.BudgetError, match=r"bytes short; give this node fewer layers"):
        LocalPipeline(str(demo_path), even_split(30, 1), memory_bytes=64 << 20)


def test_the_demo_command() -> None:
    """`make demo`'s job: split, answer, survive a kill with the same text, plan Kimi K3."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "cellswarm", "demo", "--max-tokens", "16"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "Paris" in out and "same text" in out and "100,000 PS3s" in out


def test_one_request_traced_across_nodes(demo_path: Path, tmp_path: Path) -> None:
    """JSON lines on every stage, merged by request id into one ordered timeline — through a
    kill and the replay that follows it."""
    import os
    import signal
    import subprocess
    import sys

    from cellswarm.swarm.logs import timeline

    logs = tmp_path / "logs"
    with LocalPipeline(str(demo_path), even_split(30, 3), log_dir=str(logs)) as pipe:

        def kill(_i: int, _t: int) -> None:
            if len(seen) == 3:
                os.kill(pipe.procs[2].pid, signal.SIGKILL)
            seen.append(_t)

        seen: list[int] = []
        [r, _] = pipe.generate([{"prompt": [1, 2, 3], "max_tokens": 6}] * 2, kill)
    events = timeline(logs, r.request_id)
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    nodes = {e["node"] for e in events if e["event"] == "step"}
    assert nodes == {"stage-0", "stage-1", "stage-2"}
    kinds = [e["event"] for e in events]
    assert kinds[0] == "generate" and "done" in kinds and "reset" in kinds
    # Stage 0 ends the request, having said what its decode steps cost it (one "decode"
    # event, not a line per token); the others say so as they let the request go, after its
    # "done" (or not at all when the pipeline stops first).
    mine = [e["event"] for e in events if e["node"] == "stage-0"]
    assert mine[-1] == "done" and mine[-2] == "decode"
    out = subprocess.run(
        [sys.executable, "-m", "cellswarm", "logs", r.request_id, "--dir", str(logs)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "stage-2" in out and "done" in out


def test_decode_steps_are_tallied_not_logged_one_by_one(demo_path: Path, tmp_path: Path) -> None:
    """A stage logs a request's prefill as a "step", and its decode steps summed in "decode"
    events (every DECODE_LOG_EVERY steps, cumulative, then when it lets the request go):
    steps, the span from the first to the last, and where a step's time went."""
    import json
    import time

    from cellswarm.swarm.ring.stage import DECODE_LOG_EVERY, HOP_PARTS

    tokens = DECODE_LOG_EVERY + 6
    with LocalPipeline(str(demo_path), even_split(30, 2), log_dir=str(tmp_path)) as pipe:
        # one decode step a token: no speculative rounds (test_speculative.py has those)
        [r] = pipe.generate([{"prompt": [1, 2, 3], "max_tokens": tokens, "speculative": "off"}])
        deadline = time.monotonic() + 10  # stage 1 logs its last tally as it lets go

        def events(node: str) -> list[dict[str, object]]:
            lines = (tmp_path / f"{node}.jsonl").read_text().splitlines()
            return [e for e in map(json.loads, lines) if e["request_id"] == r.request_id]

        while len([e for e in events("stage-1") if e["event"] == "decode"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        totals = [s["hop_s"] for s in pipe.stats()]  # every decode step's, in the stats too
    assert all(t["compute"] > 0 and set(t) == set(HOP_PARTS) for t in totals)
    for node in ("stage-0", "stage-1"):
        mine = events(node)
        assert [e["tokens"] for e in mine if e["event"] == "step"] == [3]  # the prefill
        decode = [e for e in mine if e["event"] == "decode"]
        assert [e["steps"] for e in decode] == [DECODE_LOG_EVERY, tokens - 1]
        last = decode[-1]
        assert 0 < last["max_ms"] <= last["span_ms"]
        assert all(float(last[f"{k}_us"]) >= 0 for k in HOP_PARTS) and last["compute_us"] > 0
        # a frame goes out of every step, and one came in (stage 0: the token from stage 1)
        assert last["encode_us"] > 0 and last["read_us"] > 0


def test_emulated_stages_are_slowed_to_their_profile_and_still_exact(demo_path: Path) -> None:
    from cellswarm.swarm.ring.emulate import Emulation

    model = cellswarm.load(demo_path, tokenizer=False)
    rpi4 = Emulation.for_stage(model, "rpi4")
    # the whole demo model's bytes over an rpi4's effective 4.48 GB/s, or its FLOPs
    assert rpi4.step_s(1) >= rpi4.weight_bytes / 4.48e9
    prompt = [1, 2, 3, 4]
    expected = model.generate(prompt, GenerateOptions(6, stop_ids=frozenset())).token_ids
    with LocalPipeline(str(demo_path), even_split(30, 2), profile="rpi4") as pipe:
        [r] = pipe.generate([{"prompt": prompt, "max_tokens": 6}])
        stats = pipe.stats()
    assert r.tokens == expected
    for s in stats:  # every decode step took at least the emulated time (~5 ms here)
        assert s["decode_s"] / s["decode_steps"] >= 0.004


def test_a_stage_that_keeps_failing_is_marked_offline_and_nothing_hangs(demo_path: Path) -> None:
    """Every incarnation of stage 1 dies after its 3rd step: it is replaced twice, marked
    offline at its 3rd failure in a row, and generate() ends with that error (requests get at
    most 3 attempts too, so nothing retries forever)."""
    with LocalPipeline(str(demo_path), even_split(30, 2), crash_after_steps={1: 3},
                       offline_after=3) as pipe:  # fmt: skip
        with pytest.raises(cellswarm.SwarmError, match=r"stage 1 \(layers 15..29\) failed 3 times"):
            pipe.generate([{"prompt": [1, 2, 3], "max_tokens": 12}])
        assert pipe.restarts == 2


def test_joining_is_authenticated(demo_path: Path, tmp_path: Path) -> None:
    """With a cluster token every connection must answer a fresh challenge: no proof, a wrong
    token, a replayed proof and an unexpected peer id are all refused and nothing runs."""
    import asyncio

    import numpy as np

    from cellswarm.swarm.auth import prove
    from cellswarm.swarm.ring.frames import Frame, connect, read_frame, write_frame

    token_file = tmp_path / "token"
    token_file.write_text("a-cluster-secret-of-32-bytes-xyz")
    generate = Frame("generate", {"req": "x", "max_tokens": 2}, np.asarray([1, 2], np.int64))

    secret = token_file.read_bytes()
    recorded: list[str] = []  # a nonce seen on an earlier connection

    def proof(key: bytes, nonce: str, peer: str) -> Frame:
        return Frame("proof", {"peer": peer, "mac": prove(key, nonce, peer)})

    async def attempt(port: int, answer: str) -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        challenge = await read_frame(reader)
        assert challenge is not None and challenge.type == "challenge"
        nonce = str(challenge.fields["nonce"])
        recorded.append(nonce)
        proofs = {
            "none": generate,
            "wrong": proof(b"wrong-secret-123456", nonce, "client"),
            "replay": proof(secret, recorded[0], "client"),  # valid, but for another challenge
            "stranger": proof(secret, nonce, "stage-7"),  # valid token, not in the placement
        }
        await write_frame(writer, proofs[answer])
        reply = await read_frame(reader)
        writer.close()
        return reply.type if reply is not None else "closed"

    async def good(port: int) -> str:
        reader, writer = await connect("127.0.0.1", port, token_file.read_bytes())
        await write_frame(writer, Frame("stats", {}))
        reply = await read_frame(reader)
        writer.close()
        return reply.type if reply is not None else "closed"

    with LocalPipeline(str(demo_path), even_split(30, 2), token_file=str(token_file)) as pipe:
        [r] = pipe.generate([{"prompt": [1, 2, 3], "max_tokens": 4}])
        assert len(r.tokens) == 4  # the swarm itself proves every hop and works
        for answer in ("none", "wrong", "replay", "stranger"):
            assert asyncio.run(attempt(pipe.port, answer)) == "denied", answer
        assert asyncio.run(good(pipe.port)) == "stats"
        # 4 tokens are 4 forward steps on every stage (the prompt's, then 3 decodes): the
        # refused attempts ran nothing
        assert [s["steps"] for s in pipe.stats()] == [4, 4]


def test_token_files_are_checked(tmp_path: Path) -> None:
    from cellswarm.swarm.auth import load_token, prove, verify

    with pytest.raises(cellswarm.RequestError, match="does not exist"):
        load_token(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(cellswarm.RequestError, match="holds 3 bytes; use at least 16"):
        load_token(short)
    mac = prove(b"k" * 16, "n1", "client")
    assert verify(b"k" * 16, "n1", "client", mac)
    assert not verify(b"k" * 16, "n2", "client", mac)  # bound to its nonce
    assert not verify(b"k" * 16, "n1", "stage-1", mac)  # and to its peer id


def test_budget_split_balances_memory_and_each_stage_accepts_its_share(demo_path: Path) -> None:
    from cellswarm.swarm.ring.costs import budget_split

    splits = budget_split(str(demo_path), 3, 128 << 20, context=256, max_sequences=4)
    assert splits[0][0] == 0 and splits[-1][1] == 30
    assert all(a[1] == b[0] for a, b in itertools.pairwise(splits))
    # the planner's bytes and each stage's own start-up check agree: all three accept
    with LocalPipeline(str(demo_path), splits, memory_bytes=128 << 20, context=256,
                       max_sequences=4) as pipe:  # fmt: skip
        [r] = pipe.generate([{"prompt": [1, 2, 3], "max_tokens": 3}])
    assert len(r.tokens) == 3
    with pytest.raises(cellswarm.BudgetError, match=r"2 workers need .* bytes each .* short"):
        budget_split(str(demo_path), 2, 64 << 20, context=256, max_sequences=4)


@pytest.mark.parametrize("stages", [1, 2, 5, 8])
def test_a_random_llama_over_up_to_8_stages_equals_one_process(tmp_path: Path, stages: int) -> None:
    """Random weights, 8 layers: greedy tokens and the last stage's logits match one process
    (the ring carries the same float32 activations the single process computes)."""
    from tests.hf_reference import LLAMA_FAMILY, build_hf_model, save_hf

    config = dict(LLAMA_FAMILY["llama"], num_hidden_layers=8)
    folder = save_hf(build_hf_model(config, seed=3), tmp_path / "llama8")
    model = cellswarm.load(folder)
    prompts = [[1, 5, 9, 14, 3], [7, 7, 2], [30, 31, 32, 33]]
    opts = GenerateOptions(8, stop_ids=frozenset())
    expected = [model.generate(p, opts).token_ids for p in prompts]
    with LocalPipeline(str(folder), even_split(8, stages)) as pipe:
        results = pipe.generate([{"prompt": p, "max_tokens": 8} for p in prompts])
    assert [r.tokens for r in results] == expected
    # the stages' layer ranges, run one after another in this process, give the same logits
    ids = np.asarray(prompts[0] + expected[0])
    staged = cellswarm.load(folder)
    cache = staged.new_cache(len(ids))
    h = staged.arch.embed(ids)
    for lo, hi in even_split(8, stages):
        h = staged.forward(h, cache, range(lo, hi))
    assert np.abs(staged.arch.head(h) - model.logits(ids)).max() <= 1e-5


def test_balanced_split_evens_out_emulated_step_times(demo_path: Path) -> None:
    """The demo model's tied head weighs several layers: the last stage gets fewer layers,
    and no stage's emulated step is far from the others'."""
    from cellswarm.planner.cost import emulated_split

    split = emulated_split(str(demo_path), 4, "rpi4")
    assert split[0][0] == 0 and split[-1][1] == 30
    assert all(a[1] == b[0] for a, b in itertools.pairwise(split))
    assert split[-1][1] - split[-1][0] < 30 // 4


def test_a_long_prompt_is_prefilled_in_the_engine_s_chunks_bit_for_bit(demo_path: Path) -> None:
    """A 1,300-token prompt: each stage prefills it in chunks of PREFILL_CHUNK positions (its
    loop free between two), at the positions the engine's own prefill chunks at: the tokens
    are one process's."""
    from cellswarm.engine import PREFILL_CHUNK

    model = cellswarm.load(demo_path)
    text = " ".join(f"item {i} is {i * 7 % 13};" for i in range(260))
    prompt = model.tokenizer.encode(text)[: 2 * PREFILL_CHUNK + 276]
    expected = model.generate(prompt, GenerateOptions(6, stop_ids=frozenset())).token_ids
    with LocalPipeline(str(demo_path), even_split(30, 2), context=2048) as pipe:
        [result] = pipe.generate([{"prompt": prompt, "max_tokens": 6}])
    assert result.tokens == expected
