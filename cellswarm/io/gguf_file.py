"""Lazy GGUF access: the file is memory-mapped and tensors stay in their packed block layout.

Nothing is copied at open: a tensor is a view into the mapping, so the bytes of a tensor are
read from disk only when a computation touches them. `GGUFFile.weights(selection)` hands out
just the tensors a shard needs (a layer range, some experts, a slice of vocabulary rows).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import gguf
import numpy as np

from cellswarm.errors import (
    MissingTensorError,
    ModelFileError,
    ShapeMismatchError,
    UnsupportedQuantError,
)
from cellswarm.io.weights import Selection, Tensor, WeightStore
from cellswarm.quant import FORMATS, PackedExperts, PackedMatrix, format_for


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
        return gguf.GGMLQuantizationType(int(self._reader_tensor(name).tensor_type))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Logical shape, outermost first (numpy order: (n_expert, out, in) / (out, in))."""
        return tuple(int(d) for d in reversed(self._reader_tensor(name).shape))

    def tensor_nbytes(self, name: str) -> int:
        return int(self._reader_tensor(name).n_bytes)

    def tensor(self, name: str) -> Tensor:
        try:
            return _to_tensor(self._reader_tensor(name))
        except UnsupportedQuantError as exc:
            raise UnsupportedQuantError(
                f"{self.path}: tensor {name}: {exc}; re-quantize the model to one of these "
                "(llama.cpp's llama-quantize)"
            ) from None
        except ShapeMismatchError as exc:
            raise ShapeMismatchError(f"{self.path}: tensor {name}: {exc}") from None

    def weights(self, selection: Selection | None = None) -> WeightStore:
        """The tensors `selection` keeps, as views into the mapping (nothing is read yet)."""
        sel = selection or Selection()
        return WeightStore(
            {name: sel.narrow(name, self.tensor(name)) for name in self._tensors if sel.keeps(name)}
        )

    def _reader_tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise MissingTensorError(f"{self.path} has no tensor {name!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist; pass the path of a .gguf file")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF" and b"GGUF".startswith(magic):
        raise ModelFileError(
            f"{path} is truncated: it has {size} bytes, too few to hold a GGUF header; "
            "re-download or re-convert the file"
        )
    if magic != b"GGUF":
        raise ModelFileError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "convert it with llama.cpp's convert_hf_to_gguf.py or pass a Hugging Face folder"
        )
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # gguf raises bare ValueError/IndexError on damaged headers
        _check_header(path, size)  # names the damage when it can
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelFileError(
            f"{path} is corrupt ({size} bytes; reading its header failed: {reason}); "
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
                f"{path} is truncated: tensor {t.name} runs to byte {end} but the file has only "
                f"{size} bytes; re-download or re-convert the file"
            )


# ------------------------------------------------------------------ header damage, in words

_MAX_NAME = 65535  # GGUF caps key and tensor names; a longer one is garbage, not a cut
_MAX_COUNT = 1 << 24  # more tensors or metadata keys than any model has: a garbage count
_MAX_DIMS = 4
_SCALAR_SIZES = {
    gguf.GGUFValueType.UINT8: 1,
    gguf.GGUFValueType.INT8: 1,
    gguf.GGUFValueType.BOOL: 1,
    gguf.GGUFValueType.UINT16: 2,
    gguf.GGUFValueType.INT16: 2,
    gguf.GGUFValueType.UINT32: 4,
    gguf.GGUFValueType.INT32: 4,
    gguf.GGUFValueType.FLOAT32: 4,
    gguf.GGUFValueType.UINT64: 8,
    gguf.GGUFValueType.INT64: 8,
    gguf.GGUFValueType.FLOAT64: 8,
}


class _HeaderWalk:
    """Walks a GGUF header with bounds checks, to say where a file gguf's reader rejected is
    damaged: which metadata key or tensor entry runs past the end, or holds a garbage value."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int) -> None:
        self.path, self.buf, self.size = path, buf, size
        self.pos = 4  # after the magic
        self.order = "<"

    def run(self) -> None:
        (version,) = self.read("I", "the header")
        if version & 0xFFFF == 0:  # written on a big-endian machine, as gguf's reader assumes
            self.order = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in gguf.READER_SUPPORTED_VERSIONS:
            known = " and ".join(str(v) for v in gguf.READER_SUPPORTED_VERSIONS)
            self.corrupt(
                f"has GGUF version {version}; cellswarm reads versions {known}",
                "re-convert it with a current llama.cpp",
            )
        n_tensors, n_kv = self.read("QQ", "the header")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            self.corrupt(f"claims {n_tensors} tensors and {n_kv} metadata keys")
        keys: set[str] = set()
        align = gguf.GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = self.name(f"metadata key {i + 1} of {n_kv}")
            if key in keys:
                self.corrupt(f"holds metadata key {key!r} twice")
            keys.add(key)
            (vtype,) = self.read("I", f"metadata key {key!r}")
            if key == "general.alignment" and vtype == gguf.GGUFValueType.UINT32:
                (align,) = self.read("I", f"metadata key {key!r}")
                if align == 0 or align & (align - 1):
                    self.corrupt(f"gives general.alignment {align}, not a power of two")
                continue
            self.value(vtype, f"metadata key {key!r}")
        names: set[str] = set()
        extents: list[tuple[str, int, int]] = []  # name, offset in the data section, bytes
        for i in range(n_tensors):
            name = self.name(f"tensor entry {i + 1} of {n_tensors}")
            what = f"tensor entry {i + 1} of {n_tensors} ({name})"
            if name in names:
                self.corrupt(f"holds tensor {name} twice")
            names.add(name)
            (n_dims,) = self.read("I", what)
            if not 1 <= n_dims <= _MAX_DIMS:
                self.corrupt(f"says tensor {name} has {n_dims} dimensions")
            dims = self.read("Q" * n_dims, what)
            (ttype,) = self.read("I", what)
            if ttype not in gguf.GGML_QUANT_SIZES:
                supported = ", ".join(f.name for f in FORMATS.values())
                raise UnsupportedQuantError(
                    f"{self.path}: tensor {name} has type id {ttype}, which GGUF does not define "
                    f"(supported: {supported}); the file is corrupt or needs a newer reader"
                )
            (offset,) = self.read("Q", what)
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            extents.append((name, offset, math.prod(dims) * type_size // block))
        data_start = -(-self.pos // align) * align
        for name, offset, n_bytes in extents:
            end = data_start + offset + n_bytes
            if end > self.size:
                raise ModelFileError(
                    f"{self.path} is truncated: tensor {name} runs to byte {end} but the file "
                    f"has only {self.size} bytes; re-download or re-convert the file"
                )

    def value(self, vtype: int, what: str) -> None:
        if vtype in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[gguf.GGUFValueType(vtype)], what)
        elif vtype == gguf.GGUFValueType.STRING:
            (n,) = self.read("Q", what)
            self.skip(n, what)
        elif vtype == gguf.GGUFValueType.ARRAY:
            item_type, count = self.read("IQ", what)
            if count > self.size:  # every item takes at least a byte
                self.corrupt(f"gives {what} {count} items")
            if item_type in _SCALAR_SIZES:
                self.skip(count * _SCALAR_SIZES[gguf.GGUFValueType(item_type)], what)
                return
            for _ in range(count):
                self.value(item_type, what)
        else:
            self.corrupt(f"gives {what} value type {vtype}, which GGUF does not define")

    def name(self, what: str) -> str:
        (n,) = self.read("Q", what)
        if n > _MAX_NAME:
            self.corrupt(f"gives {what} a name of {n} bytes")
        start = self.pos
        self.skip(n, what)
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def read(self, fmt: str, what: str) -> tuple[int, ...]:
        start = self.pos
        self.skip(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.buf, start)

    def skip(self, n: int, what: str) -> None:
        end = self.pos + n
        if end > self.size:
            if n > self.size:  # a length no cut could explain: the length itself is garbage
                self.corrupt(f"gives {what} a length of {n} bytes")
            raise ModelFileError(
                f"{self.path} is truncated: {what} runs to byte {end} but the file has only "
                f"{self.size} bytes; re-download or re-convert the file"
            )
        self.pos = end

    def corrupt(self, what: str, fix: str = "re-download or re-convert the file") -> NoReturn:
        raise ModelFileError(f"{self.path} is corrupt: it {what}; {fix}")


def _check_header(path: Path, size: int) -> None:
    """Raise a ModelFileError naming the damage in a header gguf's reader could not parse."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _HeaderWalk(path, buf, size).run()


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
