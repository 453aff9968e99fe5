"""Weights repacked at load into 16-row groups (kernels.c, "Q4_0 and Q8_0 in 16-row groups";
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, TQ1_0, TQ2_0, IQ4_NL, IQ4_XS, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS, IQ3_S and MXFP4 in the same scheme):
the same numbers to the bit as the file's layout, on every path that reads them, and the
same memory (the file's pages are let go).

On a CPU without the repacked kernel (no AVX-512 VNNI + VBMI) `kernels.repack` says None
and these tests have nothing to compare: they skip.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cellswarm
from bench.kernels import random_weights as _weights
from cellswarm import kernels
from cellswarm.io.gguf_write import write_gguf
from cellswarm.models.llama_config import LlamaConfig
from cellswarm.quant import PackedMatrix, format_by_name
from cellswarm.quant.formats import dequantize, quantize

Q4_0 = format_by_name("q4_0")


def _repacked_or_skip(w: np.ndarray, fmt: str = "Q4_0") -> tuple[int, np.ndarray]:
    r = kernels.repack(fmt, w)
    if r is None:
        pytest.skip("no repacked layout on this CPU (or fast kernels are off)")
    return r


def _matmul(code: int, w: np.ndarray, cols: int, x: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    kernels.matmul_args((0, code, int(w.ctypes.data), *w.shape), cols, x, out)
    return out


@pytest.mark.parametrize(
    ("rows", "cols"),
    [(1030, 1024), (64, 2816), (37, 512), (48, 96), (16, 4096), (17, 32)],
)  # fmt: skip
@pytest.mark.parametrize("nx", [1, 3, 16, 70])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                  "TQ2_0", "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ2_XXS", "IQ1_M",
                                  "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ2_S", "TQ1_0", "MXFP4"])
def test_a_repacked_weight_gives_the_same_bits(rows: int, cols: int, nx: int, name: str) -> None:
    """Whole groups and the rows after them, one token and a batch, with outliers (values
    multiplied in float) in the activations: every output bit as from the file's layout."""
    if cols % format_by_name(name).block_size:
        pytest.skip(f"{name} rows are whole blocks of {format_by_name(name).block_size}")
    rng = np.random.default_rng(rows * cols + nx)
    fmt = format_by_name(name)
    w = _weights(name, rows, cols, rng)
    code, repacked = _repacked_or_skip(w, name)
    assert repacked.shape == w.shape and code != kernels.FUSED_TYPES[name]
    x = rng.standard_normal((nx, cols)).astype(np.float32)
    x[:, 5] = 40.0  # a column the rows share
    x[0, cols - 3] = -55.0
    for k in range(1, nx):  # and columns of their own, at every place in a block
        spikes = rng.choice(cols, size=3, replace=False)
        x[k, spikes] = rng.choice([-1.0, 1.0], 3) * rng.uniform(40.0, 60.0, 3)
    natural = _matmul(kernels.FUSED_TYPES[name], w, cols, x)
    assert np.array_equal(natural.view(np.uint32), _matmul(code, repacked, cols, x).view(np.uint32))
    ref = x @ dequantize(w, fmt).T
    assert float(np.abs(natural - ref).max() / np.abs(ref).max()) < 0.02


# The child's half of the test below: a Q6_K weight's repacked product, from its own build.
_CHILD = """
import sys
import numpy as np
from cellswarm import kernels
w, x, cols = np.load(sys.argv[1]), np.load(sys.argv[2]), int(sys.argv[4])
code, r = kernels.repack("Q6_K", w)
for n in (1, len(x)):  # one token (the decode kernel), then a batch (the tile)
    out = np.empty((n, w.shape[0]), np.float32)
    kernels.matmul_args((0, code, int(r.ctypes.data), *r.shape), cols, x[:n], out)
    np.save(f"{sys.argv[3]}{n}.npy", out)
"""


@pytest.mark.slow
def test_a_build_without_gfni_unpacks_q6_k_to_the_same_bits(tmp_path: Path) -> None:
    """Q6_K's group kernel moves bits with GFNI where the CPU has it, with shifts and masks
    where not (kernels.c, BYTE_BITS): a build told -mno-gfni (compiled in a child process,
    cached apart) must give the same bits."""
    if "gfni" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no GFNI: the default build is already the other path")
    rng = np.random.default_rng(6)
    w = _weights("Q6_K", 48, 1024, rng)
    code, repacked = _repacked_or_skip(w, "Q6_K")
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "CELLSWARM_CFLAGS": "-mno-gfni"}
    args = [tmp_path / "w.npy", tmp_path / "x.npy", tmp_path / "out", 1024]
    subprocess.run([sys.executable, "-c", _CHILD, *map(str, args)], env=env, check=True,
                   timeout=600)  # fmt: skip
    for n in (1, len(x)):
        theirs = np.load(tmp_path / f"out{n}.npy")
        assert np.array_equal(_matmul(code, repacked, 1024, x[:n]).view(np.uint32),
                              theirs.view(np.uint32))  # fmt: skip


@pytest.mark.parametrize(("rows", "cols"), [(1030, 1024), (37, 768)])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                  "TQ2_0", "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ2_XXS", "IQ1_M",
                                  "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ2_S", "TQ1_0", "MXFP4"])
def test_a_repacked_weight_dequantizes_to_the_gguf_values(rows: int, cols: int, name: str) -> None:
    rng = np.random.default_rng(rows)
    fmt = format_by_name(name)
    w = _weights(name, rows, cols, rng)
    code, repacked = _repacked_or_skip(w, name)
    out = np.empty((rows, cols), np.float32)
    kernels.dequantize(name, repacked, cols, out, code)
    assert np.array_equal(out, dequantize(w, fmt))


def _mapped(tmp_path: Path, w: np.ndarray) -> np.ndarray:
    """w as a read-only view of a file, as a GGUF's tensors are loaded."""
    f = tmp_path / "w.bin"
    w.tofile(f)
    return np.memmap(f, dtype=np.uint8, mode="r").reshape(w.shape)


def test_a_matrix_repacks_only_from_a_mapped_file_and_reads_the_same(tmp_path: Path) -> None:
    """`PackedMatrix.repack`: memory of its own stays as it is (a copy would double it); a
    mapped file's matrix is repacked, and its fused matmul and its dequantize (rows not on
    group bounds too) give what they gave before, for a batch beyond 16 rows (a prefill) too:
    the same bits as the file's layout."""
    rng = np.random.default_rng(7)
    cols = 256
    w = quantize(rng.standard_normal((100, cols)).astype(np.float32), Q4_0)
    _repacked_or_skip(w)
    assert PackedMatrix(w, Q4_0).repack() is False
    m = PackedMatrix(_mapped(tmp_path, w), Q4_0)
    x1 = rng.standard_normal((2, cols)).astype(np.float32)
    x2 = rng.standard_normal((40, cols)).astype(np.float32)
    before = m.matmul(x1), m.matmul(x2), m.dequantize()
    assert m.repack() is True
    after = m.matmul(x1), m.matmul(x2), m.dequantize()
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.array_equal(m._dequantize_rows(3, 50), before[2][3:50])
    assert np.array_equal(m._dequantize_rows(96, 100), before[2][96:100])


def _write_llama(path: Path, head: str = "F32") -> Path:
    """A random llama in Q4_0 (rows and columns not all whole groups or quads), its output
    head near-tied (tests/same_bits_models.py): a token turns on the last bits; the head in
    `head` (F32, or a packed format)."""
    from tests.same_bits_models import near_tied_head

    c = LlamaConfig(
        arch="llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32,
        ffn_dim=352, vocab_size=256, context_length=128, rms_eps=1e-5, rope_theta=10000.0,
        rope_dim=32, rope_layout="norm",
    )  # fmt: skip
    rng = np.random.default_rng(3)
    tensors: dict[str, np.ndarray | PackedMatrix] = {}
    for name, shape in c.expected_tensors(range(c.n_layers)).items():
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "output.weight" and head == "F32":
            tensors[name] = near_tied_head(rng, c.vocab_size, c.d_model, 1e-7)
        elif name == "output.weight":
            w = rng.standard_normal(shape)
            tensors[name] = PackedMatrix.from_float(w, format_by_name(head))
        elif name == "token_embd.weight":
            tensors[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            tensors[name] = PackedMatrix.from_float(0.2 * rng.standard_normal(shape), Q4_0)
    write_gguf(path, c.to_gguf_metadata(), tensors)
    return path


def _mapped_resident_bytes(path: Path) -> int:
    """This process's resident bytes of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def test_a_q4_0_model_decodes_the_same_bits_repacked_and_lets_the_file_go(
    tmp_path: Path,
) -> None:
    """Greedy decode through the fused layers, repacked and not: the same logits to the bit
    on a model whose tokens turn on the last bits; and the layers' file pages are not
    resident once repacked (the weight is in memory once, not twice)."""
    path = _write_llama(tmp_path / "q4_0.gguf")
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int64)
    logits = {}
    for on in (False, True):
        with kernels.repacking(on):
            model = cellswarm.load(path)
            cache = model.new_cache(len(ids))
            logits[on] = np.concatenate([model.step(ids[i : i + 1], cache) for i in range(8)])
            if on:
                layer = model.arch.w.matrix("blk.0.ffn_up.weight")  # type: ignore[attr-defined]
                if not layer.repack():
                    pytest.skip("no repacked layout on this CPU")
                held = _mapped_resident_bytes(path)
    assert np.array_equal(logits[False].view(np.uint32), logits[True].view(np.uint32))
    layers = sum(
        model.arch.w.matrix(f"blk.{i}.{n}.weight").nbytes  # type: ignore[attr-defined]
        for i in range(2) for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                    "ffn_up", "ffn_down")
    )  # fmt: skip
    assert held < path.stat().st_size - layers + 64 * 1024


@pytest.mark.parametrize("head", ["Q4_0", "Q8_0"])
def test_an_output_head_of_its_own_is_repacked_and_its_rows_read_from_the_copy(
    tmp_path: Path, head: str
) -> None:
    """output.weight (not tied to the embedding) is repacked on first use (ops.head_matrix):
    the same logits to the bit, the float-refined best rows (take_rows) read from the copy, so
    after decoding none of the head's file pages are resident."""
    path = _write_llama(tmp_path / f"head-{head}.gguf", head)
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int64)
    logits, rows = {}, {}
    for on in (False, True):
        with kernels.repacking(on):
            model = cellswarm.load(path)
            cache = model.new_cache(len(ids))
            logits[on] = np.concatenate([model.step(ids[i : i + 1], cache) for i in range(8)])
            out = model.arch.w.matrix("output.weight")  # type: ignore[attr-defined]
            rows[on] = out.take_rows(np.array([0, 15, 16, 200, 255, 3]))
            if on:
                if out._repacked is None:
                    pytest.skip("no repacked layout on this CPU")
                present = _present_pages(out.data)
    assert np.array_equal(logits[False].view(np.uint32), logits[True].view(np.uint32))
    assert np.array_equal(rows[False], rows[True])
    assert present == 0


def _present_pages(a: np.ndarray) -> int:
    """How many of the whole pages under `a` this process has mapped in (/proc/self/pagemap's
    present bit): a view of a file whose pages were let go has none, whatever the page cache
    holds."""
    page = mmap.PAGESIZE
    lo, hi = -(-a.ctypes.data // page), (a.ctypes.data + a.nbytes) // page
    assert hi > lo, "no whole page under the array"
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(8 * lo)
        entries = np.frombuffer(f.read(8 * (hi - lo)), np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.parametrize(
    ("rows", "row_bytes", "chunk_bytes", "expected"),
    [
        (100, 256, 1 << 20, [(0, 100)]),  # one chunk
        (100, 256, 32 * 256, [(0, 32), (32, 64), (64, 100)]),  # the 4-row tail joins 64..96
        (96, 256, 32 * 256, [(0, 32), (32, 64), (64, 96)]),
        (120, 256, 40 * 256, [(0, 32), (32, 64), (64, 96), (96, 120)]),  # whole groups only
        (50, 4096, 100, [(0, 16), (16, 32), (32, 50)]),  # at least a group a chunk
    ],
)  # fmt: skip
def test_repack_chunks(
    monkeypatch: pytest.MonkeyPatch, rows: int, row_bytes: int, chunk_bytes: int,
    expected: list[tuple[int, int]],
) -> None:  # fmt: skip
    from cellswarm.quant import packed

    monkeypatch.setattr(packed, "REPACK_CHUNK_BYTES", chunk_bytes)
    assert packed._repack_chunks(rows, row_bytes) == expected


def test_a_matrix_repacked_in_chunks_is_the_whole_repack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repacked a few groups at a time (its file pages let go after each): the same bytes
    as one repack of the whole matrix, the rows after the last group included."""
    from cellswarm.quant import packed

    rng = np.random.default_rng(9)
    w = quantize(rng.standard_normal((1030, 256)).astype(np.float32), Q4_0)
    code, whole = _repacked_or_skip(w)
    monkeypatch.setattr(packed, "REPACK_CHUNK_BYTES", 5 * 16 * w.shape[1])
    assert len(packed._repack_chunks(*w.shape)) > 10
    m = PackedMatrix(_mapped(tmp_path, w), Q4_0)
    assert m.repack() and m._repacked is not None
    assert m._repacked[0] == code and np.array_equal(m._repacked[1], whole)
