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
from gguf import GGMLQuantizationType

from cellswarm.errors import ShapeMismatchError, UnsupportedQuantError

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
    # The block's floating-point fields, (byte offset, "f16" | "bf16" | "f32"): its scales
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
    "f32": (np.dtype("<u4"), 0x7F800000),
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
