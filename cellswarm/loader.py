"""`cellswarm.load(path)`: a GGUF file or a Hugging Face folder in, a `Model` out."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cellswarm.cache_types import DEFAULT_CACHE_TYPE, check_cache_type
from cellswarm.engine.model import Model
from cellswarm.errors import TokenizerError
from cellswarm.io import hf_dir
from cellswarm.io.gguf_file import GGUFFile
from cellswarm.io.tokenizer import gguf_tokenizer
from cellswarm.io.weights import Selection, WeightStore
from cellswarm.models import (
    config_from_hf,
    config_module_of,
    module_of,
)
from cellswarm.models.from_file import check_tensors, gguf_config
from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name

if TYPE_CHECKING:
    from cellswarm.io.tokenizer import Tokenizer


def load(
    path: str | os.PathLike[str],
    *,
    quant: str | None = None,
    selection: Selection | None = None,
    kv_budget_bytes: int | None = None,
    tokenizer: bool = True,
    cache_type: str = DEFAULT_CACHE_TYPE,
) -> Model:
    """Load a model, or the shard of it that `selection` names.

    quant: re-pack 2-D/3-D weights in this format (e.g. "q8_0"); for a GGUF file this
        dequantizes and re-quantizes, for a Hugging Face folder it quantizes the floats
        (default there: keep F32). Without it, GGUF tensors stay exactly as stored.
    kv_budget_bytes: a sequence whose KV cache would exceed this is refused before it starts.
    cache_type: what the KV cache stores values as: "f16" (default), "q8_0" or "f32"
        (cache_types.py; its bytes are what kv_budget_bytes counts).
    """
    check_cache_type(cache_type)
    p = Path(path)
    sel = selection or Selection()
    if p.is_dir():
        model = _load_hf(p, quant, sel, kv_budget_bytes, tokenizer)
    else:
        model = _load_gguf(p, quant, sel, kv_budget_bytes, tokenizer)
    model.name = p.name
    model.set_cache_type(cache_type)
    return model


def read_config(path: str | os.PathLike[str]) -> Any:
    """The architecture's config alone (n_layers, n_experts, vocab_size, ...), without
    loading a tensor: what a placement needs before deciding who loads what."""
    p = Path(path)
    if p.is_dir():
        return config_from_hf(p / "config.json", hf_dir.read_config(p))[1]
    f = GGUFFile(p)
    return gguf_config(p, f)[1]


def _load_gguf(
    path: Path, quant: str | None, sel: Selection, budget: int | None, with_tok: bool
) -> Model:
    f = GGUFFile(path)
    entry, config = gguf_config(path, f)
    shapes = {name: f.tensor_shape(name) for name in f.tensor_names()}
    check_tensors(path, config, sel, shapes)
    weights = f.weights(sel)
    if quant is not None:
        weights = _repack(weights, quant)
    tok = gguf_tokenizer(f.metadata, config.vocab_size) if with_tok else None
    return Model(config, module_of(entry).MODEL(config, weights), weights, tok, sel, budget)


def _load_hf(
    folder: Path, quant: str | None, sel: Selection, budget: int | None, with_tok: bool
) -> Model:
    hf_cfg = hf_dir.read_config(folder)
    entry, config = config_from_hf(folder / "config.json", hf_cfg)
    conv = config_module_of(entry)
    tensors = conv.hf_tensors_to_gguf(config, hf_dir.read_safetensors(folder))
    tensors |= conv.hf_extra_tensors(config, hf_cfg)
    check_tensors(folder, config, sel, tensors)
    tensors = {k: v for k, v in tensors.items() if sel.keeps(k)}
    weights = WeightStore(
        {k: sel.narrow(k, t) for k, t in hf_dir.pack_tensors(tensors, quant).items()}
    )
    tok = None
    if with_tok and (folder / "tokenizer.json").is_file():
        from cellswarm.io.tokenizer import Tokenizer, check_vocab

        tok = Tokenizer.from_hf_dir(folder)
        check_vocab(tok, config.vocab_size)
    return Model(config, module_of(entry).MODEL(config, weights), weights, tok, sel, budget)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A model's tokenizer alone (no weights): from a GGUF's metadata, or a Hugging Face
    folder's tokenizer.json; TokenizerError when the model has none."""
    from cellswarm.io.tokenizer import Tokenizer

    p = Path(path)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise TokenizerError(f"{p} has no tokenizer.json: send token ids")
        return Tokenizer.from_hf_dir(p)
    from cellswarm.io.gguf_file import GGUFFile

    meta = GGUFFile(p).metadata
    if "tokenizer.ggml.model" not in meta:
        raise TokenizerError(f"{p} has no tokenizer in its metadata: send token ids")
    return Tokenizer.from_gguf_metadata(meta)


def _repack(weights: WeightStore, quant: str) -> WeightStore:
    out: dict[str, Any] = {}
    for name, t in weights.items():
        if isinstance(t, (PackedMatrix, PackedExperts)):
            out[name] = hf_dir.pack_tensor(name, t.dequantize(), format_by_name(quant))
        else:
            out[name] = np.asarray(t)
    return WeightStore(out)
