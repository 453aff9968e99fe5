"""The seam between the engine and an architecture file.

An architecture is three steps a shard can run independently — `embed` (token ids to hidden
states), `block` (one transformer layer), `head` (hidden states to logits) — plus what it
caches per token. The engine, the swarm's pipeline stages and the memory accounting only
talk to this interface, so an architecture file holds nothing but its math.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from cellswarm.models.kv_cache import CacheSpec, KVCache, LayerCache

if TYPE_CHECKING:
    from cellswarm.models import FamilyConfig


class ModelConfig(Protocol):
    """What the engine, the planner and the swarm read of any family's config (the configs
    themselves are frozen dataclasses in `*_config.py`)."""

    arch: str
    n_layers: int
    d_model: int
    vocab_size: int
    context_length: int

    def kv_bytes_per_token_layer(self, cache_type: str = "f16") -> int: ...

    def expected_tensors(self, layers: Iterable[int]) -> dict[str, tuple[int, ...]]: ...


class Architecture(Protocol):
    config: FamilyConfig

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

    def prepare(self, layers: range) -> None:
        """Lay `layers`' weights out for the fused kernels (their repacked layout), once, before
        their first step of any kind. Why: a repacked weight's prefill goes through the int8
        kernels and an unrepacked one's through BLAS, so without this a prompt's logits would
        depend on whether a decode had come before it in the process."""
        ...

    def decode_fused(
        self, x: np.ndarray, positions: np.ndarray, cache: KVCache, layers: range
    ) -> np.ndarray | None:
        """One token (1, d_model) through `layers` in one C call per layer; None when this
        model cannot (no kernels, a weight without a fused kernel): the engine then runs
        `block` layer by layer."""
        ...

    def decode_fused_many(
        self, x: np.ndarray, positions: np.ndarray, caches: list[KVCache], layers: range
    ) -> np.ndarray | None:
        """One token each of n sequences (n, d_model), their weights read once; None when
        this model cannot (the engine then decodes them one by one)."""
        ...


@runtime_checkable
class ExpertArchitecture(Architecture, Protocol):
    """A mixture of experts (DeepSeek-V3, Kimi): routed experts may live elsewhere — on part
    servers, in the tiered expert cache — behind `remote_experts`; `absorbed` is a layer's
    decoded W_UK / W_UV (MLA), which the tiered engine pins."""

    remote_experts: Any  # deepseek2.RemoteExperts | None

    def absorbed(self, layer: int) -> tuple[np.ndarray, np.ndarray]: ...
