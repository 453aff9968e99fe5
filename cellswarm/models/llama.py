"""Llama-family decoder: llama (1/2/3, SmolLM), qwen2 (QKV bias) and qwen3 (QK-norm).

Reference: Hugging Face transformers `modeling_llama.py`, `modeling_qwen2.py`,
`modeling_qwen3.py`; llama.cpp `llm_build_llama` / `llm_build_qwen3`. Tensor names are
llama.cpp's GGUF names. RMSNorm -> GQA attention with RoPE -> residual -> RMSNorm -> SwiGLU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cellswarm import kernels
from cellswarm.io.weights import WeightStore
from cellswarm.models import ops
from cellswarm.models.kv_cache import CacheSpec, KVCache, LayerCache, check_room
from cellswarm.models.llama_config import (  # noqa: F401  (re-exported: the family's config)
    ARCHS,
    LlamaConfig,
    hf_extra_tensors,
    hf_rope_params,
    hf_tensors_to_gguf,
)
from cellswarm.models.rope import Rope, base_inv_freq


class Llama:
    """Forward pass over a (possibly partial) weight store; see models/base.py."""

    def __init__(self, config: LlamaConfig, weights: WeightStore) -> None:
        self.config = config
        self.w = weights
        inv_freq = base_inv_freq(config.rope_dim, config.rope_theta)
        factors = weights.optional_vector("rope_freqs.weight")
        if factors is not None:
            inv_freq = (inv_freq / factors).astype(np.float32)
        self.rope = Rope(config.rope_dim, inv_freq, config.rope_layout)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self._fused: dict[int, tuple[Any, ...] | None] = {}
        self._stacks: dict[tuple[int, int], Any] = {}  # layer ranges: fused layers' pointers
        self._scratch: tuple[Any, ...] | None = None
        self._many_scratch: dict[str, Any] = {}  # decode_fused_many's, per (layers, n)

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return ops.embed(self.w, token_ids)  # (T, d)

    def head(self, x: np.ndarray) -> np.ndarray:
        return ops.lm_head(self.w, x, self.config.d_model, self.config.rms_eps)  # (T, vocab)

    def block(
        self, layer: int, x: np.ndarray, positions: np.ndarray, cache: LayerCache
    ) -> np.ndarray:
        c, p = self.config, f"blk.{layer}."
        h = ops.rms_norm(x, self.w.vector(p + "attn_norm.weight"), c.rms_eps)
        x = x + self._attention(p, h, positions, cache)
        h = ops.rms_norm(x, self.w.vector(p + "ffn_norm.weight"), c.rms_eps)
        w = self.w
        return x + ops.swiglu(
            h,
            w.matrix(p + "ffn_gate.weight"),
            w.matrix(p + "ffn_up.weight"),
            w.matrix(p + "ffn_down.weight"),
        )

    def _attention(
        self, p: str, h: np.ndarray, positions: np.ndarray, cache: LayerCache
    ) -> np.ndarray:
        c, w, t = self.config, self.w, h.shape[0]
        q, k, v = ops.linears(h, [(w.matrix(p + f"attn_{n}.weight"),
                                   w.optional_vector(p + f"attn_{n}.bias")) for n in "qkv"])
        q = q.reshape(t, c.n_heads, c.head_dim)  # (T, H, D)
        k = k.reshape(t, c.n_kv_heads, c.head_dim)  # (T, Hkv, D)
        v = v.reshape(t, c.n_kv_heads, c.head_dim)
        if c.qk_norm:  # qwen3: RMSNorm over each head before RoPE
            q = ops.rms_norm(q, w.vector(p + "attn_q_norm.weight"), c.rms_eps)
            k = ops.rms_norm(k, w.vector(p + "attn_k_norm.weight"), c.rms_eps)
        q, k = ops.rope(self.rope, q, positions), ops.rope(self.rope, k, positions)
        start, end = int(positions[0]), int(positions[-1]) + 1
        cache.write(start, kt=k, v=v)
        if kernels.enabled():  # the keys component-major (for f32 the cache's own: no copy)
            out = kernels.attend_keys(q, cache.keys("kt", end), cache.read("v", end), self.scale)
        else:
            out = ops.attention(q, cache.read("kt", end), cache.read("v", end), self.scale)
        return w.matrix(p + "attn_output.weight").matmul(out.reshape(t, -1))  # (T, d)

    def prepare(self, layers: range) -> None:
        if kernels.enabled():
            self._fused_stack(layers)  # builds each layer, which repacks its matrices

    def decode_fused(
        self, x: np.ndarray, positions: np.ndarray, cache: KVCache, layers: range
    ) -> np.ndarray | None:
        """One token through `layers` in one C call, with no allocation per layer (llama.c:
        cs_llama_decode_layers). None when a weight has no fused kernel (e.g. F32)."""
        if not kernels.enabled():
            return None
        stack = self._fused_stack(layers)
        if stack is None:
            return None
        if x.shape != (1, self.config.d_model):
            raise ValueError(f"decode_fused takes hidden states (1, d_model), got {x.shape}")
        out = np.array(x[0], dtype=np.float32)  # (d,): the residual stream, updated in place
        cos, sin = (np.ascontiguousarray(t[0, 0]) for t in self.rope._tables(positions))
        pos = int(positions[0])
        check_room(cache.capacity, pos + 1)
        key = ("llama", layers.start, layers.stop)
        if key not in cache.memo:  # each layer's k and v storage, as C pointers
            cache.memo[key] = tuple(
                kernels.pointers([cache.layer(i).storage(n) for i in layers]) for n in ("kt", "v")
            )  # fmt: skip
        k_stores, v_stores = cache.memo[key]
        scratch = self._decode_scratch(cache.capacity)
        kernels.llama_decode_layers(stack, out, pos, cos, sin, k_stores, v_stores,
                                    cache.capacity, scratch, cache.kind)  # fmt: skip
        return out[None]

    def _fused_stack(self, layers: range) -> Any:
        """The fused layers `layers` as a C array of pointers, or None if one has no kernel."""
        key = (layers.start, layers.stop)
        if key not in self._stacks:
            fused = [self._fused_layer(i) for i in layers]
            ok = all(f is not None for f in fused)
            self._stacks[key] = kernels.pointers([f[0] for f in fused]) if ok else None  # type: ignore[index]
        return self._stacks[key]

    def decode_fused_many(
        self, x: np.ndarray, positions: np.ndarray, caches: list[KVCache], layers: range
    ) -> np.ndarray | None:
        """One token of each of n <= MAX_BATCH sequences (x (n, d), sequence i at
        positions[i] of caches[i]) through `layers` in one C call: each weight row read once
        for all n, each token's values those of a decode step alone (llama.c). None when a
        layer has no fused kernel."""
        n = x.shape[0]
        if not kernels.enabled() or not 1 <= n <= kernels.MAX_BATCH:
            return None
        stack = self._fused_stack(layers)
        if stack is None:
            return None
        pos = np.ascontiguousarray(positions, dtype=np.int64)  # (n,)
        for c, p in zip(caches, pos, strict=True):
            check_room(c.capacity, int(p) + 1)
        out = np.array(x, dtype=np.float32)  # (n, d): the residual streams, in place
        cos, sin = (np.ascontiguousarray(t[:, 0]) for t in self.rope._tables(pos))
        stores = {n: [c.layer(i).storage(n) for i in layers for c in caches] for n in ("kt", "v")}
        caps = np.array([c.capacity for c in caches], dtype=np.int64)
        key = (layers.start, layers.stop, n)
        if self._many_scratch.get("key") != key:  # the widest layer's needs, for n tokens
            structs = [f[0] for f in (self._fused_layer(i) for i in layers) if f is not None]
            self._many_scratch = {"key": key, "buf": kernels.llama_scratch_many(structs, n)}
        kernels.llama_decode_many(stack, out, pos, cos, sin, stores["kt"], stores["v"], caps,
                                  self._many_scratch["buf"], _one_kind(caches))  # fmt: skip
        return out

    def _fused_layer(self, layer: int) -> tuple[Any, ...] | None:
        if layer not in self._fused:
            self._fused[layer] = self._build_fused_layer(layer)
        return self._fused[layer]

    def _build_fused_layer(self, layer: int) -> tuple[Any, ...] | None:
        c, w, p = self.config, self.w, f"blk.{layer}."
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        matrices = [w.matrix(f"{p}{n}.weight") for n in names]
        for m in matrices:  # this layer's own: laid out for the fastest kernel, if there is one
            m.repack()
        mats = [m._fused for m in matrices]
        if any(m is None for m in mats):
            return None
        vec = {n: w.optional_vector(p + n) for n in (
            "attn_norm.weight", "ffn_norm.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
            "attn_q_norm.weight", "attn_k_norm.weight")}  # fmt: skip
        vec = {
            n: None if a is None else np.ascontiguousarray(a, np.float32) for n, a in vec.items()
        }
        struct = kernels.LlamaLayer(
            *[kernels.mat(m[0]) for m in mats],  # type: ignore[index]
            *[kernels.ptr(a) for a in vec.values()],
            c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.rope_dim,
            int(c.rope_layout == "neox"), c.rms_eps, self.scale,
        )  # fmt: skip
        return struct, mats, vec  # the struct holds raw pointers: keep what they point into

    def _decode_scratch(self, capacity: int) -> tuple[np.ndarray, ...]:
        c = self.config
        if self._scratch is None or self._scratch[0] < capacity:
            qn, kn = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            floats = 2 * c.d_model + 2 * qn + 2 * kn + 2 * c.ffn_dim + c.n_heads * capacity
            widest = max(c.d_model, qn, c.ffn_dim)
            self._scratch = (
                capacity,
                np.empty(floats, np.float32),
                np.empty(2 * widest, np.int8),  # values, then their AVX-512 quad layout
                # scales, block sums, then 9 floats of outliers and an int per block (qbuf)
                np.empty(12 * (widest // 32), np.float32),
                np.empty(widest // 16, np.int32),
            )
        return self._scratch[1:]

    def cache_spec(self, layer: int) -> CacheSpec:
        return self.config.cache_spec()

    def scratch_bytes(self, n_tokens: int, context: int) -> int:
        return self.config.scratch_bytes(n_tokens, context)


def _one_kind(caches: list[KVCache]) -> int:
    """The caches' type, which one C call takes for all of them (a model makes its caches
    of one type: Model.cache_type)."""
    kinds = {c.kind for c in caches}
    if len(kinds) != 1:
        raise ValueError(f"one batched step takes caches of one type, got {sorted(kinds)}")
    return kinds.pop()


CONFIG = LlamaConfig
MODEL = Llama
