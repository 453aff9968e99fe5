"""A per-sequence KV cache with a byte budget, checked before a sequence starts.

Each architecture declares what it caches per token per layer (`CacheSpec`): llama caches
K and V heads; deepseek2 caches its compressed latent and one shared RoPE key. The cache
allocates exactly `capacity` tokens up front, so running out of memory mid-generation cannot
happen: a sequence that cannot fit fails with a `BudgetError` before its first token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cellswarm.errors import BudgetError
from cellswarm.kernels import keys_ld

CacheSpec = Mapping[str, tuple[int, ...]]  # name -> per-token shape, float32
_ITEM_BYTES = 4
# Per-head tensors kept component-major, (heads, d, kernels.keys_ld(capacity)): attention's
# keys, which the kernels read 16 keys to a vector (kernels.c attend_nq), so a decode step
# never transposes the cache.
TRANSPOSED = frozenset({"kt"})


def spec_bytes_per_token(spec: CacheSpec) -> int:
    return sum(int(np.prod(shape)) * _ITEM_BYTES for shape in spec.values())


def _layout(name: str, shape: tuple[int, ...], capacity: int) -> tuple[int, ...]:
    if name in TRANSPOSED:
        return (shape[0], shape[1], keys_ld(capacity))
    return (shape[0], capacity, shape[1]) if len(shape) == 2 else (capacity, *shape)


def bytes_per_token(specs: Mapping[int, CacheSpec]) -> int:
    return sum(spec_bytes_per_token(s) for s in specs.values())


def sequence_bytes(specs: Mapping[int, CacheSpec], capacity: int) -> int:
    """What one sequence's cache of `capacity` tokens allocates: bytes_per_token x capacity,
    plus the keys' padding (keys_ld), which a budget must hold too."""
    return sum(
        int(np.prod(_layout(name, shape, capacity))) * _ITEM_BYTES
        for spec in specs.values()
        for name, shape in spec.items()
    )


def check_room(capacity: int, end: int) -> None:
    """BudgetError unless tokens up to `end` fit a cache of `capacity` (the fused decode
    layers write the cache in C, so they ask before they call)."""
    if end > capacity:
        raise BudgetError(
            f"KV cache holds {capacity} tokens; writing up to token {end} overflows it "
            "(raise max tokens or the cache budget)"
        )


class LayerCache:
    """One layer's cached tensors for one sequence.

    A per-token vector (shape (n,)) is stored token-major, (capacity, n). Per-head tensors
    (shape (heads, d)) are stored head-major, (heads, capacity, d): `read` then hands each
    head's keys to attention as one contiguous (S, d) matrix, with no transpose or copy per
    decode step.
    """

    def __init__(self, spec: CacheSpec, capacity: int) -> None:
        self.capacity = capacity
        self._arrays = {
            k: np.zeros(_layout(k, shape, capacity), np.float32) for k, shape in spec.items()
        }

    def write(self, start: int, **values: np.ndarray) -> None:
        for name, v in values.items():
            end = start + v.shape[0]
            check_room(self.capacity, end)
            arr = self._arrays[name]
            if name in TRANSPOSED:  # (T, heads, d) into component-major storage
                arr[:, :, start:end] = v.transpose(1, 2, 0)
            elif arr.ndim == 3:  # (T, heads, d) into head-major storage
                arr[:, start:end] = v.transpose(1, 0, 2)
            else:
                arr[start:end] = v

    def take(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Copies of positions [start, end) of every tensor, in storage layout (put's)."""
        return {k: self._positions(k, start, end).copy() for k in self._arrays}

    def put(self, start: int, parts: Mapping[str, np.ndarray]) -> None:
        """Write what `take` gave back at positions from `start`."""
        for k, v in parts.items():
            n = v.shape[2] if k in TRANSPOSED else v.shape[1] if v.ndim == 3 else v.shape[0]
            check_room(self.capacity, start + n)
            self._positions(k, start, start + n)[...] = v

    def _positions(self, name: str, start: int, end: int) -> np.ndarray:
        arr = self._arrays[name]
        if name in TRANSPOSED:
            return arr[:, :, start:end]
        return arr[:, start:end] if arr.ndim == 3 else arr[start:end]

    def storage(self, name: str) -> np.ndarray:
        """The whole backing array (for kernels that take it with its capacity stride)."""
        return self._arrays[name]

    def read(self, name: str, end: int) -> np.ndarray:
        """(end, n) for vectors; (heads, end, d) for per-head tensors (a view; for a
        TRANSPOSED one, of its component-major storage)."""
        arr = self._arrays[name]
        if name in TRANSPOSED:
            return arr[:, :, :end].transpose(0, 2, 1)
        return arr[:, :end] if arr.ndim == 3 else arr[:end]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())


class KVCache:
    """All layers' caches for one sequence; `length` is how many tokens are filled."""

    def __init__(self, specs: Mapping[int, CacheSpec], capacity: int, budget_bytes: int | None):
        need = sequence_bytes(specs, capacity)
        if budget_bytes is not None and need > budget_bytes:
            per_token = bytes_per_token(specs)
            fits = budget_bytes // max(per_token, 1)
            while fits > 0 and sequence_bytes(specs, fits) > budget_bytes:
                fits -= 1  # the keys' padding: at most a few dozen tokens
            raise BudgetError(
                f"a sequence of {capacity} tokens needs {need:,} bytes of KV cache "
                f"({per_token:,} per token) but the budget is {budget_bytes:,} bytes "
                f"({need - budget_bytes:,} short); shorten the prompt or max tokens, or "
                f"raise the cache budget (fits {fits:,} tokens)"
            )
        self.capacity = capacity
        self.length = 0
        self.layers = {i: LayerCache(spec, capacity) for i, spec in specs.items()}
        # what the code that runs a model computes once per cache, e.g. C arrays of its
        # storage's addresses (storage never moves: the capacity is fixed)
        self.memo: dict[Any, Any] = {}

    def layer(self, i: int) -> LayerCache:
        return self.layers[i]

    def truncate(self, length: int) -> None:
        """Forget tokens after `length` (entries beyond it are overwritten later)."""
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers.values())
