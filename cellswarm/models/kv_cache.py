"""A per-sequence KV cache with a byte budget, checked before a sequence starts.

Each architecture declares what it caches per token per layer (`CacheSpec`): llama caches
K and V heads; deepseek2 caches its compressed latent and one shared RoPE key. The cache
allocates exactly `capacity` tokens up front, so running out of memory mid-generation cannot
happen: a sequence that cannot fit fails with a `BudgetError` before its first token.

Values are stored as the cache's type (cache_types.py: f16 by default, q8_0 or f32). Writing
here rounds with numpy (astype(np.float16), or the Q8_0 codec); the fused C layers write the
same bits (kernels/kv.c); reading gives float32 back exactly, and attention runs on that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cellswarm.cache_types import (
    DEFAULT_CACHE_TYPE,
    KIND,
    Q8_BLOCK,
    Q8_BLOCK_BYTES,
    check_cache_type,
    spec_bytes_per_token,
    vector_bytes,
)
from cellswarm.errors import BudgetError
from cellswarm.kernels import keys_ld
from cellswarm.quant.formats import FORMATS, GGMLQuantizationType

CacheSpec = Mapping[str, tuple[int, ...]]  # name -> per-token shape (float32 values)
_Q8_0 = FORMATS[GGMLQuantizationType.Q8_0]
_DTYPES = {"f32": np.float32, "f16": np.float16}
# Per-head tensors kept component-major, (heads, d, kernels.keys_ld(capacity)): attention's
# keys, which the kernels read 16 keys to a vector (kernels.c attend_nq), so a decode step
# never transposes the cache. In q8_0 a key's blocks run along its own d values, so there the
# keys are token-major like the values, (heads, capacity, d / 32 blocks).
TRANSPOSED = frozenset({"kt"})


def _transposed(name: str, cache_type: str) -> bool:
    return name in TRANSPOSED and cache_type != "q8_0"


def _layout(name: str, shape: tuple[int, ...], capacity: int, cache_type: str) -> tuple[int, ...]:
    """The storage array's shape: elements for f32/f16, bytes of Q8_0 blocks for q8_0."""
    width = shape[-1] if cache_type != "q8_0" else vector_bytes(shape[-1], cache_type)
    if _transposed(name, cache_type):
        return (shape[0], shape[1], keys_ld(capacity))
    return (shape[0], capacity, width) if len(shape) == 2 else (capacity, width)


def _dtype(cache_type: str) -> type:
    return _DTYPES.get(cache_type, np.uint8)


def bytes_per_token(specs: Mapping[int, CacheSpec], cache_type: str = DEFAULT_CACHE_TYPE) -> int:
    return sum(spec_bytes_per_token(s, cache_type) for s in specs.values())


def sequence_bytes(
    specs: Mapping[int, CacheSpec], capacity: int, cache_type: str = DEFAULT_CACHE_TYPE
) -> int:
    """What one sequence's cache of `capacity` tokens allocates: bytes_per_token x capacity,
    plus the keys' padding (keys_ld), which a budget must hold too."""
    item = np.dtype(_dtype(cache_type)).itemsize
    return sum(
        int(np.prod(_layout(name, shape, capacity, cache_type))) * item
        for spec in specs.values()
        for name, shape in spec.items()
    )


def read_bytes(spec: CacheSpec, capacity: int, cache_type: str = DEFAULT_CACHE_TYPE) -> int:
    """The float32 copies a step makes of one layer's cache while it attends, at most: none
    for f32 (attention reads the storage); for f16 the layer's values as floats
    (LayerCache.keys / read in a prefill); for q8_0 twice that (the int8s as floats, then
    their products with the scales). Freed after the layer: a budget holds one."""
    copies = {"f32": 0, "f16": 1}.get(cache_type, 2)
    return copies * sequence_bytes({0: spec}, capacity, "f32")


def check_room(capacity: int, end: int) -> None:
    """BudgetError unless tokens up to `end` fit a cache of `capacity` (the fused decode
    layers write the cache in C, so they ask before they call)."""
    if end > capacity:
        raise BudgetError(
            f"KV cache holds {capacity} tokens; writing up to token {end} overflows it "
            "(raise max tokens or the cache budget)"
        )


def encode(values: np.ndarray, cache_type: str) -> np.ndarray:
    """float32 (..., n) -> what the cache stores for them: float16 (rounded to nearest even,
    as kv.c f32_to_f16), (..., n / 32 * 34) bytes of Q8_0 blocks, or the floats."""
    v = np.asarray(values, np.float32)
    if cache_type != "q8_0":
        return v.astype(_dtype(cache_type))
    blocks = _Q8_0.quantize_blocks(np.ascontiguousarray(v).reshape(-1, Q8_BLOCK))
    return blocks.reshape(*v.shape[:-1], v.shape[-1] // Q8_BLOCK * Q8_BLOCK_BYTES)


def decode(stored: np.ndarray, cache_type: str) -> np.ndarray:
    """The inverse of `encode`, exactly: float32 (..., n)."""
    if cache_type != "q8_0":
        return stored.astype(np.float32, copy=False)
    blocks = np.ascontiguousarray(stored).reshape(-1, Q8_BLOCK_BYTES)
    n = stored.shape[-1] // Q8_BLOCK_BYTES * Q8_BLOCK
    return _Q8_0.dequantize_blocks(blocks).reshape(*stored.shape[:-1], n)


class LayerCache:
    """One layer's cached tensors for one sequence.

    A per-token vector (shape (n,)) is stored token-major, (capacity, n). Per-head tensors
    (shape (heads, d)) are stored head-major, (heads, capacity, d): `read` then hands each
    head's keys to attention as one contiguous (S, d) matrix, with no transpose or copy per
    decode step (f32; other types are decoded on read).
    """

    def __init__(
        self, spec: CacheSpec, capacity: int, cache_type: str = DEFAULT_CACHE_TYPE
    ) -> None:
        self.capacity = capacity
        self.cache_type = cache_type
        self._arrays: dict[str, np.ndarray] = {
            k: np.zeros(_layout(k, shape, capacity, cache_type), _dtype(cache_type))
            for k, shape in spec.items()
        }

    def write(self, start: int, **values: np.ndarray) -> None:
        for name, v in values.items():
            end = start + v.shape[0]
            check_room(self.capacity, end)
            arr, stored = self._arrays[name], encode(v, self.cache_type)
            if _transposed(name, self.cache_type):  # (T, heads, d) into component-major
                arr[:, :, start:end] = stored.transpose(1, 2, 0)
            elif arr.ndim == 3:  # (T, heads, d) into head-major storage
                arr[:, start:end] = stored.transpose(1, 0, 2)
            else:
                arr[start:end] = stored

    def take(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Copies of positions [start, end) of every tensor, in storage layout (put's)."""
        return {k: self._positions(k, start, end).copy() for k in self._arrays}

    def put(self, start: int, parts: Mapping[str, np.ndarray]) -> None:
        """Write what `take` gave back at positions from `start` (the same cache type)."""
        for k, v in parts.items():
            transposed = _transposed(k, self.cache_type)
            n = v.shape[2] if transposed else v.shape[1] if v.ndim == 3 else v.shape[0]
            check_room(self.capacity, start + n)
            self._positions(k, start, start + n)[...] = v

    def _positions(self, name: str, start: int, end: int) -> np.ndarray:
        arr = self._arrays[name]
        if _transposed(name, self.cache_type):
            return arr[:, :, start:end]
        return arr[:, start:end] if arr.ndim == 3 else arr[start:end]

    def storage(self, name: str) -> np.ndarray:
        """The whole backing array (for kernels that take it with its capacity stride)."""
        return self._arrays[name]

    def read(self, name: str, end: int) -> np.ndarray:
        """float32 (end, n) for vectors; (heads, end, d) for per-head tensors (for f32 a view;
        for a TRANSPOSED one, of its component-major storage)."""
        stored = self._positions(name, 0, end)
        if _transposed(name, self.cache_type):
            stored = stored.transpose(0, 2, 1)
        return decode(stored, self.cache_type)

    def keys(self, name: str, end: int) -> np.ndarray:
        """A per-head tensor's first `end` tokens as kernels.attend_keys takes keys: float32
        (heads, d, ld), ld a multiple of 16 at least `end` (f32: the storage itself)."""
        arr = self._arrays[name]
        if self.cache_type == "f32":
            return arr
        ld = -(-end // 16) * 16
        if _transposed(name, self.cache_type):
            return decode(arr[:, :, :ld], self.cache_type)
        out = np.zeros((arr.shape[0], self._width(name), ld), np.float32)
        out[:, :, :end] = self.read(name, end).transpose(0, 2, 1)
        return out

    def _width(self, name: str) -> int:
        width = self._arrays[name].shape[-1]
        return width // Q8_BLOCK_BYTES * Q8_BLOCK if self.cache_type == "q8_0" else width

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())


class KVCache:
    """All layers' caches for one sequence; `length` is how many tokens are filled."""

    def __init__(
        self, specs: Mapping[int, CacheSpec], capacity: int, budget_bytes: int | None,
        cache_type: str = DEFAULT_CACHE_TYPE,
    ) -> None:  # fmt: skip
        check_cache_type(cache_type)
        need = sequence_bytes(specs, capacity, cache_type)
        if budget_bytes is not None and need > budget_bytes:
            raise BudgetError(_over_budget(specs, capacity, budget_bytes, cache_type))
        self.capacity = capacity
        self.cache_type = cache_type
        self.kind = KIND[cache_type]  # the kernels' number for it
        self.length = 0
        self.layers = {i: LayerCache(spec, capacity, cache_type) for i, spec in specs.items()}
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


def _over_budget(
    specs: Mapping[int, CacheSpec], capacity: int, budget_bytes: int, cache_type: str
) -> str:
    need = sequence_bytes(specs, capacity, cache_type)
    per_token = bytes_per_token(specs, cache_type)
    fits = budget_bytes // max(per_token, 1)
    while fits > 0 and sequence_bytes(specs, fits, cache_type) > budget_bytes:
        fits -= 1  # the keys' padding: at most a few dozen tokens
    return (
        f"a sequence of {capacity} tokens needs {need:,} bytes of KV cache "
        f"({per_token:,} per token, {cache_type}) but the budget is {budget_bytes:,} bytes "
        f"({need - budget_bytes:,} short); shorten the prompt or max tokens, or "
        f"raise the cache budget (fits {fits:,} tokens)"
    )
