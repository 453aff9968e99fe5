"""Small GGUF models of every family in every format the kernels read, for the bit-identity
tests (tests/test_bits_everywhere.py): random weights, real files.

Formats the project can quantize (F32, Q8_0, Q4_0) are quantized from floats; the K formats
(which only llama.cpp's llama-quantize writes) are random blocks with sane scales, read by the
same kernels as a downloaded file's. "Q4_K_M" is llama-quantize's default mix: Q4_K, with
Q6_K for attn_v, ffn_down and the output head, and Q8_0 / F32 where a row is not whole
256-blocks (DeepSeek's per-head k_b and v_b), as llama-quantize falls back.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np

from cellswarm.io.gguf_write import write_gguf
from cellswarm.models.deepseek2 import DeepseekConfig
from cellswarm.models.llama_config import LlamaConfig
from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name
from tests.random_blocks import random_blocks

SCALES = {"Q4_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82)}  # bytes of each block's f16 scales

LLAMA = dict(n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
             vocab_size=512, context_length=512, rms_eps=1e-5, rope_theta=10000.0, rope_dim=64)
FAMILIES: dict[str, Any] = {
    "llama": LlamaConfig(arch="llama", rope_layout="norm", **LLAMA),
    "qwen2": LlamaConfig(arch="qwen2", rope_layout="neox", qkv_bias=True, **LLAMA),
    "qwen3": LlamaConfig(arch="qwen3", rope_layout="neox", qk_norm=True, **LLAMA),
    # DeepSeek-V3 / Kimi-K2 shaped: q LoRA, sigmoid gating with a correction bias over
    # grouped experts, normalized top-k weights times a routed scale, a shared expert
    "deepseek2": DeepseekConfig(
        n_layers=4, d_model=256, n_heads=4, vocab_size=512, context_length=512, rms_eps=1e-6,
        q_lora_rank=256, kv_lora_rank=256, qk_nope_dim=32, qk_rope_dim=32, v_head_dim=32,
        ffn_dim=512, moe_ffn_dim=256, n_experts=16, n_experts_used=4, n_shared_experts=1,
        first_k_dense=1, n_groups=4, topk_groups=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, gating="sigmoid", rope_theta=10000.0,
    ),
}  # fmt: skip
FORMATS = ("F32", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K_M", "LOWBIT")
# "LOWBIT": every other format the kernels read (kernels/lowbit.c), one per tensor in turn by
# its name, the routed experts of a MoE among them (a dynamic mix's 1-2 bit experts)
LOWBIT = ("Q5_1", "Q3_K", "Q5_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S",
          "IQ2_S", "IQ4_XS", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q2_K")  # fmt: skip
# every family in every format, but a float32 MoE (~50 MB here, and no one's download), and the
# low-bit mix on one dense family and the MoE (the kernels are the families' shared ones)
MODELS = [
    (f, q) for f in FAMILIES for q in FORMATS
    if (f, q) != ("deepseek2", "F32") and (q != "LOWBIT" or f in ("llama", "deepseek2"))
]


def _format_of(name: str, shape: tuple[int, ...], quant: str) -> str:
    """llama-quantize's choice for one tensor of a `quant` file (mixes by tensor name)."""
    if quant == "Q4_K_M":
        quant = "Q6_K" if any(k in name for k in ("attn_v.", "ffn_down", "output.")) else "Q4_K"
    if quant == "DYNAMIC":  # the big MoEs' dynamic mixes: 1-bit routed experts, the rest high
        if "_exps" in name:
            return "IQ1_S" if "down" not in name else "TQ1_0"
        quant = "Q6_K" if shape[-1] % 256 == 0 and "token_embd" not in name else "Q8_0"
        return quant
    if quant == "LOWBIT":
        quant = LOWBIT[zlib.crc32(name.encode()) % len(LOWBIT)]
        return quant if shape[-1] % format_by_name(quant).block_size == 0 else "Q8_0"
    if quant in ("Q4_K", "Q6_K") and shape[-1] % 256:
        return "Q8_0"  # a row of part-blocks: llama-quantize falls back
    return quant


def _random_k(fmt_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K format with small finite f16 scales: (..., rows, row_bytes)."""
    fmt = format_by_name(fmt_name)
    nb = shape[-1] // fmt.block_size
    data = rng.integers(0, 256, (*shape[:-1], nb, fmt.type_size), dtype=np.uint8)
    for off in SCALES[fmt_name]:
        scales = rng.uniform(0.002, 0.01, (*shape[:-1], nb)).astype(np.float16)
        data[..., off : off + 2] = scales.view(np.uint8).reshape(*shape[:-1], nb, 2)
    return data.reshape(*shape[:-1], nb * fmt.type_size)


def _tensor(name: str, shape: tuple[int, ...], quant: str, rng: np.random.Generator) -> Any:
    w = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "ffn_gate_inp" in name:
        return w  # routers stay float32, as llama-quantize leaves them
    if "attn_k_b" in name or "attn_v_b" in name:  # per head: rows of 32 columns
        if quant == "Q8_0":
            return w  # float32, as in older files: the fused layer's float path
        quant = "Q8_0"
    kind = _format_of(name, shape, quant)
    fmt = format_by_name(kind)
    if kind in LOWBIT and kind not in SCALES:
        data = random_blocks(fmt, shape, rng)
        return PackedExperts(data, fmt) if len(shape) == 3 else PackedMatrix(data, fmt)
    if kind in SCALES:
        data = _random_k(kind, shape, rng)
        return PackedExperts(data, fmt) if len(shape) == 3 else PackedMatrix(data, fmt)
    if kind == "F32":
        return w
    return PackedExperts.from_float(w, fmt) if len(shape) == 3 else PackedMatrix.from_float(w, fmt)


def write_model(path: Path, family: str, quant: str, seed: int = 0) -> Path:
    """`family` (FAMILIES) with random weights in `quant` (FORMATS) at `path`."""
    config, rng = FAMILIES[family], np.random.default_rng(seed)
    shapes = dict(config.expected_tensors(range(config.n_layers)))
    if family == "deepseek2":  # llama.cpp's current layout of the kv up-projection
        c = config
        for layer in range(c.n_layers):
            p = f"blk.{layer}."
            shapes.pop(p + "attn_kv_b.weight", None)
            shapes[p + "attn_k_b.weight"] = (c.n_heads, c.kv_lora_rank, c.qk_nope_dim)
            shapes[p + "attn_v_b.weight"] = (c.n_heads, c.v_head_dim, c.kv_lora_rank)
    tensors = {name: _tensor(name, tuple(shape), quant, rng) for name, shape in shapes.items()}
    write_gguf(path, config.to_gguf_metadata(), tensors)
    return path
