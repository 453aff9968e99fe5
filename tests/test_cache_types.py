"""The KV cache's types (issue 55, item 6): f16 by default, q8_0 on request, f32 still.
Written in integer arithmetic by the fused layers (kernels/kv.c) and with numpy by
LayerCache: the same bytes (numpy's astype(np.float16), the Q8_0 codec); read back exactly;
so a cache type gives the same bits decoded alone, batched, replayed as a prefill, and the
same tokens on the numpy path. Budgets count the type's bytes (cache_types.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import cellswarm
from cellswarm import kernels
from cellswarm.cache_types import spec_bytes_per_token, vector_bytes
from cellswarm.engine.model import Model
from cellswarm.errors import RequestError
from cellswarm.io.weights import Selection
from cellswarm.models.kv_cache import decode, encode, sequence_bytes
from tests.bits_models import write_model

needs_kernels = pytest.mark.skipif(not kernels.enabled(), reason="needs the C kernels")
SPECIAL = [0x7F800001, 0x7FC00000, 0xFF800001, 0x7FA00000, 0x7F800000, 0xFF800000, 0x477FEFFF,
           0x477FF000, 0x47800000, 0x33000000, 0x33000001, 0x387FE000, 0x38800000, 0x00000001,
           0x80000000, 0x3F801000, 0x3F803000, 0x3F800FFF]  # fmt: skip


def _floats(n: int, seed: int = 0) -> np.ndarray:
    """Random bit patterns (every exponent: subnormals, overflow, NaNs) and the edges."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    bits[: len(SPECIAL)] = SPECIAL
    return bits.view(np.float32)


@needs_kernels
def test_f16_is_numpy_s_rounding_and_reads_back_exactly() -> None:
    x = _floats(1 << 18).reshape(-1, 64)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    assert np.array_equal(kernels.kv_encode(x, 1).view(np.uint16), expected.view(np.uint16))
    assert np.array_equal(encode(x, "f16").view(np.uint16), expected.view(np.uint16))
    codes = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(-1, 64)
    read = kernels.kv_decode(codes.view(np.uint8), 1)
    assert np.array_equal(read.view(np.uint32), codes.view(np.float16).astype(np.float32).view(
        np.uint32))  # fmt: skip


@needs_kernels
def test_q8_0_is_the_codec_and_gguf_py_s() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4000, 64)) * rng.choice([1e-7, 1e-3, 1.0, 1e4], (4000, 1)))
    x = x.astype(np.float32)
    x[0], x[1, :7] = 0.0, 0.5  # an empty block; ties
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(kernels.kv_encode(x, 8), theirs)
    assert np.array_equal(encode(x, "q8_0"), theirs)
    assert np.array_equal(kernels.kv_decode(theirs, 8).view(np.uint32),
                          decode(theirs, "q8_0").view(np.uint32))  # fmt: skip


def test_bytes_per_token_from_the_type() -> None:
    spec = {"kt": (3, 64), "v": (3, 64)}
    f32 = spec_bytes_per_token(spec, "f32")
    assert f32 == 2 * 3 * 64 * 4
    assert spec_bytes_per_token(spec, "f16") * 2 == f32
    assert spec_bytes_per_token(spec, "q8_0") == 2 * 3 * 2 * 34
    for t in ("f32", "f16", "q8_0"):  # what a cache allocates, the keys' padding on top
        assert sequence_bytes({0: spec}, 100, t) >= 100 * spec_bytes_per_token(spec, t)
    with pytest.raises(RequestError, match=r"blocks of 32.*vectors of 40"):
        vector_bytes(40, "q8_0")


def test_the_demo_model_s_kv_bytes_halve_and_up_fits_longer(demo_path: Path) -> None:
    """On `cellswarm up`'s 3 workers of 256M the longest context on one sequence goes from
    5,380 tokens (f32) to 6,612 (f16) and 7,289 (q8_0), --context 4096 fits 3 sequences,
    and `up`'s default fit (one worker spare) goes from 2 sequences of 2,391 to 2 of 3,664.
    (Before a stage's prefill scratch counted its queries 128 at a time, as attention runs
    them, it held ~150 MB at 4096 and capped f16 at 3,695; before a first step's rows were
    counted, 3 copies of a whole prompt's, f16 reached 9,200 and a stage sent such a prompt
    over its budget.)"""
    from cellswarm.planner.placement import ContextFit, fit_context, largest_context
    from cellswarm.swarm.ring.costs import costs_at

    model = cellswarm.load(demo_path, tokenizer=False)
    assert model.cache_type == "f16"
    assert model.kv_bytes_per_token() * 2 == model.kv_bytes_per_token("f32")
    at = {t: costs_at(str(demo_path), cache_type=t) for t in ("f32", "f16", "q8_0")}
    longest = {t: largest_context(a, 1, 3, 256 << 20, 100_000) for t, a in at.items()}
    assert longest == {"f32": 5380, "f16": 6612, "q8_0": 7289}
    assert fit_context(at["f16"], 2, 256 << 20, 8192, 8) == ContextFit(3664, 2)
    assert fit_context(at["f32"], 2, 256 << 20, 8192, 8) == ContextFit(2391, 2)
    assert fit_context(at["f16"], 3, 256 << 20, 4096, 8) == ContextFit(4096, 3)
    shard = cellswarm.load(demo_path, tokenizer=False, selection=Selection(layers=(0, 10)))
    assert 10 * at["f16"](4096, 1).kv == shard.kv_sequence_bytes(4096)  # the worker's bytes


def test_plan_counts_and_names_the_cache_type(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --cache-type`: the KV bytes the engine would allocate, and their type named
    (the table said "float32" while it counted f16)."""
    from cellswarm.cli import main

    per_token = {}
    for t in ("f32", "f16", "q8_0"):
        assert main(["plan", "smollm2-135m", "--cache-type", t]) == 0
        out = capsys.readouterr().out.splitlines()
        row = next(line for line in out if "KV cache per token" in line)
        assert f"({t}, all layers)" in row, row
        per_token[t] = int(row.split("│")[2].split()[0].replace(",", ""))
    assert per_token["f32"] == 2 * per_token["f16"] and per_token["q8_0"] < per_token["f16"]


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--cache-type", "f8"], ["up", "--cache-type", "fp16"],
    ["coordinator", "--cache-type", "q4_0"], ["worker", "--join", "http://x", "--memory", "1G",
                                             "--cache-type", "int8"],
    ["eval", "m.gguf", "--cache-type", "f16,bf16"], ["plan", "kimi-k3", "--cache-type", "fp8"],
])  # fmt: skip
def test_a_bad_cache_type_is_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from cellswarm.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    bad = argv[-1].split(",")[-1]
    assert "\n" not in err and repr(bad) in err and "f16, q8_0, f32" in err, err


def test_a_worker_refuses_a_shard_of_another_cache_type() -> None:
    from cellswarm.errors import BudgetError
    from cellswarm.swarm.node.worker import cache_type_for

    assert cache_type_for(None, "q8_0") == "q8_0" == cache_type_for("q8_0", "q8_0")
    with pytest.raises(BudgetError, match=r"serves a f32 KV cache .* runs f16"):
        cache_type_for("f32", "f16")


# -- one type, the same bits on every path --------------------------------------------------

PROMPT, STEPS = 21, 6


@pytest.fixture(scope="module", params=["llama", "deepseek2"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = write_model(tmp_path_factory.mktemp("kv") / "m.gguf", request.param, "Q4_K_M")
    return cellswarm.load(str(path), tokenizer=False)


def _alone(m: Model, prompt: np.ndarray) -> tuple[list[np.ndarray], list[int], object]:
    cache = m.new_cache(PROMPT + STEPS + 1)
    steps = [m.step(prompt, cache)[-1:]]
    tokens: list[int] = []
    for _ in range(STEPS):
        tokens.append(int(np.argmax(steps[-1][-1])))
        steps.append(m.step(np.array(tokens[-1:]), cache))
    return steps, tokens, cache


@needs_kernels
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_decoded_batched_and_replayed_are_the_same_bits(tiny: Model, cache_type: str) -> None:
    """A sequence decoded alone (the fused C layers write and read its cache), among two
    others at other positions (the batched layers), and replayed as one prefill (LayerCache's
    numpy writes): the same logits, and the same cache bytes."""
    tiny.set_cache_type(cache_type)
    vocab = tiny.config.vocab_size
    prompt = np.arange(PROMPT) * 7 % (vocab - 3) + 3
    steps, tokens, cache = _alone(tiny, prompt)
    caches = [tiny.new_cache(PROMPT + STEPS + 1 + 8 * i) for i in range(3)]
    last = [tiny.step(prompt[: PROMPT - 5 * i], c)[-1] for i, c in enumerate(caches)]
    for step in range(STEPS):
        ids = [tokens[step]] + [int(np.argmax(x)) for x in last[1:]]
        last = list(tiny.step_many(ids, caches))
        assert last[0].tobytes() == steps[step + 1][0].tobytes(), step
    replay_cache = tiny.new_cache(PROMPT + STEPS + 1)
    rows = tiny.step(np.concatenate([prompt, tokens]), replay_cache)
    for i in range(1, STEPS + 1):
        assert rows[PROMPT + i - 1].tobytes() == steps[i][0].tobytes(), i
    n = PROMPT + STEPS
    for layer in cache.layers:  # type: ignore[attr-defined]
        a, b = cache.layer(layer).take(0, n), replay_cache.layer(layer).take(0, n)  # type: ignore[attr-defined]
        assert all(np.array_equal(a[k], b[k]) for k in a), layer


@needs_kernels
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_the_numpy_path_gives_the_c_path_s_tokens(demo_path: Path, cache_type: str) -> None:
    model = cellswarm.load(demo_path, cache_type=cache_type)
    text = {}
    for backend in ("numpy", "c"):
        with kernels.using(backend):
            text[backend] = model.generate("The capital of France is", max_tokens=8).token_ids
    assert text["numpy"] == text["c"]
