"""Tiny random Hugging Face models (transformers, torch CPU, float32) to check numerics against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

LLAMA_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama-tied": dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        use_sliding_window=False,
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        use_sliding_window=False,
    ),
}


def build_hf_model(config_kwargs: dict[str, Any], seed: int = 0) -> Any:
    """A float32 causal LM with every weight random (norms around 1, so they matter)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(config_kwargs)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def hf_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.as_tensor(ids[None, :], dtype=torch.long)).logits[0]
    return out.float().numpy()


def save_hf(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder
