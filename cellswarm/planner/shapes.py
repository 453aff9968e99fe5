"""Tensor shapes (llama.cpp names, numpy order) from a Hugging Face config, without weights.

Architectures the engine runs take their shapes from the engine's own config classes
(`expected_tensors`), so the planner and the loader cannot disagree; mixtral and qwen3_moe,
which the planner sizes but the engine does not run, get a llama-with-experts layout here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cellswarm.errors import UnsupportedArchitectureError

Shape = tuple[int, ...]
LLAMA_MOE_TYPES = ("mixtral", "qwen3_moe")


def tensor_shapes(cfg: Mapping[str, Any]) -> tuple[str, Any, dict[str, Shape]]:
    """-> (GGUF arch name, engine config or None, name -> shape)."""
    model_type = str(cfg.get("model_type"))
    if model_type in LLAMA_MOE_TYPES:
        return model_type, None, _llama_moe_shapes(cfg)
    from pathlib import Path

    from cellswarm.models import config_from_hf, config_module_of

    entry, config = config_from_hf(Path("config.json"), cfg)
    module = config_module_of(entry)
    shapes: dict[str, Shape] = dict(config.expected_tensors(range(config.n_layers)))
    if cfg.get("tie_word_embeddings", False):
        del shapes["output.weight"]
    for name, value in module.hf_extra_tensors(config, cfg).items():
        shapes[name] = tuple(value.shape)
    shapes |= module.converter_shapes(config)
    return str(config.arch), config, shapes


def _llama_moe_shapes(cfg: Mapping[str, Any]) -> dict[str, Shape]:
    d, vocab, n_layers = (
        int(cfg["hidden_size"]),
        int(cfg["vocab_size"]),
        int(cfg["num_hidden_layers"]),
    )
    n_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or d // n_heads)
    kv = int(cfg.get("num_key_value_heads") or n_heads) * head_dim
    n_exp = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    ffn = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shapes: dict[str, Shape] = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["output.weight"] = (vocab, d)
    for i in range(n_layers):
        p = f"blk.{i}."
        shapes |= {p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)}
        shapes |= {p + "attn_q.weight": (n_heads * head_dim, d), p + "attn_k.weight": (kv, d)}
        shapes |= {p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, n_heads * head_dim)}
        if cfg["model_type"] == "qwen3_moe":
            shapes |= {p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,)}
        shapes |= {p + "ffn_gate_inp.weight": (n_exp, d)}
        shapes |= {
            p + "ffn_gate_exps.weight": (n_exp, ffn, d),
            p + "ffn_up_exps.weight": (n_exp, ffn, d),
        }
        shapes |= {p + "ffn_down_exps.weight": (n_exp, d, ffn)}
    return shapes


def non_engine_inventory(inv: Any, cfg: Mapping[str, Any]) -> Any:
    """Fill the per-model figures the engine config would have given."""
    if cfg.get("model_type") not in LLAMA_MOE_TYPES:
        raise UnsupportedArchitectureError(f"model_type {cfg.get('model_type')!r} has no shapes")
    n_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads)
    kv_heads = int(cfg.get("num_key_value_heads") or n_heads)
    return dataclasses.replace(
        inv,
        n_layers=int(cfg["num_hidden_layers"]),
        d_model=int(cfg["hidden_size"]),
        vocab_size=int(cfg["vocab_size"]),
        n_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
        n_experts_used=int(cfg["num_experts_per_tok"]),
        kv_bytes_per_token_layer=2 * kv_heads * head_dim * 2,  # f16, the engine's default
    )
