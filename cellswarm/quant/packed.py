"""Weights kept in their GGUF block layout, dequantized only a bounded tile at a time.

A `PackedMatrix` wraps the bytes of a 2-D GGUF tensor (often a read-only np.memmap
view of the file) without copying them. `matmul` dequantizes a few rows of the weight
at a time, so the float32 working set is at most `TILE_BYTES`, never the whole matrix.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from cellswarm import kernels
from cellswarm.errors import ShapeMismatchError
from cellswarm.quant.formats import (
    Bytes,
    Floats,
    QuantFormat,
    dequantize,
    q5_0_as_q8_0,
    quantize,
)
from cellswarm.quant.ggml_types import GGMLQuantizationType

# Float32 bytes of one dequantized weight tile in `matmul`: big enough that np.matmul
# runs at BLAS speed, small enough to stay near cache and far below the model's size.
TILE_BYTES = 16 << 20
# Float32 bytes of one block of `matmul(rows_of=...)` (the output head), and how many blocks
# are in flight at once: together no more float32 than one tile.
BLOCK_BYTES = 4 << 20
BLOCK_WORKERS = TILE_BYTES // BLOCK_BYTES
GROUP_ROWS = 16  # rows in one group of a repacked weight (kernels.repack)
REPACK_CHUNK_BYTES = 4 << 20  # repacked this much at a time, its file pages then let go
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def _file_pages(data: npt.NDArray[Any]) -> tuple[int, int] | None:
    """The whole pages [lo, hi) under `data` when it is a read-only view of a mapped file
    (np.memmap mode "r"), which this process may drop: they leave its resident set, and
    reading them again maps them back from the page cache or the disk. None for anything else
    (memory of its own, a copy-on-write map), where dropping pages would lose bytes."""
    base: Any = data
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or getattr(base, "mode", None) != "r":
        return None
    page, start = mmap.PAGESIZE, int(data.ctypes.data)
    return -(-start // page) * page, (start + int(data.nbytes)) // page * page


def _advise(lo: int, hi: int, advice: int) -> None:
    if hi > lo:
        _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice)


def _drop(pages: tuple[int, int]) -> None:
    _advise(*pages, MADV_DONTNEED)


MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
HUGE_PAGE_BYTES = 2 << 20


def _huge_pages(a: npt.NDArray[Any]) -> None:
    """Ask for transparent huge pages under a buffer that will be written whole (a repacked
    copy): one fault and one zeroing per 2 MiB instead of per 4 KiB. A first prompt's lazy
    repack of a MoE's experts spent a quarter of its time in page faults and zeroing (under a
    hypervisor each fault costs more). Only for buffers written whole: a huge page under a
    partly written one (a stack whose unheld experts are never written) would make memory
    resident that the budget never counted. A no-op where THP is off."""
    start = int(a.ctypes.data)
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    _advise(lo, (start + int(a.nbytes)) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, MADV_HUGEPAGE)


def release_file_pages(data: npt.NDArray[Any]) -> None:
    """Let go of the whole file pages under `data` when it is a read-only view of a mapped
    file (they leave this process's resident set; reading them again maps them back), as a
    repack does once it has its copy; nothing for memory of its own."""
    if (pages := _file_pages(data)) is not None:
        _drop(pages)


def _repack_chunks(rows: int, row_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of ~REPACK_CHUNK_BYTES, whole 16-row groups, every one at least a group: the
    rows after the last whole group go with the chunk before them."""
    step = max(GROUP_ROWS, REPACK_CHUNK_BYTES // max(row_bytes, 1) // GROUP_ROWS * GROUP_ROWS)
    cuts = list(range(0, rows, step))
    if len(cuts) > 1 and rows - cuts[-1] < GROUP_ROWS:
        cuts.pop()
    return list(zip(cuts, [*cuts[1:], rows], strict=True))


_libc_handle: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _libc_handle
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(None, use_errno=True)
    return _libc_handle


def _as_bytes(data: npt.NDArray[Any], ndim: int, fmt: QuantFormat) -> Bytes:
    """A uint8 view (never a copy) of tensor data, checked to be `ndim`-D whole blocks.

    GGUFReader hands F32/F16 tensors out as float arrays (..., cols); viewing them as
    bytes gives the same (..., row_bytes) layout the quantized types have.
    """
    raw = cast(Bytes, data) if data.dtype == np.uint8 else data.view(np.uint8)
    if raw.ndim != ndim:
        raise ShapeMismatchError(
            f"packed {fmt.name} data must be {ndim}-D (..., row_bytes), got shape {raw.shape}"
        )
    fmt.n_cols(raw.shape[-1])  # raises unless rows are whole blocks
    return raw


class PackedMatrix:
    """A weight of logical shape (out_features, in_features) stored as GGUF blocks.

    `data` is uint8 (out_features, row_bytes), one packed row per output feature; it is
    held as given (a memmap stays a memmap).
    """

    __slots__ = ("_fused_args", "_repacked", "data", "fmt")

    def __init__(self, data: npt.NDArray[Any], fmt: QuantFormat) -> None:
        self.data: Bytes = _as_bytes(data, 2, fmt)
        self.fmt = fmt
        self._fused_args: tuple[tuple[int, int, int, int, int], Bytes] | bool | None = False
        self._repacked: tuple[int, Bytes] | None = None  # (format code, bytes): repack()

    def repack(self) -> bool:
        """Lay the bytes out for this CPU's fastest kernel (kernels.repack: every fused format
        but Q5_1 and NVFP4 in groups of 16 rows, on AVX-512 VNNI or AVX2), which reads them
        as the same numbers to the bit, and let go of the file's pages they came from: the
        weight then takes the same memory as before, in memory of its own instead of the page
        cache's, not twice. The fused paths (any batch) and dequantize read the new layout from then
        on; `data` stays the GGUF bytes (a view of the file: reading it again maps pages
        again; the numpy path does, CELLSWARM_KERNELS=numpy being the reference). False
        where there is no faster layout, and for a weight not read from a mapped file
        (memory of its own: a second copy would double it). Called by the fused layers for
        the matrices they own, and for an output head of its own (ops.head_matrix: its best
        rows are read back by take_rows, from this copy); not for the embedding, whose token
        lookups read the file's rows."""
        if self._repacked is not None:
            return True
        pages = _file_pages(self.data)
        fast = kernels.enabled() and kernels.can_fuse(self.fmt.name)
        code = kernels.repacked_code(self.fmt.name, self.shape[0]) if fast else None
        if not pages or code is None:
            return False
        src = self._contiguous()
        dst = np.empty_like(src)  # pages appear as they are written
        _huge_pages(dst)
        for a, b in _repack_chunks(self.shape[0], self.data.shape[1]):
            # a chunk at a time, its file pages let go at once: while a big matrix (a head of
            # 600 MB) is copied, it is not resident twice, only one chunk of it
            kernels.repack(self.fmt.name, src[a:b], dst[a:b])
            release_file_pages(self.data[a:b])
        _drop(pages)  # and the pages the chunks shared at their edges
        self._repacked = (code, dst)
        self._fused_args = False  # rebuilt on the new bytes
        return True

    @classmethod
    def from_float(cls, w: npt.ArrayLike, fmt: QuantFormat) -> PackedMatrix:
        """Quantize a float weight (out_features, in_features) into `fmt`."""
        return cls(quantize(w, fmt), fmt)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.data.shape[0]), self.fmt.n_cols(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes really held (the packed size, not the float32 size)."""
        return int(self.data.nbytes)

    def __repr__(self) -> str:
        return f"PackedMatrix({self.fmt.name}, shape={self.shape}, nbytes={self.nbytes})"

    def rows(self, start: int, stop: int) -> PackedMatrix:
        """Output rows [start, stop) as a view sharing this matrix's bytes."""
        n = self.shape[0]
        if not 0 <= start <= stop <= n:
            raise IndexError(f"rows [{start}, {stop}) are outside a matrix of {n} rows")
        return PackedMatrix(self.data[start:stop], self.fmt)

    def dequantize(self) -> Floats:
        """The whole weight as a new float32 array (out_features, in_features)."""
        return self._dequantize_rows(0, self.shape[0])

    def _dequantize_rows(self, start: int, stop: int) -> Floats:
        if self._repacked is not None and kernels.enabled():
            return self._dequantize_repacked(start, stop)
        rows = self.data[start:stop]  # (the numpy path reads the file's bytes again)
        if self.fmt.name in kernels.FUSED_TYPES and kernels.can_fuse(self.fmt.name):
            out = np.empty((stop - start, self.shape[1]), np.float32)
            kernels.dequantize(self.fmt.name, np.ascontiguousarray(rows), self.shape[1], out)
            return out
        return dequantize(rows, self.fmt)

    def _dequantize_repacked(self, start: int, stop: int) -> Floats:
        """Rows [start, stop) of a repacked weight: the whole 16-row groups around them (a
        group is readable only whole; the rows after the last group are as in the file)."""
        code, data = cast(tuple[int, Bytes], self._repacked)
        n = self.shape[0]
        a = start // GROUP_ROWS * GROUP_ROWS
        b = n if stop > n // GROUP_ROWS * GROUP_ROWS else -(-stop // GROUP_ROWS) * GROUP_ROWS
        out = np.empty((b - a, self.shape[1]), np.float32)
        kernels.dequantize(self.fmt.name, data[a:b], self.shape[1], out, code)
        return out[start - a : stop - a]

    @property
    def _fused(self) -> tuple[tuple[int, int, int, int, int], Bytes] | None:
        """Fused-kernel arguments, fixed for the life of this weight, and the bytes they point
        into (kept here so the pointer stays valid); None when the format has no kernel."""
        if self._fused_args is False:
            args = None
            if self._repacked is not None:
                code, data = self._repacked
                args = ((0, code, int(data.ctypes.data), *data.shape), data)
            elif kernels.can_fuse(self.fmt.name):
                data = self._contiguous()
                args = (kernels.weight_args(self.fmt.name, data, self.shape[1]), data)
            elif self.fmt.name == "Q5_0" and kernels.can_fuse("Q8_0"):
                # no kernel reads Q5_0; Q8_0 holds its values to the bit (34/22 of its bytes),
                # as the fused layers read it: the same arithmetic; in 16-row groups where
                # this CPU has them (a DeepSeek prefill's per-head W_UK, 64 columns, took 29%
                # of its time a row at a time)
                data = q5_0_as_q8_0(self._contiguous())
                packed = kernels.repack("Q8_0", data)
                if packed is not None:
                    code, data = packed
                    args = ((0, code, int(data.ctypes.data), *data.shape), data)
                else:
                    args = (kernels.weight_args("Q8_0", data, self.shape[1]), data)
            self._fused_args = args
        return self._fused_args  # type: ignore[return-value]

    def _contiguous(self) -> Bytes:
        # Views of a memory map are contiguous already; a copy happens only for odd views.
        return self.data if self.data.flags.c_contiguous else np.ascontiguousarray(self.data)

    def take_rows(self, ids: npt.ArrayLike) -> Floats:
        """Rows `ids` (any int shape) dequantized: (*ids.shape, in_features).

        This is an embedding lookup; only the selected rows are decoded.
        """
        index = np.asarray(ids, dtype=np.intp)
        if self._repacked is not None and kernels.enabled():  # not the file's pages: let go
            code, data = self._repacked
            out = np.empty((index.size, self.shape[1]), np.float32)
            kernels.dequantize_rows(code, data, self.shape[1], index.reshape(-1), out)
            return out.reshape(*index.shape, self.shape[1])
        if (
            index.ndim == 1
            and self.fmt.name in kernels.FUSED_TYPES
            and kernels.can_fuse(self.fmt.name)
        ):
            out = np.empty((len(index), self.shape[1]), np.float32)
            kernels.dequantize(self.fmt.name, self.data[index], self.shape[1], out)
            return out
        return dequantize(self.data[index], self.fmt)

    def matmul(
        self, x: npt.ArrayLike, *, tile_bytes: int | None = None,
        rows_of: tuple[int, int] | None = None,
    ) -> Floats:  # fmt: skip
        """x @ W.T for x of shape (..., in_features) -> (..., out_features), float32.

        With the C kernels, every output is computed in one fixed order of float operations
        (kernels/exact.c): its bits depend on the weights and the input only, not on the
        CPU's instruction set, the thread count, how many rows x has or which rows of W are
        held here. A format with its own kernel is read packed, any batch in one call; any
        other is decoded `tile_bytes` (default `TILE_BYTES`) of float32 at a time and each
        tile multiplied by the float kernel.

        rows_of=(first, total): these are rows [first, first + out_features) of a matrix of
        `total` rows, split over nodes (the output head on vocab parts). With the kernels a
        row is the same bits wherever it is; the numpy reference path computes it in the
        whole matrix's fixed blocks (`_matmul_blocks`) for the same reason.
        """
        out_features, in_features = self.shape
        xs = np.asarray(x, dtype=np.float32)
        if xs.shape[-1:] != (in_features,):
            raise ShapeMismatchError(
                f"input of shape {xs.shape} does not fit a {self.fmt.name} weight of "
                f"shape {self.shape}: last axis must be {in_features}"
            )
        if rows_of is not None and not 0 <= rows_of[0] <= rows_of[0] + out_features <= rows_of[1]:
            raise ShapeMismatchError(
                f"rows [{rows_of[0]}, {rows_of[0] + out_features}) of a {out_features}-row "
                f"weight do not fit in a matrix of {rows_of[1]} rows"
            )
        lead = xs.shape[:-1]
        x2 = xs.reshape(-1, in_features)  # (n, in)
        if kernels.enabled():
            return self._matmul_exact(x2, tile_bytes).reshape(*lead, out_features)
        if rows_of is not None:
            return self._matmul_blocks(x2, *rows_of).reshape(*lead, out_features)
        if self.fmt.ggml_type == GGMLQuantizationType.F32:
            # The bytes already are the weight: multiply by a float view, no tiles.
            return np.matmul(x2, self.data.view(np.float32).T).reshape(*lead, out_features)
        out = np.empty((x2.shape[0], out_features), dtype=np.float32)  # (n, out)
        for start, stop, tile in self._tiles(tile_bytes):
            # A column slice of a C-order result is still BLAS-addressable: no temp copy.
            np.matmul(x2, tile.T, out=out[:, start:stop])
        return out.reshape(*lead, out_features)

    def _matmul_exact(self, x2: Floats, tile_bytes: int | None) -> Floats:
        """x2 (n, in) @ W.T in the C kernels' one order (kernels/exact.c)."""
        x2 = x2 if x2.flags.c_contiguous and x2.flags.writeable else x2.copy()
        out = np.empty((x2.shape[0], self.shape[0]), dtype=np.float32)  # (n, out)
        fused = self._fused
        if fused is not None:  # packed, or F16/BF16/F32: one call for any batch
            kernels.matmul_args(fused[0], self.shape[1], x2, out)
            return out
        part = np.empty_like(out)
        for start, stop, tile in self._tiles(tile_bytes):  # other formats: float tiles
            sub = part[:, : stop - start]
            kernels.matmul("F32", tile, self.shape[1], x2, sub)
            out[:, start:stop] = sub
        return out

    def _tiles(self, tile_bytes: int | None) -> Iterator[tuple[int, int, Floats]]:
        """(start, stop, rows [start, stop) as float32), a bounded tile at a time."""
        out_features, in_features = self.shape
        budget = TILE_BYTES if tile_bytes is None else tile_bytes
        step = max(1, budget // max(1, in_features * 4))  # weight rows per tile
        for start in range(0, out_features, step):
            stop = min(start + step, out_features)
            yield start, stop, np.ascontiguousarray(self._dequantize_rows(start, stop))

    def _matmul_blocks(self, x2: Floats, first: int, total: int) -> Floats:
        """x2 (n, in) @ W.T for rows [first, first + out) of a `total`-row matrix, computed
        in that matrix's blocks [k * B, (k + 1) * B) of B = BLOCK_BYTES // (in * 4) rows.

        BLAS picks its kernel, and its blocking of the sum, by the call's shape and its
        thread count; a row's bits then depend on where it falls in the call. Here every
        block goes through one call of the same shape whoever computes it: a node holding
        part of a block fills the rows it lacks with zeros, and BLAS runs on one thread
        (blocks are spread over up to BLOCK_WORKERS threads of our own instead). So a row is
        the same bits on any split of the rows and any number of threads; the unsplit
        matrix (first 0, total its rows) is the one-process case.
        """
        rows, cols = self.shape
        if not 0 <= first <= first + rows <= total:
            raise ShapeMismatchError(
                f"rows [{first}, {first + rows}) of a {rows}-row weight do not fit in a "
                f"matrix of {total} rows"
            )
        out = np.empty((x2.shape[0], rows), dtype=np.float32)  # (n, rows)
        if rows == 0:
            return out
        block = max(1, BLOCK_BYTES // (cols * 4))
        blocks = range(first // block, (first + rows - 1) // block + 1)

        errors = np.geterr()  # the caller's, for our threads too (numpy's is per thread)

        def run(ks: range) -> None:
            with np.errstate(**errors):
                _run(ks)

        def _run(ks: range) -> None:
            for k in ks:
                g0, g1 = k * block, min((k + 1) * block, total)  # the block's global rows
                a, b = max(g0, first), min(g1, first + rows)  # the ones held here
                held = self._float_rows(a - first, b - first)  # (b - a, in)
                if (a, b) != (g0, g1):
                    tile = np.zeros((g1 - g0, cols), dtype=np.float32)
                    tile[a - g0 : b - g0] = held
                    held = tile
                y = np.matmul(x2, held.T)  # (n, g1 - g0): one call of the block's shape
                out[:, a - first : b - first] = y[:, a - g0 : b - g0]

        workers = min(kernels.threads(), BLOCK_WORKERS, len(blocks))
        with _one_blas_thread():
            if workers <= 1:
                run(blocks)
            else:
                pool = _block_pool()
                for f in [pool.submit(run, blocks[j::workers]) for j in range(workers)]:
                    f.result()
        return out

    def _float_rows(self, start: int, stop: int) -> Floats:
        """Rows [start, stop) as float32 (a view for F32 weights)."""
        if self.fmt.ggml_type == GGMLQuantizationType.F32:
            return self.data[start:stop].view(np.float32)
        return dequantize(self.data[start:stop], self.fmt)


_blas: Any = None
_pool: ThreadPoolExecutor | None = None


def _one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """BLAS on one thread for a block (threadpoolctl; a no-op without it)."""
    global _blas
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController().select(user_api="blas")
        except ImportError:
            _blas = False
    return _blas.limit(limits=1) if _blas else contextlib.nullcontext()


def _block_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(BLOCK_WORKERS, thread_name_prefix="blocks")
    return _pool


class PackedExperts:
    """A stack of expert weights, logical shape (n_expert, out_features, in_features).

    `data` is uint8 (n_expert, out_features, row_bytes), as GGUF stores ffn_*_exps.
    A node that runs only some experts `select`s them: the stack stays a view of the
    whole tensor (unselected experts of a memmap are never read, so never resident),
    `held` names the experts kept and `nbytes` counts only those.
    """

    __slots__ = ("_held", "_repacked", "data", "fmt")

    def __init__(
        self, data: npt.NDArray[Any], fmt: QuantFormat, held: Iterable[int] | None = None
    ) -> None:
        self.data: Bytes = _as_bytes(data, 3, fmt)
        self.fmt = fmt
        self._repacked: tuple[int, Bytes] | None = None  # (format code, the stack): repack()
        n = self.data.shape[0]
        self._held = tuple(range(n)) if held is None else tuple(sorted({int(e) for e in held}))
        if self._held and not 0 <= self._held[0] <= self._held[-1] < n:
            raise IndexError(f"experts {self._held} are outside 0..{n - 1}")

    @classmethod
    def from_float(cls, w: npt.ArrayLike, fmt: QuantFormat) -> PackedExperts:
        """Quantize float expert weights (n_expert, out_features, in_features) into `fmt`."""
        return cls(quantize(w, fmt), fmt)

    @property
    def shape(self) -> tuple[int, int, int]:
        n_expert, rows, row_bytes = self.data.shape
        return int(n_expert), int(rows), self.fmt.n_cols(row_bytes)

    @property
    def held(self) -> tuple[int, ...]:
        """Ids of the experts this stack serves, ascending."""
        return self._held

    @property
    def nbytes(self) -> int:
        """Packed bytes of the held experts."""
        return len(self._held) * int(self.data[0].nbytes) if len(self.data) else 0

    def __repr__(self) -> str:
        return (
            f"PackedExperts({self.fmt.name}, shape={self.shape}, held={len(self._held)}, "
            f"nbytes={self.nbytes})"
        )

    def select(self, ids: Iterable[int]) -> PackedExperts:
        """Only experts `ids` (a subset of `held`), sharing this stack's bytes."""
        chosen = tuple(sorted({int(e) for e in ids}))
        missing = [e for e in chosen if e not in self._held]
        if missing:
            raise IndexError(f"experts {missing} are not held; held: {list(self._held)}")
        out = PackedExperts(self.data, self.fmt, chosen)
        out._repacked = self._repacked
        return out

    def expert(self, e: int) -> PackedMatrix:
        """Expert `e`'s weight (out_features, in_features) as a view (of the repacked bytes
        too, once repacked)."""
        if e not in self._held:
            raise IndexError(f"expert {e} is not held; held: {list(self._held)}")
        m = PackedMatrix(self.data[e], self.fmt)
        if self._repacked is not None:
            m._repacked = (self._repacked[0], self._repacked[1][e])
        return m

    def repack(self) -> bool:
        """PackedMatrix.repack for the held experts: a stack of the same shape whose other
        experts are never written (so never resident), the held ones laid out for the fastest
        kernel, their file pages let go. Not for a stack in slow memory that a cache serves
        from (the tiered engine): that would bring every held expert into DRAM."""
        if self._repacked is not None:
            return True
        pages = _file_pages(self.data)
        fast = kernels.enabled() and kernels.can_fuse(self.fmt.name)
        code = kernels.repacked_code(self.fmt.name, self.data.shape[1]) if fast else None
        if not pages or code is None or not self._held:
            return False
        stack = np.empty(self.data.shape, np.uint8)  # pages appear where written
        if len(self._held) == self.data.shape[0]:
            _huge_pages(stack)  # every expert written
        for e in self._held:  # decided up front: never some experts repacked and some not
            kernels.repack(self.fmt.name, self.data[e], stack[e])
            release_file_pages(self.data[e])
        self._repacked = (code, stack)
        return True

    def dequantize(self) -> Floats:
        """Every expert as float32 (n_expert, out_features, in_features), e.g. to repack."""
        return dequantize(self.data, self.fmt)


def matmul_shared(mats: Sequence[PackedMatrix], x: npt.ArrayLike) -> list[Floats]:
    """x (n, in) @ W.T for each of `mats`, matrices that read the same input (Q, K and V; gate
    and up). With the kernels and every matrix in a packed integer format, x is quantized
    once for all (kernels.matmul_shared); each result is the bits of its own `matmul`."""
    xs = np.asarray(x, dtype=np.float32)
    fused = [m._fused for m in mats]
    args = [f[0] for f in fused if f is not None and f[0][0] == 0]
    cols = {m.shape[1] for m in mats}
    if not kernels.enabled() or xs.ndim != 2 or len(args) < len(mats) or cols != {xs.shape[1]}:
        return [m.matmul(xs) for m in mats]
    x2 = xs if xs.flags.c_contiguous and xs.flags.writeable else xs.copy()
    outs = [np.empty((x2.shape[0], m.shape[0]), dtype=np.float32) for m in mats]
    kernels.matmul_shared(args, xs.shape[1], x2, outs)
    return outs
