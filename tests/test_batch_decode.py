"""Batched decode (issue 33): one token of each of n sequences per pass over the weights
(`Model.step_many` -> the families' `decode_fused_many`), each sequence's logits the bits it
gets decoded alone — whatever its neighbours, their positions and cache sizes, and however
many share the step (beyond the kernels' 16 the step goes in groups of 16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cellswarm
from cellswarm import kernels
from cellswarm.engine.model import Model
from tests.bits_models import write_model

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="needs the C kernels")

CASES = [("llama", "Q4_K_M"), ("qwen2", "Q8_0"), ("qwen3", "Q4_0"), ("deepseek2", "Q4_K_M")]
STEPS = 6


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    family, quant = request.param
    path = write_model(tmp_path_factory.mktemp("batch") / f"{family}.gguf", family, quant)
    return cellswarm.load(str(path), tokenizer=False)


def _prompts(model: Model, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, model.config.vocab_size, int(rng.integers(1, 30))) for _ in range(n)]


def _alone(model: Model, prompt: np.ndarray, capacity: int) -> list[bytes]:
    """Greedy steps of one sequence by itself: each step's logits, as bytes."""
    cache = model.new_cache(capacity)
    logits = model.step(prompt, cache, last_only=True)[-1]
    out = []
    for _ in range(STEPS):
        logits = model.step(np.array([int(np.argmax(logits))]), cache, last_only=True)[-1]
        out.append(logits.tobytes())
    return out


def _together(model: Model, prompts: list[np.ndarray], capacities: list[int]) -> list[list[bytes]]:
    caches = [model.new_cache(c) for c in capacities]
    last = [model.step(p, c, last_only=True)[-1] for p, c in zip(prompts, caches, strict=True)]
    out: list[list[bytes]] = [[] for _ in prompts]
    for _ in range(STEPS):
        last = list(model.step_many([int(np.argmax(x)) for x in last], caches))
        for i, x in enumerate(last):
            out[i].append(x.tobytes())
    return out


@pytest.mark.parametrize("n", [2, 5, 16, 19])
def test_a_sequence_decoded_among_others_gets_its_own_bits(model: Model, n: int) -> None:
    """Neighbours at other positions with caches of other sizes: every sequence's logits at
    every step equal to the bit those it gets alone (19: a group of 16, then one of 3)."""
    prompts = _prompts(model, n)
    capacities = [len(p) + STEPS + 1 + 7 * (i % 3) for i, p in enumerate(prompts)]
    together = _together(model, prompts, capacities)
    for i in range(n):
        assert together[i] == _alone(model, prompts[i], capacities[i]), f"sequence {i} of {n}"


def test_a_batch_is_refused_past_a_cache_end(model: Model) -> None:
    """A sequence whose cache is full fails the step with the budget's one-line error, as a
    decode step alone does; the others' caches are not advanced."""
    caches = [model.new_cache(4), model.new_cache(2)]
    for c in caches:
        model.step(np.array([3, 4]), c)
    with pytest.raises(cellswarm.errors.BudgetError, match="KV cache holds 2 tokens"):
        model.step_many([5, 6], caches)
    assert [c.length for c in caches] == [2, 2]


def test_the_demo_model_batched_is_its_one_process_text(demo_path: Path) -> None:
    """The shipped model (llama family, Q4_1, a tied Q8_0 head in 16-row groups): 8 prompts
    decoded together give the tokens each gives alone."""
    model = cellswarm.load(str(demo_path))
    prompts = [np.asarray(model.tokenizer.encode(t)) for t in (
        "The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3,",
        "Water boils at", "The quick brown fox", "import numpy as np", "Dear Sir,")]  # fmt: skip
    together = _together(model, prompts, [len(p) + STEPS + 1 for p in prompts])
    for p, got in zip(prompts, together, strict=True):
        assert got == _alone(model, p, len(p) + STEPS + 1)
