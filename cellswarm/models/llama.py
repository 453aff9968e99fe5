"""Llama-family decoder: llama (1/2/3, SmolLM), qwen2 (QKV bias) and qwen3 (QK-norm).

Reference: Hugging Face transformers `modeling_llama.py`, `modeling_qwen2.py`,
`modeling_qwen3.py`; llama.cpp `llm_build_llama` / `llm_build_qwen3`. Tensor names are
llama.cpp's GGUF names. RMSNorm -> GQA attention with RoPE -> residual -> RMSNorm -> SwiGLU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from cellswarm import kernels
from cellswarm.engine.kv_cache import CacheSpec, KVCache, LayerCache, check_room
from cellswarm.errors import ModelFileError
from cellswarm.io.weights import WeightStore, global_tensor_shapes
from cellswarm.models import ops
from cellswarm.models.rope import Rope, base_inv_freq, llama3_factors

ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    rope_layout: str  # "norm" for llama (converter-permuted Q/K), "neox" for qwen
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ModelFileError(f"architecture {self.arch!r} is not one of {ARCHS}")
        if self.n_heads % self.n_kv_heads:
            raise ModelFileError(
                f"{self.n_heads} attention heads are not a multiple of {self.n_kv_heads} KV heads"
            )
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ModelFileError(f"rope dim {self.rope_dim} does not fit head dim {self.head_dim}")

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_rows: int) -> LlamaConfig:
        arch = str(meta["general.architecture"])

        def get(key: str, default: Any = None) -> Any:
            full = f"{arch}.{key}"
            if full not in meta and default is None:
                raise ModelFileError(f"GGUF metadata lacks {full}; the file is incomplete")
            return meta.get(full, default)

        d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", d_model // n_heads))
        return cls(
            arch=arch,
            n_layers=int(get("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn_dim=int(get("feed_forward_length")),
            vocab_size=int(get("vocab_size", vocab_rows)),
            context_length=int(get("context_length", 4096)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_layout="norm" if arch == "llama" else "neox",
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
        )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg["model_type"]]
        n_heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads)
        return cls(
            arch=arch,
            n_layers=int(cfg["num_hidden_layers"]),
            d_model=int(cfg["hidden_size"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            ffn_dim=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            context_length=int(cfg.get("max_position_embeddings", 4096)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf_rope_params(cfg).get("rope_theta", 10000.0)),
            rope_dim=head_dim,
            # HF llama checkpoints are loaded with llama.cpp's Q/K permutation applied
            # (see io/hf_dir.py), so they use the same pairwise layout as GGUF files.
            rope_layout="norm" if arch == "llama" else "neox",
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
        )

    def scratch_bytes(self, n_tokens: int, context: int, attn_layers: int = 0) -> int:
        """Peak temporary float32 bytes of one step over n_tokens with `context` cached."""
        per_token = 4 * (4 * self.d_model + 2 * self.n_heads * self.head_dim + 3 * self.ffn_dim)
        scores = 4 * 2 * self.n_heads * n_tokens * context  # scores and probabilities
        return n_tokens * per_token + scores

    def kv_bytes_per_token_layer(self, item_bytes: int = 4) -> int:
        return 2 * self.n_kv_heads * self.head_dim * item_bytes  # K and V

    def to_gguf_metadata(self) -> dict[str, Any]:
        """The inverse of from_gguf: keys as llama.cpp's converter writes them."""
        a = self.arch
        return {
            "general.architecture": a,
            f"{a}.block_count": self.n_layers,
            f"{a}.context_length": self.context_length,
            f"{a}.embedding_length": self.d_model,
            f"{a}.feed_forward_length": self.ffn_dim,
            f"{a}.attention.head_count": self.n_heads,
            f"{a}.attention.head_count_kv": self.n_kv_heads,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": self.rms_eps,
            f"{a}.rope.freq_base": self.rope_theta,
            f"{a}.rope.dimension_count": self.rope_dim,
            f"{a}.vocab_size": self.vocab_size,
        }

    def expected_tensors(self, layers: Iterable[int]) -> dict[str, tuple[int, ...]]:
        """GGUF name -> numpy-order shape of every tensor `layers` and the ends of the model read.

        output.weight is listed too; a file without one ties the head to the embedding.
        """
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        out = global_tensor_shapes(self.vocab_size, d)
        for i in layers:
            p = f"blk.{i}."
            out |= {
                p + "attn_norm.weight": (d,),
                p + "attn_q.weight": (q, d),
                p + "attn_k.weight": (kv, d),
                p + "attn_v.weight": (kv, d),
                p + "attn_output.weight": (d, q),
                p + "ffn_norm.weight": (d,),
                p + "ffn_gate.weight": (self.ffn_dim, d),
                p + "ffn_up.weight": (self.ffn_dim, d),
                p + "ffn_down.weight": (d, self.ffn_dim),
            }
            if self.qkv_bias:
                out |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
            if self.qk_norm:
                out |= {p + "attn_q_norm.weight": (self.head_dim,)}
                out |= {p + "attn_k_norm.weight": (self.head_dim,)}
        return out


def hf_rope_params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 4.x has rope_theta + rope_scaling; 5.x folds both into rope_parameters."""
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    if "rope_theta" in cfg:
        params.setdefault("rope_theta", cfg["rope_theta"])
    return params


def hf_extra_tensors(config: LlamaConfig, cfg: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """llama3 scaling as llama.cpp stores it: divisors per frequency (rope_freqs.weight)."""
    params = hf_rope_params(cfg)
    if params.get("rope_type", params.get("type")) != "llama3":
        return {}
    factors = llama3_factors(
        base_inv_freq(config.rope_dim, config.rope_theta),
        float(params["factor"]),
        float(params["low_freq_factor"]),
        float(params["high_freq_factor"]),
        int(params["original_max_position_embeddings"]),
    )
    return {"rope_freqs.weight": factors}


def hf_tensors_to_gguf(
    config: LlamaConfig, tensors: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Rename a HF state dict (float arrays) to llama.cpp's names and layouts.

    For llama, Q and K rows are permuted from HF's half-split RoPE layout to the pairwise
    layout, exactly as llama.cpp's converter does, so one RoPE code path serves both sources.
    """
    arch = gguf.MODEL_ARCH[config.arch.upper()]
    names = gguf.get_tensor_name_map(arch, config.n_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, value in tensors.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ModelFileError(f"tensor {hf_name!r} has no llama.cpp name for {config.arch}")
        if config.arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            value = _permute_qk(value, config.n_heads)
        elif config.arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            value = _permute_qk(value, config.n_kv_heads)
        out[name] = value
    return out


def _permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    # rows (heads * D) in halves order [x0..x(D/2-1), y0..] -> pairs order [x0, y0, x1, y1, ...]
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


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
        self._scratch: tuple[Any, ...] | None = None

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
        bias = w.optional_vector
        q = ops.linear(h, w.matrix(p + "attn_q.weight"), bias(p + "attn_q.bias"))
        k = ops.linear(h, w.matrix(p + "attn_k.weight"), bias(p + "attn_k.bias"))
        v = ops.linear(h, w.matrix(p + "attn_v.weight"), bias(p + "attn_v.bias"))
        q = q.reshape(t, c.n_heads, c.head_dim)  # (T, H, D)
        k = k.reshape(t, c.n_kv_heads, c.head_dim)  # (T, Hkv, D)
        v = v.reshape(t, c.n_kv_heads, c.head_dim)
        if c.qk_norm:  # qwen3: RMSNorm over each head before RoPE
            q = ops.rms_norm(q, w.vector(p + "attn_q_norm.weight"), c.rms_eps)
            k = ops.rms_norm(k, w.vector(p + "attn_k_norm.weight"), c.rms_eps)
        q, k = self.rope.apply(q, positions), self.rope.apply(k, positions)
        start, end = int(positions[0]), int(positions[-1]) + 1
        cache.write(start, k=k, v=v)
        if t == 1 and kernels.enabled():  # decode: one C call instead of a dozen numpy ops
            k_all, v_all = cache.storage("k"), cache.storage("v")
            out = kernels.attend1(q[0], k_all, v_all, end, self.scale)[None]
        else:
            out = ops.attention(q, cache.read("k", end), cache.read("v", end), self.scale)
        return w.matrix(p + "attn_output.weight").matmul(out.reshape(t, -1))  # (T, d)

    def decode_fused(
        self, x: np.ndarray, positions: np.ndarray, cache: KVCache, layers: range
    ) -> np.ndarray | None:
        """One token through `layers` with one C call per layer and no allocation per layer
        (kernels.c: cs_llama_decode). None when a weight has no fused kernel (e.g. F32)."""
        if not kernels.enabled():
            return None
        fused = [self._fused_layer(i) for i in layers]
        if any(f is None for f in fused):
            return None
        if x.shape != (1, self.config.d_model):
            raise ValueError(f"decode_fused takes hidden states (1, d_model), got {x.shape}")
        out = np.array(x[0], dtype=np.float32)  # (d,): the residual stream, updated in place
        cos, sin = (np.ascontiguousarray(t[0, 0]) for t in self.rope._tables(positions))
        pos = int(positions[0])
        for i, f in zip(layers, fused, strict=True):
            lc = cache.layer(i)
            k_store, v_store = lc.storage("k"), lc.storage("v")
            check_room(k_store.shape[1], pos + 1)
            scratch = self._decode_scratch(k_store.shape[1])
            kernels.llama_decode(f[0], out, pos, cos, sin, k_store, v_store, scratch)  # type: ignore[index]
        return out[None]

    def _fused_layer(self, layer: int) -> tuple[Any, ...] | None:
        if layer not in self._fused:
            self._fused[layer] = self._build_fused_layer(layer)
        return self._fused[layer]

    def _build_fused_layer(self, layer: int) -> tuple[Any, ...] | None:
        c, w, p = self.config, self.w, f"blk.{layer}."
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        mats = [w.matrix(f"{p}{n}.weight")._fused for n in names]
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
        c = self.config
        return {"k": (c.n_kv_heads, c.head_dim), "v": (c.n_kv_heads, c.head_dim)}

    def scratch_bytes(self, n_tokens: int, context: int) -> int:
        return self.config.scratch_bytes(n_tokens, context)


CONFIG = LlamaConfig
MODEL = Llama
