"""The llama family's configuration (llama, qwen2, qwen3): read from GGUF metadata or a Hugging
Face config.json, written back as GGUF metadata, the tensors it implies, and the renaming of a
HF state dict to llama.cpp's names. Pure (numpy, gguf): the planner sizes models from it
without the model code (llama.py) or the kernels."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cellswarm.cache_types import DEFAULT_CACHE_TYPE, spec_bytes_per_token
from cellswarm.errors import ModelFileError
from cellswarm.io.names import global_tensor_shapes
from cellswarm.models.rope import base_inv_freq, llama3_factors

# A prefill attends its queries this many at a time (ops.attention, deepseek2's latent
# attention), each block against only the keys it can see: a step's scores are at most
# QUERY_BLOCK x context a head, whatever its length, and scratch_bytes counts that.
QUERY_BLOCK = 128

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
        # scores and probabilities: a prefill's queries are attended QUERY_BLOCK at a time
        # (ops.attention; the kernels hold one query's row a thread)
        scores = 4 * 2 * self.n_heads * min(n_tokens, QUERY_BLOCK) * context
        return n_tokens * per_token + scores

    def kv_bytes_per_token_layer(self, cache_type: str = DEFAULT_CACHE_TYPE) -> int:
        return spec_bytes_per_token(self.cache_spec(), cache_type)  # K and V

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        """A layer's KV cache tensors per token (kv_cache.py lays "kt" out transposed and
        padded): the one definition the model and a placement's budget use."""
        return {"kt": (self.n_kv_heads, self.head_dim), "v": (self.n_kv_heads, self.head_dim)}

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
    import gguf  # (the tensor-name maps: a conversion's, not a worker's, 4.6 MB)

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


CONFIG = LlamaConfig


def converter_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Tensors the converter writes beyond expected_tensors: none for this family."""
    return {}
