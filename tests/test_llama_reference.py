"""llama / qwen2 / qwen3 logits against transformers on tiny random models, from a Hugging Face
folder and from the same weights written to GGUF under llama.cpp's names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import cellswarm
from cellswarm.io import hf_dir
from cellswarm.io.gguf_write import write_gguf
from cellswarm.models import entry_for_hf, module_of
from tests.conftest import max_rel_diff, prefill_then_decode
from tests.hf_reference import LLAMA_FAMILY, build_hf_model, hf_logits, save_hf

TOLERANCE = 1e-4  # of the largest absolute logit, f32 weights on both sides
PREFILL, DECODE = 32, 8


@pytest.fixture(scope="module", params=sorted(LLAMA_FAMILY))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = build_hf_model(LLAMA_FAMILY[request.param])
    folder = save_hf(hf, tmp_path_factory.mktemp(request.param))
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, PREFILL + DECODE)
    return folder, ids, hf_logits(hf, ids)


def _to_gguf(folder: Path, out: Path) -> Path:
    hf_cfg = json.loads((folder / "config.json").read_text())
    module = module_of(entry_for_hf(hf_cfg["model_type"]))
    config = module.CONFIG.from_hf(hf_cfg)
    tensors = module.hf_tensors_to_gguf(config, hf_dir.read_safetensors(folder))
    tensors |= module.hf_extra_tensors(config, hf_cfg)
    write_gguf(out, config.to_gguf_metadata(), tensors)
    return out


def test_hf_folder_matches_transformers(reference) -> None:
    folder, ids, ref = reference
    model = cellswarm.load(folder, cache_type="f32")  # the math; an f16 cache adds ~1e-3
    ours = prefill_then_decode(model, ids, PREFILL)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert max_rel_diff(ours, ref) <= TOLERANCE


def test_gguf_copy_matches_transformers(reference, tmp_path: Path) -> None:
    folder, ids, ref = reference
    model = cellswarm.load(_to_gguf(folder, tmp_path / "model.gguf"), cache_type="f32")
    assert max_rel_diff(prefill_then_decode(model, ids, PREFILL), ref) <= TOLERANCE
    assert max_rel_diff(model.logits(ids), ref) <= TOLERANCE
