"""bench/peers.py's pure helpers: llama-bench/llama-perplexity output, the table, which format
a tensor is written in, and the bench's round-to-nearest K-quant packers (read back with
cellswarm's own codecs). The bench itself (a llama.cpp build, GBs of models) is not run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import peers
from cellswarm.quant import format_by_name

LLAMA_BENCH_JSON = json.dumps([
    {"build_commit": "0c1e570", "n_threads": 2, "n_prompt": 512, "n_gen": 0, "avg_ts": 101.5,
     "stddev_ts": 1.0},
    {"build_commit": "0c1e570", "n_threads": 2, "n_prompt": 0, "n_gen": 128, "avg_ts": 20.25,
     "stddev_ts": 0.1},
])  # fmt: skip


def test_parse_llama_bench() -> None:
    assert peers.parse_llama_bench(LLAMA_BENCH_JSON) == {"prefill": 101.5, "decode": 20.25}
    assert peers.parse_llama_bench("[]") == {}


def test_parse_perplexity() -> None:
    log = "[1]12.3,[2]14.1,\nFinal estimate: PPL = 13.4567 +/- 0.51234\n"
    assert peers.parse_perplexity(log) == pytest.approx(13.4567)
    assert peers.parse_perplexity("main: error: failed to load model") is None


def test_agreeing_tokens() -> None:
    pieces = [" the", " the cat", " the cat sat"]
    assert peers.agreeing_tokens(pieces, " the cat sat on") == 3
    assert peers.agreeing_tokens(pieces, " the cow") == 1
    assert peers.agreeing_tokens(pieces, "") == 0


def test_format_table() -> None:
    rows = [
        {"file": "llama-0.3B Q4_0 (pure)", "threads": 1, "llama_decode": 20.0,
         "cells_decode": 15.0, "llama_prefill": 1500.0, "cells_prefill": 300.0},
        {"file": "deepseek-moe-0.8B Q8_0 (llama-quantize)", "threads": 2, "llama_decode": None,
         "cells_decode": 9.5, "llama_prefill": 80.0, "cells_prefill": None},
    ]  # fmt: skip
    lines = peers.format_table(rows).splitlines()
    assert lines[0].split()[:2] == ["file", "threads"]
    assert set(lines[1]) == {"-"} and len(lines) == 4
    assert lines[2].split() == ["llama-0.3B", "Q4_0", "(pure)", "1", "20.0", "15.0", "0.75",
                                "1500", "300.0", "0.20"]  # fmt: skip
    assert lines[3].split() == ["deepseek-moe-0.8B", "Q8_0", "(llama-quantize)", "2", "-", "9.5",
                                "-", "80.0", "-", "-"]  # fmt: skip
    assert len({len(line) for line in lines}) == 1  # aligned


def test_the_baseline_columns_say_what_a_change_cost() -> None:
    """--baseline: the other checkout's tokens/s and now / before, per row."""
    row = {"file": "m Q4_K_M (llama-quantize)", "threads": 1, "llama_decode": 20.0,
           "cells_decode": 18.0, "llama_prefill": 100.0, "cells_prefill": 90.0,
           "before_decode": 24.0, "before_prefill": 90.0}  # fmt: skip
    lines = peers.format_table([row]).splitlines()
    assert lines[0].endswith("before prefill  now/before")
    assert lines[2].split()[-4:] == ["24.0", "0.75", "90.0", "1.00"]


def test_peer_files_name_their_maker() -> None:
    models = peers.peer_models()
    files = peers.peer_files(models, ["download", "llama-quantize"], quick=False)
    assert files[0].label == "demo-135M Q4_1 (download)"
    assert "deepseek-moe-0.8B Q4_K_M (llama-quantize)" in [f.label for f in files]
    assert all(f.maker != "pure" for f in files)
    quick = peers.peer_files(models, ["pure"], quick=True)
    assert [f.label for f in quick] == [f"{m.name} {m.quants[0].upper()} (pure)" for m in models]


def test_rounds_give_medians_and_the_side_by_side_ratios() -> None:
    """--rounds: each engine's median, and the median of ratios of runs made together (not
    the ratio of medians), their range printed; a failed run leaves its round out."""
    rounds = [
        ({"decode": 100.0, "prefill": 400.0}, {"decode": 90.0, "prefill": 300.0}),
        ({"decode": 80.0, "prefill": 420.0}, {"decode": 88.0}),
        ({"decode": 120.0, "prefill": 380.0}, {"decode": 126.0, "prefill": 342.0}),
    ]
    row = peers.combine_rounds(rounds)
    assert row["llama_decode"] == 100.0 and row["cells_decode"] == 90.0
    assert row["decode_ratios"] == pytest.approx([0.9, 1.1, 1.05])
    assert row["llama_prefill"] == 400.0 and row["cells_prefill"] == 321.0
    assert row["prefill_ratios"] == pytest.approx([0.75, 0.9])
    table = peers.format_table([{"file": "m Q4_0 (pure)", "threads": 2, **row}])
    line = table.splitlines()[2]
    assert "1.05 [0.90-1.10]" in line and "0.82 [0.75-0.90]" in line
    assert peers.combine_rounds([({}, {})])["cells_decode"] is None


def test_storage_type_follows_llama_quantize() -> None:
    assert peers.storage_type("blk.0.attn_norm.weight", (1024,), "q4_k") == "f32"
    assert peers.storage_type("blk.1.ffn_gate_inp.weight", (64, 1024), "q8_0") == "f32"
    assert peers.storage_type("blk.0.attn_q.weight", (1024, 1024), "q4_k") == "q4_k"
    assert peers.storage_type("blk.0.attn_k_b.weight", (16, 256, 64), "q4_k") == "q5_0"
    assert peers.storage_type("blk.0.attn_k_b.weight", (16, 256, 64), "q6_k") == "q8_0"
    assert peers.storage_type("blk.0.attn_k_b.weight", (16, 256, 64), "q4_0") == "q4_0"
    assert peers.storage_type("x.weight", (8, 48), "q8_0") == "f16"


@pytest.mark.parametrize(("name", "tolerance"), [("q4_k", 0.1), ("q6_k", 0.03)])
def test_k_quant_packers_round_trip(name: str, tolerance: float) -> None:
    """Packed by the bench, read by cellswarm's codec: the layout is right exactly when the
    error is what 4 or 6 bits give (a misplaced scale or nibble gives errors of order 1)."""
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32) * 0.02
    x[3] = 0  # an all-zero block packs to zeros, not NaN
    x[5, :32] += 0.05  # a sub-block with no negative values
    blocks = peers.K_PACKERS[name](x)
    fmt = format_by_name(name)
    assert blocks.shape == (64, fmt.type_size)
    y = fmt.dequantize_blocks(blocks)
    assert np.isfinite(y).all() and not y[3].any()
    assert np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2)) < tolerance
    packed = peers.pack(x.reshape(8, 2048), name)  # whole rows, through PackedMatrix
    np.testing.assert_array_equal(packed.dequantize(), y.reshape(8, 2048))
