"""Generation: sampling, stop conditions, streaming, the KV budget, chunked prefill, memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cellswarm
from cellswarm.engine import model as model_module
from cellswarm.engine.model import GenerateOptions, Model
from cellswarm.engine.sampling import SamplingParams, filter_probs, sample
from cellswarm.errors import BudgetError, RequestError
from cellswarm.io.weights import Selection
from tests.hf_reference import LLAMA_FAMILY, build_hf_model, save_hf


@pytest.fixture(scope="module")
def demo(demo_path: Path) -> Model:
    return cellswarm.load(demo_path)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(build_hf_model(LLAMA_FAMILY["qwen3"]), tmp_path_factory.mktemp("qwen3"))


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(temperature=1, top_k=2), {0, 1}),
        (SamplingParams(temperature=1, top_p=0.5), {0}),
        (SamplingParams(temperature=1, top_p=0.75), {0, 1}),
        (SamplingParams(temperature=1, min_p=0.3), {0, 1, 2}),  # 0.15 >= 0.3 x 0.5
        (SamplingParams(temperature=1, min_p=0.31), {0, 1}),
        (SamplingParams(temperature=1), {0, 1, 2, 3}),
    ],
)
def test_filters_keep_the_expected_tokens(params: SamplingParams, kept: set[int]) -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    assert set(np.flatnonzero(filter_probs(probs, params))) == kept


def test_repetition_penalty_and_greedy_ties() -> None:
    logits = np.array([2.0, 2.0, 1.9], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingParams(), rng, []) == 0  # first index on ties
    assert sample(logits, SamplingParams(repetition_penalty=1.2), rng, [0, 1]) == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1}, {"top_p": 0}, {"min_p": 1}, {"top_k": -1}, {"repetition_penalty": 0}],
)
def test_bad_sampling_values_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(RequestError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_seeded_sampling_repeats_and_seeds_differ(demo: Model) -> None:
    def run(seed: int) -> list[int]:
        s = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        return demo.generate("Once upon a time", GenerateOptions(10, s)).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_stop_string_truncates_and_streams_the_same_text(demo: Model) -> None:
    pieces: list[str] = []
    opts = GenerateOptions(max_tokens=40, stop=(" and",))
    gen = demo.generate("List three colours: red, green", opts, on_text=pieces.append)
    full = demo.generate("List three colours: red, green", GenerateOptions(max_tokens=40))
    assert "".join(pieces) == gen.text
    if " and" in full.text:
        assert gen.stats.stop_reason == "stop_string"
        assert gen.text == full.text[: full.text.index(" and")]
    assert " and" not in gen.text


def test_max_tokens_and_stop_ids(demo: Model) -> None:
    gen = demo.generate("Count: 1, 2, 3,", GenerateOptions(max_tokens=3))
    assert len(gen.token_ids) == 3 and gen.stats.stop_reason == "max_tokens"
    stop_at = gen.token_ids[1]
    gen2 = demo.generate("Count: 1, 2, 3,", GenerateOptions(3, stop_ids=frozenset({stop_at})))
    assert gen2.token_ids == gen.token_ids[:1] and gen2.stats.stop_reason == "stop_token"


def test_keywords_and_streaming_as_llama_cpp_python_users_expect(demo: Model) -> None:
    prompt = "List three colours: red, green"
    opts = GenerateOptions(12, SamplingParams(temperature=0.7, seed=1), stop=(",",))
    by_options = demo.generate(prompt, opts)
    by_keywords = demo.generate(prompt, max_tokens=12, temperature=0.7, seed=1, stop=",")
    assert (by_keywords.text, by_keywords.token_ids) == (by_options.text, by_options.token_ids)
    stream = demo.stream(prompt, max_tokens=12, temperature=0.7, seed=1, stop=[","])
    with pytest.raises(RequestError, match="has not ended"):
        stream.result  # noqa: B018
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == by_options.text
    assert stream.result.token_ids == by_options.token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"temprature": 0.5}, "unknown generation setting 'temprature'"),
     ({"options": GenerateOptions(4), "max_tokens": 4}, "not both"),
     ({"max_tokens": 0}, "max_tokens 0 must be at least 1"),
     ({"top_p": 0.0}, "top_p 0.0 must be in")],
)  # fmt: skip
def test_bad_keywords_are_refused(demo: Model, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        demo.generate("hello", **kwargs)  # type: ignore[arg-type]


def test_kv_budget_refuses_a_sequence_before_it_starts(demo_path: Path) -> None:
    model = cellswarm.load(demo_path, kv_budget_bytes=1 << 20)
    per_token = model.kv_bytes_per_token()
    assert per_token == 30 * 2 * 3 * 64 * 2  # layers x (K, V) x kv heads x head dim x f16
    assert model.kv_bytes_per_token("f32") == 2 * per_token
    with pytest.raises(BudgetError, match=r"needs .* bytes of KV cache .* short"):
        model.generate("hello", GenerateOptions(max_tokens=100))


def test_chunked_prefill_equals_one_chunk(tiny_folder: Path, monkeypatch: pytest.MonkeyPatch):
    model = cellswarm.load(tiny_folder)
    ids = np.arange(23) % model.config.vocab_size
    whole = model.logits(ids)
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 5)
    np.testing.assert_allclose(model.logits(ids), whole, rtol=1e-5, atol=1e-5)


def test_bad_token_ids_are_refused(tiny_folder: Path) -> None:
    model = cellswarm.load(tiny_folder)
    with pytest.raises(RequestError, match="token id 999 is outside the vocabulary"):
        model.logits([1, 999])


def test_memory_report_equals_bytes_held(demo_path: Path) -> None:
    model = cellswarm.load(demo_path)
    report = model.memory(batch=1, context=512)
    held = sum(int(t.nbytes) for t in model.weights.values())
    assert report.weight_bytes == held
    assert set(report.weights_by_kind) == {"embedding", "attention", "ffn", "norm"}
    cache = model.new_cache(16)
    assert cache.nbytes == 16 * report.kv_bytes_per_token
    assert report.kv_bytes == 512 * report.kv_bytes_per_token


def test_a_shard_holds_only_its_layers_and_vocab_rows(demo_path: Path) -> None:
    full = cellswarm.load(demo_path)
    shard = cellswarm.load(
        demo_path, selection=Selection(layers=(4, 8), vocab_rows=(0, 1000), embed=False)
    )
    layers = {int(n.split(".")[1]) for n in shard.weights if n.startswith("blk.")}
    assert layers == {4, 5, 6, 7}
    assert shard.weights.matrix("token_embd.weight").shape == (1000, 576)
    assert shard.memory().weight_bytes < full.memory().weight_bytes / 6
    assert shard.kv_bytes_per_token() == full.kv_bytes_per_token() * 4 // 30
    # Views into the file mapping: nothing was copied at load.
    data = shard.weights.matrix("blk.4.ffn_up.weight").data
    assert _maps_the_file(data)


def _maps_the_file(a: np.ndarray) -> bool:
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = base.base  # type: ignore[assignment]
    return isinstance(base, np.memmap)


def test_sharded_layers_equal_the_single_process_run(demo_path: Path) -> None:
    full = cellswarm.load(demo_path)
    ids = np.asarray(full.tokenizer.encode("A sharded run must equal one process."))
    stages = [cellswarm.load(demo_path, selection=Selection(layers=r)) for r in [(0, 11), (11, 30)]]
    caches = [s.new_cache(len(ids)) for s in stages]
    h = stages[0].arch.embed(ids)
    for stage, cache in zip(stages, caches, strict=True):
        h = stage.forward(h, cache)
    assert np.array_equal(stages[1].arch.head(h), full.logits(ids))
