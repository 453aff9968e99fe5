"""The slow tier: the model file (PMem, SSD) read into buffers, paced to a bandwidth, its
pages released after each read; page-fault counters."""

from __future__ import annotations

import mmap
import os
import resource
import time
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
# A fault on a file mapping maps more than the faulting page: fault-around (64 KiB of cached
# pages) and, where the filesystem caches the file in large folios (ext4 on Linux 6.x: up
# to 2 MiB), the whole folio. A release covers the aligned 2 MiB windows a range touched;
# dropping a neighbour's mapping is harmless (it is read-only and re-faults if needed).
RELEASE_ALIGN = max(PAGE, 2 << 20)


def faults() -> tuple[int, int]:
    """(major, minor) page faults of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return int(r.ru_majflt), int(r.ru_minflt)


class SlowTier:
    """The model file, memory-mapped read-only; expert bytes are copied out of it and their
    pages released after each copy. `bandwidth`: pace reads to this many bytes/s (None:
    as fast as the device gives them)."""

    def __init__(self, path: Path, bandwidth: float | None = None) -> None:
        self.path = path
        self._fh = path.open("rb")
        self.fd = self._fh.fileno()
        self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        self.view = np.frombuffer(self.map, dtype=np.uint8)
        self.bandwidth = bandwidth
        self.bytes_read = 0
        self.seconds = 0.0  # time spent reading, throttle sleep included

    def read_into(self, ranges: list[tuple[int, int]], out: np.ndarray) -> None:
        """Copy the file ranges (offset, nbytes), back to back, into `out` (uint8), then
        release their pages from the mapping and the page cache."""
        t0 = time.perf_counter()
        pos = 0
        for off, n in ranges:
            out[pos : pos + n] = self.view[off : off + n]
            pos += n
        for off, n in ranges:
            self.release(off, n)
        elapsed = time.perf_counter() - t0
        if self.bandwidth:
            wait = pos / self.bandwidth - elapsed
            if wait > 0:
                time.sleep(wait)
        self.bytes_read += pos
        self.seconds += time.perf_counter() - t0

    def release(self, off: int, n: int) -> None:
        start = off - off % RELEASE_ALIGN
        length = off + n - start
        length += -length % RELEASE_ALIGN
        length = min(length, len(self.map) - start)
        self.map.madvise(mmap.MADV_DONTNEED, start, length)
        first = off - off % PAGE  # the page cache: only the pages read
        os.posix_fadvise(self.fd, first, off + n - first, os.POSIX_FADV_DONTNEED)

    def page_cache_bytes(self) -> int:
        """Bytes of the model file in the page cache now (mincore over the whole mapping):
        whether the page cache is quietly acting as a DRAM tier. -1 where unavailable."""
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pages = -(-len(self.map) // PAGE)
            vec = (ctypes.c_ubyte * pages)()
            addr = ctypes.c_void_p(self.view.ctypes.data)
            if libc.mincore(addr, ctypes.c_size_t(len(self.map)), vec) != 0:
                return -1
            return int((np.frombuffer(bytes(vec), np.uint8) & 1).sum()) * PAGE
        except (OSError, AttributeError):
            return -1

    def release_all(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED, 0, len(self.map))
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)


# ----------------------------------------------------------------------------- expert cache
