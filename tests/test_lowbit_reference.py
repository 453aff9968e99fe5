"""The low-bit formats through the whole engine against transformers: a qwen3-shaped model
(256-wide rows, so no tensor falls back to another type) whose every matrix is stored in a
low-bit format, one per tensor in turn; transformers runs the same model on gguf-py's
dequantization of those tensors. cellswarm's fused path (int8 activations) must give its
greedy tokens and its logits to within the activations' rounding."""

from __future__ import annotations

import json
from pathlib import Path

import gguf.quants as gq
import numpy as np
import pytest
import torch

import cellswarm
from cellswarm.io import hf_dir
from cellswarm.io.gguf_write import write_gguf
from cellswarm.models import entry_for_hf, module_of
from cellswarm.quant import PackedMatrix, format_by_name
from tests.bits_models import LOWBIT
from tests.conftest import max_rel_diff, prefill_then_decode
from tests.hf_reference import build_hf_model, hf_logits, save_hf
from tests.random_blocks import random_blocks

CONFIG = dict(
    model_type="qwen3", vocab_size=256, hidden_size=256, intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_theta=1000000.0, use_sliding_window=False,
)  # fmt: skip
PREFILL, DECODE = 16, 24


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """(the GGUF file, transformers on its dequantized weights)."""
    folder = tmp_path_factory.mktemp("lowbit-ref")
    hf = build_hf_model(CONFIG)
    save_hf(hf, folder / "hf")
    hf_cfg = json.loads((folder / "hf" / "config.json").read_text())
    module = module_of(entry_for_hf(hf_cfg["model_type"]))
    config = module.CONFIG.from_hf(hf_cfg)
    names = {}  # llama.cpp name -> HF name (qwen3 keeps HF's RoPE layout: no permutation)
    floats = hf_dir.read_safetensors(folder / "hf")
    for hf_name, value in floats.items():
        (gguf_name,) = module.hf_tensors_to_gguf(config, {hf_name: value})
        names[gguf_name] = hf_name
    tensors: dict[str, object] = {}
    state = {}
    rng = np.random.default_rng(55)
    for i, (gguf_name, hf_name) in enumerate(sorted(names.items())):
        value = floats[hf_name]
        if value.ndim == 2:
            fmt = format_by_name(LOWBIT[i % len(LOWBIT)])
            data = random_blocks(fmt, value.shape, rng, lo=0.004, hi=0.02)
            tensors[gguf_name] = PackedMatrix(data, fmt)
            value = gq.dequantize(data, fmt.ggml_type).astype(np.float32)
        else:
            tensors[gguf_name] = value
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(value))
    path = folder / "lowbit.gguf"
    write_gguf(path, config.to_gguf_metadata(), tensors)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return path, hf


def test_greedy_tokens_and_logits_agree_with_transformers(models: tuple[Path, object]) -> None:
    path, hf = models
    prompt = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], PREFILL)
    ids = list(prompt)
    for _ in range(DECODE):  # transformers' greedy continuation
        ids.append(int(np.argmax(hf_logits(hf, np.array(ids))[-1])))
    ref = hf_logits(hf, np.array(ids))
    model = cellswarm.load(path)
    ours = prefill_then_decode(model, np.array(ids), PREFILL)
    assert max_rel_diff(ours, ref) <= 5e-2
    # every greedy choice that is not a near tie is ours too, and the text itself
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * np.abs(ref).max()
    assert clear[PREFILL - 1 :].mean() > 0.5
    agree = ours.argmax(-1) == ref.argmax(-1)
    assert agree[clear].all()
    out = model.generate([int(t) for t in prompt], max_tokens=DECODE)
    n = next((k for k in range(DECODE) if not clear[PREFILL - 1 + k]), DECODE)
    assert out.token_ids[:n] == ids[PREFILL : PREFILL + n]
