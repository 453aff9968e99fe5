"""Byte sizes as users write them ("256M", "1.5G", "4096") and as we print them."""

from __future__ import annotations

import re

from cellswarm.errors import RequestError

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'256M' -> 268435456. Binary units: K = 1024 bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise RequestError(f"size {text!r} is not a byte count; write e.g. 256M, 1.5G or 4096")
    return int(float(m.group(1)) * _SUFFIX[m.group(2).upper()])


def format_power(watts: float) -> str:
    """Watts in the unit of the thing: "422 W" a box, "38.4 kW" a room, "12.3 MW" a hall."""
    for unit, scale in (("W", 1.0), ("kW", 1e3), ("MW", 1e6)):
        if abs(watts) < 1000 * scale or unit == "MW":
            value = watts / scale
            return f"{value:,.0f} {unit}" if unit == "W" else f"{value:,.1f} {unit}"
    raise AssertionError("unreachable")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
