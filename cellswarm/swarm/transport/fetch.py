"""A worker that cannot read the model file fetches only its shard's bytes from the coordinator.

The coordinator describes its file with a `Manifest` (the file's sha256 as its content id, and
a sha256 per fixed-size chunk) and serves chunks with `read_chunk`. A worker calls
`ensure_local`: it keeps a sparse copy of the whole file named by content hash, fetches the
header chunks, parses the tensor table from them, and fetches only the chunks holding the
tensors its `Selection` keeps — for an expert stack or the vocabulary tensors, only the slices
of the experts / rows it keeps. Each chunk is checked against the manifest before it is written,
and the indices of written chunks are recorded in a sidecar replaced atomically after the data
is on disk, so a restart fetches nothing twice and a crash never marks a chunk present that is
not. The copy then opens as an ordinary GGUF: the engine touches only the selected tensors,
never the holes.

The transport (HTTP on the coordinator) is the caller's: `ensure_local` takes a function
`fetch_chunk(index) -> bytes`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cellswarm.errors import ChunkMismatchError, ModelFileError, ProtocolError, RequestError
from cellswarm.io.gguf_file import Header, IncompleteHeader, TensorInfo, parse_header
from cellswarm.io.names import layer_of
from cellswarm.io.weights import Selection

DEFAULT_CHUNK_BYTES = 4 * 2**20  # a few per tensor of a large model; small enough to retry
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_VOCAB_TENSORS = ("token_embd.weight", "output.weight")


def default_cache_dir() -> Path:
    """~/.cache/cellswarm, or $CELLSWARM_CACHE as for the kernels: manifests/ and models/."""
    return Path(os.environ.get("CELLSWARM_CACHE") or Path.home() / ".cache" / "cellswarm")


# --------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class Manifest:
    """What a worker needs to fetch and check a file: its content id and chunk hashes.

    sha256 is the whole file's (the same as `sha256sum`, so it can be checked against a model
    hub's listing); chunk i covers bytes [i * chunk_bytes, min((i + 1) * chunk_bytes, size)).
    """

    sha256: str
    size_bytes: int
    chunk_bytes: int
    chunk_sha256: tuple[str, ...]

    def __post_init__(self) -> None:
        # The content id names a file on the worker: it must be a hash, never a path.
        bad = [h for h in (self.sha256, *self.chunk_sha256) if not _SHA256_RE.match(h)]
        if bad:
            raise ProtocolError(f"manifest holds {bad[0]!r}, not a lowercase hex sha256")
        if self.chunk_bytes <= 0 or self.size_bytes < 0:
            raise ProtocolError(
                f"manifest gives chunk_bytes {self.chunk_bytes} and size_bytes {self.size_bytes}"
            )
        if len(self.chunk_sha256) != self.n_chunks:
            raise ProtocolError(
                f"manifest lists {len(self.chunk_sha256)} chunk hashes, but {self.size_bytes} "
                f"bytes in chunks of {self.chunk_bytes} make {self.n_chunks}"
            )

    @property
    def n_chunks(self) -> int:
        return -(-self.size_bytes // self.chunk_bytes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Byte range [start, end) of chunk `index`."""
        if not 0 <= index < self.n_chunks:
            raise RequestError(
                f"chunk {index} does not exist; the file has chunks 0 to {self.n_chunks - 1}"
            )
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.size_bytes)

    def to_json(self) -> str:
        return json.dumps(
            {
                "sha256": self.sha256,
                "size_bytes": self.size_bytes,
                "chunk_bytes": self.chunk_bytes,
                "chunk_sha256": list(self.chunk_sha256),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            d = json.loads(text)
            return cls(
                str(d["sha256"]),
                int(d["size_bytes"]),
                int(d["chunk_bytes"]),
                tuple(str(h) for h in d["chunk_sha256"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed manifest ({exc!r}); fetch it again") from None


def build_manifest(
    path: str | os.PathLike[str],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Manifest:
    """The manifest of the file at `path`. Hashing a large file takes a while, so the result is
    kept in `cache_dir` (default ~/.cache/cellswarm/manifests; not next to the model, whose
    folder may be read-only) under a key of the path, size, mtime and chunk size: a file that
    changes gets a new manifest."""
    p = Path(path).resolve()
    if not p.is_file():
        raise ModelFileError(f"model file {p} does not exist; pass the path of a .gguf file")
    if chunk_bytes <= 0:
        raise RequestError(f"chunk_bytes must be positive, got {chunk_bytes}")
    st = p.stat()
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{chunk_bytes}".encode())
    where = Path(cache_dir or default_cache_dir() / "manifests") / f"{key.hexdigest()[:32]}.json"
    with contextlib.suppress(OSError, ProtocolError):
        cached = Manifest.from_json(where.read_text())
        if cached.size_bytes == st.st_size and cached.chunk_bytes == chunk_bytes:
            return cached
    manifest = _hash_file(p, chunk_bytes)
    with contextlib.suppress(OSError):  # a cache that cannot be written costs time, not results
        where.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(where, manifest.to_json().encode())
    return manifest


def _hash_file(path: Path, chunk_bytes: int) -> Manifest:
    # The whole-file hash is sequential; each chunk's hash runs beside it on a thread (hashlib
    # lets go of the GIL), which nearly halves the time of a many-gigabyte file.
    # At most two chunks wait for their hash, so memory stays two chunks whatever the file.
    whole, size, chunks = hashlib.sha256(), 0, []
    pending: deque[Future[str]] = deque()
    with path.open("rb") as f, ThreadPoolExecutor(1) as pool:
        while data := f.read(chunk_bytes):
            if len(pending) == 2:
                chunks.append(pending.popleft().result())
            pending.append(pool.submit(lambda d: hashlib.sha256(d).hexdigest(), data))
            whole.update(data)
            size += len(data)
        chunks.extend(p.result() for p in pending)
    return Manifest(whole.hexdigest(), size, chunk_bytes, tuple(chunks))


def read_chunk(path: str | os.PathLike[str], manifest: Manifest, index: int) -> bytes:
    """Chunk `index` of the file, for the coordinator to serve. Not hashed here: the worker
    checks every chunk, and a file whose size no longer matches is refused outright."""
    start, end = manifest.chunk_range(index)
    with Path(path).open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != manifest.size_bytes:
            raise ModelFileError(
                f"{path} has {size} bytes but its manifest says {manifest.size_bytes}; the file "
                "changed since the manifest was built — build it again (build_manifest)"
            )
        f.seek(start)
        return f.read(end - start)


# ------------------------------------------------------------------ which bytes a shard needs


def selected_ranges(tensors: Iterable[TensorInfo], selection: Selection) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of the file that the tensors `selection` keeps occupy, cut as
    `Selection.narrow` cuts them: only the kept vocabulary rows of the embedding / head, only
    the kept experts' slices of a routed-expert stack. Sorted and merged."""
    ranges: list[tuple[int, int]] = []
    for t in tensors:
        if not selection.keeps(t.name):
            continue
        ranges.extend(_narrowed(t, selection))
    return _merge(ranges)


def _narrowed(t: TensorInfo, selection: Selection) -> Iterator[tuple[int, int]]:
    # Rows of a matrix and experts of a stack are contiguous, equal-size slices of its bytes.
    stride = t.n_bytes // t.shape[0] if t.shape and t.shape[0] else t.n_bytes
    if t.name in _VOCAB_TENSORS and selection.vocab_rows is not None and len(t.shape) == 2:
        lo, hi = selection.vocab_rows
        yield t.offset + lo * stride, t.offset + hi * stride
        return
    layer = layer_of(t.name)
    kept = selection.experts.get(layer) if selection.experts and layer is not None else None
    if t.name.endswith("_exps.weight") and len(t.shape) == 3 and kept is not None:
        for e in sorted(set(kept)):
            yield t.offset + e * stride, t.offset + (e + 1) * stride
        return
    yield t.offset, t.offset + t.n_bytes


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def chunks_needed(
    header_bytes: int, ranges: Iterable[tuple[int, int]], chunk_bytes: int, size_bytes: int
) -> list[int]:
    """Indices of the chunks covering the header [0, header_bytes) and every range [start,
    end), in order. A range past the end of the file is a bug in the caller, not a cut."""
    needed: set[int] = set()
    for start, end in [(0, header_bytes), *ranges]:
        if not 0 <= start <= end <= size_bytes:
            raise ValueError(f"range [{start}, {end}) is outside a file of {size_bytes} bytes")
        if end > start:
            needed.update(range(start // chunk_bytes, (end - 1) // chunk_bytes + 1))
    return sorted(needed)


# ---------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class FetchReport:
    """What `ensure_local` did, for the worker's log. chunks_* count chunk indices; a chunk
    that had to be fetched twice (a bad copy, then a good one) counts once in chunks_fetched
    and once in retries; bytes_fetched counts good copies only."""

    path: Path  # the local copy; open it as a GGUF file
    chunks_needed: int  # header and selected tensors
    chunks_fetched: int
    chunks_cached: int  # needed and already present from an earlier run
    bytes_fetched: int
    selected_bytes: int  # the selected tensors' own bytes (chunks round this up)
    retries: int


def ensure_local(
    manifest: Manifest,
    selection: Selection,
    fetch_chunk: Callable[[int], bytes],
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FetchReport:
    """Make `cache_dir/<sha256>.gguf` (default ~/.cache/cellswarm/models) hold the header and
    every tensor `selection` keeps, fetching only the chunks not already there; the rest of
    the file stays holes. Raises ChunkMismatchError if a chunk is bad twice in a row.
    `progress(done_bytes, total_bytes)` is called after each chunk of the shard."""
    folder = Path(cache_dir or default_cache_dir() / "models")
    folder.mkdir(parents=True, exist_ok=True)
    with _Local(folder, manifest, fetch_chunk) as local:
        header = local.header()
        ranges = selected_ranges(header.tensors, selection)
        needed = chunks_needed(header.size_bytes, ranges, manifest.chunk_bytes, manifest.size_bytes)
        total = sum(_span(manifest.chunk_range(i)) for i in needed)
        done = 0
        for i in needed:
            local.ensure(i)
            done += _span(manifest.chunk_range(i))
            if progress is not None:
                progress(done, total)
        fetched = local.fetched
        return FetchReport(
            path=local.path,
            chunks_needed=len(needed),
            chunks_fetched=len(fetched),
            chunks_cached=len(set(needed) - fetched),
            bytes_fetched=sum(_span(manifest.chunk_range(i)) for i in fetched),
            selected_bytes=sum(_span(r) for r in ranges),
            retries=local.retries,
        )


def _span(r: tuple[int, int]) -> int:
    return r[1] - r[0]


class _Local:
    """The sparse local copy, its sidecar of verified chunks, and an exclusive lock so that
    two workers on one machine sharing a cache do not interleave their writes."""

    def __init__(
        self, folder: Path, manifest: Manifest, fetch_chunk: Callable[[int], bytes]
    ) -> None:
        self.manifest, self.fetch_chunk = manifest, fetch_chunk
        self.path = folder / f"{manifest.sha256}.gguf"
        self.sidecar = folder / f"{manifest.sha256}.chunks.json"
        self.lock_path = folder / f"{manifest.sha256}.lock"
        self.fetched: set[int] = set()
        self.retries = 0

    def __enter__(self) -> _Local:
        self._lock = self.lock_path.open("a")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.present = self._read_sidecar()
        if not self.path.exists() or self.path.stat().st_size != self.manifest.size_bytes:
            self.present = set()  # no copy, or not this file's: start over
            self._write_sidecar()
        self._file = self.path.open("r+b" if self.path.exists() else "w+b")
        self._file.truncate(self.manifest.size_bytes)  # sparse: holes cost no disk
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()

    def header(self) -> Header:
        """The header, parsed from as many leading chunks as it takes."""
        end = min(self.manifest.chunk_bytes, self.manifest.size_bytes)
        while True:
            for i in chunks_needed(end, (), self.manifest.chunk_bytes, self.manifest.size_bytes):
                self.ensure(i)
            self._file.seek(0)
            try:
                return parse_header(self._file.read(end), self.manifest.size_bytes, self.path)
            except IncompleteHeader as more:
                # At least one more chunk, or as far as the header is known to run.
                cb = self.manifest.chunk_bytes
                end = min(max(more.end_bytes, end + cb), self.manifest.size_bytes)

    def ensure(self, index: int) -> None:
        if index in self.present:
            return
        data = self._fetch_verified(index)
        start, _ = self.manifest.chunk_range(index)
        self._file.seek(start)
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())  # the bytes are on disk before the sidecar says so
        self.present.add(index)
        self.fetched.add(index)
        self._write_sidecar()

    def _fetch_verified(self, index: int) -> bytes:
        try:
            return self._check(index, self.fetch_chunk(index))
        except ChunkMismatchError:
            self.retries += 1  # once: a flipped bit in transit; twice: the source is wrong
            return self._check(index, self.fetch_chunk(index))

    def _check(self, index: int, data: bytes) -> bytes:
        start, end = self.manifest.chunk_range(index)
        expected = self.manifest.chunk_sha256[index]
        got = hashlib.sha256(data).hexdigest()
        if len(data) != end - start or got != expected:
            raise ChunkMismatchError(
                f"chunk {index} of {self.manifest.sha256[:12]}… (bytes {start}-{end}) arrived "
                f"as {len(data)} bytes hashing to {got[:12]}…, expected {end - start} bytes "
                f"hashing to {expected[:12]}…; the coordinator's file changed since its "
                "manifest was built (rebuild the manifest, restart the worker) or the link "
                "corrupts data"
            )
        return data

    def _read_sidecar(self) -> set[int]:
        try:
            d = json.loads(self.sidecar.read_text())
        except (OSError, ValueError):
            return set()
        if not isinstance(d, Mapping) or (d.get("sha256"), d.get("chunk_bytes")) != (
            self.manifest.sha256,
            self.manifest.chunk_bytes,
        ):
            return set()  # another file's, or another chunking's indices (other byte ranges)
        n = self.manifest.n_chunks
        return {i for i in d.get("chunks", ()) if isinstance(i, int) and 0 <= i < n}

    def _write_sidecar(self) -> None:
        body = {
            "sha256": self.manifest.sha256,
            "chunk_bytes": self.manifest.chunk_bytes,
            "chunks": sorted(self.present),
        }
        _write_atomically(self.sidecar, json.dumps(body).encode())


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so a reader sees the old or the new file, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
