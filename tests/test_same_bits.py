"""The same bits on any layout: replicas cross-check each other and recovery promises the same
text, so where the experts or the vocabulary rows sit must not change the arithmetic.

The models are near-tied on purpose (tests/same_bits_models.py): one ulp of difference in a
hidden state flips their greedy tokens, so "the tokens match" here means "the bits match".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cellswarm
from cellswarm.engine.model import GenerateOptions, Model
from cellswarm.io.weights import Selection
from cellswarm.models.deepseek2 import InProcessExperts
from cellswarm.planner.placement import even_split
from cellswarm.swarm.local.pipeline import LocalPipeline
from cellswarm.swarm.ring.parts import ExpertParts
from cellswarm.swarm.ring.stage import stage_selection
from tests.conftest import prefill_then_decode
from tests.same_bits_models import MOE, write_dense, write_moe

PROMPTS = [[1, 5, 9, 14, 3], [7, 7, 2], [100, 3, 64, 8, 8, 1, 90]]
MOE_LAYERS = [i for i in range(MOE.n_layers) if MOE.is_moe(i)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_moe(tmp_path_factory.mktemp("bits") / "moe.gguf")


def _holding(path: Path, experts: tuple[int, ...], **kw: object) -> Model:
    sel = Selection(experts={i: experts for i in MOE_LAYERS}, **kw)  # type: ignore[arg-type]
    return cellswarm.load(path, selection=sel, tokenizer=False)


def _node(path: Path, experts: tuple[int, ...]) -> Model:
    return _holding(path, experts, kinds=frozenset({"experts"}), embed=False, head=False)


@pytest.mark.parametrize("model", ["moe", "dense-q8_0", "dense-q4_0"])
def test_a_prompt_gives_the_same_bits_whatever_ran_before_it(
    model: str, moe: Path, tmp_path: Path
) -> None:
    """A repacked weight's prefill goes through the int8 kernels, a weight in the file's
    layout through BLAS beyond 16 tokens; the layers are laid out before their first step of
    any kind (Architecture.prepare), so a long prompt's logits do not depend on whether the
    process decoded before it. (They did: the fused layers repacked at the first decode.)"""
    path = moe if model == "moe" else write_dense(tmp_path / "m.gguf", model.split("-")[1])
    prompt = np.arange(3, 43)  # beyond the int8 kernels' 16 rows
    m = cellswarm.load(path, tokenizer=False)
    first = m.step(prompt, m.new_cache(64))
    cache = m.new_cache(64)
    m.step(prompt[:3], cache)
    m.step(prompt[3:4], cache)  # a decode step
    again = m.step(prompt, m.new_cache(64))
    assert np.array_equal(first.view(np.uint32), again.view(np.uint32))


def test_the_model_is_near_tied(moe: Path) -> None:
    """Guard for the tests below: the top two logits are within a few ulps."""
    logits = cellswarm.load(moe, tokenizer=False).logits(PROMPTS[2])
    top2 = np.sort(logits, axis=-1)[:, -2:]
    ulp = np.spacing(np.abs(top2[:, 1]))
    assert np.median((top2[:, 1] - top2[:, 0]) / ulp) <= 16


@pytest.mark.parametrize(
    "split",
    [
        [(), tuple(range(0, 64, 2)), tuple(range(1, 64, 2))],  # round-robin over two nodes
        [tuple(range(0, 64, 3)), tuple(range(1, 64, 3)), tuple(range(2, 64, 3))],  # one here
        [tuple(range(32)), tuple(range(32, 40)), tuple(range(40, 64))],  # contiguous, uneven
    ],
    ids=["two-nodes", "local-and-two-nodes", "uneven-ranges"],
)
def test_experts_anywhere_give_one_process_logits(
    moe: Path, split: list[tuple[int, ...]]
) -> None:
    """The model seam with the in-process fake, prefill then decode through the cache: the
    expert outputs are summed in one process's order wherever they were computed."""
    full = cellswarm.load(moe, tokenizer=False)
    local = _holding(moe, split[0])
    local.arch.remote_experts = InProcessExperts([_node(moe, s).weights for s in split[1:]])  # type: ignore[attr-defined]
    ids = np.asarray(PROMPTS[2] + PROMPTS[0] + PROMPTS[1])
    ref = prefill_then_decode(full, ids, 7)
    assert np.array_equal(prefill_then_decode(local, ids, 7), ref)


def test_remote_experts_over_real_sockets_give_one_process_logits(moe: Path) -> None:
    """A stage's shard (no routed experts of its own) calling two real expert processes."""
    full = cellswarm.load(moe, tokenizer=False)
    with LocalPipeline(str(moe), [(0, MOE.n_layers)], expert_nodes=2) as pipe:
        cfg = pipe.configs[0]
        shard = cellswarm.load(moe, selection=stage_selection(cfg), tokenizer=False)
        assert shard.memory().weights_by_kind.get("experts", 0) == 0  # all on the nodes
        remote = ExpertParts(cfg.parts, None, "client")
        shard.arch.remote_experts = remote  # type: ignore[attr-defined]
        ids = np.asarray(PROMPTS[2] * 2 + PROMPTS[1])
        ours = prefill_then_decode(shard, ids, 9)
        remote.close()
    assert np.array_equal(ours, prefill_then_decode(full, ids, 9))


def test_two_stages_and_two_expert_nodes_give_one_process_tokens(moe: Path) -> None:
    full = cellswarm.load(moe, tokenizer=False)
    opts = GenerateOptions(24, stop_ids=frozenset())
    expected = [full.generate(p, opts).token_ids for p in PROMPTS]
    requests = [{"prompt": p, "max_tokens": 24} for p in PROMPTS]
    with LocalPipeline(str(moe), even_split(MOE.n_layers, 2), expert_nodes=2) as pipe:
        results = pipe.generate(requests)
    assert [r.tokens for r in results] == expected


# -- the output head split by rows over vocab nodes ------------------------------------------


def _haswell_kernels() -> str | None:
    """Why OpenBLAS's Haswell kernels cannot be tried here, or None (the failing machine
    was an AMD EPYC that OpenBLAS ran with them)."""
    from threadpoolctl import threadpool_info

    if not any(i.get("internal_api") == "openblas" for i in threadpool_info()):
        return "numpy's BLAS is not OpenBLAS"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not all(f" {f}" in flags for f in ("avx2", "fma")):
        return "this CPU cannot run OpenBLAS's Haswell kernels"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("coretype", [None, "Haswell"], ids=["this-cpu", "openblas-haswell"])
def test_vocabulary_split_anywhere_gives_one_process_logits(
    demo_path: Path, coretype: str | None
) -> None:
    """The demo head split at even and uneven rows, its parts with one BLAS thread: the same
    bits as one process's head for decode, small batches and prefills — also under the
    Haswell kernels OpenBLAS picks on some AMD EPYCs (another process: the kernels are
    chosen when OpenBLAS loads)."""
    import json
    import os
    import subprocess
    import sys

    from tests.same_bits_models import head_mismatches

    if coretype is None:
        assert head_mismatches(str(demo_path)) == []
        return
    why = _haswell_kernels()
    if why:
        pytest.skip(why)
    env = dict(os.environ, OPENBLAS_CORETYPE=coretype)
    run = subprocess.run(
        [sys.executable, "-m", "tests.same_bits_models", str(demo_path)], env=env,
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == []
