"""Bad model files: each is refused at load with one line naming the problem, the value and the
fix, never a traceback — GGUF files cut short or corrupt, unknown architectures and tensor types,
missing or misshapen tensors, a tokenizer disagreeing with the model, broken Hugging Face folders.

The tiny models are written with numpy (no torch): a Hugging Face state dict in transformers'
names and layouts, and the same weights renamed to llama.cpp's names and written to GGUF.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

import cellswarm
from cellswarm import cli
from cellswarm.demo import demo_model_path
from cellswarm.errors import (
    CellswarmError,
    MissingTensorError,
    ModelFileError,
    RequestError,
    ShapeMismatchError,
    TokenizerError,
    UnsupportedArchitectureError,
    UnsupportedQuantError,
)
from cellswarm.io.gguf_write import write_gguf
from cellswarm.io.weights import Selection
from cellswarm.models import llama_config as llama
from cellswarm.quant import FORMATS
from tests.hf_reference import LLAMA_FAMILY

Q = gguf.GGMLQuantizationType

# The reference tests' tiny configs, made smaller still (2 layers, no llama3 rope scaling):
# these files only need to be valid or broken in one known way.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    arch: {
        **{k: v for k, v in LLAMA_FAMILY[arch].items() if k != "rope_scaling"},
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "max_position_embeddings": 64,
    }
    for arch in ("llama", "qwen2", "qwen3")
}


def hf_state(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under transformers' names, in its (out, in) layout."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim", d // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
        if cfg["model_type"] == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv))}
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    shapes["model.norm.weight"] = (d,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    rng = np.random.default_rng(seed)
    return {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}


def write_hf(folder: Path, cfg: dict[str, Any], state: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(folder / "model.safetensors"))
    return folder


@dataclass(frozen=True)
class Source:
    """One valid tiny model: a Hugging Face folder, and its GGUF copy (metadata, tensors, file)."""

    hf_cfg: dict[str, Any]
    hf_state: dict[str, np.ndarray]
    hf: Path
    meta: dict[str, Any]
    tensors: dict[str, np.ndarray]
    gguf: Path


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Source]:
    out = {}
    for arch, cfg in HF_CONFIGS.items():
        folder = tmp_path_factory.mktemp(arch)
        state = hf_state(cfg)
        config = llama.LlamaConfig.from_hf(cfg)
        tensors = llama.hf_tensors_to_gguf(config, dict(state))
        meta = config.to_gguf_metadata()
        write_gguf(folder / "model.gguf", meta, tensors)
        hf = write_hf(folder / "hf", cfg, state)
        out[arch] = Source(cfg, state, hf, meta, tensors, folder / "model.gguf")
    return out


# ------------------------------------------------------------------------ bad-file makers


def cut(src: Source, out: Path, where: Callable[[gguf.GGUFReader], int]) -> Path:
    data = src.gguf.read_bytes()
    out.write_bytes(data[: where(gguf.GGUFReader(src.gguf))])
    return out


def patch(src: Source, out: Path, where: Callable[[gguf.GGUFReader], int], new: bytes) -> Path:
    at = where(gguf.GGUFReader(src.gguf))
    data = bytearray(src.gguf.read_bytes())
    data[at : at + len(new)] = new
    out.write_bytes(bytes(data))
    return out


def tensor_type_offset(reader: gguf.GGUFReader, name: str) -> int:
    t = next(t for t in reader.tensors if t.name == name)
    return t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape)


def remade(
    src: Source,
    out: Path,
    meta: Callable[[dict[str, Any]], None] = lambda m: None,
    tensors: Callable[[dict[str, Any]], None] = lambda t: None,
) -> Path:
    """The source GGUF written again after editing copies of its metadata and tensors."""
    m, t = dict(src.meta), dict(src.tensors)
    meta(m)
    tensors(t)
    write_gguf(out, m, t)
    return out


def with_raw_tensor(src: Source, out: Path, name: str, qtype: Q) -> Path:
    """The source GGUF with tensor `name` stored as raw bytes of type `qtype`."""
    writer = gguf.GGUFWriter(str(out), str(src.meta["general.architecture"]))
    for key, value in src.meta.items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    for n, t in src.tensors.items():
        if n == name:
            rows, cols = t.shape
            raw = rng.integers(0, 256, (rows, cols // block * type_size), dtype=np.uint8)
            writer.add_tensor(n, raw, raw_shape=raw.shape, raw_dtype=qtype)  # shape in bytes
        else:
            writer.add_tensor(n, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def with_tokenizer(n_tokens: int) -> Callable[[dict[str, Any]], None]:
    """A SentencePiece-style vocabulary of n_tokens in the metadata, as llama.cpp writes it."""

    def edit(meta: dict[str, Any]) -> None:
        pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz"]
        filler = [f"▁w{i}" for i in range(n_tokens - 3 - len(pieces))]
        tokens = ["<unk>", "<s>", "</s>", *pieces, *filler]
        meta["tokenizer.ggml.model"] = "llama"
        meta["tokenizer.ggml.tokens"] = tokens
        meta["tokenizer.ggml.scores"] = [-float(i) for i in range(n_tokens)]
        meta["tokenizer.ggml.token_type"] = [2, 3, 3, *([1] * (n_tokens - 3))]
        meta["tokenizer.ggml.bos_token_id"] = 1
        meta["tokenizer.ggml.eos_token_id"] = 2

    return edit


def hf_copy(
    src: Source,
    out: Path,
    config: str | None = None,
    state: Callable[[dict[str, np.ndarray]], None] | None = None,
    safetensors: Callable[[bytes], bytes | None] | None = None,
) -> Path:
    """The source folder, with config.json text replaced (or deleted if ""), the state dict
    edited, or the safetensors bytes rewritten (or the file deleted when that returns None)."""
    shutil.copytree(src.hf, out)
    if config == "":
        (out / "config.json").unlink()
    elif config is not None:
        (out / "config.json").write_text(config)
    if state is not None:
        st = dict(src.hf_state)
        state(st)
        save_file(st, str(out / "model.safetensors"))
    if safetensors is not None:
        new = safetensors((out / "model.safetensors").read_bytes())
        (out / "model.safetensors").unlink()
        if new is not None:
            (out / "model.safetensors").write_bytes(new)
    return out


def hf_config(**changes: Any) -> Callable[[Source], str]:
    def text(src: Source) -> str:
        cfg = {k: v for k, v in src.hf_cfg.items() if k not in changes or changes[k] is not None}
        return json.dumps(cfg | {k: v for k, v in changes.items() if v is not None})

    return text


def _pop(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        del d[name]

    return edit


def _set(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        d[name] = value

    return edit


def _bytes(out: Path, data: bytes) -> Path:
    out.write_bytes(data)
    return out


@dataclass(frozen=True)
class Case:
    """A bad model made from a valid source; `match` may hold {size}, the bad file's size."""

    id: str
    arch: str
    make: Callable[[Source, Path], Path]
    error: type[CellswarmError]
    match: str


TRUNCATED = (
    r"model\.gguf is truncated: {what} runs to byte \d+ but the file has only {{size}} bytes"
)
SUPPORTED_QUANTS = ", ".join(f.name for f in FORMATS.values())
# Cut points inside the valid file, found with gguf's own reader.


def in_header(r: gguf.GGUFReader) -> int:
    return 20  # inside the tensor and metadata counts


def in_key_name(r: gguf.GGUFReader) -> int:
    return r.fields["llama.block_count"].offset + 12


def in_value(r: gguf.GGUFReader) -> int:
    key = "llama.rope.freq_base"
    return r.fields[key].offset + 8 + len(key) + 4 + 2  # name length, name, type, half a float


def in_tensor_name(r: gguf.GGUFReader) -> int:
    return r.tensors[3].field.offset + 11


def in_tensor_dims(r: gguf.GGUFReader) -> int:
    return r.tensors[3].field.offset + 8 + len(r.tensors[3].name) + 6


def in_data(r: gguf.GGUFReader) -> int:
    return (r.data_offset + len(r.data)) // 2


def last_byte(r: gguf.GGUFReader) -> int:
    return len(r.data) - 1


CASES = [
    # 1. truncated GGUF, cut at several points
    Case(
        "truncated-empty",
        "llama",
        lambda s, o: cut(s, o, lambda r: 0),
        ModelFileError,
        r"model\.gguf is truncated: it has 0 bytes, too few to hold a GGUF header",
    ),
    Case(
        "truncated-in-header",
        "llama",
        lambda s, o: cut(s, o, in_header),
        ModelFileError,
        TRUNCATED.format(what="the header"),
    ),
    Case(
        "truncated-in-metadata-key",
        "llama",
        lambda s, o: cut(s, o, in_key_name),
        ModelFileError,
        TRUNCATED.format(what=r"metadata key \d+ of 13"),
    ),
    Case(
        "truncated-in-metadata-value",
        "llama",
        lambda s, o: cut(s, o, in_value),
        ModelFileError,
        TRUNCATED.format(what="metadata key 'llama.rope.freq_base'"),
    ),
    Case(
        "truncated-in-tensor-name",
        "llama",
        lambda s, o: cut(s, o, in_tensor_name),
        ModelFileError,
        TRUNCATED.format(what=r"tensor entry 4 of 21"),
    ),
    Case(
        "truncated-in-tensor-dims",
        "llama",
        lambda s, o: cut(s, o, in_tensor_dims),
        ModelFileError,
        TRUNCATED.format(what=r"tensor entry 4 of 21 \(blk\.0\.attn_k\.weight\)"),
    ),
    Case(
        "truncated-in-data",
        "llama",
        lambda s, o: cut(s, o, in_data),
        ModelFileError,
        TRUNCATED.format(what=r"tensor blk\.\d\.\w+\.weight"),
    ),
    Case(
        "truncated-last-byte",
        "llama",
        lambda s, o: cut(s, o, last_byte),
        ModelFileError,
        TRUNCATED.format(what=r"tensor output\.weight"),
    ),
    Case(
        "no-such-file",
        "llama",
        lambda s, o: o.with_name("missing.gguf"),
        ModelFileError,
        r"model file .*missing\.gguf does not exist; pass the path of a \.gguf file",
    ),
    # 2. corrupt
    Case(
        "wrong-magic",
        "llama",
        lambda s, o: patch(s, o, lambda r: 0, b"PK\x03\x04"),
        ModelFileError,
        r"model\.gguf is not a GGUF file \(starts with b'PK\\x03\\x04', expected b'GGUF'\); "
        r"convert it with llama\.cpp's convert_hf_to_gguf\.py",
    ),
    Case(
        "random-bytes",
        "llama",
        lambda s, o: _bytes(o, np.random.default_rng(3).bytes(4096)),
        ModelFileError,
        r"model\.gguf is not a GGUF file \(starts with b'",
    ),
    Case(
        "garbage-version",
        "llama",
        lambda s, o: patch(s, o, lambda r: 4, struct.pack("<I", 0xDEADBEEF)),
        ModelFileError,
        r"model\.gguf is corrupt: it has GGUF version 3735928559; cellswarm reads versions 2 "
        r"and 3; re-convert it with a current llama\.cpp",
    ),
    Case(
        "garbage-tensor-count",
        "llama",
        lambda s, o: patch(s, o, lambda r: 8, struct.pack("<Q", 1 << 60)),
        ModelFileError,
        r"model\.gguf is corrupt: it claims 1152921504606846976 tensors and 13 metadata keys; "
        r"re-download or re-convert the file",
    ),
    Case(
        "garbage-value-type",
        "llama",
        lambda s, o: patch(
            s, o, lambda r: r.fields["llama.block_count"].offset + 8 + 17, struct.pack("<I", 77)
        ),
        ModelFileError,
        r"model\.gguf is corrupt: it gives metadata key 'llama\.block_count' value type 77, "
        r"which GGUF does not define",
    ),
    Case(
        "garbage-name-length",
        "llama",
        lambda s, o: patch(
            s, o, lambda r: r.fields["llama.block_count"].offset, struct.pack("<Q", 1 << 40)
        ),
        ModelFileError,
        r"model\.gguf is corrupt: it gives metadata key \d+ of 13 a name of 1099511627776 bytes",
    ),
    Case(
        "garbage-tensor-type",
        "llama",
        lambda s, o: patch(
            s, o, lambda r: tensor_type_offset(r, "blk.0.attn_q.weight"), struct.pack("<I", 99)
        ),
        UnsupportedQuantError,
        r"model\.gguf: tensor blk\.0\.attn_q\.weight has type id 99, which GGUF does not define "
        r"\(supported: F32, .*\); the file is corrupt or needs a newer reader",
    ),
    Case(
        "garbage-alignment",
        "llama",
        lambda s, o: remade(s, o, meta=_set("general.alignment", 3)),
        ModelFileError,
        r"model\.gguf is corrupt: it gives general\.alignment 3, not a power of two",
    ),
    # 3. unknown architecture
    Case(
        "architecture-mamba",
        "llama",
        lambda s, o: remade(s, o, meta=_set("general.architecture", "mamba")),
        UnsupportedArchitectureError,
        r"architecture 'mamba' is not supported; supported: llama, qwen2, qwen3, deepseek2",
    ),
    # metadata the architecture needs: absent, or of the wrong type
    Case(
        "metadata-missing",
        "llama",
        lambda s, o: remade(s, o, meta=_pop("llama.embedding_length")),
        ModelFileError,
        r"GGUF metadata lacks llama\.embedding_length; the file is incomplete",
    ),
    Case(
        "metadata-wrong-type",
        "llama",
        lambda s, o: remade(s, o, meta=_set("llama.block_count", "two")),
        ModelFileError,
        r"model\.gguf has a malformed field \(invalid literal for int\(\) with base 10: 'two'\); "
        r"re-download or re-convert the model",
    ),
    Case(
        "metadata-zero-heads",
        "llama",
        lambda s, o: remade(s, o, meta=_set("llama.attention.head_count_kv", 0)),
        ModelFileError,
        r"model\.gguf has a malformed field \(integer (division or )?modulo by zero\)",
    ),
    # 4. tensor types cellswarm cannot decode, named with the tensor, at load
    *(
        Case(
            f"quant-{qtype.name}",
            "llama",
            lambda s, o, name=name, qtype=qtype: with_raw_tensor(s, o, name, qtype),
            UnsupportedQuantError,
            rf"model\.gguf: tensor {re.escape(name)}: tensor type {qtype.name} is not "
            rf"supported; supported: {SUPPORTED_QUANTS}; re-quantize the model to one of these",
        )
        for name, qtype in (
            ("blk.0.attn_q.weight", Q.Q8_1),  # llama.cpp's activation type, never stored
            ("blk.1.ffn_down.weight", Q.I32),
            ("blk.0.ffn_down.weight", Q.I8),
        )
    ),
    # 5. missing tensors, found at load
    Case(
        "missing-ffn-up",
        "llama",
        lambda s, o: remade(s, o, tensors=_pop("blk.1.ffn_up.weight")),
        MissingTensorError,
        r"model\.gguf has no tensor blk\.1\.ffn_up\.weight; the file is incomplete or was "
        r"converted for another architecture or size — re-download or re-convert it",
    ),
    Case(
        "missing-embedding",
        "llama",
        lambda s, o: remade(s, o, tensors=_pop("token_embd.weight")),
        MissingTensorError,
        r"model\.gguf has no tensor token_embd\.weight;",
    ),
    Case(
        "missing-qwen2-biases",
        "qwen2",
        lambda s, o: remade(
            s, o, tensors=lambda t: [t.pop(n) for n in list(t) if n.endswith(".bias")]
        ),
        MissingTensorError,
        r"model\.gguf has no tensor blk\.0\.attn_q\.bias, blk\.0\.attn_k\.bias, "
        r"blk\.0\.attn_v\.bias and 3 more;",
    ),
    Case(
        "missing-qwen3-qk-norm",
        "qwen3",
        lambda s, o: remade(s, o, tensors=_pop("blk.1.attn_k_norm.weight")),
        MissingTensorError,
        r"model\.gguf has no tensor blk\.1\.attn_k_norm\.weight;",
    ),
    # 6. shapes that disagree with the metadata
    Case(
        "shape-attn-q",
        "llama",
        lambda s, o: remade(
            s, o, tensors=_set("blk.0.attn_q.weight", np.zeros((48, 64), np.float32))
        ),
        ShapeMismatchError,
        r"model\.gguf: tensor blk\.0\.attn_q\.weight has shape \(48, 64\), but the model's "
        r"config implies \(64, 64\); the file's metadata does not match its weights — "
        r"re-convert it",
    ),
    Case(
        "shape-from-metadata",
        "llama",
        lambda s, o: remade(s, o, meta=_set("llama.feed_forward_length", 128)),
        ShapeMismatchError,
        r"model\.gguf: tensor blk\.0\.ffn_gate\.weight has shape \(256, 64\), but the model's "
        r"config implies \(128, 64\)",
    ),
    Case(
        "shape-qwen3-q-norm",
        "qwen3",
        lambda s, o: remade(
            s, o, tensors=_set("blk.0.attn_q_norm.weight", np.ones(16, np.float32))
        ),
        ShapeMismatchError,
        r"model\.gguf: tensor blk\.0\.attn_q_norm\.weight has shape \(16,\), but the model's "
        r"config implies \(32,\)",
    ),
    # 7. a tokenizer larger than the embedding
    Case(
        "tokenizer-vocab",
        "llama",
        lambda s, o: remade(s, o, meta=with_tokenizer(200)),
        TokenizerError,
        r"tokenizer has 200 tokens but the model's embedding has 128 rows; use the tokenizer "
        r"that came with the model",
    ),
    # 8. Hugging Face folders
    Case(
        "hf-no-config",
        "llama",
        lambda s, o: hf_copy(s, o, config=""),
        ModelFileError,
        r"has no config\.json; pass a Hugging Face model folder",
    ),
    Case(
        "hf-config-not-json",
        "llama",
        lambda s, o: hf_copy(s, o, config='{"model_type": "llama",'),
        ModelFileError,
        r"config\.json is not valid JSON \(Expecting property name enclosed in double quotes: "
        r"line 1 column 24 \(char 23\)\); restore the file",
    ),
    Case(
        "hf-config-a-list",
        "llama",
        lambda s, o: hf_copy(s, o, config="[1, 2]"),
        ModelFileError,
        r"config\.json holds a JSON list, not an object; restore the file",
    ),
    Case(
        "hf-config-no-model-type",
        "llama",
        lambda s, o: hf_copy(s, o, config=hf_config(model_type=None)(s)),
        ModelFileError,
        r"config\.json has no model_type; it is not a transformers config",
    ),
    Case(
        "hf-model-type-unknown",
        "llama",
        lambda s, o: hf_copy(s, o, config=hf_config(model_type="mamba")(s)),
        UnsupportedArchitectureError,
        r"Hugging Face model_type 'mamba' is not supported; supported: llama, qwen2, qwen3, "
        r"deepseek_v3",
    ),
    Case(
        "hf-config-field-missing",
        "llama",
        lambda s, o: hf_copy(s, o, config=hf_config(hidden_size=None)(s)),
        ModelFileError,
        r"config\.json lacks 'hidden_size', which the architecture needs; "
        r"re-download or re-convert the model",
    ),
    Case(
        "hf-no-safetensors",
        "llama",
        lambda s, o: hf_copy(s, o, safetensors=lambda b: None),
        ModelFileError,
        r"has no \*\.safetensors files; save the model with them",
    ),
    Case(
        "hf-safetensors-cut-in-data",
        "llama",
        lambda s, o: hf_copy(s, o, safetensors=lambda b: b[: len(b) // 2]),
        ModelFileError,
        r"model\.safetensors is truncated: it has {size} bytes but its header describes \d+; "
        r"re-download it",
    ),
    Case(
        "hf-safetensors-cut-in-header",
        "llama",
        lambda s, o: hf_copy(s, o, safetensors=lambda b: b[:100]),
        ModelFileError,
        r"model\.safetensors is truncated: it has {size} bytes but its header describes \d+",
    ),
    Case(
        "hf-safetensors-garbage",
        "llama",
        lambda s, o: hf_copy(s, o, safetensors=lambda b: np.random.default_rng(4).bytes(2000)),
        ModelFileError,
        r"model\.safetensors is corrupt \({size} bytes; .*\); re-download it",
    ),
    Case(
        "hf-missing-tensor",
        "llama",
        lambda s, o: hf_copy(s, o, state=_pop("model.layers.1.mlp.up_proj.weight")),
        MissingTensorError,
        r"/hf has no tensor blk\.1\.ffn_up\.weight;",
    ),
    Case(
        "hf-wrong-shape",
        "qwen2",
        lambda s, o: hf_copy(
            s, o, state=_set("model.layers.1.self_attn.k_proj.bias", np.zeros(8, np.float32))
        ),
        ShapeMismatchError,
        r"/hf: tensor blk\.1\.attn_k\.bias has shape \(8,\), but the model's config implies "
        r"\(32,\)",
    ),
    Case(
        "hf-unknown-tensor",
        "llama",
        lambda s, o: hf_copy(
            s, o, state=_set("model.layers.0.mystery.weight", np.zeros(4, np.float32))
        ),
        ModelFileError,
        r"tensor 'model\.layers\.0\.mystery\.weight' has no llama\.cpp name for llama",
    ),
]


@pytest.fixture
def bad(
    request: pytest.FixtureRequest, sources: dict[str, Source], tmp_path: Path
) -> tuple[Path, Case]:
    case: Case = request.param
    out = tmp_path / ("hf" if case.id.startswith("hf-") else "model.gguf")
    return case.make(sources[case.arch], out), case


def _match(case: Case, path: Path) -> str:
    size = path.stat().st_size if path.is_file() else 0
    if path.is_dir() and (path / "model.safetensors").is_file():
        size = (path / "model.safetensors").stat().st_size
    return case.match.format(size=size)


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES], indirect=True)
def test_bad_file_is_refused_with_its_message(bad: tuple[Path, Case]) -> None:
    path, case = bad
    with pytest.raises(case.error, match=_match(case, path)) as info:
        cellswarm.load(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES], indirect=True)
def test_cli_prints_one_line_and_no_traceback(
    bad: tuple[Path, Case], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = bad
    assert cli.main(["generate", "--model", str(path), "hi"]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("cellswarm: error: ")
    assert "Traceback" not in err


def test_cli_subprocess_exit_code_and_stderr(sources: dict[str, Source], tmp_path: Path) -> None:
    bad = cut(sources["llama"], tmp_path / "model.gguf", in_tensor_dims)
    run = subprocess.run(
        [sys.executable, "-m", "cellswarm", "generate", "--model", str(bad), "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cellswarm: error: ")
    assert "is truncated: tensor entry 4 of 21" in lines[0]
    assert "Traceback" not in run.stderr and run.stdout == ""


# ------------------------------------------------------------------------ no false positives


@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_valid_files_still_load(sources: dict[str, Source], arch: str) -> None:
    src = sources[arch]
    ids = [1, 5, 9, 127]
    from_gguf = cellswarm.load(src.gguf).logits(ids)
    from_hf = cellswarm.load(src.hf).logits(ids)
    assert from_gguf.shape == (4, 128) and np.isfinite(from_gguf).all()
    assert np.allclose(from_gguf, from_hf, atol=1e-5)


def test_valid_tokenizer_of_the_embedding_size_loads(sources: dict[str, Source], tmp_path: Path):
    path = remade(sources["llama"], tmp_path / "model.gguf", meta=with_tokenizer(128))
    model = cellswarm.load(path)
    assert model.tokenizer.vocab_size == 128
    ids = model.tokenizer.encode("hi there")
    assert model.tokenizer.decode(ids, skip_special=True) == "hi there"
    assert np.isfinite(model.logits(ids)).all()


def test_only_the_selected_layers_must_be_present(
    sources: dict[str, Source], tmp_path: Path
) -> None:
    path = remade(sources["llama"], tmp_path / "model.gguf", tensors=_pop("blk.1.ffn_up.weight"))
    shard = cellswarm.load(path, selection=Selection(layers=(0, 1), head=False))
    assert "blk.1.ffn_up.weight" not in shard.weights
    with pytest.raises(MissingTensorError, match=r"blk\.1\.ffn_up\.weight"):
        cellswarm.load(path, selection=Selection(layers=(1, 2), embed=False))


def test_selected_layers_outside_the_model(sources: dict[str, Source]) -> None:
    with pytest.raises(RequestError, match=r"selected layers \[1, 5\) do not fit the model's 2"):
        cellswarm.load(sources["llama"].gguf, selection=Selection(layers=(1, 5)))


def test_demo_model_still_loads() -> None:
    try:
        demo_path = demo_model_path()
    except ModelFileError as exc:
        pytest.skip(str(exc))
    model = cellswarm.load(demo_path)
    assert model.config.n_layers == 30 and model.tokenizer.vocab_size <= model.config.vocab_size
