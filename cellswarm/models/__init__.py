"""Architecture files, one per family, and the registry that picks one for a model file.

Each family is two modules: `<family>_config.py`, pure (the config dataclass, the tensors it
implies, HF -> GGUF renaming; what the planner reads), and `<family>.py`, the model code
(numpy ops, the kernels). `config_from_gguf` / `config_from_hf` are the one place a file's
architecture is looked up and its config built."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellswarm.errors import ModelFileError, UnsupportedArchitectureError

if TYPE_CHECKING:
    from cellswarm.models.deepseek2_config import DeepseekConfig
    from cellswarm.models.llama_config import LlamaConfig

    FamilyConfig = LlamaConfig | DeepseekConfig  # every family's config


@dataclass(frozen=True)
class ArchEntry:
    """How to build one architecture from GGUF metadata or a Hugging Face config."""

    gguf_archs: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    module: str  # cellswarm.models.<module> defines MODEL, <module>_config defines CONFIG


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
    """The family's model module (MODEL): numpy ops and the kernels come with it."""
    import importlib

    return importlib.import_module(f"cellswarm.models.{entry.module}")


def config_module_of(entry: ArchEntry) -> Any:
    """The family's pure config module: CONFIG, hf_extra_tensors, hf_tensors_to_gguf,
    converter_shapes."""
    import importlib

    return importlib.import_module(f"cellswarm.models.{entry.module}_config")


def config_from_gguf(
    source: Path, metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[ArchEntry, Any]:
    """A GGUF file's family and config, from its metadata and tensor shapes (name -> shape,
    numpy order); the vocabulary rows are the embedding's (0 for a shard without one)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{source}: GGUF metadata has no general.architecture")
    entry = entry_for_gguf(arch)
    embd = shapes.get("token_embd.weight")
    vocab_rows = int(embd[0]) if embd else 0
    module = config_module_of(entry)
    return entry, _build(source, lambda: module.CONFIG.from_gguf(metadata, vocab_rows))


def config_from_hf(source: Path, hf_cfg: Mapping[str, Any]) -> tuple[ArchEntry, Any]:
    """A Hugging Face config.json's family and config (`source`: the file, for messages)."""
    entry = entry_for_hf(str(hf_cfg.get("model_type")))
    module = config_module_of(entry)
    return entry, _build(source, lambda: module.CONFIG.from_hf(hf_cfg))


def _build(source: Path, build: Callable[[], Any]) -> Any:
    """The architecture's config; a missing or ill-typed field is the file's fault, not a bug."""
    try:
        return build()
    except KeyError as exc:
        raise ModelFileError(
            f"{source} lacks {exc.args[0]!r}, which the architecture needs; "
            "re-download or re-convert the model"
        ) from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ModelFileError(
            f"{source} has a malformed field ({exc}); re-download or re-convert the model"
        ) from None
