"""Routed experts and vocabulary rows on part servers of their own (swarm/ring/parts.py): real
processes, real sockets, against the single-process engine."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cellswarm
from cellswarm.engine.model import GenerateOptions
from cellswarm.io.weights import Selection
from cellswarm.models.deepseek2 import InProcessExperts, Routing, held_experts_sum
from cellswarm.models.ops import lm_head
from cellswarm.planner.placement import even_split
from cellswarm.swarm.local.pipeline import LocalPipeline
from cellswarm.swarm.ring.costs import part_specs
from cellswarm.swarm.ring.parts import ExpertParts, VocabParts, pack_routes, unpack_routes
from cellswarm.swarm.ring.stage import StageConfig, stage_selection

PROMPTS = [[1, 5, 9, 14, 3], [7, 7, 2], [100, 3, 64, 8, 8, 1, 90]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A random DeepSeek-V3-style model (MLA, 8 routed experts, top-4 from the best 2 of 4
    groups, a shared expert; layer 0 dense) and its single-process greedy tokens. Top-4, not
    top-2: two outputs add up the same in either order, four do not (tests/test_same_bits.py
    holds the near-tied version)."""
    from tests.hf_reference import build_hf_model, save_hf
    from tests.test_deepseek2 import DEEPSEEK_V3

    hf = build_hf_model(dict(DEEPSEEK_V3, num_experts_per_tok=4), seed=5)
    folder = save_hf(hf, tmp_path_factory.mktemp("ds") / "m")
    model = cellswarm.load(folder)
    opts = GenerateOptions(8, stop_ids=frozenset())
    return folder, [model.generate(p, opts).token_ids for p in PROMPTS]


def _requests(prompts: list[list[int]], n: int) -> list[dict[str, Any]]:
    return [{"prompt": p, "max_tokens": n} for p in prompts]


def test_routes_travel_in_one_float32_buffer() -> None:
    rng = np.random.default_rng(0)
    h, ids = rng.standard_normal((5, 16)).astype(np.float32), rng.integers(-1, 384, (5, 8))
    w = rng.random((5, 8)).astype(np.float32)
    h2, ids2, w2 = unpack_routes(pack_routes(h, ids, w), 8)
    assert np.array_equal(h2, h) and np.array_equal(ids2, ids) and np.array_equal(w2, w)


def test_experts_held_elsewhere_add_up_to_the_whole_layer(moe: tuple[Path, Any]) -> None:
    """The model hook with the in-process fake: a store holding experts {0, 3, 6} plus two
    'nodes' holding the rest give the single-process logits, bit for bit."""
    folder, _ = moe
    full = cellswarm.load(folder, tokenizer=False)
    moe_layers = (1, 2)
    split = [(0, 3, 6), (1, 4, 7), (2, 5)]

    def holding(ids: tuple[int, ...], **kw: Any) -> cellswarm.Model:
        sel = Selection(experts={i: ids for i in moe_layers}, **kw)
        return cellswarm.load(folder, selection=sel, tokenizer=False)

    local = holding(split[0])
    nodes = [
        holding(ids, kinds=frozenset({"experts"}), embed=False, head=False) for ids in split[1:]
    ]
    assert all(set(n.weights) == {f"blk.{i}.ffn_{p}_exps.weight" for i in moe_layers
                                  for p in ("gate", "up", "down")} for n in nodes)  # fmt: skip
    local.arch.remote_experts = InProcessExperts([n.weights for n in nodes])  # type: ignore[attr-defined]
    ids = np.asarray(PROMPTS[2] + PROMPTS[0])
    ref, ours = full.logits(ids), local.logits(ids)
    assert np.array_equal(ours, ref)
    # a node with none of a token's experts adds exactly nothing for it
    h = np.ones((2, 64), np.float32)
    routing = Routing(np.asarray([[0, 3, 6, 1], [1, 2, 4, 5]]), np.ones((2, 4), np.float32))
    out = held_experts_sum(nodes[1].weights, 1, h, routing)  # that node holds experts 2, 5
    assert not out[0].any() and out[1].all()


@pytest.mark.parametrize(("stages", "expert_nodes"), [(1, 1), (2, 2), (3, 3), (1, 3)])
def test_experts_on_separate_nodes_equal_one_process(
    moe: tuple[Path, list[list[int]]], stages: int, expert_nodes: int
) -> None:
    folder, expected = moe
    with LocalPipeline(str(folder), even_split(3, stages), expert_nodes=expert_nodes) as pipe:
        results = pipe.generate(_requests(PROMPTS, 8))
        parts = pipe.part_stats()
        stats = pipe.stats()
    assert [r.tokens for r in results] == expected  # three sequences in flight together
    assert all(set(p["weights_by_kind"]) == {"experts"} for p in parts)  # nothing else loaded
    assert all(p["requests"] > 0 for p in parts)  # every node served some tokens
    assert all(s["steps"] > 0 for s in stats)


def test_remote_expert_logits_are_bit_identical_over_real_sockets(
    moe: tuple[Path, Any],
) -> None:
    """A stage's shard (no routed experts of its own) calling two real expert processes."""
    folder, _ = moe
    full = cellswarm.load(folder, tokenizer=False)
    with LocalPipeline(str(folder), [(0, 3)], expert_nodes=2) as pipe:
        cfg = pipe.configs[0]
        shard = cellswarm.load(folder, selection=stage_selection(cfg), tokenizer=False)
        assert shard.memory().weights_by_kind.get("experts", 0) == 0  # all on the nodes
        remote = ExpertParts(cfg.parts, None, "client")
        shard.arch.remote_experts = remote  # type: ignore[attr-defined]
        ids = np.asarray(PROMPTS[2] * 3)
        ref, ours = full.logits(ids), shard.logits(ids)
        remote.close()
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize(("stages", "vocab_nodes"), [(1, 2), (2, 3)])
def test_vocabulary_split_over_head_nodes_gives_identical_tokens(
    demo_path: Path, stages: int, vocab_nodes: int
) -> None:
    model = cellswarm.load(demo_path)
    prompts = [model.tokenizer.encode(t) for t in ("The capital of France is", "def fib(n):")]
    opts = GenerateOptions(10, stop_ids=frozenset())
    expected = [model.generate(p, opts).token_ids for p in prompts]
    with LocalPipeline(str(demo_path), even_split(30, stages), vocab_nodes=vocab_nodes) as pipe:
        results = pipe.generate(_requests(prompts, 10))
        parts = pipe.part_stats()
    assert [r.tokens for r in results] == expected
    per_node = 49152 // vocab_nodes * 576 * 34 // 32  # Q8_0: 34 bytes per 32 weights
    assert all(abs(p["weight_bytes"] - per_node) <= 576 * 34 // 32 for p in parts)


def test_merged_logits_and_embedding_rows_are_bit_identical(demo_path: Path) -> None:
    """Partial logits concatenated, then the top rows refined in float from rows fetched off
    the head nodes: the same bits as one process's head (fused kernel and refine alike)."""
    model = cellswarm.load(demo_path, tokenizer=False)
    rng = np.random.default_rng(2)
    with LocalPipeline(str(demo_path), [(0, 30)], vocab_nodes=3) as pipe:
        vocab = VocabParts(pipe.configs[0].parts, None, "client")
        for t in (1, 4, 20):  # decode, a small batch (fused + refine), a prefill (tiled BLAS)
            x = rng.standard_normal((t, 576)).astype(np.float32)
            ours = lm_head(model.weights, x, 576, model.config.rms_eps, head=vocab)
            assert np.array_equal(ours, model.arch.head(x)), t
        ids = np.asarray([0, 49151, 16384, 16383, 5, 32768, 5])  # every node, out of order
        assert np.array_equal(vocab.embed(ids), model.arch.embed(ids))
        vocab.close()


def test_experts_and_vocabulary_on_parts_together(moe: tuple[Path, list[list[int]]]) -> None:
    folder, expected = moe
    with LocalPipeline(str(folder), even_split(3, 2), expert_nodes=2, vocab_nodes=2) as pipe:
        results = pipe.generate(_requests(PROMPTS, 8))
    assert [r.tokens for r in results] == expected


@pytest.mark.parametrize("victim", ["experts-1", "vocab-0"])
def test_a_part_killed_mid_generation_is_replaced_and_replayed(
    moe: tuple[Path, list[list[int]]], tmp_path: Path, victim: str
) -> None:
    """SIGKILL an expert node (or a vocabulary node) after the first tokens: it is started
    again on its port, the requests in flight are replayed, the output is token-identical —
    with a cluster token, so the replacement proves itself to the stages as the first did."""
    folder, _ = moe
    model = cellswarm.load(folder, tokenizer=False)
    prompts = [[i + 1, 2 * i + 3, 5, 9] for i in range(8)]
    opts = GenerateOptions(12, stop_ids=frozenset())
    expected = [model.generate(p, opts).token_ids for p in prompts]
    token_file = tmp_path / "token"
    token_file.write_text("a-cluster-secret-of-32-bytes-xyz")
    seen = [0]

    def kill_after_some_tokens(_i: int, _token: int) -> None:
        seen[0] += 1
        if seen[0] == 15:
            k = [c.spec.node_id for c in pipe.part_configs].index(victim)
            os.kill(pipe.part_procs[k].pid, signal.SIGKILL)

    with LocalPipeline(str(folder), even_split(3, 2), expert_nodes=2, vocab_nodes=2,
                       token_file=str(token_file)) as pipe:  # fmt: skip
        results = pipe.generate(_requests(prompts, 12), on_token=kill_after_some_tokens)
        assert pipe.restarts == 1
    assert [r.tokens for r in results] == expected


def test_placement_and_config_round_trip(moe: tuple[Path, Any]) -> None:
    folder, _ = moe
    specs = part_specs(str(folder), 3, 2, [9001, 9002, 9003, 9004, 9005])
    assert [s.experts for s in specs[:3]] == [
        {1: (0, 3, 6), 2: (0, 3, 6)}, {1: (1, 4, 7), 2: (1, 4, 7)}, {1: (2, 5), 2: (2, 5)},
    ]  # fmt: skip
    assert [s.vocab_rows for s in specs[3:]] == [(0, 64), (64, 128)]
    cfg = StageConfig(str(folder), (1, 3), first=False, last=True, parts=tuple(specs))
    assert StageConfig.from_json(cfg.to_json()) == cfg
    sel = stage_selection(cfg)
    assert sel.experts == {1: (), 2: ()} and sel.vocab_rows == (0, 0)
    with pytest.raises(cellswarm.RequestError, match="9 expert nodes for 8 experts"):
        part_specs(str(folder), 9, 0, list(range(9)))


def test_a_dynamic_low_bit_mix_runs_with_experts_on_nodes_of_their_own(
    tmp_path: Path,
) -> None:
    """The way the big MoEs are run from the files their users download (Kimi K2/K3,
    DeepSeek-V3 "1-bit" dynamic mixes): routed experts IQ1_S / TQ1_0, everything else Q6_K or
    Q8_0. A DeepSeek-V3-shaped model (MLA, 16 routed experts, a shared expert) in that mix over
    2 stages and 2 expert nodes (real processes and sockets) gives one process's tokens."""
    from tests.bits_models import write_model

    path = write_model(tmp_path / "dynamic.gguf", "deepseek2", "DYNAMIC")
    model = cellswarm.load(path, tokenizer=False)
    kinds = {t.fmt.name for n, t in model.weights.items() if "_exps" in n}  # type: ignore[union-attr]
    assert kinds == {"IQ1_S", "TQ1_0"}
    opts = GenerateOptions(8, stop_ids=frozenset())
    expected = [model.generate(p, opts).token_ids for p in PROMPTS]
    with LocalPipeline(str(path), even_split(4, 2), expert_nodes=2) as pipe:
        results = pipe.generate(_requests(PROMPTS, 8))
        parts = pipe.part_stats()
    assert [r.tokens for r in results] == expected
    assert all(set(p["weights_by_kind"]) == {"experts"} and p["requests"] > 0 for p in parts)
