"""cellswarm.quant: codecs bit-exact with gguf.quants, and packed matmul in bounded tiles."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path

import gguf.quants as gq
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from cellswarm import kernels
from cellswarm.errors import ShapeMismatchError, UnsupportedQuantError
from cellswarm.quant import (
    FORMATS,
    PackedExperts,
    PackedMatrix,
    QuantFormat,
    dequantize,
    format_by_name,
    format_for,
    quantize,
)
from tests.random_blocks import random_blocks


@pytest.fixture(autouse=True)
def _numpy_kernels() -> Iterator[None]:
    """These tests are about the reference codec path; tests/test_kernels.py checks the fast
    path against it."""
    with kernels.using("numpy"):
        yield


ALL = list(FORMATS.values())
QUANTIZABLE = [f for f in ALL if f.can_quantize]
READ_ONLY = [f for f in ALL if not f.can_quantize]

# Byte offsets of the float16 scale fields inside one block. Random blocks get finite
# values there, so decoded weights are finite (random bytes could make NaN/inf scales).
SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns: equality here is bit-exactness (-0.0 != 0.0)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def wide_floats(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values over ~12 decades, with exact zeros mixed in."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 4, shape)
    x[rng.random(shape) < 0.1] = 0
    return x.astype(np.float32)


def finite_f16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float16 scales from subnormal to ~16, some zero."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-26, 4, shape)
    x[rng.random(shape) < 0.05] = 0
    return x.astype(np.float16)


def random_packed(fmt: QuantFormat, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Valid packed bytes (*lead, row_bytes) for logical `shape` (*lead, cols)."""
    rng = np.random.default_rng(seed)
    if fmt.block_size == 1:  # plain floats: encode random values with gguf itself
        return gq.quantize(wide_floats(rng, shape), fmt.ggml_type).view(np.uint8)
    *lead, cols = shape
    if fmt.name not in SCALE_OFFSETS:  # the low-bit formats: scales of a few sizes
        return random_blocks(fmt, shape, rng, lo=1e-4, hi=4.0)
    blocks = rng.integers(0, 256, (*lead, cols // fmt.block_size, fmt.type_size), np.uint8)
    for off in SCALE_OFFSETS[fmt.name]:
        blocks[..., off : off + 2] = finite_f16(rng, (*blocks.shape[:-1], 1)).view(np.uint8)
    return blocks.reshape(*lead, fmt.row_bytes(cols))


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_format_table_matches_gguf(fmt: QuantFormat) -> None:
    assert FORMATS[fmt.ggml_type] is fmt
    assert fmt.name == fmt.ggml_type.name
    assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[fmt.ggml_type]
    assert fmt.bits_per_weight == fmt.type_size * 8 / fmt.block_size
    assert fmt.row_bytes(fmt.block_size * 3) == fmt.type_size * 3


def test_bits_per_weight_examples() -> None:
    assert format_by_name("Q4_0").bits_per_weight == 4.5
    assert format_by_name("Q8_0").bits_per_weight == 8.5
    assert format_by_name("Q6_K").bits_per_weight == 6.5625
    assert format_by_name("F16").bits_per_weight == 16


def test_lookup_by_type_and_name() -> None:
    q40 = format_for(GGMLQuantizationType.Q4_0)
    assert format_for(int(GGMLQuantizationType.Q4_0)) is q40
    assert format_by_name("q4_0") is q40
    assert format_by_name("Q4_k") is format_for(GGMLQuantizationType.Q4_K)


@pytest.mark.parametrize(
    ("lookup", "message"),
    [
        (lambda: format_for(GGMLQuantizationType.Q8_K), r"tensor type Q8_K is not supported"),
        (lambda: format_for(9999), r"tensor type id 9999 is not supported"),
        (lambda: format_by_name("q9_9"), r"tensor type 'q9_9' is not supported"),
    ],
)
def test_unsupported_type_error(lookup: Callable[[], QuantFormat], message: str) -> None:
    with pytest.raises(UnsupportedQuantError, match=message + r"; supported: F32, F16, BF16, Q8_0"):
        lookup()


def test_bad_row_length_error() -> None:
    q40 = format_by_name("Q4_0")
    with pytest.raises(
        ShapeMismatchError, match=r"^row of 100 elements is not a multiple of Q4_0's block size 32$"
    ):
        q40.row_bytes(100)
    with pytest.raises(ShapeMismatchError, match="row of 100 elements"):
        quantize(np.zeros((2, 100), np.float32), q40)
    with pytest.raises(ShapeMismatchError, match="row of 19 bytes"):
        dequantize(np.zeros((2, 19), np.uint8), q40)
    with pytest.raises(ShapeMismatchError, match="hold 32 elements, not 64"):
        dequantize(np.zeros((2, 18), np.uint8), q40, 64)


# ---------------------------------------------------------------------- bit-exact codecs

SHAPES = [(1, 256), (3, 512), (17, 768), (2, 3, 256)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_dequantize_bit_exact(fmt: QuantFormat, shape: tuple[int, ...]) -> None:
    packed = random_packed(fmt, shape, seed=len(shape) * 1000 + shape[-1])
    ours = dequantize(packed, fmt, shape[-1])
    assert ours.shape == shape and ours.dtype == np.float32
    np.testing.assert_array_equal(bits(ours), bits(gq.dequantize(packed, fmt.ggml_type)))


def _data(kind: str, shape: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(kind)) % 2**32)
    rows, cols = shape
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "wide":  # per-32-block magnitudes from 1e-8 to 1e4, plus zeros
        scale = 10.0 ** rng.uniform(-8, 4, (rows, cols // 32, 1))
        x = rng.standard_normal((rows, cols // 32, 32)) * scale
        x[rng.random(x.shape) < 0.1] = 0
        return x.reshape(shape).astype(np.float32)
    if kind == "zeros":  # whole rows, whole blocks and single values
        x = rng.standard_normal(shape).astype(np.float32)
        x[0] = 0
        x[1, :32] = 0
        x[2, ::3] = 0
        return x
    if kind == "ties":  # half-integers hit every rounding tie; ±8 ties the abs-max
        x = rng.integers(-16, 17, shape) / np.float32(2)
        x[:, 0], x[:, 1] = 8, -8
        return x.astype(np.float32)
    if kind == "spike":  # one huge value per block beside tiny ones
        x = rng.standard_normal((rows, cols // 32, 32)) * 1e-4
        x[..., 5] = rng.choice([-1, 1], (rows, cols // 32)) * 3e3
        return x.reshape(shape).astype(np.float32)
    if kind == "constant":  # max == min: a zero range must not divide by zero
        return np.full(shape, -2.75, np.float32)
    raise AssertionError(kind)


DATA_KINDS = ["normal", "wide", "zeros", "ties", "spike", "constant"]


@pytest.mark.parametrize("kind", DATA_KINDS)
@pytest.mark.parametrize("fmt", QUANTIZABLE, ids=lambda f: f.name)
def test_quantize_bit_exact(fmt: QuantFormat, kind: str) -> None:
    x = _data(kind, (6, 256))
    expected = gq.quantize(x, fmt.ggml_type).view(np.uint8)
    ours = quantize(x, fmt)
    assert ours.shape == (6, fmt.row_bytes(256)) and ours.dtype == np.uint8
    np.testing.assert_array_equal(ours, expected)
    # and decoding what gguf encoded matches gguf bit for bit
    np.testing.assert_array_equal(
        bits(dequantize(expected, fmt)), bits(gq.dequantize(expected, fmt.ggml_type))
    )


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_float_codecs_special_values(name: str) -> None:
    fmt = format_by_name(name)
    special = np.array([0x7F800001, 0xFFC00001, 0x7FFF0000, 0x3F808000, 0x3F818000], np.uint32)
    x = np.concatenate(
        [
            special.view(np.float32),  # NaNs with low-half payloads, rounding ties
            np.array([np.inf, -np.inf, -0.0, 1e-45, 7e4, -65520.0, 6e-8], np.float32),
        ]
    ).reshape(1, -1)
    with np.errstate(over="ignore"):  # 7e4 overflows float16, on purpose
        expected = gq.quantize(x, fmt.ggml_type).view(np.uint8)
        np.testing.assert_array_equal(quantize(x, fmt), expected)


@pytest.mark.parametrize("fmt", READ_ONLY, ids=lambda f: f.name)
def test_k_quants_are_read_only_like_gguf(fmt: QuantFormat) -> None:
    # gguf-py has no reference quantizer for most of these; if it gains one, enable ours.
    # (TQ1_0, TQ2_0, MXFP4 and NVFP4 it has: llama-quantize writes the files users run.)
    if fmt.name not in {"TQ1_0", "TQ2_0", "MXFP4", "NVFP4"}:
        with pytest.raises(NotImplementedError):
            gq.quantize(np.zeros((1, 256), np.float32), fmt.ggml_type)
    message = f"^quantizing to {fmt.name} is not supported; quantizable: F32, F16, BF16, Q8_0"
    with pytest.raises(UnsupportedQuantError, match=message):
        quantize(np.zeros((1, 256), np.float32), fmt)
    with pytest.raises(UnsupportedQuantError, match=message):
        PackedMatrix.from_float(np.zeros((1, 256), np.float32), fmt)


def test_dequantize_accepts_gguf_reader_float_arrays() -> None:
    # GGUFReader hands F32/F16 tensors out as float arrays, not bytes.
    w = np.arange(64, dtype=np.float32).reshape(2, 32)
    np.testing.assert_array_equal(dequantize(w, format_by_name("F32")), w)
    np.testing.assert_array_equal(dequantize(w.astype(np.float16), format_by_name("F16")), w)


# -------------------------------------------------------------------------- packed matmul

IN_FEATURES = 512


def packed(fmt: QuantFormat, out_features: int = 24, seed: int = 1) -> PackedMatrix:
    return PackedMatrix(random_packed(fmt, (out_features, IN_FEATURES), seed), fmt)


def assert_matmul_close(
    got: np.ndarray, x: np.ndarray, w: np.ndarray, expected: np.ndarray | None = None
) -> None:
    """got ≈ x @ w.T (or `expected`), to float32 rounding of sums with cancellation."""
    atol = 1e-5 * float((np.abs(x) @ np.abs(w).T).max())
    np.testing.assert_allclose(got, x @ w.T if expected is None else expected, 1e-5, atol)


@pytest.mark.parametrize("tile_bytes", [None, 1, 3 * IN_FEATURES * 4 + 5], ids=str)
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_matmul_matches_dense(fmt: QuantFormat, tile_bytes: int | None) -> None:
    m = packed(fmt)
    w = m.dequantize()
    assert w.shape == m.shape == (24, IN_FEATURES)
    x = np.random.default_rng(2).standard_normal((5, IN_FEATURES)).astype(np.float32)
    got = m.matmul(x, tile_bytes=tile_bytes)
    assert got.shape == (5, 24) and got.dtype == np.float32
    assert_matmul_close(got, x, w)


def test_tiny_tiles_match_default_tiles() -> None:
    m = packed(format_by_name("Q4_K"), out_features=37)
    x = np.random.default_rng(3).standard_normal((3, IN_FEATURES)).astype(np.float32)
    assert_matmul_close(m.matmul(x, tile_bytes=1), x, m.dequantize(), expected=m.matmul(x))


def test_module_tile_bytes_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import cellswarm.quant.packed as packed_module

    seen: list[int] = []
    real = packed_module.dequantize

    def spy(data: np.ndarray, fmt: QuantFormat, n_cols: int | None = None) -> np.ndarray:
        seen.append(data.shape[0])
        return real(data, fmt, n_cols)

    monkeypatch.setattr(packed_module, "dequantize", spy)
    monkeypatch.setattr(packed_module, "TILE_BYTES", 4 * IN_FEATURES * 4)
    packed(format_by_name("Q8_0"), out_features=10).matmul(np.ones((1, IN_FEATURES), np.float32))
    assert seen == [4, 4, 2]  # never more than TILE_BYTES of float32 at once


@pytest.mark.parametrize("fmt", ["F32", "Q8_0", "Q6_K"])
def test_rows_of_a_split_matrix_have_the_same_bits_anywhere(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matmul(rows_of=...) on any slice of rows, with any number of threads, gives the bits
    of the whole matrix's rows (the output head on vocab parts); blocks of 7 rows here, so
    slices cut blocks anywhere, and batches beyond the fused kernels' go through BLAS."""
    from threadpoolctl import threadpool_limits

    import cellswarm.quant.packed as packed_module

    monkeypatch.setattr(packed_module, "BLOCK_BYTES", 7 * IN_FEATURES * 4)
    m = packed(format_by_name(fmt), out_features=61)
    rng = np.random.default_rng(5)
    for n in (1, 17, 40):
        x = rng.standard_normal((n, IN_FEATURES)).astype(np.float32)
        whole = m.matmul(x, rows_of=(0, 61))
        assert_matmul_close(whole, x, m.dequantize())
        for bounds, threads in [([0, 61], 1), ([0, 30, 61], 2), ([0, 1, 13, 14, 60, 61], 1)]:
            with threadpool_limits(threads), kernels_threads(threads):
                parts = [m.rows(a, b).matmul(x, rows_of=(a, 61)) for a, b in pairwise(bounds)]
            assert np.array_equal(np.concatenate(parts, axis=1), whole), (n, bounds)
    with pytest.raises(ShapeMismatchError, match=r"rows \[50, 111\) of a 61-row weight"):
        m.matmul(np.ones((20, IN_FEATURES), np.float32), rows_of=(50, 61))


@contextlib.contextmanager
def kernels_threads(n: int) -> Iterator[None]:
    before = kernels.threads()
    kernels.set_threads(n)
    try:
        yield
    finally:
        kernels.set_threads(before)


def test_matmul_leading_dims_and_bad_input() -> None:
    m = packed(format_by_name("Q6_K"))
    x = np.random.default_rng(4).standard_normal((2, 3, IN_FEATURES)).astype(np.float32)
    got = m.matmul(x)
    assert got.shape == (2, 3, 24)
    assert_matmul_close(got.reshape(6, 24), x.reshape(6, -1), m.dequantize())
    with pytest.raises(ShapeMismatchError, match=r"last axis must be 512"):
        m.matmul(np.ones((2, 100), np.float32))


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_take_rows_and_row_views(fmt: QuantFormat) -> None:
    m = packed(fmt)
    w = m.dequantize()
    ids = np.array([5, 0, 23, 5])
    np.testing.assert_array_equal(bits(m.take_rows(ids)), bits(w[ids]))
    assert m.take_rows(ids.reshape(2, 2)).shape == (2, 2, IN_FEATURES)

    part = m.rows(8, 20)
    assert part.shape == (12, IN_FEATURES)
    assert np.shares_memory(part.data, m.data)
    np.testing.assert_array_equal(bits(part.dequantize()), bits(w[8:20]))
    x = np.random.default_rng(5).standard_normal((2, IN_FEATURES)).astype(np.float32)
    assert_matmul_close(part.matmul(x, tile_bytes=1), x, w[8:20])
    with pytest.raises(IndexError, match=r"rows \[20, 30\) are outside a matrix of 24 rows"):
        m.rows(20, 30)


def test_from_float_and_nbytes() -> None:
    fmt = format_by_name("Q4_0")
    w = np.random.default_rng(6).standard_normal((8, 64)).astype(np.float32)
    m = PackedMatrix.from_float(w, fmt)
    np.testing.assert_array_equal(m.data, quantize(w, fmt))
    assert m.shape == (8, 64)
    assert m.nbytes == 8 * 2 * 18 == m.data.nbytes


def test_memmap_is_used_in_place(tmp_path: Path) -> None:
    fmt = format_by_name("Q8_0")
    raw = random_packed(fmt, (16, IN_FEATURES))
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    m = PackedMatrix(mm, fmt)
    assert m.data is mm  # no copy on construction
    assert m.rows(2, 5).data.base is not None
    x = np.ones((1, IN_FEATURES), np.float32)
    assert_matmul_close(m.matmul(x, tile_bytes=1000), x, dequantize(raw, fmt))


def test_f32_weight_from_float_array_is_a_view() -> None:
    w = np.random.default_rng(7).standard_normal((6, 32)).astype(np.float32)
    m = PackedMatrix(w, format_by_name("F32"))
    assert m.shape == (6, 32) and np.shares_memory(m.data, w)
    x = np.random.default_rng(8).standard_normal((2, 32)).astype(np.float32)
    assert_matmul_close(m.matmul(x), x, w)


def test_packed_matrix_rejects_bad_data() -> None:
    with pytest.raises(ShapeMismatchError, match=r"must be 2-D"):
        PackedMatrix(np.zeros(18, np.uint8), format_by_name("Q4_0"))
    with pytest.raises(ShapeMismatchError, match=r"row of 20 bytes"):
        PackedMatrix(np.zeros((2, 20), np.uint8), format_by_name("Q4_0"))


def test_packed_experts() -> None:
    fmt = format_by_name("Q4_K")
    data = random_packed(fmt, (3, 8, IN_FEATURES))  # (n_expert, out, row_bytes)
    experts = PackedExperts(data, fmt)
    assert experts.shape == (3, 8, IN_FEATURES) and experts.held == (0, 1, 2)
    assert experts.nbytes == data.nbytes
    full = dequantize(data, fmt)  # (3, 8, in)
    np.testing.assert_array_equal(bits(experts.dequantize()), bits(full))
    for e in range(3):
        ex = experts.expert(e)
        assert np.shares_memory(ex.data, data)
        np.testing.assert_array_equal(bits(ex.dequantize()), bits(full[e]))
    with pytest.raises(IndexError, match=r"expert 3 is not held; held: \[0, 1, 2\]"):
        experts.expert(3)


def test_selected_experts_share_bytes_and_count_only_held() -> None:
    fmt = format_by_name("Q8_0")
    data = random_packed(fmt, (4, 8, IN_FEATURES))
    some = PackedExperts(data, fmt).select([2, 0])
    assert some.held == (0, 2) and some.shape == (4, 8, IN_FEATURES)
    assert some.data is data
    assert some.nbytes == data.nbytes // 2
    np.testing.assert_array_equal(some.expert(2).data, data[2])
    with pytest.raises(IndexError, match=r"expert 1 is not held; held: \[0, 2\]"):
        some.expert(1)
    with pytest.raises(IndexError, match=r"experts \[3\] are not held"):
        some.select([3])


def test_experts_from_float() -> None:
    fmt = format_by_name("Q4_1")
    w = np.random.default_rng(9).standard_normal((2, 4, 64)).astype(np.float32)
    experts = PackedExperts.from_float(w, fmt)
    np.testing.assert_array_equal(experts.expert(1).data, quantize(w[1], fmt))
    with pytest.raises(ShapeMismatchError, match=r"must be 3-D"):
        PackedExperts(np.zeros((2, 18), np.uint8), fmt)


def test_q5_0_becomes_q8_0_with_the_same_values_to_the_bit() -> None:
    """formats.q5_0_as_q8_0 (a K-quant file's Q5_0 fallback, read by the fused kernels as
    Q8_0): every value gguf decodes from the Q5_0 bytes, from the Q8_0 ones; rows and stacks
    keep their shape; every 5-bit value, both signs of d, and subnormal d included."""
    from cellswarm.quant.formats import q5_0_as_q8_0

    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (3, 4, 7 * 22), dtype=np.uint8)  # (stack, rows, 7 blocks)
    d = rng.uniform(-2, 2, (3, 4, 7)).astype(np.float16)
    d[0, 0, :3] = [np.float16(6e-8), np.float16(-0.0), np.float16(65504)]
    b = blocks.reshape(3, 4, 7, 22)
    b[..., :2] = d.view(np.uint8).reshape(3, 4, 7, 2)
    b[0, 0, 0, 2:] = [0xFF] * 4 + [0x10 * i + (15 - i) for i in range(16)]  # q = 0..31 all seen
    q8 = q5_0_as_q8_0(blocks)
    assert q8.shape == (3, 4, 7 * 34) and q8.dtype == np.uint8
    want = gq.dequantize(blocks, GGMLQuantizationType.Q5_0)
    got = gq.dequantize(q8, GGMLQuantizationType.Q8_0)
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
