"""DeepSeek-V2/V3 and Kimi-K2's configuration: read from GGUF metadata or a Hugging Face
config.json, written back as GGUF metadata, the tensors it implies (attention, MLA, experts),
its memory formulas, and the renaming of a HF state dict to llama.cpp's names. Pure (numpy):
the planner sizes a Kimi K3 from it without the model code (deepseek2.py) or the kernels."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cellswarm.cache_types import DEFAULT_CACHE_TYPE, spec_bytes_per_token
from cellswarm.errors import ModelFileError
from cellswarm.io.names import global_tensor_shapes
from cellswarm.models.llama_config import QUERY_BLOCK, hf_rope_params
from cellswarm.models.rope import Yarn

ARCH = "deepseek2"
GATINGS = ("softmax", "sigmoid")  # llama.cpp expert_gating_func 1 and 2
# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not
# config.rms_norm_eps (llama.cpp uses the latter; both are 1e-6 in every released model).
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DeepseekConfig:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    context_length: int
    rms_eps: float
    q_lora_rank: int  # 0: queries come from one plain projection, attn_q
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    ffn_dim: int  # dense layers
    moe_ffn_dim: int  # one routed expert; shared experts are n_shared_experts times wider
    n_experts: int  # 0: every layer is dense
    n_experts_used: int
    n_shared_experts: int
    first_k_dense: int
    n_groups: int  # experts are routed within the topk_groups best of n_groups groups
    topk_groups: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    gating: str  # "sigmoid" (V3/K2, with e_score_correction_bias) or "softmax" (V2)
    rope_theta: float
    yarn: Yarn | None = None
    arch: str = ARCH

    def __post_init__(self) -> None:
        if self.gating not in GATINGS:
            raise ModelFileError(f"expert gating {self.gating!r} is not one of {GATINGS}")
        if self.qk_rope_dim % 2:
            raise ModelFileError(f"rope dim {self.qk_rope_dim} is odd; RoPE rotates pairs")
        if self.n_experts:
            if not 0 < self.n_experts_used <= self.n_experts:
                raise ModelFileError(
                    f"{self.n_experts_used} experts used per token of {self.n_experts}"
                )
            per_group = self.n_experts // self.n_groups
            if (
                self.n_experts % self.n_groups
                or not 0 < self.topk_groups <= self.n_groups
                or self.n_experts_used > self.topk_groups * per_group
            ):
                raise ModelFileError(
                    f"{self.n_experts_used} of {self.n_experts} experts cannot be routed from "
                    f"the best {self.topk_groups} of {self.n_groups} groups"
                )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.first_k_dense

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_rows: int) -> DeepseekConfig:
        arch = str(meta.get("general.architecture", ARCH))
        if arch != ARCH:
            raise ModelFileError(f"architecture {arch!r} is not {ARCH!r}")

        def get(key: str, default: Any = None) -> Any:
            full = f"{ARCH}.{key}"
            if full not in meta and default is None:
                raise ModelFileError(f"GGUF metadata lacks {full}; the file is incomplete")
            return meta.get(full, default)

        rope_dim = int(get("rope.dimension_count"))
        # Converters since llama.cpp's MLA rework write the MQA view of MLA as key_length /
        # value_length (kv_lora_rank + R, kv_lora_rank) and the real head sizes as *_mla;
        # older files have only key_length / value_length, holding the real head sizes.
        qk_head = int(get("attention.key_length_mla", 0) or get("attention.key_length"))
        v_head = int(get("attention.value_length_mla", 0) or get("attention.value_length"))
        n_layers = int(get("block_count"))
        n_experts = int(get("expert_count", 0))
        gating = {1: "softmax", 2: "sigmoid"}.get(int(get("expert_gating_func", 1)))
        if gating is None:
            raise ModelFileError(
                f"{ARCH}.expert_gating_func {get('expert_gating_func')} is not 1 (softmax) "
                "or 2 (sigmoid)"
            )
        n_groups = int(get("expert_group_count", 0)) or 1
        yarn = None
        if get("rope.scaling.type", "none") == "yarn":
            # llama.cpp keeps only 0.1 * mscale_all_dim and assumes mscale == mscale_all_dim
            # (see its [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]); rounding undoes float32 storage.
            log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0))
            mscale_all = round(log_mul / 0.1, 6) if log_mul else None
            attn_factor = get("rope.scaling.yarn_attn_factor", 0.0)
            yarn = Yarn(
                factor=float(get("rope.scaling.factor")),
                original_context=int(get("rope.scaling.original_context_length")),
                beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
                mscale=mscale_all,
                mscale_all_dim=mscale_all,
                attention_factor_override=float(attn_factor) if attn_factor else None,
            )
        return cls(
            n_layers=n_layers,
            d_model=int(get("embedding_length")),
            n_heads=int(get("attention.head_count")),
            vocab_size=int(get("vocab_size", vocab_rows)),
            context_length=int(get("context_length", 4096)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            q_lora_rank=int(get("attention.q_lora_rank", 0)),
            kv_lora_rank=int(get("attention.kv_lora_rank")),
            qk_nope_dim=qk_head - rope_dim,
            qk_rope_dim=rope_dim,
            v_head_dim=v_head,
            ffn_dim=int(get("feed_forward_length")),
            moe_ffn_dim=int(get("expert_feed_forward_length", 0)),
            n_experts=n_experts,
            n_experts_used=int(get("expert_used_count", 0)),
            n_shared_experts=int(get("expert_shared_count", 0)),
            first_k_dense=int(get("leading_dense_block_count", 0)) if n_experts else n_layers,
            n_groups=n_groups,
            topk_groups=int(get("expert_group_used_count", 0)) or n_groups,
            routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
            norm_topk_prob=bool(get("expert_weights_norm", False)),
            gating=gating,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            yarn=yarn,
        )

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> DeepseekConfig:
        model_type = cfg.get("model_type", "deepseek_v3")
        v2 = model_type == "deepseek_v2"
        if cfg.get("rope_interleave") is False:
            raise ModelFileError(
                "rope_interleave=false (half-split RoPE) is not supported; DeepSeek checkpoints "
                "use interleaved pairs"
            )
        rope = hf_rope_params(cfg)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        yarn = None
        if rope_type == "yarn":

            def opt(key: str) -> float | None:
                return None if rope.get(key) is None else float(rope[key])

            yarn = Yarn(
                factor=float(rope["factor"]),
                original_context=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32.0),
                beta_slow=float(rope.get("beta_slow") or 1.0),
                mscale=opt("mscale"),
                mscale_all_dim=opt("mscale_all_dim"),
                attention_factor_override=opt("attention_factor"),
                truncate=bool(rope.get("truncate", True)),
            )
        elif rope_type != "default":
            raise ModelFileError(f"RoPE scaling {rope_type!r} is not supported for {model_type}")
        n_layers = int(cfg["num_hidden_layers"])
        n_experts = int(cfg.get("n_routed_experts") or 0)
        routing: dict[str, Any] = dict(  # a dense model: what from_gguf reads for one
            n_experts_used=0,
            first_k_dense=n_layers,
            n_groups=1,
            topk_groups=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            gating="softmax",
        )
        if n_experts:
            # transformers' deepseek_v2 "greedy" routing ignores the groups a config lists.
            grouped = cfg.get("topk_method", "greedy" if v2 else "noaux_tc") != "greedy"
            n_groups = int(cfg.get("n_group") or 1) if grouped else 1
            routing = dict(
                n_experts_used=int(cfg["num_experts_per_tok"]),
                first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
                n_groups=n_groups,
                topk_groups=int(cfg.get("topk_group") or n_groups) if grouped else 1,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", not v2)),
                gating=str(cfg.get("scoring_func") or ("softmax" if v2 else "sigmoid")),
            )
        return cls(
            n_layers=n_layers,
            d_model=int(cfg["hidden_size"]),
            n_heads=int(cfg["num_attention_heads"]),
            vocab_size=int(cfg["vocab_size"]),
            context_length=int(cfg.get("max_position_embeddings", 4096)),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            ffn_dim=int(cfg["intermediate_size"]),
            moe_ffn_dim=int(cfg.get("moe_intermediate_size") or 0),
            n_experts=n_experts,
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            yarn=yarn,
            **routing,
        )

    def to_gguf_metadata(self) -> dict[str, Any]:
        """The inverse of from_gguf: keys as llama.cpp's converter writes them (MLA as MQA:
        head_count_kv 1, key/value_length over the latent, real head sizes in *_mla)."""
        k = f"{ARCH}."
        meta: dict[str, Any] = {
            "general.architecture": ARCH,
            k + "block_count": self.n_layers,
            k + "context_length": self.context_length,
            k + "embedding_length": self.d_model,
            k + "feed_forward_length": self.ffn_dim,
            k + "attention.head_count": self.n_heads,
            k + "attention.head_count_kv": 1,  # MLA run as MQA over the latent
            k + "rope.freq_base": self.rope_theta,
            k + "attention.layer_norm_rms_epsilon": self.rms_eps,
            k + "vocab_size": self.vocab_size,
            k + "attention.kv_lora_rank": self.kv_lora_rank,
            k + "attention.key_length": self.kv_lora_rank + self.qk_rope_dim,
            k + "attention.value_length": self.kv_lora_rank,
            k + "attention.key_length_mla": self.qk_head_dim,
            k + "attention.value_length_mla": self.v_head_dim,
            k + "rope.dimension_count": self.qk_rope_dim,
        }
        if self.q_lora_rank:
            meta[k + "attention.q_lora_rank"] = self.q_lora_rank
        meta |= {  # written for dense models too: llama.cpp requires them for deepseek2
            k + "leading_dense_block_count": self.first_k_dense,
            k + "expert_feed_forward_length": self.moe_ffn_dim,
            k + "expert_shared_count": self.n_shared_experts,
        }
        if self.n_experts:
            meta |= {
                k + "expert_count": self.n_experts,
                k + "expert_used_count": self.n_experts_used,
                k + "expert_group_count": self.n_groups,
                k + "expert_group_used_count": self.topk_groups,
                k + "expert_gating_func": GATINGS.index(self.gating) + 1,
                k + "expert_weights_scale": self.routed_scaling_factor,
            }
            if self.norm_topk_prob:
                meta[k + "expert_weights_norm"] = True
        if self.yarn is not None:
            y = self.yarn
            meta |= {
                k + "rope.scaling.type": "yarn",
                k + "rope.scaling.factor": y.factor,
                k + "rope.scaling.original_context_length": y.original_context,
                k + "rope.scaling.yarn_beta_fast": y.beta_fast,
                k + "rope.scaling.yarn_beta_slow": y.beta_slow,
            }
            if y.mscale_all_dim is not None:
                meta[k + "rope.scaling.yarn_log_multiplier"] = 0.1 * y.mscale_all_dim
            if y.attention_factor_override is not None:
                meta[k + "rope.scaling.yarn_attn_factor"] = y.attention_factor_override
        return meta

    def absorbed_bytes_per_layer(self) -> int:
        """Float32 W_UK and W_UV that `Deepseek2.absorbed` keeps decoded per layer held."""
        return 4 * self.n_heads * (self.qk_nope_dim + self.v_head_dim) * self.kv_lora_rank

    def scratch_bytes(self, n_tokens: int, context: int, attn_layers: int = 0) -> int:
        """Peak temporary bytes of one step, plus the decoded W_UK/W_UV of `attn_layers`."""
        ffn = (
            max(self.ffn_dim, (self.n_shared_experts + self.n_experts_used) * self.moe_ffn_dim)
            if self.n_experts
            else self.ffn_dim
        )
        per_token = 4 * (
            4 * self.d_model
            + max(self.q_lora_rank, self.kv_lora_rank + self.qk_rope_dim)
            + self.n_heads * (2 * self.qk_head_dim + 2 * self.kv_lora_rank + 2 * self.v_head_dim)
            + 3 * ffn
            + 4 * self.n_experts
        )
        # latent scores, rope scores, probabilities: QUERY_BLOCK queries at a time in a prefill
        scores = 4 * 3 * self.n_heads * min(n_tokens, QUERY_BLOCK) * context
        # Not temporary, but not in the weight store either: the decoded W_UK/W_UV kept per
        # layer held (see `Deepseek2.absorbed`), counted so a memory report's total is right.
        return n_tokens * per_token + scores + attn_layers * self.absorbed_bytes_per_layer()

    def kv_bytes_per_token_layer(self, cache_type: str = DEFAULT_CACHE_TYPE) -> int:
        return spec_bytes_per_token(self.cache_spec(), cache_type)  # latent + shared RoPE key

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        """A layer's KV cache tensors per token: the latent and the shared RoPE key."""
        return {"latent": (self.kv_lora_rank,), "k_rope": (self.qk_rope_dim,)}

    def expected_tensors(self, layers: Iterable[int]) -> dict[str, tuple[int, ...]]:
        """GGUF name -> numpy-order shape of every tensor `layers` and the ends of the model read.

        Not listed: the key/value up-projection, which comes in one of two layouts (attn_kv_b,
        or attn_k_b + attn_v_b; `Deepseek2` checks whichever is there), and the optional
        router bias exp_probs_b. output.weight is listed; a file without one ties the head.
        """
        d, n_heads, lat = self.d_model, self.n_heads, self.kv_lora_rank
        q_out, shared = n_heads * self.qk_head_dim, self.n_shared_experts * self.moe_ffn_dim
        out = global_tensor_shapes(self.vocab_size, d)
        for i in layers:
            p = f"blk.{i}."
            out |= {
                p + "attn_norm.weight": (d,),
                p + "attn_kv_a_mqa.weight": (lat + self.qk_rope_dim, d),
                p + "attn_kv_a_norm.weight": (lat,),
                p + "attn_output.weight": (d, n_heads * self.v_head_dim),
                p + "ffn_norm.weight": (d,),
            }
            if self.q_lora_rank:
                out |= {
                    p + "attn_q_a.weight": (self.q_lora_rank, d),
                    p + "attn_q_a_norm.weight": (self.q_lora_rank,),
                    p + "attn_q_b.weight": (q_out, self.q_lora_rank),
                }
            else:
                out[p + "attn_q.weight"] = (q_out, d)
            if not self.is_moe(i):
                out |= {
                    p + "ffn_gate.weight": (self.ffn_dim, d),
                    p + "ffn_up.weight": (self.ffn_dim, d),
                    p + "ffn_down.weight": (d, self.ffn_dim),
                }
                continue
            e, ffn = self.n_experts, self.moe_ffn_dim
            out |= {
                p + "ffn_gate_inp.weight": (e, d),
                p + "ffn_gate_exps.weight": (e, ffn, d),
                p + "ffn_up_exps.weight": (e, ffn, d),
                p + "ffn_down_exps.weight": (e, d, ffn),
            }
            if shared:
                out |= {
                    p + "ffn_gate_shexp.weight": (shared, d),
                    p + "ffn_up_shexp.weight": (shared, d),
                    p + "ffn_down_shexp.weight": (d, shared),
                }
        return out


# ----------------------------------------------------------------------------- routing


def converter_shapes(c: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """What DeepseekConfig.expected_tensors leaves out: the key/value up-projection (in the
    attn_kv_b layout the engine's converter writes) and the router's correction bias."""
    out: dict[str, tuple[int, ...]] = {}
    for i in range(c.n_layers):
        out[f"blk.{i}.attn_kv_b.weight"] = (
            c.n_heads * (c.qk_nope_dim + c.v_head_dim),
            c.kv_lora_rank,
        )
        if c.is_moe(i) and c.gating == "sigmoid":
            out[f"blk.{i}.exp_probs_b.bias"] = (c.n_experts,)
    return out


# ----------------------------------------------------------------------------- HF -> GGUF


def hf_extra_tensors(config: DeepseekConfig, cfg: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Tensors llama.cpp derives from the config: none for deepseek2 (YaRN lives in metadata)."""
    return {}


_HF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


def hf_tensors_to_gguf(
    config: DeepseekConfig, tensors: Mapping[str, np.ndarray], *, split_kv_b: bool = False
) -> dict[str, np.ndarray]:
    """Rename a Hugging Face state dict to llama.cpp's GGUF names and layouts (float32).

    Routed experts come either one matrix per expert (`mlp.experts.{j}.gate_proj.weight`, as
    checkpoints and transformers' save_pretrained have them) or fused as transformers 5 holds
    them in memory (`mlp.experts.gate_up_proj` (E, 2 * I, d), gate rows first, and
    `mlp.experts.down_proj` (E, d, I)); both become `ffn_{gate,up,down}_exps` (E, out, in).
    Layers past n_layers (DeepSeek's multi-token-prediction layer) are dropped.
    `split_kv_b` writes attn_k_b (H, L, N) and attn_v_b (H, V, L) instead of attn_kv_b, as
    llama.cpp's current converter does.
    """
    c = config
    out: dict[str, np.ndarray] = {}
    per_expert: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, value in tensors.items():
        t = np.asarray(value, dtype=np.float32)
        if name in _HF_GLOBAL:
            out[_HF_GLOBAL[name]] = t
            continue
        m = _LAYER_RE.match(name)
        if m is None:
            if _IGNORED_RE.search(name):
                continue
            raise ModelFileError(f"unexpected tensor {name!r} in a {c.arch} checkpoint")
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= c.n_layers or _IGNORED_RE.search(rest):
            continue
        p = f"blk.{layer}."
        if (e := _EXPERT_RE.match(rest)) is not None:
            per_expert.setdefault((layer, e.group(2)), {})[int(e.group(1))] = t
        elif rest == "mlp.experts.gate_up_proj":  # (E, 2I, d)
            half = t.shape[1] // 2
            out[p + "ffn_gate_exps.weight"] = np.ascontiguousarray(t[:, :half])
            out[p + "ffn_up_exps.weight"] = np.ascontiguousarray(t[:, half:])
        elif rest == "mlp.experts.down_proj":  # (E, d, I)
            out[p + "ffn_down_exps.weight"] = t
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            # (H * (N + V), L) -> per head (N + V, L) -> k_b (H, L, N), v_b (H, V, L)
            kv_b = t.reshape(c.n_heads, c.qk_nope_dim + c.v_head_dim, c.kv_lora_rank)
            out[p + "attn_k_b.weight"] = np.ascontiguousarray(
                kv_b[:, : c.qk_nope_dim].transpose(0, 2, 1)
            )
            out[p + "attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, c.qk_nope_dim :])
        elif rest in _HF_LAYER:
            out[p + _HF_LAYER[rest]] = t
        else:
            raise ModelFileError(f"unexpected tensor {name!r} in a {c.arch} checkpoint")
    for (layer, proj), by_id in per_expert.items():
        if sorted(by_id) != list(range(c.n_experts)):
            raise ModelFileError(
                f"layer {layer} has {proj}_proj for experts {sorted(by_id)}, expected "
                f"0..{c.n_experts - 1}"
            )
        stacked = np.stack([by_id[i] for i in range(c.n_experts)])  # (E, out, in)
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = stacked
    return out


CONFIG = DeepseekConfig
