"""What a KV cache stores its values as: f16 (the default), q8_0 or f32. Pure: the planner,
the worker's budget and the cache itself size a cache with the one function here.

- f16: each value rounded to nearest even (numpy's astype(np.float16)), read back exactly:
  half the bytes of f32.
- q8_0: each cached vector (a head's key or value, a latent, a RoPE key) in GGUF Q8_0 blocks
  of 32 — an f16 scale and 32 int8s, quantized as quant/formats.py's codec (bit-exact with
  gguf-py), read back as d * q: 34 bytes per 32 values.
- f32: the values as computed.

Attention computes in f32 on what the cache gives back, so a given cache type gives the same
bits on every CPU (kernels/kv.c); what each type costs in quality: docs/design.md, "KV cache
types".
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from cellswarm.errors import RequestError

CACHE_TYPES = ("f16", "q8_0", "f32")
DEFAULT_CACHE_TYPE = "f16"
# the numbers the C kernels take (GGUF's type numbers: F32 0, F16 1, Q8_0 8)
KIND = {"f32": 0, "f16": 1, "q8_0": 8}
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34


def check_cache_type(name: str) -> str:
    """`name` if it is a cache type, else one line naming it and the choices."""
    if name not in CACHE_TYPES:
        raise RequestError(f"--cache-type {name!r} is not a KV cache type: choose one of "
                           f"{', '.join(CACHE_TYPES)}")  # fmt: skip
    return name


def vector_bytes(n: int, cache_type: str) -> int:
    """Bytes one cached vector of n values takes (q8_0: n a multiple of 32, else refused)."""
    if cache_type == "f32":
        return 4 * n
    if cache_type == "f16":
        return 2 * n
    check_cache_type(cache_type)
    if n % Q8_BLOCK:
        raise RequestError(f"a q8_0 KV cache needs vectors in blocks of {Q8_BLOCK}; this model "
                           f"caches vectors of {n} values: use --cache-type f16 or f32")
    return n // Q8_BLOCK * Q8_BLOCK_BYTES


def spec_bytes_per_token(
    spec: Mapping[str, tuple[int, ...]], cache_type: str = DEFAULT_CACHE_TYPE
) -> int:
    """Bytes one token of one layer takes, the sum of its cached vectors' (a per-token shape
    (heads, d) is `heads` vectors of d; (n,) one of n): what every budget counts per token."""
    return sum(
        math.prod(shape[:-1]) * vector_bytes(shape[-1], cache_type) for shape in spec.values()
    )


def value_bytes(cache_type: str) -> float:
    """Bytes per cached value on average (f16 2, q8_0 34/32, f32 4): for plans of models
    whose cached vectors are only known by their total size."""
    return vector_bytes(Q8_BLOCK, cache_type) / Q8_BLOCK
