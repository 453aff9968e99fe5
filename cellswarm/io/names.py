"""llama.cpp's tensor names: which layer a tensor belongs to, what it is for, and the tensors
every architecture has outside its layers. Pure string functions: the planner reads them
without the packed-weight machinery of weights.py."""

from __future__ import annotations

import re

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


_GLOBAL_KINDS = {
    "token_embd.weight": "embedding",
    "output.weight": "output",
    "output_norm.weight": "norm",
    "rope_freqs.weight": "rope",
}


def global_tensor_shapes(vocab_size: int, d_model: int) -> dict[str, tuple[int, ...]]:
    """The tensors outside the layers that every architecture reads (numpy-order shapes);
    output.weight is listed, a file without one ties the head to the embedding."""
    return {
        "token_embd.weight": (vocab_size, d_model),
        "output_norm.weight": (d_model,),
        "output.weight": (vocab_size, d_model),
    }


def tensor_kind(name: str) -> str:
    """What a tensor is for, from its llama.cpp name: the planner and the memory accounting
    group bytes by this, so both must call this one function."""
    if name in _GLOBAL_KINDS:
        return _GLOBAL_KINDS[name]
    suffix = name.split(".", 2)[2] if layer_of(name) is not None else name
    if "norm" in suffix:
        return "norm"
    if suffix.startswith(("ffn_gate_inp.", "exp_probs_b.")):
        return "router"
    if "_exps." in suffix:
        return "experts"
    if "_shexp." in suffix:
        return "shared_experts"
    if suffix.startswith("attn_"):
        return "attention"
    if suffix.startswith("ffn_"):
        return "ffn"
    return "other"
