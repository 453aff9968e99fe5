"""`cellswarm.load(path)`: a GGUF file or a Hugging Face folder in, a `Model` out."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cellswarm.engine.model import Model
from cellswarm.io import hf_dir
from cellswarm.io.gguf_file import GGUFFile
from cellswarm.io.weights import Selection, WeightStore
from cellswarm.models import entry_for_gguf, entry_for_hf, module_of
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
) -> Model:
    """Load a model, or the shard of it that `selection` names.

    quant: re-pack 2-D/3-D weights in this format (e.g. "q8_0"); for a GGUF file this
        dequantizes and re-quantizes, for a Hugging Face folder it quantizes the floats
        (default there: keep F32). Without it, GGUF tensors stay exactly as stored.
    kv_budget_bytes: a sequence whose KV cache would exceed this is refused before it starts.
    """
    p = Path(path)
    sel = selection or Selection()
    if p.is_dir():
        return _load_hf(p, quant, sel, kv_budget_bytes, tokenizer)
    return _load_gguf(p, quant, sel, kv_budget_bytes, tokenizer)


def _load_gguf(
    path: Path, quant: str | None, sel: Selection, budget: int | None, with_tok: bool
) -> Model:
    f = GGUFFile(path)
    module = module_of(entry_for_gguf(f.architecture))
    has_embd = "token_embd.weight" in f.tensor_names()
    vocab_rows = f.tensor_shape("token_embd.weight")[0] if has_embd else 0
    config = module.CONFIG.from_gguf(f.metadata, vocab_rows)
    weights = f.weights(sel)
    if quant is not None:
        weights = _repack(weights, quant)
    tok = _gguf_tokenizer(f.metadata, config.vocab_size) if with_tok else None
    return Model(config, module.MODEL(config, weights), weights, tok, sel, budget)


def _load_hf(
    folder: Path, quant: str | None, sel: Selection, budget: int | None, with_tok: bool
) -> Model:
    hf_cfg = hf_dir.read_config(folder)
    module = module_of(entry_for_hf(hf_cfg["model_type"]))
    config = module.CONFIG.from_hf(hf_cfg)
    tensors = module.hf_tensors_to_gguf(config, hf_dir.read_safetensors(folder))
    tensors |= getattr(module, "hf_extra_tensors", lambda c, h: {})(config, hf_cfg)
    tensors = {k: v for k, v in tensors.items() if sel.keeps(k)}
    weights = WeightStore(
        {k: sel.narrow(k, t) for k, t in hf_dir.pack_tensors(tensors, quant).items()}
    )
    tok = None
    if with_tok and (folder / "tokenizer.json").is_file():
        from cellswarm.io.tokenizer import Tokenizer, check_vocab

        tok = Tokenizer.from_hf_dir(folder)
        check_vocab(tok, config.vocab_size)
    return Model(config, module.MODEL(config, weights), weights, tok, sel, budget)


def _gguf_tokenizer(meta: dict[str, Any], vocab_size: int) -> Tokenizer | None:
    """The file's own tokenizer; None when it has none (random test models)."""
    if "tokenizer.ggml.model" not in meta:
        return None
    from cellswarm.io.tokenizer import Tokenizer, check_vocab

    tok = Tokenizer.from_gguf_metadata(meta)
    check_vocab(tok, vocab_size)
    return tok


def _repack(weights: WeightStore, quant: str) -> WeightStore:
    out: dict[str, Any] = {}
    for name, t in weights.items():
        if isinstance(t, (PackedMatrix, PackedExperts)):
            out[name] = hf_dir.pack_tensor(name, t.dequantize(), format_by_name(quant))
        else:
            out[name] = np.asarray(t)
    return WeightStore(out)
