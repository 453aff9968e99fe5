"""Round trips through GGUF files: packed tensors written with GGUFWriter read back unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cellswarm
from cellswarm.io.gguf_file import GGUFFile
from cellswarm.io.gguf_write import write_gguf
from cellswarm.io.weights import Selection
from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name


@pytest.mark.parametrize("quant", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"])
def test_packed_tensors_round_trip(tmp_path: Path, quant: str) -> None:
    rng = np.random.default_rng(0)
    fmt = format_by_name(quant)
    matrix = PackedMatrix.from_float(rng.standard_normal((8, 64), np.float32), fmt)
    experts = PackedExperts.from_float(rng.standard_normal((4, 8, 64), np.float32), fmt)
    path = tmp_path / "t.gguf"
    meta = {"general.architecture": "llama"}
    write_gguf(path, meta, {"m.weight": matrix, "blk.0.ffn_up_exps.weight": experts})
    f = GGUFFile(path)
    back = f.tensor("m.weight")
    assert isinstance(back, PackedMatrix) and back.fmt == fmt
    assert np.array_equal(back.data, matrix.data)
    sel = f.weights(Selection(experts={0: (1, 3)}))["blk.0.ffn_up_exps.weight"]
    assert isinstance(sel, PackedExperts) and sel.held == (1, 3)
    assert np.array_equal(sel.expert(3).dequantize(), experts.expert(3).dequantize())


@pytest.mark.slow
def test_requantized_demo_model_written_to_gguf_loads_identically(
    demo_path: Path, tmp_path: Path
) -> None:
    q8 = cellswarm.load(demo_path, quant="q8_0")
    out = tmp_path / "demo-q8_0.gguf"
    meta = dict(GGUFFile(demo_path).metadata)
    write_gguf(out, meta, dict(q8.weights.items()))
    again = cellswarm.load(out)
    ids = q8.tokenizer.encode("Round trips keep every byte.")
    assert np.array_equal(again.logits(ids), q8.logits(ids))
