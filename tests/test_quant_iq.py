"""The low-bit formats (i-quants, ternary, FP4, Q3_K/Q5_K/Q5_1): codebooks as gguf-py's data,
every format on the fused path, damaged scales found without decoding."""

from __future__ import annotations

from pathlib import Path

import gguf.quants as gq
import numpy as np
import pytest

from cellswarm import kernels
from cellswarm.io.gguf_file import GGUFFile
from cellswarm.quant import FORMATS, PackedMatrix, dequantize, first_nonfinite_block, grids
from tests.random_blocks import random_blocks

LOWBIT = [f for f in FORMATS.values() if f.name not in {"F32", "F16", "BF16"}]


def test_the_kernels_codebooks_are_gguf_pys_byte_for_byte() -> None:
    """kernels/grids.c is generated from gguf-py (python -m cellswarm.quant.grids): made again
    here, it must be the same bytes, and each table the values gguf-py decodes with."""
    assert grids.C_PATH.read_text() == grids.c_source()
    for name, cls in grids.GRIDS.items():
        cls.init_grid()
        np.testing.assert_array_equal(
            grids.grid(name).astype(np.float32), np.asarray(cls.grid).reshape(cls.grid_shape)
        )
    assert bytes(grids.ksigns()) == gq.IQ2_XXS.ksigns
    # and the sign table is what its rule makes: 7 bits, the eighth for an even count
    rule = [i | (0x80 if bin(i).count("1") % 2 else 0) for i in range(128)]
    assert list(grids.ksigns()) == rule


def test_every_quantized_format_has_a_fused_kernel() -> None:
    """No format falls off the fused path to a per-step dequantize (the K-quant cliff: Q3_K and
    Q5_K read 30-60x slower than Q4_K): each one the codecs read, the kernels multiply as stored,
    but Q5_0, which they read as Q8_0 holding its values."""
    assert {f.name for f in LOWBIT} - set(kernels.FUSED_TYPES) == {"Q5_0"}


@pytest.mark.parametrize("fmt", LOWBIT, ids=lambda f: f.name)
def test_dequantize_is_gguf_pys_on_scales_of_every_size(fmt) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    cols = 512 if fmt.block_size != 64 else 320
    for lo, hi in ((1e-6, 1e-4), (0.01, 1.0), (100.0, 6e4)):
        data = random_blocks(fmt, (6, cols), rng, lo=lo, hi=hi)
        ours = dequantize(data, fmt)
        ref = gq.dequantize(data, fmt.ggml_type).astype(np.float32)
        np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", ["IQ1_M", "MXFP4", "TQ1_0", "IQ4_XS"])
def test_a_damaged_scale_is_found_without_decoding(name: str) -> None:
    fmt = next(f for f in FORMATS.values() if f.name == name)
    data = random_blocks(fmt, (4, 512), np.random.default_rng(1))
    assert first_nonfinite_block(data, fmt) is None
    blocks = data.reshape(-1, fmt.type_size)
    off, kind = fmt.float_fields[0]
    if kind == "e8m0":
        blocks[5, off] = 0xFF  # NaN in E8M0
    elif kind == "iq1m_d":  # exponent bits all set: the top nibbles of words 2 and 3
        blocks[5, off + 5] |= 0xC0
        blocks[5, off + 7] |= 0x70
    else:
        blocks[5, off + 1] = 0x7C  # f16 infinity
    assert first_nonfinite_block(data, fmt) == 5


@pytest.mark.skipif(kernels.backend() != "c", reason="no C compiler on this machine")
@pytest.mark.parametrize("name", [n for n in kernels.FUSED_TYPES if n not in {"Q8_0", "Q4_0"}])
def test_a_low_bit_matrix_is_never_decoded_to_float_tiles(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PackedMatrix.matmul of every format goes to the fused kernel in one call at any batch:
    the float tile path (dequantize per step) is not taken."""
    fmt = next(f for f in FORMATS.values() if f.name == name)
    m = PackedMatrix(random_blocks(fmt, (24, 512), np.random.default_rng(2)), fmt)

    def no_tiles(*_: object) -> None:
        raise AssertionError(f"{name} fell back to float tiles")

    monkeypatch.setattr(PackedMatrix, "_tiles", no_tiles)
    x = np.random.default_rng(3).standard_normal((20, 512)).astype(np.float32)
    assert m.matmul(x).shape == (20, 24)


FIXTURE = Path(__file__).with_name("data") / "llama_quantize_lowbit.gguf"


FIXTURE_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
                 "IQ4_XS", "TQ1_0", "TQ2_0", "Q2_K", "Q3_K", "Q5_K", "Q5_1", "MXFP4"]  # fmt: skip


def _fixture() -> dict[str, object]:
    f = GGUFFile(FIXTURE)
    return {name: f.tensor(name) for name in f.tensor_names()}


def test_the_fixture_holds_every_type_llama_quantize_writes_here() -> None:
    """Rows of one tensor as llama.cpp's llama-quantize wrote it (with llama-imatrix's
    importance matrix) in each low-bit type: made by `python -m bench.lowbit_fixture`."""
    names = set(_fixture())
    assert names == {"F32", *FIXTURE_TYPES}


@pytest.mark.parametrize("name", FIXTURE_TYPES)
def test_llama_quantize_rows_decode_as_gguf_py_does_and_multiply_fused(name: str) -> None:
    tensors = _fixture()
    w, source = tensors[name], tensors["F32"]
    assert isinstance(w, PackedMatrix) and isinstance(source, PackedMatrix)
    f32 = source.dequantize()
    ours = dequantize(w.data, w.fmt)
    ref = gq.dequantize(np.asarray(w.data), w.fmt.ggml_type).astype(np.float32)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))
    # real quantization of the float rows: near them, as near as the type's bits allow
    rel = np.linalg.norm(ours - f32) / np.linalg.norm(f32)
    # (ternary types round a Gaussian row mostly to 0: they are for models trained ternary)
    assert rel < (1.0 if name.startswith("TQ") else 0.75 if w.fmt.bits_per_weight < 2 else 0.45)
    if kernels.backend() == "c":
        out = np.empty_like(ours)
        kernels.dequantize(name, np.ascontiguousarray(w.data), w.shape[1], out)
        np.testing.assert_array_equal(out.view(np.uint32), ours.view(np.uint32))
        x = np.random.default_rng(4).standard_normal((3, w.shape[1])).astype(np.float32)
        exact = x.astype(np.float64) @ ours.astype(np.float64).T
        np.testing.assert_allclose(w.matmul(x), exact, rtol=0, atol=0.02 * np.abs(exact).max())
