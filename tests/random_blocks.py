"""Random packed blocks of any quantized format, with small finite scales: what a file of that
format could hold (random bytes everywhere else: every index, sign and nibble is valid)."""

from __future__ import annotations

import numpy as np

from cellswarm.quant import QuantFormat


def _f16_bits(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float16).view(np.uint16)


def random_blocks(
    fmt: QuantFormat, shape: tuple[int, ...], rng: np.random.Generator,
    lo: float = 0.002, hi: float = 0.01,
) -> np.ndarray:  # fmt: skip
    """(..., rows, row_bytes) uint8 for logical `shape` (..., rows, cols) in `fmt`: scales in
    [lo, hi) (an MXFP4 block's: 2^-8 .. 2^-5), random bytes elsewhere."""
    nb = shape[-1] // fmt.block_size
    data = rng.integers(0, 256, (*shape[:-1], nb, fmt.type_size), dtype=np.uint8)
    lead = (*shape[:-1], nb)
    for off, kind in fmt.float_fields:
        if kind == "f16":
            data[..., off : off + 2] = _f16_bits(rng, lead, lo, hi).view(np.uint8).reshape(*lead, 2)
        elif kind == "e8m0":
            data[..., off] = rng.integers(120, 123, lead)
        elif kind == "iq1m_d":  # the f16's four nibbles go to the top of four 16-bit words
            d = _f16_bits(rng, lead, lo, hi)
            words = np.ascontiguousarray(data[..., off : off + 8]).view("<u2") & np.uint16(0x0FFF)
            for k in range(4):
                words[..., k] |= ((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
            data[..., off : off + 8] = words.view(np.uint8)
    return data.reshape(*shape[:-1], nb * fmt.type_size)
