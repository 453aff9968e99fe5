"""The seam between the engine and an architecture file.

An architecture is three steps a shard can run independently — `embed` (token ids to hidden
states), `block` (one transformer layer), `head` (hidden states to logits) — plus what it
caches per token. The engine, the swarm's pipeline stages and the memory accounting only
talk to this interface, so an architecture file holds nothing but its math.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from cellswarm.io.weights import WeightStore
from cellswarm.models.kv_cache import CacheSpec, LayerCache


class ModelConfig(Protocol):
    arch: str
    n_layers: int
    d_model: int
    vocab_size: int
    context_length: int


class Architecture(Protocol):
    config: Any

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """(T,) int -> (T, d_model) float32."""
        ...

    def block(
        self, layer: int, x: np.ndarray, positions: np.ndarray, cache: LayerCache
    ) -> np.ndarray:
        """(T, d_model) -> (T, d_model); writes this layer's cache at `positions`."""
        ...

    def head(self, x: np.ndarray) -> np.ndarray:
        """(T, d_model) -> (T, vocab rows held) float32 logits."""
        ...

    def cache_spec(self, layer: int) -> CacheSpec: ...

    def scratch_bytes(self, n_tokens: int, context: int) -> int:
        """Peak temporary bytes of one forward step over n_tokens new tokens."""
        ...


class ArchitectureFactory(Protocol):
    def __call__(self, config: Any, weights: WeightStore) -> Architecture: ...
