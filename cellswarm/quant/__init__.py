"""GGUF tensor formats, bit-exact numpy codecs, and weights kept packed until used."""

from cellswarm.quant.formats import (
    FORMATS,
    QuantFormat,
    dequantize,
    first_nonfinite_block,
    format_by_name,
    format_for,
    quantize,
)
from cellswarm.quant.packed import TILE_BYTES, PackedExperts, PackedMatrix

__all__ = [
    "FORMATS",
    "TILE_BYTES",
    "PackedExperts",
    "PackedMatrix",
    "QuantFormat",
    "dequantize",
    "first_nonfinite_block",
    "format_by_name",
    "format_for",
    "quantize",
]
