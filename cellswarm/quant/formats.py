"""GGUF tensor formats as typed data, with numpy codecs bit-exact with `gguf.quants`.

A format is a frozen `QuantFormat` value: its name, GGML type id, how many elements one
block holds and how many bytes it takes. Each supported type has one small subclass that
knows its block layout and converts whole batches of blocks at once:

    dequantize_blocks: uint8 (n_blocks, type_size)    -> float32 (n_blocks, block_size)
    quantize_blocks:   float32 (n_blocks, block_size) -> uint8 (n_blocks, type_size)

Bit-exactness with gguf-py is a contract, not an accident: every float32 expression below
performs the same roundings in the same order as `gguf.quants` (numpy never fuses a
multiply-add, so `(d * sc) * q - m` and `d * (sc * q) - m` can differ in the last bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import numpy.typing as npt

from cellswarm.errors import ShapeMismatchError, UnsupportedQuantError
from cellswarm.quant.ggml_types import GGMLQuantizationType

Bytes = npt.NDArray[np.uint8]
Floats = npt.NDArray[np.float32]

QK_K = 256  # elements in a K-quant super-block

# Dequantize/quantize this many elements per step, so the temporaries of a large tensor
# stay a few MiB (cache-sized) instead of several copies of the whole tensor.
_CHUNK_ELEMENTS = 1 << 18


# --------------------------------------------------------------------------- bit helpers


def _f16(field: Bytes) -> Floats:
    """Little-endian float16 bytes (n, 2*k) -> their float32 values (n, k), exactly."""
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)


def _to_f16_bytes(values: Floats) -> Bytes:
    """float32 (n, k) -> float16 bytes (n, 2*k), rounded to nearest even like ggml."""
    return values.astype(np.float16).view(np.uint8)


def _planes(packed: Bytes, bits: int) -> Bytes:
    """Split each byte into 8/bits fields of `bits` bits, lowest first, plane-major.

    (..., k) -> (..., 8 // bits * k); output index `p * k + j` holds bits
    [p*bits, (p+1)*bits) of byte j. This is how GGML spreads nibbles, 2-bit and 1-bit
    fields over a run of bytes: the low field of every byte first, then the next.
    """
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]  # (planes, 1)
    fields = (packed[..., None, :] >> shifts) & np.uint8((1 << bits) - 1)  # (..., planes, k)
    return fields.reshape(*packed.shape[:-1], -1)


def _pack_nibbles(q: Bytes) -> Bytes:
    """Inverse of `_planes(_, 4)`: (n, 2k) values < 16 -> (n, k) bytes, first half low."""
    low, high = np.split(q, 2, axis=-1)
    return low | (high << np.uint8(4))


def _round_half_away(x: Floats) -> Floats:
    """Round to nearest, ties away from zero (C `roundf`), exactly in float32.

    `trunc(x + 0.5)` is not exact: 0.49999997 + 0.5 rounds up to 1.0 in float32. The
    fractional part of a float32 is exact, so comparing it with 0.5 is.
    """
    a = np.abs(x)
    whole = np.floor(a)
    rounded = whole + (a - whole >= np.float32(0.5))
    return np.copysign(rounded, x).astype(np.float32)


def _safe_reciprocal(d: Floats) -> Floats:
    """1 / d in float32, and 0 where d is 0 (an all-zero block quantizes to zeros)."""
    out = np.zeros_like(d)
    np.divide(np.float32(1), d, out=out, where=d != 0)
    return out


# ------------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class QuantFormat:
    """One GGUF tensor type: `block_size` elements are stored in `type_size` bytes."""

    name: str
    ggml_type: GGMLQuantizationType
    block_size: int
    type_size: int

    # Whether `quantize_blocks` exists for this format (gguf-py has no K-quant quantizer
    # to be bit-exact with, so those are read-only).
    can_quantize: ClassVar[bool] = False
    # The block's floating-point fields, (byte offset, "f16" | "bf16" | "f32" | "e8m0" |
    # "iq1m_d"): its scales
    # (and mins), or the value itself for float formats. Every other field is a small
    # integer, so a block dequantizes to finite numbers exactly when these are finite.
    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ()

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block_size

    def row_bytes(self, n_cols: int) -> int:
        """Bytes one row of `n_cols` elements takes."""
        if n_cols % self.block_size:
            raise ShapeMismatchError(
                f"row of {n_cols} elements is not a multiple of "
                f"{self.name}'s block size {self.block_size}"
            )
        return n_cols // self.block_size * self.type_size

    def n_cols(self, row_bytes: int) -> int:
        """Elements in a row of `row_bytes` bytes (the inverse of `row_bytes`)."""
        if row_bytes % self.type_size:
            raise ShapeMismatchError(
                f"row of {row_bytes} bytes is not a multiple of "
                f"{self.name}'s block of {self.type_size} bytes"
            )
        return row_bytes // self.type_size * self.block_size

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        """uint8 (n_blocks, type_size) -> float32 (n_blocks, block_size)."""
        raise NotImplementedError

    def quantize_blocks(self, x: Floats) -> Bytes:
        """float32 (n_blocks, block_size) -> uint8 (n_blocks, type_size)."""
        raise _cannot_quantize(self)


@dataclass(frozen=True)
class F32Format(QuantFormat):
    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f32"),)
    can_quantize: ClassVar[bool] = True

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        return np.ascontiguousarray(blocks).view(np.float32)  # (n, 1)

    def quantize_blocks(self, x: Floats) -> Bytes:
        return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8)  # (n, 4)


@dataclass(frozen=True)
class F16Format(QuantFormat):
    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)
    can_quantize: ClassVar[bool] = True

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        return _f16(blocks)  # (n, 1)

    def quantize_blocks(self, x: Floats) -> Bytes:
        return _to_f16_bytes(x)  # (n, 2)


@dataclass(frozen=True)
class BF16Format(QuantFormat):
    """The top half of a float32; encoding rounds to nearest even and keeps NaNs quiet."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "bf16"),)
    can_quantize: ClassVar[bool] = True

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        high = np.ascontiguousarray(blocks).view(np.uint16).astype(np.uint32)  # (n, 1)
        return (high << np.uint32(16)).view(np.float32)

    def quantize_blocks(self, x: Floats) -> Bytes:
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)  # (n, 1)
        # A NaN whose payload sits only in the low half would round to infinity: keep
        # the high half and set the quiet bit instead (ggml_compute_fp32_to_bf16).
        is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        bits = np.where(is_nan, (bits & np.uint32(0xFFFF0000)) | np.uint32(0x00400000), bits)
        # Round to nearest even. No overflow in uint32: the largest non-NaN pattern is
        # 0xFF800000 (-inf), and quieted NaNs have a zero low half.
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        bits = (bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)
        return bits.astype(np.uint16).view(np.uint8)  # (n, 2)


@dataclass(frozen=True)
class Q8_0Format(QuantFormat):
    """Block of 32: f16 scale d, then 32 int8 q; x = q * d."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)
    can_quantize: ClassVar[bool] = True

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        d = _f16(blocks[:, :2])  # (n, 1)
        q = blocks[:, 2:].view(np.int8).astype(np.float32)  # (n, 32)
        return q * d

    def quantize_blocks(self, x: Floats) -> Bytes:
        d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)  # (n, 1)
        # Quantize with the float32 reciprocal, not the f16-rounded scale, as ggml does.
        q = _round_half_away(x * _safe_reciprocal(d)).astype(np.int8)  # (n, 32)
        return np.concatenate([_to_f16_bytes(d), q.view(np.uint8)], axis=1)


def _signed_absmax(x: Floats) -> Floats:
    """The element of largest magnitude per block, with its sign; first one on ties."""
    at = np.abs(x).argmax(axis=-1, keepdims=True)  # (n, 1)
    return np.take_along_axis(x, at, axis=-1)


@dataclass(frozen=True)
class Q4_0Format(QuantFormat):
    """Block of 32: f16 d, then 16 bytes of nibbles; x = d * (q - 8)."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)
    can_quantize: ClassVar[bool] = True

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        d = _f16(blocks[:, :2])  # (n, 1)
        q = _planes(blocks[:, 2:], 4).astype(np.int8) - np.int8(8)  # (n, 32)
        return d * q.astype(np.float32)

    def quantize_blocks(self, x: Floats) -> Bytes:
        # The scale maps the extreme value to -8, so one side uses the full 16 levels.
        d = _signed_absmax(x) / np.float32(-8)  # (n, 1)
        scaled = np.trunc(x * _safe_reciprocal(d) + np.float32(8.5), dtype=np.float32)
        q = scaled.astype(np.uint8).clip(0, 15)  # (n, 32)
        return np.concatenate([_to_f16_bytes(d), _pack_nibbles(q)], axis=1)


@dataclass(frozen=True)
class Q4_1Format(QuantFormat):
    """Block of 32: f16 d, f16 min m, then 16 bytes of nibbles; x = d * q + m."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"), (2, "f16"))
    can_quantize: ClassVar[bool] = True

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # (n, 1) each
        q = _planes(blocks[:, 4:], 4).astype(np.float32)  # (n, 32)
        return d * q + m

    def quantize_blocks(self, x: Floats) -> Bytes:
        lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)  # (n, 1)
        d = (hi - lo) / np.float32(15)
        scaled = np.trunc((x - lo) * _safe_reciprocal(d) + np.float32(0.5), dtype=np.float32)
        q = scaled.astype(np.uint8).clip(0, 15)  # (n, 32)
        return np.concatenate([_to_f16_bytes(d), _to_f16_bytes(lo), _pack_nibbles(q)], axis=1)


def _q5(high_bits: Bytes, nibbles: Bytes) -> Bytes:
    """5-bit values (n, 32) from a 32-bit mask (n, 4 bytes, bit i = element i) and nibbles."""
    high = np.unpackbits(high_bits, axis=-1, bitorder="little")  # (n, 32)
    return _planes(nibbles, 4) | (high << np.uint8(4))


def _q5_split(q: Bytes) -> tuple[Bytes, Bytes]:
    """Inverse of `_q5`: 5-bit values (n, 32) -> (mask (n, 4), nibbles (n, 16))."""
    high = np.packbits(q >> np.uint8(4), axis=-1, bitorder="little")
    return high, _pack_nibbles(q & np.uint8(0x0F))


@dataclass(frozen=True)
class Q5_0Format(QuantFormat):
    """Block of 32: f16 d, 4 bytes of fifth bits, 16 bytes of nibbles; x = d * (q - 16)."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)
    can_quantize: ClassVar[bool] = True

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        d = _f16(blocks[:, :2])  # (n, 1)
        q = _q5(blocks[:, 2:6], blocks[:, 6:]).astype(np.int8) - np.int8(16)  # (n, 32)
        return d * q.astype(np.float32)

    def quantize_blocks(self, x: Floats) -> Bytes:
        d = _signed_absmax(x) / np.float32(-16)  # (n, 1)
        scaled = np.trunc(x * _safe_reciprocal(d) + np.float32(16.5), dtype=np.float32)
        high, low = _q5_split(scaled.astype(np.uint8).clip(0, 31))
        return np.concatenate([_to_f16_bytes(d), high, low], axis=1)


def q5_0_as_q8_0(blocks: Bytes) -> Bytes:
    """Q5_0 rows (..., n * 22 bytes) as Q8_0 rows (..., n * 34) holding the same values to the
    bit: Q5_0 is d * (q - 16) with q - 16 in -16..15, Q8_0 is d * q8 with q8 an int8, and the
    f16 d carries over. For a fused kernel, which reads Q8_0 and not Q5_0."""
    rows = blocks.shape[:-1]
    b = np.ascontiguousarray(blocks).reshape(-1, 22)
    q = _q5(b[:, 2:6], b[:, 6:]).astype(np.int8) - np.int8(16)  # (n, 32)
    out = np.concatenate([b[:, :2], q.view(np.uint8)], axis=1)
    return out.reshape(*rows, -1)


@dataclass(frozen=True)
class Q5_1Format(QuantFormat):
    """Block of 32: f16 d, f16 m, 4 bytes of fifth bits, 16 of nibbles; x = d * q + m."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"), (2, "f16"))
    can_quantize: ClassVar[bool] = True

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # (n, 1) each
        q = _q5(blocks[:, 4:8], blocks[:, 8:]).astype(np.float32)  # (n, 32)
        return d * q + m

    def quantize_blocks(self, x: Floats) -> Bytes:
        lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)  # (n, 1)
        d = (hi - lo) / np.float32(31)
        scaled = np.trunc((x - lo) * _safe_reciprocal(d) + np.float32(0.5), dtype=np.float32)
        high, low = _q5_split(scaled.astype(np.uint8).clip(0, 31))
        return np.concatenate([_to_f16_bytes(d), _to_f16_bytes(lo), high, low], axis=1)


# K-quants: a 256-element super-block split into sub-blocks, each with its own small
# integer scale (and min) multiplied by one or two f16 super-scales. The quant bits are
# spread over 32- or 64-byte runs with `_planes`.


def _per_sub_block(q: Floats, n_sub: int) -> Floats:
    """(n, 256) -> (n, n_sub, 256 // n_sub), so sub-block scales (n, n_sub, 1) broadcast."""
    return q.reshape(q.shape[0], n_sub, -1)


def _k_scale_min(packed: Bytes) -> tuple[Bytes, Bytes]:
    """12 bytes of Q4_K/Q5_K 6-bit scales and mins (n, 12) -> scales (n, 8), mins (n, 8).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; sub-blocks 4-7
    take their low 4 bits from bytes 8-11 (scale low nibble, min high nibble) and their
    top 2 bits from the spare top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    first, second, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]  # (n, 4) each
    six = np.uint8(0x3F)
    scales = np.concatenate(
        [first & six, (rest & np.uint8(0x0F)) | ((first >> np.uint8(6)) << np.uint8(4))], axis=1
    )
    mins = np.concatenate(
        [second & six, (rest >> np.uint8(4)) | ((second >> np.uint8(6)) << np.uint8(4))], axis=1
    )
    return scales, mins


@dataclass(frozen=True)
class Q2_KFormat(QuantFormat):
    """scales (16 B: low nibble scale, high nibble min), 2-bit q (64 B), f16 d, f16 dmin.

    x = (d * scale) * q - dmin * min, per 16-element sub-block.
    """

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((80, "f16"), (82, "f16"))

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        n = blocks.shape[0]
        sub, qs = blocks[:, 0:16], blocks[:, 16:80]
        d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])  # (n, 1) each
        scale = (d * (sub & np.uint8(0x0F)).astype(np.float32))[..., None]  # (n, 16, 1)
        low = (dmin * (sub >> np.uint8(4)).astype(np.float32))[..., None]  # (n, 16, 1)
        q = _planes(qs.reshape(n, 2, 32), 2).reshape(n, QK_K).astype(np.float32)  # (n, 256)
        return (scale * _per_sub_block(q, 16) - low).reshape(n, QK_K)


@dataclass(frozen=True)
class Q3_KFormat(QuantFormat):
    """high-bit mask (32 B), 2-bit low q (64 B), 6-bit signed scales (12 B), f16 d.

    x = (d * (scale - 32)) * (low - 4 * (1 - high)), per 16-element sub-block.
    """

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((108, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        n = blocks.shape[0]
        hmask, qs, packed = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
        d = _f16(blocks[:, 108:110])  # (n, 1)
        # 16 six-bit scales: low nibbles from bytes 0-7, top 2 bits from bytes 8-11.
        sc = _planes(packed[:, 0:8], 4) | (_planes(packed[:, 8:12], 2) << np.uint8(4))
        scale = (d * (sc.astype(np.int8) - np.int8(32)).astype(np.float32))[..., None]
        low = _planes(qs.reshape(n, 2, 32), 2).reshape(n, QK_K).astype(np.int8)  # (n, 256)
        # A clear high bit means "subtract 4"; a set one adds nothing.
        no_high = _planes(hmask, 1) ^ np.uint8(1)  # (n, 256)
        q = (low - (no_high << np.uint8(2)).astype(np.int8)).astype(np.float32)
        return (scale * _per_sub_block(q, 16)).reshape(n, QK_K)


def _k_scale_low(blocks: Bytes) -> tuple[Floats, Floats]:
    """Q4_K/Q5_K block prelude: (d * scale, dmin * min) per 32-element sub-block, (n, 8, 1)."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # (n, 1) each
    sc, mn = _k_scale_min(blocks[:, 4:16])  # (n, 8) each
    return (d * sc.astype(np.float32))[..., None], (dmin * mn.astype(np.float32))[..., None]


@dataclass(frozen=True)
class Q4_KFormat(QuantFormat):
    """f16 d, f16 dmin, 6-bit scales and mins (12 B), nibbles (128 B).

    x = (d * scale) * q - dmin * min, per 32-element sub-block.
    """

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"), (2, "f16"))

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        n = blocks.shape[0]
        scale, low = _k_scale_low(blocks)  # (n, 8, 1) each
        q = _planes(blocks[:, 16:].reshape(n, 4, 32), 4).astype(np.float32)  # (n, 4, 64)
        return (scale * _per_sub_block(q.reshape(n, QK_K), 8) - low).reshape(n, QK_K)


@dataclass(frozen=True)
class Q5_KFormat(QuantFormat):
    """f16 d, f16 dmin, 6-bit scales and mins (12 B), fifth bits (32 B), nibbles (128 B).

    x = (d * scale) * q - dmin * min, per 32-element sub-block.
    """

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"), (2, "f16"))

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        n = blocks.shape[0]
        scale, low = _k_scale_low(blocks)  # (n, 8, 1) each
        nibbles = _planes(blocks[:, 48:].reshape(n, 4, 32), 4).reshape(n, QK_K)  # (n, 256)
        high = _planes(blocks[:, 16:48], 1)  # (n, 256)
        q = (nibbles | (high << np.uint8(4))).astype(np.float32)
        return (scale * _per_sub_block(q, 8) - low).reshape(n, QK_K)


@dataclass(frozen=True)
class Q6_KFormat(QuantFormat):
    """low nibbles (128 B), high 2 bits (64 B), int8 scales (16 B), f16 d.

    x = (d * scale) * (q - 32), per 16-element sub-block. Each 128-element half uses
    64 nibble bytes and 32 high-bit bytes.
    """

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((208, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        n = blocks.shape[0]
        ql, qh, sc = blocks[:, 0:128], blocks[:, 128:192], blocks[:, 192:208]
        d = _f16(blocks[:, 208:210])  # (n, 1)
        scale = (d * sc.view(np.int8).astype(np.float32))[..., None]  # (n, 16, 1)
        low = _planes(ql.reshape(n, 2, 64), 4)  # (n, 2, 128)
        high = _planes(qh.reshape(n, 2, 32), 2)  # (n, 2, 128)
        q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
        return (scale * _per_sub_block(q.reshape(n, QK_K), 16)).reshape(n, QK_K)


# I-quants, ternary and MXFP4: each weight is a scale times a small integer, like the others,
# but the integer comes from a table (a nibble's value, or a codebook entry of 8 or 4 values
# with its signs stored apart). `_signed` applies sign bits; the scale is per unit of 32 or
# 16 weights. Codebooks are gguf-py's own (quant/grids.py).


def _u16(field: Bytes) -> npt.NDArray[np.uint16]:
    return np.ascontiguousarray(field).view("<u2")


def _u32(field: Bytes) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(field).view("<u4")


def _signed(values: npt.NDArray[np.int8], sign_bytes: Bytes) -> npt.NDArray[np.int8]:
    """values (..., 8 * k) with the bits of sign_bytes (..., k) applied, bit j of byte i to
    value 8 i + j (set: negative)."""
    neg = np.unpackbits(sign_bytes, axis=-1, bitorder="little").astype(bool)
    return np.where(neg, -values, values).astype(np.int8)


def _iq_scale(d: Floats, nibble: npt.NDArray[np.integer], step: float) -> Floats:
    """d * (0.5 + s) * step, in float32 and in that order (IQ2/IQ3_XXS block scales)."""
    return (d * (np.float32(0.5) + nibble.astype(np.float32))) * np.float32(step)


def _nibble_values(packed: Bytes, table: tuple[int, ...]) -> npt.NDArray[np.int8]:
    """(n, 16) bytes of nibbles, low ones first -> their values in `table` (n, 32), int8."""
    return np.array(table, dtype=np.int8)[_planes(packed, 4)]


@dataclass(frozen=True)
class IQ4_NLFormat(QuantFormat):
    """Block of 32: f16 d, 16 bytes of nibbles indexing a fixed non-linear table."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import KVALUES_IQ4NL

        d = _f16(blocks[:, :2])  # (n, 1)
        return d * _nibble_values(blocks[:, 2:], KVALUES_IQ4NL).astype(np.float32)


@dataclass(frozen=True)
class IQ4_XSFormat(QuantFormat):
    """f16 d, 6-bit sub-block scales (2 B high bits, 4 B low nibbles), 128 B of IQ4_NL nibbles.

    x = (d * (scale - 32)) * kvalue, per 32-element sub-block."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import KVALUES_IQ4NL

        n = blocks.shape[0]
        d = _f16(blocks[:, :2])  # (n, 1)
        high = (_u16(blocks[:, 2:4]) >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)
        low = _planes(blocks[:, 4:8, None], 4).reshape(n, 8)  # (n, 8): byte j -> 2j, 2j + 1
        scale = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(32)
        dl = (d * scale.astype(np.float32))[..., None]  # (n, 8, 1)
        q = _nibble_values(blocks[:, 8:].reshape(n * 8, 16), KVALUES_IQ4NL).reshape(n, 8, 32)
        return (dl * q.astype(np.float32)).reshape(n, QK_K)


@dataclass(frozen=True)
class IQ2_XXSFormat(QuantFormat):
    """f16 d, then 8 sub-blocks of 32 in 8 bytes each: 4 codebook indices (8 values each),
    then a 32-bit word of 4 x 7 sign bits and a 4-bit scale. x = d (0.5 + s) / 4 * value."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import grid, ksigns

        n = blocks.shape[0]
        d = _f16(blocks[:, :2])  # (n, 1)
        words = _u32(blocks[:, 2:]).reshape(n, 8, 2)  # (n, 8, [indices, signs + scale])
        db = _iq_scale(d, words[..., 1] >> np.uint32(28), 0.25)[..., None]  # (n, 8, 1)
        index = np.ascontiguousarray(words[..., 0]).view(np.uint8).reshape(n, 8, 4)
        values = grid("iq2xxs_grid")[index].reshape(n, 8, 32)
        sign_index = (words[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & np.uint32(127)
        q = _signed(values, ksigns()[sign_index])  # (n, 8, 32)
        return (db * q.astype(np.float32)).reshape(n, QK_K)


@dataclass(frozen=True)
class IQ2_XSFormat(QuantFormat):
    """f16 d, 32 16-bit words (9-bit codebook index, 7 sign bits), 8 bytes of two 4-bit
    scales (one a 16-element half). x = d (0.5 + s) / 4 * value."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import grid, ksigns

        n = blocks.shape[0]
        d = _f16(blocks[:, :2])  # (n, 1)
        words = _u16(blocks[:, 2:66])  # (n, 32)
        db = _iq_scale(d, _planes(blocks[:, 66:74, None], 4).reshape(n, 16), 0.25)
        values = grid("iq2xs_grid")[words & np.uint16(511)].reshape(n, 16, 16)
        signs = ksigns()[words >> np.uint16(9)].reshape(n, 16, 2)
        q = _signed(values, signs)
        return (db[..., None] * q.astype(np.float32)).reshape(n, QK_K)


@dataclass(frozen=True)
class IQ2_SFormat(QuantFormat):
    """f16 d, 32 low index bytes, 32 sign bytes, 8 bytes of 2-bit index tops, 8 bytes of two
    4-bit scales (a 16-element half each). x = d (0.5 + s) / 4 * value."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import grid

        n = blocks.shape[0]
        d = _f16(blocks[:, :2])  # (n, 1)
        low, signs, tops = blocks[:, 2:34], blocks[:, 34:66], blocks[:, 66:74]
        db = _iq_scale(d, _planes(blocks[:, 74:82, None], 4).reshape(n, 16), 0.25)
        top = _planes(tops[..., None], 2).reshape(n, 32).astype(np.uint16)  # (n, 32)
        index = low.astype(np.uint16) | (top << np.uint16(8))
        q = _signed(grid("iq2s_grid")[index].reshape(n, 32, 8), signs[..., None])
        return (db[..., None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


@dataclass(frozen=True)
class IQ3_XXSFormat(QuantFormat):
    """f16 d, 64 codebook indices (4 values each), 8 words of 4 x 7 sign bits and a 4-bit
    scale. x = d (0.5 + s) / 2 * value, per 32-element sub-block."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import grid, ksigns

        n = blocks.shape[0]
        d = _f16(blocks[:, :2])  # (n, 1)
        words = _u32(blocks[:, 66:98])  # (n, 8)
        db = _iq_scale(d, words >> np.uint32(28), 0.5)[..., None]  # (n, 8, 1)
        values = grid("iq3xxs_grid")[blocks[:, 2:66]].reshape(n, 8, 32)
        sign_index = (words[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & np.uint32(127)
        q = _signed(values, ksigns()[sign_index])
        return (db * q.astype(np.float32)).reshape(n, QK_K)


@dataclass(frozen=True)
class IQ3_SFormat(QuantFormat):
    """f16 d, 64 low index bytes, 8 bytes of index ninth bits, 32 sign bytes, 4 bytes of two
    4-bit scales. x = d (1 + 2 s) * value, per 32-element sub-block."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import grid

        n = blocks.shape[0]
        d = _f16(blocks[:, :2])  # (n, 1)
        low, ninth, signs = blocks[:, 2:66], blocks[:, 66:74], blocks[:, 74:106]
        s = _planes(blocks[:, 106:110, None], 4).reshape(n, 8).astype(np.float32)
        db = (d * (np.float32(1) + np.float32(2) * s))[..., None]  # (n, 8, 1)
        high = np.unpackbits(ninth, axis=-1, bitorder="little").astype(np.uint16)  # (n, 64)
        values = grid("iq3s_grid")[low.astype(np.uint16) | (high << np.uint16(8))]
        q = _signed(values.reshape(n, 32, 8), signs[..., None]).reshape(n, 8, 32)
        return (db * q.astype(np.float32)).reshape(n, QK_K)


def iq1_values(grid_values: npt.NDArray[np.int8], negative_delta: npt.NDArray[np.bool_]) -> Bytes:
    """IQ1 weights as 8 * (value + delta): integers (value in -1..1, delta = +-1/8), so a
    group of 8 is 8 * value +- 1 in int8 and its scale is the block's divided by 8, exactly."""
    eight = grid_values.astype(np.int8) * np.int8(8)
    return np.where(negative_delta, eight - np.int8(1), eight + np.int8(1)).astype(np.int8)


@dataclass(frozen=True)
class IQ1_SFormat(QuantFormat):
    """f16 d, 32 low index bytes, 8 16-bit words (4 x 3 index top bits, a 3-bit scale, the
    delta's sign). x = d (2 s + 1) * (value + delta), value in -1..1, delta = +-1/8."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import grid

        n = blocks.shape[0]
        d = _f16(blocks[:, :2])  # (n, 1)
        words = _u16(blocks[:, 34:50])  # (n, 8)
        s = ((words >> np.uint16(12)) & np.uint16(7)).astype(np.float32)
        dl = (d * (np.float32(2) * s + np.float32(1)))[..., None]  # (n, 8, 1)
        tops = (words[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)
        index = blocks[:, 2:34].astype(np.uint16).reshape(n, 8, 4) | (tops << np.uint16(8))
        negative = (words & np.uint16(0x8000)) != 0  # (n, 8)
        q = iq1_values(grid("iq1s_grid")[index].reshape(n, 8, 32), negative[..., None])
        return (dl * (q.astype(np.float32) * np.float32(0.125))).reshape(n, QK_K)


@dataclass(frozen=True)
class IQ1_MFormat(QuantFormat):
    """32 low index bytes, 16 bytes of two (3 index top bits, delta sign) nibbles, 8 bytes of
    3-bit scales (one a 16-element half) whose spare top nibbles hold the f16 d.
    x = d (2 s + 1) * (value + delta) with a delta per 8 values."""

    # its f16 is spread over four nibbles: first_nonfinite_block reads it whole (IQ1_M_D)
    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((48, "iq1m_d"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import grid

        n = blocks.shape[0]
        words = _u16(blocks[:, 48:56])  # (n, 4)
        d = _f16(iq1m_scale(blocks[:, 48:56]).view(np.uint8))  # (n, 1)
        s = (words[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & np.uint16(7)  # (n, 4, 4)
        dl = (d * (np.float32(2) * s.reshape(n, 16).astype(np.float32) + np.float32(1)))
        nib = _planes(blocks[:, 32:48, None], 4).reshape(n, 32)  # (n, 32): one per 8 values
        index = blocks[:, :32].astype(np.uint16) | ((nib & np.uint8(7)).astype(np.uint16) << 8)
        q = iq1_values(grid("iq1s_grid")[index], (nib & np.uint8(8))[..., None] != 0)
        x = q.reshape(n, 16, 16).astype(np.float32) * np.float32(0.125)
        return (dl[..., None] * x).reshape(n, QK_K)


def iq1m_scale(scales: Bytes) -> npt.NDArray[np.uint16]:
    """IQ1_M's f16 d from its 8 scale bytes (n, 8): the top nibble of each 16-bit word."""
    words = _u16(scales)  # (n, 4)
    parts = (words & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], np.uint16)
    return (parts[:, 0] | parts[:, 1] | parts[:, 2] | parts[:, 3])[:, None]  # (n, 1)


@dataclass(frozen=True)
class TQ1_0Format(QuantFormat):
    """Ternary: 48 bytes of 5 base-3 digits, 4 bytes of 4, f16 d. x = d * (digit - 1)."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((52, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        d = _f16(blocks[:, 52:54])  # (n, 1)
        digits = tq1_digits(blocks[:, :52])  # (n, 256)
        return d * (digits.astype(np.int8) - np.int8(1)).astype(np.float32)


_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def tq1_digits(packed: Bytes) -> Bytes:
    """TQ1_0's 52 bytes (n, 52) -> its 256 base-3 digits (0..2) in element order: byte b
    holds a fixed-point fraction; multiplying by 3^k (mod 256) brings digit k to the top."""
    n = packed.shape[0]

    def digits(part: Bytes, k: int) -> Bytes:  # (n, m) -> (n, k * m), digit-major
        scaled = part[:, None, :] * _POW3[:k, None]  # (n, k, m), uint8 wraps as in C
        return ((scaled.astype(np.uint16) * np.uint16(3)) >> np.uint16(8)).reshape(n, -1)

    return np.concatenate(
        [digits(packed[:, :32], 5), digits(packed[:, 32:48], 5), digits(packed[:, 48:52], 4)],
        axis=1,
    ).astype(np.uint8)


@dataclass(frozen=True)
class TQ2_0Format(QuantFormat):
    """Ternary in 2 bits: 64 bytes of 2-bit fields (planes of 32 bytes), f16 d.
    x = d * (field - 1)."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((64, "f16"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        n = blocks.shape[0]
        d = _f16(blocks[:, 64:66])  # (n, 1)
        q = _planes(blocks[:, :64].reshape(n, 2, 32), 2).reshape(n, QK_K)
        return d * (q.astype(np.int8) - np.int8(1)).astype(np.float32)


def e8m0_half(e: Bytes) -> Floats:
    """An MXFP4 block's scale byte -> 2^(e - 128) as float32 (ggml_e8m0_to_fp32_half: half
    the E8M0 value, since the table holds doubled e2m1 values)."""
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


@dataclass(frozen=True)
class MXFP4Format(QuantFormat):
    """Block of 32: an E8M0 scale byte, 16 bytes of e2m1 nibbles. x = 2^(e-128) * kvalue."""

    float_fields: ClassVar[tuple[tuple[int, str], ...]] = ((0, "e8m0"),)

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import KVALUES_MXFP4

        d = e8m0_half(blocks[:, :1])  # (n, 1)
        return d * _nibble_values(blocks[:, 1:], KVALUES_MXFP4).astype(np.float32)


def ue4m3_half(x: Bytes) -> Floats:
    """NVFP4's unsigned E4M3 scale bytes -> half their value as float32, exactly (0 and 0x7F
    are zero; bit 7 is not read)."""
    exp = (x >> np.uint8(3)).astype(np.int32) & 15
    man = (x & np.uint8(7)).astype(np.float32)
    raw = np.where(
        exp == 0,
        man * np.float32(2.0**-9),
        (np.float32(1) + man / np.float32(8)) * np.ldexp(np.float32(1), exp - 7),
    ).astype(np.float32)
    return np.where((x == 0) | (x == 0x7F), np.float32(0), raw * np.float32(0.5))


@dataclass(frozen=True)
class NVFP4Format(QuantFormat):
    """Block of 64: 4 unsigned E4M3 scale bytes (one a 16-element sub-block), 32 bytes of
    e2m1 nibbles (low ones first, per sub-block of 8 bytes). x = scale / 2 * kvalue."""

    def dequantize_blocks(self, blocks: Bytes) -> Floats:
        from cellswarm.quant.grids import KVALUES_MXFP4

        n = blocks.shape[0]
        d = ue4m3_half(blocks[:, :4])[..., None]  # (n, 4, 1)
        q = _nibble_values(blocks[:, 4:].reshape(n * 4, 8), KVALUES_MXFP4).reshape(n, 4, 16)
        return (d * q.astype(np.float32)).reshape(n, 64)


# ------------------------------------------------------------------------------ registry

_T = GGMLQuantizationType

FORMATS: dict[GGMLQuantizationType, QuantFormat] = {
    f.ggml_type: f
    for f in (
        F32Format("F32", _T.F32, 1, 4),
        F16Format("F16", _T.F16, 1, 2),
        BF16Format("BF16", _T.BF16, 1, 2),
        Q8_0Format("Q8_0", _T.Q8_0, 32, 34),
        Q4_0Format("Q4_0", _T.Q4_0, 32, 18),
        Q4_1Format("Q4_1", _T.Q4_1, 32, 20),
        Q5_0Format("Q5_0", _T.Q5_0, 32, 22),
        Q5_1Format("Q5_1", _T.Q5_1, 32, 24),
        Q2_KFormat("Q2_K", _T.Q2_K, QK_K, 84),
        Q3_KFormat("Q3_K", _T.Q3_K, QK_K, 110),
        Q4_KFormat("Q4_K", _T.Q4_K, QK_K, 144),
        Q5_KFormat("Q5_K", _T.Q5_K, QK_K, 176),
        Q6_KFormat("Q6_K", _T.Q6_K, QK_K, 210),
        IQ4_NLFormat("IQ4_NL", _T.IQ4_NL, 32, 18),
        IQ4_XSFormat("IQ4_XS", _T.IQ4_XS, QK_K, 136),
        IQ3_SFormat("IQ3_S", _T.IQ3_S, QK_K, 110),
        IQ3_XXSFormat("IQ3_XXS", _T.IQ3_XXS, QK_K, 98),
        IQ2_SFormat("IQ2_S", _T.IQ2_S, QK_K, 82),
        IQ2_XSFormat("IQ2_XS", _T.IQ2_XS, QK_K, 74),
        IQ2_XXSFormat("IQ2_XXS", _T.IQ2_XXS, QK_K, 66),
        IQ1_MFormat("IQ1_M", _T.IQ1_M, QK_K, 56),
        IQ1_SFormat("IQ1_S", _T.IQ1_S, QK_K, 50),
        TQ2_0Format("TQ2_0", _T.TQ2_0, QK_K, 66),
        TQ1_0Format("TQ1_0", _T.TQ1_0, QK_K, 54),
        MXFP4Format("MXFP4", _T.MXFP4, 32, 17),
        NVFP4Format("NVFP4", _T.NVFP4, 64, 36),
    )
}


def _cannot_quantize(fmt: QuantFormat) -> UnsupportedQuantError:
    quantizable = ", ".join(f.name for f in FORMATS.values() if f.can_quantize)
    return UnsupportedQuantError(
        f"quantizing to {fmt.name} is not supported; quantizable: {quantizable}"
    )


def _unsupported(what: str) -> UnsupportedQuantError:
    supported = ", ".join(f.name for f in FORMATS.values())
    return UnsupportedQuantError(f"tensor type {what} is not supported; supported: {supported}")


def format_for(ggml_type: GGMLQuantizationType | int) -> QuantFormat:
    """The format of a GGUF tensor type id."""
    try:
        return FORMATS[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        try:
            what = GGMLQuantizationType(ggml_type).name
        except ValueError:
            what = f"id {int(ggml_type)}"
        raise _unsupported(what) from None


def format_by_name(name: str) -> QuantFormat:
    """The format called `name` ("q4_0", "Q4_K", ...), case-insensitive."""
    for fmt in FORMATS.values():
        if fmt.name.lower() == name.lower():
            return fmt
    raise _unsupported(repr(name))


# ------------------------------------------------------------------------ whole tensors


def _chunk_blocks(fmt: QuantFormat) -> int:
    return max(1, _CHUNK_ELEMENTS // fmt.block_size)


def dequantize(data: npt.NDArray[Any], fmt: QuantFormat, n_cols: int | None = None) -> Floats:
    """Rows of packed blocks (..., row_bytes) -> a new float32 array (..., n_cols).

    `n_cols` defaults to what the row length implies; given, it is checked against it.
    """
    raw = cast(Bytes, data) if data.dtype == np.uint8 else data.view(np.uint8)
    cols = fmt.n_cols(raw.shape[-1])
    if n_cols is not None and n_cols != cols:
        raise ShapeMismatchError(
            f"{fmt.name} rows of {raw.shape[-1]} bytes hold {cols} elements, not {n_cols}"
        )
    blocks = raw.reshape(-1, fmt.type_size)  # (n_blocks, type_size)
    out = np.empty((blocks.shape[0], fmt.block_size), dtype=np.float32)
    step = _chunk_blocks(fmt)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fmt.dequantize_blocks(blocks[start : start + step])
    return out.reshape(*raw.shape[:-1], cols)


# Exponent bits of a float16, bfloat16 and float32: all set is an infinity or a NaN.
_EXPONENT: dict[str, tuple[np.dtype[Any], int]] = {
    "f16": (np.dtype("<u2"), 0x7C00), "bf16": (np.dtype("<u2"), 0x7F80),
    "f32": (np.dtype("<u4"), 0x7F800000), "e8m0": (np.dtype("u1"), 0xFF),
}  # fmt: skip


def first_nonfinite_block(data: npt.NDArray[Any], fmt: QuantFormat) -> int | None:
    """The index of the first block of `data` (packed rows, any shape) with a NaN or an
    infinite float field (`fmt.float_fields`: scales, or the values of a float format), or
    None when every one is finite. Reads only those bytes, a chunk of blocks at a time, and
    tests their exponent bits: no dequantizing, no float arithmetic."""
    raw = cast(Bytes, data) if data.dtype == np.uint8 else data.view(np.uint8)
    blocks = raw.reshape(-1, fmt.type_size)  # (n_blocks, type_size)
    step = max(1, _CHUNK_ELEMENTS)  # blocks per chunk: a few MiB of copied fields at most
    for start in range(0, blocks.shape[0], step):
        chunk = blocks[start : start + step]
        bad = np.zeros(chunk.shape[0], dtype=bool)
        for offset, kind in fmt.float_fields:
            if kind == "iq1m_d":  # an f16 spread over the top nibbles of 4 words
                d = iq1m_scale(chunk[:, offset : offset + 8])[:, 0]
                bad |= (d & np.uint16(0x7C00)) == np.uint16(0x7C00)
                continue
            dtype, mask = _EXPONENT[kind]
            field = np.ascontiguousarray(chunk[:, offset : offset + dtype.itemsize])
            bad |= (field.view(dtype)[:, 0] & mask) == mask
        if bad.any():
            return start + int(np.argmax(bad))
    return None


def quantize(x: npt.ArrayLike, fmt: QuantFormat) -> Bytes:
    """float32 rows (..., cols) -> packed blocks (..., row_bytes) in `fmt`."""
    values = np.asarray(x, dtype=np.float32)
    row_bytes = fmt.row_bytes(values.shape[-1])
    if not fmt.can_quantize:
        raise _cannot_quantize(fmt)
    blocks = values.reshape(-1, fmt.block_size)  # (n_blocks, block_size)
    out = np.empty((blocks.shape[0], fmt.type_size), dtype=np.uint8)
    step = _chunk_blocks(fmt)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fmt.quantize_blocks(blocks[start : start + step])
    return out.reshape(*values.shape[:-1], row_bytes)
