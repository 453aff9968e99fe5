"""Architecture files, one per family, and the registry that picks one for a model file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cellswarm.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ArchEntry:
    """How to build one architecture from GGUF metadata or a Hugging Face config."""

    gguf_archs: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    module: str  # cellswarm.models.<module> defines CONFIG and MODEL


_REGISTRY = (
    ArchEntry(("llama", "qwen2", "qwen3"), ("llama", "qwen2", "qwen3"), "llama"),
    ArchEntry(("deepseek2",), ("deepseek_v3", "deepseek_v2", "kimi_k2"), "deepseek2"),
)


def supported_gguf_archs() -> list[str]:
    return [a for e in _REGISTRY for a in e.gguf_archs]


def entry_for_gguf(arch: str) -> ArchEntry:
    for e in _REGISTRY:
        if arch in e.gguf_archs:
            return e
    raise UnsupportedArchitectureError(
        f"architecture {arch!r} is not supported; supported: {', '.join(supported_gguf_archs())}"
    )


def entry_for_hf(model_type: str) -> ArchEntry:
    for e in _REGISTRY:
        if model_type in e.hf_model_types:
            return e
    known = ", ".join(t for e in _REGISTRY for t in e.hf_model_types)
    raise UnsupportedArchitectureError(
        f"Hugging Face model_type {model_type!r} is not supported; supported: {known}"
    )


def module_of(entry: ArchEntry) -> Any:
    import importlib

    return importlib.import_module(f"cellswarm.models.{entry.module}")
