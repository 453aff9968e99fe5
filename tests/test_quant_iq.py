"""The low-bit formats (i-quants, ternary, FP4, Q3_K/Q5_K/Q5_1): codebooks as gguf-py's data,
every format on the fused path, damaged scales found without decoding."""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import pytest

from cellswarm import kernels
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
