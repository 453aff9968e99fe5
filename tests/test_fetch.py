"""Fetching a shard's bytes chunk by chunk: only what the selection keeps, each chunk checked,
nothing fetched twice, a sidecar that never lists a chunk not on disk."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import cellswarm
from cellswarm.engine.model import Model
from cellswarm.errors import ChunkMismatchError, ModelFileError, ProtocolError, RequestError
from cellswarm.io.gguf_file import GGUFFile, IncompleteHeader, TensorInfo, parse_header
from cellswarm.io.gguf_write import write_gguf
from cellswarm.io.weights import Selection
from cellswarm.models.llama_config import LlamaConfig
from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name
from cellswarm.swarm.transport.fetch import (
    Manifest,
    build_manifest,
    chunks_needed,
    ensure_local,
    read_chunk,
    selected_ranges,
)

CHUNK = 16 * 1024

CONFIG = LlamaConfig(
    arch="llama", n_layers=8, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
    vocab_size=256, context_length=64, rms_eps=1e-6, rope_theta=10000.0, rope_dim=16,
    rope_layout="norm",
)  # fmt: skip


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-layer random llama (F32, ~1.3 MB) with a header spanning several chunks."""
    rng = np.random.default_rng(0)
    shapes = CONFIG.expected_tensors(range(CONFIG.n_layers))
    tensors = {n: rng.standard_normal(s).astype(np.float32) * 0.1 for n, s in shapes.items()}
    meta = CONFIG.to_gguf_metadata() | {"test.filler": [f"token-{i:05d}" for i in range(4000)]}
    path = tmp_path_factory.mktemp("model") / "m.gguf"
    write_gguf(path, meta, tensors)
    return path


@pytest.fixture(scope="module")
def manifest(model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    return build_manifest(model_file, CHUNK, tmp_path_factory.mktemp("manifests"))


class Source:
    """The coordinator's side, in process: serves chunks and counts calls per chunk."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path, self.manifest = path, manifest
        self.calls: list[int] = []

    def __call__(self, index: int) -> bytes:
        self.calls.append(index)
        return read_chunk(self.path, self.manifest, index)


def _same_weights(original: Model, fetched: Model) -> None:
    assert set(fetched.weights) == set(original.weights)
    for name, t in original.weights.items():
        u = fetched.weights[name]
        if isinstance(t, PackedMatrix | PackedExperts):
            assert isinstance(u, type(t))
            np.testing.assert_array_equal(u.dequantize(), t.dequantize(), err_msg=name)
        else:
            np.testing.assert_array_equal(u, t, err_msg=name)


# -------------------------------------------------------------------------------- manifest


def test_manifest_hashes_the_file_and_round_trips(model_file: Path, manifest: Manifest) -> None:
    data = model_file.read_bytes()
    assert manifest.sha256 == hashlib.sha256(data).hexdigest()
    assert manifest.size_bytes == len(data) and manifest.n_chunks == -(-len(data) // CHUNK)
    last = manifest.n_chunks - 1
    assert read_chunk(model_file, manifest, last) == data[last * CHUNK :]
    assert hashlib.sha256(data[:CHUNK]).hexdigest() == manifest.chunk_sha256[0]
    assert Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(RequestError, match="chunk 9999 does not exist"):
        read_chunk(model_file, manifest, 9999)


def test_manifest_is_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"a" * 1000)
    cache = tmp_path / "cache"
    first = build_manifest(f, 300, cache)
    (entry,) = cache.iterdir()
    # A cached entry is used as is (here doctored, to show it is not hashed again) ...
    doctored = Manifest("0" * 64, 1000, 300, first.chunk_sha256)
    entry.write_text(doctored.to_json())
    assert build_manifest(f, 300, cache) == doctored
    # ... until the file changes.
    f.write_bytes(b"b" * 1001)
    second = build_manifest(f, 300, cache)
    assert second.sha256 == hashlib.sha256(b"b" * 1001).hexdigest() and second.n_chunks == 4
    with pytest.raises(ModelFileError, match="changed since the manifest was built"):
        read_chunk(f, first, 0)


@pytest.mark.parametrize(
    "text",
    [
        '{"sha256": "../../etc/passwd", "size_bytes": 0, "chunk_bytes": 4, "chunk_sha256": []}',
        '{"sha256": "' + "a" * 64 + '", "size_bytes": 9, "chunk_bytes": 4, "chunk_sha256": []}',
        '{"sha256": "' + "a" * 64 + '"}',
        "not json",
    ],
)
def test_a_malformed_manifest_is_refused(text: str) -> None:
    with pytest.raises(ProtocolError):
        Manifest.from_json(text)


# ----------------------------------------------------------------------- which bytes, pure


@pytest.mark.parametrize(
    ("header", "ranges", "expected"),
    [
        (10, [], [0]),
        (100, [], [0]),  # the header ends exactly at a chunk boundary
        (101, [], [0, 1]),
        (10, [(350, 450)], [0, 3, 4]),
        (10, [(400, 500), (500, 501)], [0, 4, 5]),  # end is exclusive
        (10, [(250, 250)], [0]),  # an empty range needs nothing
        (10, [(900, 950)], [0, 9]),  # the short last chunk
        (250, [(120, 180)], [0, 1, 2]),  # overlaps are counted once
    ],
)
def test_chunks_needed(header: int, ranges: list[tuple[int, int]], expected: list[int]) -> None:
    assert chunks_needed(header, ranges, 100, 950) == expected


def test_chunks_needed_refuses_a_range_past_the_file() -> None:
    with pytest.raises(ValueError, match="outside a file of 950 bytes"):
        chunks_needed(10, [(900, 951)], 100, 950)


def test_selected_ranges_cut_expert_stacks_and_vocab_rows() -> None:
    tensors = [
        TensorInfo("token_embd.weight", 0, (10, 4), 160, 1000),  # 16 bytes a row
        TensorInfo("blk.0.attn_q.weight", 0, (4, 4), 64, 1160),
        TensorInfo("blk.0.ffn_up_exps.weight", 0, (8, 2, 4), 256, 1224),  # 32 bytes an expert
        TensorInfo("blk.1.ffn_up_exps.weight", 0, (8, 2, 4), 256, 1480),
        TensorInfo("output.weight", 0, (10, 4), 160, 1736),
    ]
    sel = Selection(layers=(0, 1), vocab_rows=(2, 5), experts={0: (6, 1, 2)}, head=False)
    assert selected_ranges(tensors, sel) == [
        (1000 + 2 * 16, 1000 + 5 * 16),  # rows 2..4 of the embedding
        (1160, 1224),  # attn_q, whole
        (1224 + 1 * 32, 1224 + 3 * 32),  # experts 1 and 2, merged
        (1224 + 6 * 32, 1224 + 7 * 32),  # expert 6; layer 1 and the head are not kept
    ]
    # A layer without an expert list keeps its whole stack.
    assert selected_ranges(tensors[3:4], Selection(experts={0: (1,)})) == [(1480, 1736)]


# ------------------------------------------------------------------ gguf header from a prefix


def test_a_header_parses_from_a_prefix_or_asks_for_more(model_file: Path) -> None:
    data = model_file.read_bytes()
    whole = GGUFFile(model_file)
    header = parse_header(data, len(data), "m")
    assert header.size_bytes > 4 * CHUNK  # the fixture's filler spans chunks
    assert header == parse_header(data[: header.size_bytes], len(data), "m")
    assert header.metadata == whole.metadata
    assert [t.name for t in header.tensors] == whole.tensor_names()
    with pytest.raises(IncompleteHeader) as more:
        parse_header(data[:CHUNK], len(data), "m")
    assert CHUNK < more.value.end_bytes <= header.size_bytes
    with pytest.raises(IncompleteHeader) as more:
        parse_header(data[: header.size_bytes - 1], len(data), "m")
    assert more.value.end_bytes == header.size_bytes
    with pytest.raises(ModelFileError, match="truncated"):  # a cut file is still a cut file
        parse_header(data[:CHUNK], CHUNK, "m")


# ------------------------------------------------------------------------ fetching a shard


def test_a_fetched_shard_loads_like_the_original(
    model_file: Path, manifest: Manifest, tmp_path: Path
) -> None:
    sel = Selection(layers=(3, 5), embed=False, head=False)
    source = Source(model_file, manifest)
    report = ensure_local(manifest, sel, source, tmp_path)
    assert report.path == tmp_path / f"{manifest.sha256}.gguf"
    assert report.path.stat().st_size == manifest.size_bytes
    assert report.chunks_fetched == report.chunks_needed == len(source.calls)
    assert report.chunks_cached == report.retries == 0
    # Two of eight layers and neither end: a fraction of the file (header chunks included).
    assert report.bytes_fetched < 0.4 * manifest.size_bytes
    assert report.selected_bytes <= report.bytes_fetched
    _same_weights(
        cellswarm.load(model_file, selection=sel, tokenizer=False),
        cellswarm.load(report.path, selection=sel, tokenizer=False),
    )
    # A restart fetches nothing again.
    again = ensure_local(manifest, sel, source, tmp_path)
    assert again.chunks_fetched == again.bytes_fetched == 0
    assert again.chunks_cached == report.chunks_needed
    assert len(source.calls) == report.chunks_fetched
    # A wider shard fetches only what it lacks.
    wider = Selection(layers=(3, 8), embed=False, head=True)
    more = ensure_local(manifest, wider, source, tmp_path)
    assert more.chunks_cached >= report.chunks_needed - 2  # bar the chunks shared with layer 2
    assert len(set(source.calls)) == len(source.calls)  # never the same chunk twice
    _same_weights(
        cellswarm.load(model_file, selection=wider, tokenizer=False),
        cellswarm.load(more.path, selection=wider, tokenizer=False),
    )


def test_the_whole_model_fetched_is_the_file(
    model_file: Path, manifest: Manifest, tmp_path: Path
) -> None:
    report = ensure_local(manifest, Selection(), Source(model_file, manifest), tmp_path)
    assert report.chunks_fetched == manifest.n_chunks
    assert report.bytes_fetched == manifest.size_bytes
    assert report.path.read_bytes() == model_file.read_bytes()


def _corrupting(source: Source, bad: int, times: int) -> Callable[[int], bytes]:
    left = [times]

    def fetch(index: int) -> bytes:
        data = source(index)
        if index == bad and left[0] > 0:
            left[0] -= 1
            return bytes([data[0] ^ 1]) + data[1:]
        return data

    return fetch


def test_a_corrupt_chunk_is_refused_and_never_recorded(
    model_file: Path, manifest: Manifest, tmp_path: Path
) -> None:
    sel = Selection(layers=(0, 2))
    source = Source(model_file, manifest)
    with pytest.raises(ChunkMismatchError, match=r"chunk 2 of .*rebuild the manifest"):
        ensure_local(manifest, sel, _corrupting(source, 2, times=2), tmp_path)
    assert source.calls.count(2) == 2  # retried once
    listed = _listed(tmp_path, manifest)
    assert 2 not in listed and {0, 1} <= listed
    # Once in transit is forgiven: the retry's good copy is kept.
    report = ensure_local(manifest, sel, _corrupting(source, 2, times=1), tmp_path)
    assert report.retries == 1 and 2 in _listed(tmp_path, manifest)
    _same_weights(
        cellswarm.load(model_file, selection=sel, tokenizer=False),
        cellswarm.load(report.path, selection=sel, tokenizer=False),
    )


def test_a_crash_mid_fetch_leaves_only_verified_chunks_listed(
    model_file: Path, manifest: Manifest, tmp_path: Path
) -> None:
    source = Source(model_file, manifest)

    def dies_after(n: int) -> Callable[[int], bytes]:
        def fetch(index: int) -> bytes:
            if len(source.calls) >= n:
                raise ConnectionError("coordinator went away")
            return source(index)

        return fetch

    for n in (3, 7, 12):
        with pytest.raises(ConnectionError):
            ensure_local(manifest, Selection(), dies_after(n), tmp_path)
        listed = _listed(tmp_path, manifest)
        assert len(listed) == n == len(source.calls)
        local = (tmp_path / f"{manifest.sha256}.gguf").read_bytes()
        for i in listed:
            chunk = local[i * CHUNK : (i + 1) * CHUNK]
            assert hashlib.sha256(chunk).hexdigest() == manifest.chunk_sha256[i], i
    report = ensure_local(manifest, Selection(), source, tmp_path)
    assert report.chunks_cached == 12 and report.chunks_fetched == manifest.n_chunks - 12
    assert report.path.read_bytes() == model_file.read_bytes()


def test_only_the_kept_experts_are_fetched(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    stack = rng.standard_normal((16, 64, 256)).astype(np.float32)  # 16 experts of 17 KiB
    experts = PackedExperts.from_float(stack, format_by_name("q8_0"))
    path = tmp_path / "moe.gguf"
    write_gguf(path, {"general.architecture": "llama"}, {"blk.0.ffn_up_exps.weight": experts})
    manifest = build_manifest(path, 4096, tmp_path / "manifests")
    sel = Selection(experts={0: (3, 11)})
    report = ensure_local(manifest, sel, Source(path, manifest), tmp_path / "cache")
    expert_bytes = experts.data.nbytes // 16
    assert report.selected_bytes == 2 * expert_bytes
    # The header's chunk, and at most one partly used chunk at each end of each expert.
    assert report.bytes_fetched <= 2 * expert_bytes + (1 + 2 * 2) * 4096
    assert report.bytes_fetched < 0.25 * manifest.size_bytes
    ours = GGUFFile(report.path).weights(sel).experts("blk.0.ffn_up_exps.weight")
    theirs = GGUFFile(path).weights(sel).experts("blk.0.ffn_up_exps.weight")
    for e in (3, 11):
        np.testing.assert_array_equal(ours.expert(e).dequantize(), theirs.expert(e).dequantize())


def _listed(cache: Path, manifest: Manifest) -> set[int]:
    return set(json.loads((cache / f"{manifest.sha256}.chunks.json").read_text())["chunks"])


def test_only_the_kept_vocabulary_rows_are_fetched(
    model_file: Path, manifest: Manifest, tmp_path: Path
) -> None:
    rows = Selection(layers=(0, 0), vocab_rows=(64, 128), head=False)  # a quarter of the rows
    report = ensure_local(manifest, rows, Source(model_file, manifest), tmp_path)
    embd_bytes = CONFIG.vocab_size * CONFIG.d_model * 4
    assert report.selected_bytes < embd_bytes // 4 + 2048  # + the layerless norms
    _same_weights(
        cellswarm.load(model_file, selection=rows, tokenizer=False),
        cellswarm.load(report.path, selection=rows, tokenizer=False),
    )
