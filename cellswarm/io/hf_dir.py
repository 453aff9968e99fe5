"""Hugging Face model folders: config.json + *.safetensors (+ tokenizer.json).

Tensors are renamed to llama.cpp's GGUF names by the architecture file, then packed: kept as
F32 by default, or quantized at load (`quant="q8_0"`) so a folder of float weights runs in the
same packed layout as a GGUF file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from cellswarm.errors import ModelFileError
from cellswarm.io.weights import Tensor, WeightStore
from cellswarm.quant import PackedExperts, PackedMatrix, QuantFormat, format_by_name

_MAX_HEADER = 100_000_000  # safetensors refuses longer headers too


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{folder} has no config.json; pass a Hugging Face model folder")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path} is not valid JSON ({exc}); restore the file") from exc
    if not isinstance(cfg, dict):
        raise ModelFileError(
            f"{path} holds a JSON {type(cfg).__name__}, not an object; restore the file"
        )
    if "model_type" not in cfg:
        raise ModelFileError(f"{path} has no model_type; it is not a transformers config")
    return cfg


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """All tensors of the folder as float32 arrays, by their Hugging Face names."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{folder} has no *.safetensors files; save the model with them")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(_read_file(f))
    return out


def _read_file(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                dtype = f.get_slice(name).get_dtype()
                if dtype == "BF16":  # numpy has no bfloat16: widen the raw bits
                    out[name] = _read_bf16(path, name)
                else:
                    out[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        size, needed = path.stat().st_size, _described_size(path)
        if needed is not None and size < needed:
            raise ModelFileError(
                f"{path} is truncated: it has {size} bytes but its header describes {needed}; "
                "re-download it"
            ) from exc
        raise ModelFileError(
            f"{path} is corrupt ({size} bytes; {' '.join(str(exc).split())}); re-download it"
        ) from exc
    return out


def _described_size(path: Path) -> int | None:
    """The size a safetensors file's header promises, or None if the header is garbage."""
    try:
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return 8
            (header_len,) = struct.unpack("<Q", head)
            if header_len > _MAX_HEADER:
                return None
            raw = fh.read(header_len)
            if len(raw) < header_len:
                return 8 + header_len
            header = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return 8 + header_len + max(ends, default=0)


def _read_bf16(path: Path, name: str) -> np.ndarray:
    with path.open("rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
        start, end = header[name]["data_offsets"]
        fh.seek(8 + header_len + start)
        raw = np.frombuffer(fh.read(end - start), dtype=np.uint16)
    bits = raw.astype(np.uint32) << 16
    return bits.view(np.float32).reshape(header[name]["shape"])


def pack_tensors(tensors: Mapping[str, np.ndarray], quant: str | None = None) -> WeightStore:
    """Float arrays in GGUF names/layouts -> packed weight store (2-D/3-D weights quantized)."""
    fmt = format_by_name(quant or "f32")
    return WeightStore({name: pack_tensor(name, v, fmt) for name, v in tensors.items()})


def pack_tensor(name: str, value: np.ndarray, fmt: QuantFormat) -> Tensor:
    value = np.ascontiguousarray(value, dtype=np.float32)
    # Tables that are read as vectors, or whose rows don't fill whole blocks, stay in F32.
    if value.ndim == 1:
        return value
    if value.shape[-1] % fmt.block_size:
        fmt = format_by_name("f32")
    if value.ndim == 2:
        return PackedMatrix.from_float(value, fmt)
    if value.ndim == 3:
        return PackedExperts.from_float(value, fmt)
    raise ModelFileError(f"tensor {name} has {value.ndim} dimensions; at most 3 are supported")
