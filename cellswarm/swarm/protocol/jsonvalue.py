"""What a JSON body may hold, as a type: the edge to clients (HTTP responses, the dashboard,
`--json` output) is JSON, and mypy checks that a body built for it holds nothing else (a
numpy scalar, a dataclass, bytes) where `dict[str, Any]` let anything through. Messages
between the swarm's own processes are not JSON values: they are Structs (messages.py).

Parameters take `JsonMapping` (covariant: a `dict[str, int]` is one); built bodies are
`JsonObject`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

JsonScalar: TypeAlias = str | int | float | bool | None
JsonValue: TypeAlias = JsonScalar | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject: TypeAlias = dict[str, JsonValue]
# read-only views: what a function that only reads a body accepts
JsonReadable: TypeAlias = (JsonScalar | Sequence["JsonReadable"]
                           | Mapping[str, "JsonReadable"])  # fmt: skip
JsonMapping: TypeAlias = Mapping[str, JsonReadable]


def number(value: object) -> float:
    """A JSON number (or numeric text) as `float()` reads it; TypeError for anything else."""
    if not isinstance(value, int | float | str):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def whole(value: object) -> int:
    """A JSON number (or numeric text) as `int()` reads it; TypeError for anything else."""
    if not isinstance(value, int | float | str):
        raise TypeError(f"{value!r} is not a number")
    return int(value)
