"""Lazy GGUF access: the file is memory-mapped and tensors stay in their packed block layout.

Nothing is copied at open: a tensor is a view into the mapping, so the bytes of a tensor are
read from disk only when a computation touches them. `GGUFFile.weights(selection)` hands out
just the tensors a shard needs (a layer range, some experts, a slice of vocabulary rows).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from cellswarm.errors import ModelFileError
from cellswarm.io.weights import Selection, Tensor, WeightStore
from cellswarm.quant import PackedExperts, PackedMatrix, format_for


class GGUFFile:
    """An open GGUF file: decoded metadata plus lazily mapped tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = _decode_metadata(self._reader)
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType(int(self._tensors[name].tensor_type))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Logical shape, outermost first (numpy order: (n_expert, out, in) / (out, in))."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def tensor_nbytes(self, name: str) -> int:
        return int(self._tensors[name].n_bytes)

    def tensor(self, name: str) -> Tensor:
        return _to_tensor(self._reader_tensor(name))

    def weights(self, selection: Selection | None = None) -> WeightStore:
        """The tensors `selection` keeps, as views into the mapping (nothing is read yet)."""
        sel = selection or Selection()
        return WeightStore(
            {name: sel.narrow(name, self.tensor(name)) for name in self._tensors if sel.keeps(name)}
        )

    def _reader_tensor(self, name: str) -> Any:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist; pass the path of a .gguf file")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "convert it with llama.cpp's convert_hf_to_gguf.py or pass a Hugging Face folder"
        )
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # gguf raises bare ValueError/IndexError on damaged headers
        raise ModelFileError(
            f"{path} is truncated or corrupt ({size} bytes; reading its header failed: {exc}); "
            "re-download or re-convert the file"
        ) from exc
    _check_extent(path, reader, size)
    return reader


def _check_extent(path: Path, reader: gguf.GGUFReader, size: int) -> None:
    """A truncated file maps fine; catch it here by comparing each tensor's extent to the size."""
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ModelFileError(
                f"{path} is truncated: tensor {t.name} ends at byte {end} but the file has "
                f"{size} bytes; re-download or re-convert the file"
            )


def _decode_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _to_tensor(t: Any) -> Tensor:
    ttype = gguf.GGMLQuantizationType(int(t.tensor_type))
    fmt = format_for(ttype)
    shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
    raw = np.asarray(t.data).view(np.uint8)
    if len(shape) == 1:
        # Norm weights and biases: small, always float; dequantize once (usually F32 already).
        return fmt.dequantize_blocks(raw.reshape(-1, fmt.type_size)).reshape(shape)
    row_bytes = fmt.row_bytes(shape[-1])
    if len(shape) == 2:
        return PackedMatrix(raw.reshape(shape[0], row_bytes), fmt)
    if len(shape) == 3:
        return PackedExperts(raw.reshape(shape[0], shape[1], row_bytes), fmt)
    raise ModelFileError(f"tensor {t.name} has {len(shape)} dimensions; at most 3 are supported")
