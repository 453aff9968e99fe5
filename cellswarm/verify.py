"""`cellswarm verify FILE`: what loading a GGUF file checks, without loading it, and then
every block's floating-point fields.

A file damaged on disk or in transit still loads when the damage hits tensor data: a flipped
exponent bit in a block's f16 scale makes that block NaN or infinite, and the model then
answers garbage (or the sampler a NaN) far from the cause. `verify` walks the header with
its metadata arrays bounds-checked against the file size and never allocated (a tokenizer's
hundreds of thousands of strings are stepped over), checks the architecture's config and
every tensor it expects (names, shapes, types, extents), then reads each block's scales (or
a float tensor's values) and tests their exponent bits: a NaN or infinity is named with its
tensor, block and row. It reads the scale bytes of the whole file once — for quantized types
every page — at the disk's speed; no float32 copy of any tensor is made.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cellswarm.errors import ModelFileError, NonFiniteError, RequestError, ShapeMismatchError
from cellswarm.io.gguf_file import TensorInfo, read_header
from cellswarm.io.weights import Selection
from cellswarm.quant import QuantFormat, first_nonfinite_block, format_for

VERSION = 1  # of what a cached verification promises; bump when the checks grow


@dataclass(frozen=True)
class Verified:
    path: str
    architecture: str
    tensors: int
    blocks: int  # blocks (or float values) whose float fields were read
    data_bytes: int  # tensor bytes under them

    def line(self) -> str:
        return (
            f"{self.path}: ok — {self.architecture}, {self.tensors} tensors, every scale of "
            f"{self.blocks:,} blocks finite ({self.data_bytes:,} bytes of tensor data)"
        )


def verify(path: str | os.PathLike[str], scales: bool = True,
           progress: Callable[[int, int], None] | None = None) -> Verified:  # fmt: skip
    """Check a GGUF file as `load` would, then (scales=True) every block's float fields.
    Raises the ModelFileError a load would, or NonFiniteError naming the tensor and row.
    `progress(bytes_read, bytes_total)` after each tensor (a big file reads for minutes)."""
    from cellswarm.models import config_from_gguf
    from cellswarm.models.from_file import check_tensors

    p = Path(path)
    if p.is_dir():
        raise RequestError(
            f"{p} is a folder; verify reads .gguf files (a Hugging Face folder's safetensors "
            "are checked when it loads)"
        )
    header = read_header(p, skim=True)
    infos = {t.name: t for t in header.tensors}
    _, config = config_from_gguf(p, header.metadata, {n: t.shape for n, t in infos.items()})
    check_tensors(p, config, Selection(), {n: t.shape for n, t in infos.items()})
    blocks, read, total = 0, 0, sum(t.n_bytes for t in header.tensors)
    with p.open("rb") as f:
        mapped = np.memmap(f, dtype=np.uint8, mode="r") if header.tensors else None
        for t in header.tensors:
            fmt = _format(p, t)
            n = t.n_bytes // fmt.type_size
            if scales and mapped is not None and n:
                raw = mapped[t.offset : t.offset + n * fmt.type_size]
                bad = first_nonfinite_block(raw, fmt)
                if bad is not None:
                    raise NonFiniteError(f"{p} is corrupt: {_where(t, fmt, bad)}")
                read += t.n_bytes
                if progress is not None:
                    progress(read, total)
            blocks += n
    return Verified(str(p), str(config.arch), len(infos), blocks, total)


def verify_cached(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  ) -> Verified | None:  # fmt: skip
    """`verify`, remembered by path, size and mtime (a coordinator restarting on a file it
    verified reads only its header again); None when the cache answered."""
    from cellswarm.swarm.transport.fetch import default_cache_dir

    p = Path(path).resolve()
    st = p.stat() if p.is_file() else None
    key = hashlib.sha256(f"{p}\0{st and st.st_size}\0{st and st.st_mtime_ns}\0{VERSION}".encode())
    mark = Path(cache_dir or default_cache_dir() / "verified") / key.hexdigest()[:32]
    if st is not None and mark.is_file():
        verify(p, scales=False)  # the header and tensor table again: cheap, and not cached
        return None
    result = verify(p, progress=progress)
    with contextlib.suppress(OSError):  # a cache that cannot be written costs time only
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(result.line() + "\n")
    return result


def _format(path: Path, t: TensorInfo) -> QuantFormat:
    try:
        fmt = format_for(t.ggml_type)
    except ModelFileError as exc:
        raise type(exc)(f"{path}: tensor {t.name}: {exc}; re-quantize the model") from None
    if t.shape[-1] % fmt.block_size:
        raise ShapeMismatchError(
            f"{path}: tensor {t.name} has rows of {t.shape[-1]} values, not whole {fmt.name} "
            f"blocks of {fmt.block_size}; the file is corrupt: re-download or re-convert it"
        )
    return fmt


def _where(t: TensorInfo, fmt: QuantFormat, block: int) -> str:
    """'tensor blk.3.ffn_down.weight has a NaN or infinite scale in block 17 (row 2)'."""
    per_row = t.shape[-1] // fmt.block_size
    row = block // per_row
    at = f"row {row}"
    if len(t.shape) == 3:
        at = f"expert {row // t.shape[1]}, row {row % t.shape[1]}"
    what = "value" if fmt.block_size == 1 else "scale"
    return (
        f"tensor {t.name} has a NaN or infinite {what} in block {block} ({at}); compare the "
        "file's sha256 with its source's and download it again"
    )
