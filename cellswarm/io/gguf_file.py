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
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np

from cellswarm.errors import (
    MissingTensorError,
    ModelFileError,
    ShapeMismatchError,
    UnsupportedQuantError,
)
from cellswarm.quant import FORMATS, format_for
from cellswarm.quant.ggml_types import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    READER_SUPPORTED_VERSIONS,
    GGMLQuantizationType,
    GGUFValueType,
)

if TYPE_CHECKING:  # the packed weights bring the kernels: loaded when a tensor is made, so
    # reading a header (the planner, verify) does not
    from cellswarm.io.weights import Selection, Tensor, WeightStore


class GGUFFile:
    """An open GGUF file: decoded metadata plus lazily mapped tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.metadata, infos = _read_header(self.path)
        self._tensors = {t.name: t for t in infos}
        # One read-only mapping of the whole file; tensors are views into it, so opening a
        # file reads only its header (gguf's own reader builds a numpy array per string of
        # the vocabulary: ~160 MB of Python objects for a 49k-token model).
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if infos else None

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self._reader_tensor(name).ggml_type)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Logical shape, outermost first (numpy order: (n_expert, out, in) / (out, in))."""
        return self._reader_tensor(name).shape

    def tensor_nbytes(self, name: str) -> int:
        return self._reader_tensor(name).n_bytes

    def tensor(self, name: str) -> Tensor:
        info = self._reader_tensor(name)
        assert self._map is not None
        raw = self._map[info.offset : info.offset + info.n_bytes]
        try:
            return to_tensor(info, raw)
        except UnsupportedQuantError as exc:
            raise UnsupportedQuantError(
                f"{self.path}: tensor {name}: {exc}; re-quantize the model to one of these "
                "(llama.cpp's llama-quantize)"
            ) from None
        except ShapeMismatchError as exc:
            raise ShapeMismatchError(f"{self.path}: tensor {name}: {exc}") from None

    def weights(self, selection: Selection | None = None) -> WeightStore:
        """The tensors `selection` keeps, as views into the mapping (nothing is read yet)."""
        from cellswarm.io.weights import Selection, WeightStore

        sel = selection or Selection()
        tensors = {name: sel.narrow(name, self.tensor(name))
                   for name in self._tensors if sel.keeps(name)}  # fmt: skip
        # Vectors (norms, biases: kB each) go into memory of their own, and the file's pages
        # this process mapped to copy them are let go. The page cache hands out large folios
        # (2 MB here), and a fault maps a whole one: reading a layer's 2 kB norm at every
        # prefill mapped ~2 MB of the weights around it back into this process, beside their
        # repacked copies, and a 128 MiB stage's peak passed its --memory by a MB or two.
        vectors = {n: np.array(t) for n, t in tensors.items()
                   if isinstance(t, np.ndarray) and t.ndim == 1}  # fmt: skip
        if vectors and self._map is not None:
            from cellswarm.quant.packed import release_file_pages

            release_file_pages(self._map)
        return WeightStore(tensors | vectors)

    def _reader_tensor(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise MissingTensorError(f"{self.path} has no tensor {name!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)


class TensorInfo(NamedTuple):
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order: outermost first
    n_bytes: int
    offset: int  # from the start of the file


class Header(NamedTuple):
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    size_bytes: int  # metadata and tensor entries, up to (not including) the alignment padding


class IncompleteHeader(Exception):  # control flow between cellswarm modules, never shown
    """The bytes given end inside the header (the file itself may be whole): read at least
    `end_bytes` bytes of it and parse again. Raised only by `parse_header` on a prefix."""

    def __init__(self, end_bytes: int) -> None:
        super().__init__(f"the header runs to at least byte {end_bytes}")
        self.end_bytes = end_bytes


def parse_header(prefix: bytes, file_size: int, source: str | Path) -> Header:
    """The header of a GGUF file of `file_size` bytes from its first bytes, `prefix` (a worker
    fetching a file chunk by chunk has only these; the rest may still be holes). Damage is
    judged against `file_size`, so messages match `GGUFFile`'s; raises IncompleteHeader when
    the header runs past the end of `prefix` but not past the end of the file."""
    _check_magic(prefix[:4], file_size, source)
    return _walk(source, prefix, file_size)


class SkippedArray(NamedTuple):
    """A metadata array `read_header(skim=True)` checked but did not read into memory."""

    item_type: int
    n_items: int


def read_header(path: str | os.PathLike[str], *, skim: bool = False,
                skim_large: bool = False) -> Header:  # fmt: skip
    """A GGUF file's header, checked against the file's size. skim: metadata arrays (a
    tokenizer's hundreds of thousands of strings) are bounds-checked and stepped over, not
    allocated; they read as `SkippedArray`s. skim_large: only those of more than
    MAX_READ_ITEMS items outside `tokenizer.` (what a model needs; a stray array of a
    hundred million floats would be 3 GB of Python objects)."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file {p} does not exist; pass the path of a .gguf file")
    size = p.stat().st_size
    with p.open("rb") as f:
        _check_magic(f.read(4), size, p)
    with p.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _walk(p, buf, size, skim, skim_large)


def _read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    header = read_header(path, skim_large=True)
    return header.metadata, header.tensors


def _check_magic(magic: bytes, size: int, source: str | Path) -> None:
    if magic != b"GGUF" and b"GGUF".startswith(magic):
        raise ModelFileError(
            f"{source} is truncated: it has {size} bytes, too few to hold a GGUF header; "
            "re-download or re-convert the file"
        )
    if magic != b"GGUF":
        raise ModelFileError(
            f"{source} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "convert it with llama.cpp's convert_hf_to_gguf.py or pass a Hugging Face folder"
        )


def _walk(source: str | Path, buf: mmap.mmap | bytes, size: int, skim: bool = False,
          skim_large: bool = False) -> Header:  # fmt: skip
    try:
        return _HeaderWalk(source, buf, size, skim, skim_large).run()
    except (UnicodeDecodeError, ValueError, struct.error) as exc:
        raise ModelFileError(
            f"{source} is corrupt ({size} bytes; reading its header failed: {exc}); "
            "re-download or re-convert the file"
        ) from exc


# ------------------------------------------------------------------ header damage, in words

_MAX_NAME = 65535  # GGUF caps key and tensor names; a longer one is garbage, not a cut
MAX_READ_ITEMS = 65_536  # a metadata array outside tokenizer.* longer than this is skimmed
_MAX_COUNT = 1 << 24  # more tensors or metadata keys than any model has: a garbage count
_MAX_DIMS = 4
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# The fewest bytes an array item of these types takes: a string's length, an array's type
# and count (scalars: _SCALAR_SIZES).
_LEAST_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


class _HeaderWalk:
    """Reads a GGUF header with bounds checks: metadata and tensor entries, and where a file is
    damaged, which metadata key or tensor entry runs past the end or holds a garbage value."""

    def __init__(
        self, path: str | Path, buf: mmap.mmap | bytes, size: int, skim: bool = False,
        skim_large: bool = False,
    ) -> None:  # fmt: skip
        # size: the whole file's; buf may hold fewer bytes (a prefix of the file).
        self.path, self.buf, self.size, self.skim = path, buf, size, skim
        self.skim_large, self.key = skim_large, ""  # the metadata key being read
        self.pos = 4  # after the magic
        self.order = "<"

    def run(self) -> Header:
        (version,) = self.read("I", "the header")
        if version & 0xFFFF == 0:  # written on a big-endian machine, as gguf's reader assumes
            self.order = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in READER_SUPPORTED_VERSIONS:
            known = " and ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
            self.corrupt(
                f"has GGUF version {version}; cellswarm reads versions {known}",
                "re-convert it with a current llama.cpp",
            )
        n_tensors, n_kv = self.read("QQ", "the header")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            self.corrupt(f"claims {n_tensors} tensors and {n_kv} metadata keys")
        meta: dict[str, Any] = {}
        align = GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = self.key = self.name(f"metadata key {i + 1} of {n_kv}")
            if key in meta:
                self.corrupt(f"holds metadata key {key!r} twice")
            (vtype,) = self.read("I", f"metadata key {key!r}")
            meta[key] = self.value(vtype, f"metadata key {key!r}")
            if key == "general.alignment" and vtype == GGUFValueType.UINT32:
                align = meta[key]
                if align == 0 or align & (align - 1):
                    self.corrupt(f"gives general.alignment {align}, not a power of two")
        names: set[str] = set()
        extents: list[tuple[str, int, int]] = []  # name, offset in the data section, bytes
        infos: list[tuple[str, int, tuple[int, ...]]] = []
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
            if 0 in dims:  # a weight is never empty; (2**62, 32, 0) would fit any file
                self.corrupt(f"says tensor {name} has dimensions {list(dims)}, one of them 0")
            (ttype,) = self.read("I", what)
            if ttype not in GGML_QUANT_SIZES:
                supported = ", ".join(f.name for f in FORMATS.values())
                raise UnsupportedQuantError(
                    f"{self.path}: tensor {name} has type id {ttype}, which GGUF does not define "
                    f"(supported: {supported}); the file is corrupt or needs a newer reader"
                )
            (offset,) = self.read("Q", what)
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            extents.append((name, offset, math.prod(dims) * type_size // block))
            infos.append((name, ttype, tuple(int(d) for d in reversed(dims))))
        header_bytes = self.pos
        data_start = -(-self.pos // align) * align
        for name, offset, n_bytes in extents:
            end = data_start + offset + n_bytes
            if end > self.size:
                raise ModelFileError(
                    f"{self.path} is truncated: tensor {name} runs to byte {end} but the file "
                    f"has only {self.size} bytes; re-download or re-convert the file"
                )
        tensors = [
            TensorInfo(name, ttype, shape, n_bytes, data_start + offset)
            for (name, ttype, shape), (_, offset, n_bytes) in zip(infos, extents, strict=True)
        ]
        return Header(meta, tensors, header_bytes)

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALAR_SIZES:
            vt = GGUFValueType(vtype)
            (v,) = self.read(_SCALAR_FORMATS[vt], what)
            return bool(v) if vt == GGUFValueType.BOOL else v
        if vtype == GGUFValueType.STRING:
            (n,) = self.read("Q", what)
            start = self.pos
            self.skip(n, what)
            return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")
        if vtype == GGUFValueType.ARRAY:
            item_type, count = self.read("IQ", what)
            if count > self.size:  # every item takes at least a byte
                self.corrupt(f"gives {what} {count} items")
            try:
                it = GGUFValueType(item_type)
            except ValueError:
                self.corrupt(f"gives {what} array item type {item_type}, which GGUF does not "
                             "define")  # fmt: skip
            least = _SCALAR_SIZES.get(it) or _LEAST_BYTES[it]
            # the items' least bytes must be in the file before a list of them is made (a
            # cut, not garbage: the count alone was checked, a cut file may end anywhere)
            self.reserve(count * least, f"{what} ({count} items)", garbage=False)
            if self.skim or (self.skim_large and count > MAX_READ_ITEMS
                             and not self.key.startswith("tokenizer.")):  # fmt: skip
                if item_type in _SCALAR_SIZES:
                    self.skip(count * least, what)
                else:
                    for _ in range(count):
                        self.step_over(item_type, what)
                return SkippedArray(item_type, count)
            if item_type in _SCALAR_SIZES:
                return self.numbers(GGUFValueType(item_type), count, what)
            return [self.value(item_type, what) for _ in range(count)]
        self.corrupt(f"gives {what} value type {vtype}, which GGUF does not define")

    def step_over(self, vtype: int, what: str) -> None:
        """Past one array item, allocating nothing (a string's bytes are not decoded)."""
        if vtype == GGUFValueType.STRING:
            (n,) = self.read("Q", what)
            self.skip(n, what)
        else:
            self.value(vtype, what)  # a nested array: skimmed as well

    def numbers(self, vt: GGUFValueType, count: int, what: str) -> list[Any]:
        start = self.pos
        self.skip(count * _SCALAR_SIZES[vt], what)
        dtype = np.dtype(_SCALAR_FORMATS[vt]).newbyteorder("<" if self.order == "<" else ">")
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
        return [bool(v) for v in values] if vt == GGUFValueType.BOOL else values

    def name(self, what: str) -> str:
        (n,) = self.read("Q", what)
        if n > _MAX_NAME:
            self.corrupt(f"gives {what} a name of {n} bytes")
        start = self.pos
        self.skip(n, what)
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def read(self, fmt: str, what: str) -> tuple[int, ...]:
        start = self.pos
        self.skip(struct.calcsize(self.order + fmt), what)
        return struct.unpack_from(self.order + fmt, self.buf, start)

    def skip(self, n: int, what: str) -> None:
        self.reserve(n, what)
        end = self.pos + n
        if end > len(self.buf):
            raise IncompleteHeader(end)
        self.pos = end

    def reserve(self, n: int, what: str, garbage: bool = True) -> None:
        """Refuse unless the file holds `n` more bytes from here (whatever `buf` holds)."""
        end = self.pos + n
        if end > self.size:
            if garbage and n > self.size:  # a length no cut explains: the length is garbage
                self.corrupt(f"gives {what} a length of {n} bytes")
            raise ModelFileError(
                f"{self.path} is truncated: {what} runs to byte {end} but the file has only "
                f"{self.size} bytes; re-download or re-convert the file"
            )

    def corrupt(self, what: str, fix: str = "re-download or re-convert the file") -> NoReturn:
        raise ModelFileError(f"{self.path} is corrupt: it {what}; {fix}")


def to_tensor(t: TensorInfo, raw: np.ndarray) -> Tensor:
    from cellswarm.quant.packed import PackedExperts, PackedMatrix

    fmt = format_for(GGMLQuantizationType(t.ggml_type))
    shape = t.shape  # numpy order
    if len(shape) == 1:
        # Norm weights and biases: small, always float; dequantize once (usually F32 already).
        return fmt.dequantize_blocks(raw.reshape(-1, fmt.type_size)).reshape(shape)
    row_bytes = fmt.row_bytes(shape[-1])
    if len(shape) == 2:
        return PackedMatrix(raw.reshape(shape[0], row_bytes), fmt)
    if len(shape) == 3:
        return PackedExperts(raw.reshape(shape[0], shape[1], row_bytes), fmt)
    raise ModelFileError(f"tensor {t.name} has {len(shape)} dimensions; at most 3 are supported")
