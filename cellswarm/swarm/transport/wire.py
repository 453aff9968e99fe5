"""What every message between the swarm's processes must hold before any field is read.

The inner protocol's bodies are plain JSON objects (issue 35 types them); until then this
is the floor under all of them: every number is one a field could mean. JSON allows any
integer and Python reads it exactly, so 10**30 for a port reached SQLite as an overflow (a
500) and 1e300 for a byte count reached the arithmetic of placement. NaN and Infinity are
refused where the JSON is read (api/schema.load_json).
"""

from __future__ import annotations

import math
from typing import Any

from cellswarm.errors import RequestError

MAX_INT = 2**53  # above it a JSON number stops being exact in most readers
MAX_FLOAT = 1e15  # seconds, bytes, joules: nothing in a node's message is larger
MAX_PORT = 65535


def check_numbers(value: Any, where: str = "body") -> None:
    """RequestError naming the first number out of range (depth-first), else nothing."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise RequestError(f"{where} = {value:.3g} is out of range (at most {MAX_INT:,} "
                               f"in magnitude)")  # fmt: skip
    elif isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_FLOAT:
            raise RequestError(f"{where} = {value!r} is out of range (a finite number of at "
                               f"most {MAX_FLOAT:g} in magnitude)")  # fmt: skip
    elif isinstance(value, dict):
        for k, v in value.items():
            check_numbers(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_numbers(v, f"{where}[{i}]")


def port(value: Any, where: str) -> int | None:
    """A TCP port a node says it listens on: None, or 1..65535."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_PORT:
        raise RequestError(f"{where} = {value!r} is not a TCP port (1..{MAX_PORT})")
    return value
