"""GGUF tensor formats, bit-exact numpy codecs, and weights kept packed until used.

The formats are pure data (the planner sizes tensors with them); the packed weights bring
the kernels, so they load on first use of their names."""

from typing import TYPE_CHECKING, Any

from cellswarm.quant.formats import (
    FORMATS,
    QuantFormat,
    dequantize,
    first_nonfinite_block,
    format_by_name,
    format_for,
    quantize,
)

if TYPE_CHECKING:  # for the type checker; at run time they load on first use (below)
    from cellswarm.quant.packed import TILE_BYTES, PackedExperts, PackedMatrix

_PACKED = ("TILE_BYTES", "PackedExperts", "PackedMatrix")


def __getattr__(name: str) -> Any:
    if name in _PACKED:
        from cellswarm.quant import packed

        return getattr(packed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
