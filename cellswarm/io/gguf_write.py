"""Write GGUF files with `gguf.GGUFWriter`: random test models, re-quantized copies.

Tensors go in under llama.cpp's names and block layouts, so what we write is what llama.cpp's
converter would write, and what we read back goes through the same loader as any GGUF.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np

from cellswarm.quant import PackedExperts, PackedMatrix


def write_gguf(
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray | PackedMatrix | PackedExperts],
) -> None:
    """metadata: GGUF keys (general.architecture included) -> python values."""
    arch = str(metadata["general.architecture"])
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    for key, value in metadata.items():
        if key != "general.architecture":
            add_value(writer, key, value)
    for name, t in tensors.items():
        _add_tensor(writer, name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"GGUF metadata {key} has unsupported type {type(value).__name__}")


def _add_tensor(
    writer: gguf.GGUFWriter, name: str, t: np.ndarray | PackedMatrix | PackedExperts
) -> None:
    if isinstance(t, np.ndarray):
        writer.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
        return
    writer.add_tensor(
        name, np.ascontiguousarray(t.data), raw_shape=t.data.shape,
        raw_dtype=gguf.GGMLQuantizationType(int(t.fmt.ggml_type)),
    )
