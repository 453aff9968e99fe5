"""DeepSeek-V2/V3 and Kimi-K2: multi-head latent attention (MLA) and a routed mixture of experts.

Reference: Hugging Face transformers `models/deepseek_v3/modeling_deepseek_v3.py` (and
`deepseek_v2` for softmax routing); llama.cpp's `deepseek2` architecture for tensor names,
metadata keys and weight layouts. Shapes: T new tokens, S cached tokens, H heads,
L = kv_lora_rank, N = qk_nope_dim, R = qk_rope_dim, V = v_head_dim, E routed experts.

Per layer: RMSNorm -> MLA -> residual -> RMSNorm -> FFN -> residual, where the FFN is a dense
SwiGLU for the first `first_k_dense` layers and a mixture of experts after that (routed
experts chosen per token, plus always-on shared experts).

Attention is computed in "absorbed" form, so the KV cache holds only what MLA compresses to:
per token and layer, the RMS-normalized latent c_kv (L floats) and the one rotated key k_rope
(R floats) shared by all heads. The per-head key/value up-projections W_UK (N, L) and W_UV
(V, L) are folded into the query and the output instead of expanding keys and values:

    q_lat[h]  = q_nope[h] @ W_UK[h]                       (T, L)
    score[h]  = q_lat[h] . c_kv + q_rope[h] . k_rope      (T, S)
    out[h]    = (softmax(score[h] * scale) @ c_kv) @ W_UV[h]^T   (T, V)

KV bytes per token = n_layers * (kv_lora_rank + qk_rope_dim) * 4 in float32. For DeepSeek-V3
and Kimi K2 (61 layers, kv_lora_rank 512, qk_rope_dim 64) that is 61 * 576 * 4 = 140,544 bytes
(~137 KiB) per token, 14.1 GB for a 100k-token context; expanding to per-head K and V
(128 heads * (192 + 128) floats per layer) would take 71x more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cellswarm import kernels
from cellswarm.errors import MissingTensorError, ModelFileError, ShapeMismatchError
from cellswarm.io.weights import WeightStore
from cellswarm.models import ops
from cellswarm.models.deepseek2_config import (  # the family's config, re-exported
    ARCH,
    GATINGS,
    LATENT_NORM_EPS,
    DeepseekConfig,
    hf_extra_tensors,
    hf_tensors_to_gguf,
)
from cellswarm.models.deepseek2_fused import FusedDecode
from cellswarm.models.kv_cache import CacheSpec, KVCache, LayerCache
from cellswarm.models.rope import Rope, base_inv_freq
from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name

__all__ = [
    "ARCH",
    "GATINGS",
    "LATENT_NORM_EPS",
    "Deepseek2",
    "DeepseekConfig",
    "hf_extra_tensors",
    "hf_tensors_to_gguf",
]

@dataclass(frozen=True)
class Routing:
    """Which routed experts each token uses and with what weight.

    expert_ids: (T, k) int64, weights: (T, k) float32 (already normalized and scaled).
    """

    expert_ids: np.ndarray
    weights: np.ndarray


def route(logits: np.ndarray, config: DeepseekConfig, bias: np.ndarray | None = None) -> Routing:
    """Choose experts from router logits (T, E): DeepSeek's grouped top-k.

    sigmoid (V3/K2 "noaux_tc"): scores = sigmoid(logits); the correction bias is added only
    to choose (groups ranked by the sum of their two best biased scores, then the best k
    experts within the topk_groups best groups); weights are the unbiased scores of the
    chosen experts. softmax (V2): scores = softmax(logits), groups ranked by their best score.
    Weights are then normalized to sum to 1 if norm_topk_prob, and times routed_scaling_factor.
    """
    c = config
    t, e = logits.shape
    if kernels.enabled():  # the fused layer's own routing: a prefill's bits are a decode's
        rule = kernels.RouteRule(e, c.n_experts_used, c.n_groups, c.topk_groups,
                                 int(c.gating == "sigmoid"), int(c.norm_topk_prob),
                                 c.routed_scaling_factor)  # fmt: skip
        return Routing(*kernels.route_rows(logits, rule, bias))
    logits = logits.astype(np.float32)
    scores = ops.sigmoid(logits) if c.gating == "sigmoid" else ops.softmax(logits)  # (T, E)
    choice = scores + bias if bias is not None else scores.copy()  # (T, E)
    if c.n_groups > 1 and c.topk_groups < c.n_groups:
        grouped = choice.reshape(t, c.n_groups, e // c.n_groups)  # (T, G, E/G)
        if c.gating == "sigmoid":
            best_two = -np.partition(-grouped, min(1, grouped.shape[-1] - 1), axis=-1)[..., :2]
            group_score = best_two.sum(axis=-1)  # (T, G)
        else:
            group_score = grouped.max(axis=-1)
        keep = _top_k(group_score, c.topk_groups)  # (T, topk_groups)
        mask = np.ones((t, c.n_groups), dtype=bool)
        np.put_along_axis(mask, keep, False, axis=-1)
        grouped = np.where(mask[..., None], np.float32(-np.inf), grouped)
        choice = grouped.reshape(t, e)
    ids = _top_k(choice, c.n_experts_used)  # (T, k)
    weights = np.take_along_axis(scores, ids, axis=-1)  # (T, k)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    weights = (weights * np.float32(c.routed_scaling_factor)).astype(np.float32)
    return Routing(ids.astype(np.int64), weights)


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries along the last axis, largest first."""
    part = np.argpartition(-x, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(x, part, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1)


def apply_experts(
    x: np.ndarray,
    routing: Routing,
    gate: PackedExperts,
    up: PackedExperts,
    down: PackedExperts,
    experts: Sequence[int] | None = None,
) -> np.ndarray:
    """Sum over tokens' routed experts of weight * SwiGLU_expert(x), for the experts given.

    x: (T, d) -> (T, d). `experts` defaults to every expert the stacks hold (`gate.held`);
    routed experts outside that set contribute nothing here. Each expert runs once, on just
    the tokens routed to it, in ascending expert order, and is added as it comes: that order
    of float32 additions is the one every layout reproduces (`sum_experts`).
    """
    out = np.zeros_like(x, dtype=np.float32)  # (T, d)
    for _, tokens, y in _weighted_outputs(x, routing, gate, up, down, experts):
        out[tokens] += y
    return out


def expert_outputs(
    x: np.ndarray,
    routing: Routing,
    gate: PackedExperts,
    up: PackedExperts,
    down: PackedExperts,
    experts: Sequence[int] | None = None,
) -> dict[int, np.ndarray]:
    """Each held expert's weighted output, kept apart: expert id -> (n_e, d), the rows of the
    n_e tokens routed to it in token order — what `apply_experts` adds up, before adding, so
    that nodes holding different experts can hand them to one owner who adds them in the
    single-process order (float32 addition is not associative)."""
    return {e: y for e, _, y in _weighted_outputs(x, routing, gate, up, down, experts)}


def _weighted_outputs(
    x: np.ndarray,
    routing: Routing,
    gate: PackedExperts,
    up: PackedExperts,
    down: PackedExperts,
    experts: Sequence[int] | None,
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(expert id, its tokens, weight * SwiGLU_expert(x[tokens])) in ascending expert order."""
    wanted = gate.held if experts is None else experts
    for e in sorted(set(int(i) for i in wanted) & set(np.unique(routing.expert_ids).tolist())):
        tokens, slots = np.nonzero(routing.expert_ids == e)  # each token picks e at most once
        y = ops.swiglu(x[tokens], gate.expert(e), up.expert(e), down.expert(e))
        yield e, tokens, y * routing.weights[tokens, slots][:, None]


def sum_experts(
    shape: tuple[int, ...], routing: Routing, outputs: Mapping[int, np.ndarray]
) -> np.ndarray:
    """Per-expert weighted outputs (`expert_outputs`, from any number of holders) summed per
    token in ascending expert order, from zero: the additions `apply_experts` makes in one
    process, so the result is the same bits whichever node computed which expert."""
    out = np.zeros(shape, dtype=np.float32)  # (T, d)
    for e in sorted(outputs):
        tokens = np.nonzero(routing.expert_ids == e)[0]
        y = outputs[e]
        if y.shape != (len(tokens), shape[1]):
            raise ShapeMismatchError(
                f"expert {e}'s output has shape {y.shape}; {len(tokens)} tokens were routed to it"
            )
        out[tokens] += y
    return out


def held_experts_sum(w: WeightStore, layer: int, x: np.ndarray, routing: Routing) -> np.ndarray:
    """The routed experts of `layer` that the store `w` holds, summed per token with their
    routing weights: (T, d) -> (T, d), zero rows for tokens routed to none of them."""
    p = f"blk.{layer}."
    gate = w.experts(p + "ffn_gate_exps.weight")
    return apply_experts(
        x, routing, gate, w.experts(p + "ffn_up_exps.weight"),
        w.experts(p + "ffn_down_exps.weight"),
    )  # fmt: skip


def held_expert_outputs(
    w: WeightStore, layer: int, x: np.ndarray, routing: Routing
) -> dict[int, np.ndarray]:
    """`expert_outputs` of the routed experts of `layer` that the store `w` holds: what an
    expert node computes for the layer's owner (swarm/ring/parts.py)."""
    p = f"blk.{layer}."
    gate = w.experts(p + "ffn_gate_exps.weight")
    return expert_outputs(
        x, routing, gate, w.experts(p + "ffn_up_exps.weight"),
        w.experts(p + "ffn_down_exps.weight"),
    )  # fmt: skip


class RemoteExperts(Protocol):
    """Routed experts a stage does not hold: its MoE layers send the tokens routed to them
    away before computing their own experts, and add the results after."""

    def scatter(
        self, layer: int, h: np.ndarray, routing: Routing
    ) -> Callable[[], Mapping[int, np.ndarray]]:
        """Send h (T, d)'s rows routed to experts held elsewhere; the returned call waits
        for the holders and gives each such expert's weighted output, as `expert_outputs`
        does (not their sum: the owner adds everything in the single-process order)."""
        ...


class InProcessExperts:
    """RemoteExperts over weight stores in this process: what expert nodes compute, without
    sockets (unit tests, and the reference the wire protocol must match)."""

    def __init__(self, stores: Sequence[WeightStore]) -> None:
        self.stores = list(stores)

    def scatter(
        self, layer: int, h: np.ndarray, routing: Routing
    ) -> Callable[[], Mapping[int, np.ndarray]]:
        outputs: dict[int, np.ndarray] = {}
        for w in self.stores:  # the first holder wins if two hold one, as ExpertParts does
            for e, y in held_expert_outputs(w, layer, h, routing).items():
                outputs.setdefault(e, y)
        return lambda: outputs


# ----------------------------------------------------------------------------- model


class Deepseek2:
    """Forward pass over a (possibly partial) weight store; see models/base.py."""

    def __init__(self, config: DeepseekConfig, weights: WeightStore) -> None:
        self.config = c = config
        self.w = weights
        if c.yarn is not None:
            inv_freq = c.yarn.inv_freq(c.qk_rope_dim, c.rope_theta)
            attention_factor, mscale = c.yarn.attention_factor, c.yarn.softmax_mscale
        else:
            inv_freq = base_inv_freq(c.qk_rope_dim, c.rope_theta)
            attention_factor, mscale = 1.0, 1.0
        # "norm" = adjacent pairs: DeepSeek's interleaved RoPE (transformers' rope_interleave)
        # and llama.cpp's deepseek2 rope type alike; the converter leaves these rows as is.
        self.rope = Rope(c.qk_rope_dim, inv_freq, "norm", attention_factor)
        self.scale = c.qk_head_dim**-0.5 * mscale * mscale
        self._absorbed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._heads: dict[int, tuple[list[PackedMatrix], list[PackedMatrix]]] = {}
        held = [n.split(".")[1] for n in weights if n.endswith(".attn_kv_a_mqa.weight")]
        for layer in held:
            self._check_kv_up_projection(f"blk.{layer}.")
        self._attn_layers = len(held)
        # Routed experts this store lacks, held by other nodes (None: the store has them all)
        self.remote_experts: RemoteExperts | None = None
        self._fused = FusedDecode(self)

    def _check_kv_up_projection(self, p: str) -> None:
        """At load, not at the first forward: one of the two layouts, in the config's shape."""
        c = self.config
        expected: dict[str, tuple[int, ...]]
        if p + "attn_k_b.weight" in self.w:
            expected = {
                p + "attn_k_b.weight": (c.n_heads, c.kv_lora_rank, c.qk_nope_dim),
                p + "attn_v_b.weight": (c.n_heads, c.v_head_dim, c.kv_lora_rank),
            }
        elif p + "attn_kv_b.weight" in self.w:
            heads_out = c.n_heads * (c.qk_nope_dim + c.v_head_dim)
            expected = {p + "attn_kv_b.weight": (heads_out, c.kv_lora_rank)}
        else:
            raise MissingTensorError(
                f"model has neither {p}attn_kv_b.weight nor {p}attn_k_b.weight; the file is "
                "incomplete or was converted for another architecture"
            )
        for name, shape in expected.items():
            t = self.w[name]
            flat = (shape[0] * shape[1], shape[2]) if len(shape) == 3 else shape  # heads flattened
            if tuple(t.shape) not in (shape, flat):
                raise ShapeMismatchError(
                    f"tensor {name} has shape {tuple(t.shape)}, but the model's config implies "
                    f"{shape}; the file's metadata does not match its weights — re-convert it"
                )

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return ops.embed(self.w, token_ids)  # (T, d)

    def head(self, x: np.ndarray) -> np.ndarray:
        return ops.lm_head(self.w, x, self.config.d_model, self.config.rms_eps)  # (T, vocab)

    def block(
        self, layer: int, x: np.ndarray, positions: np.ndarray, cache: LayerCache
    ) -> np.ndarray:
        c, w, p = self.config, self.w, f"blk.{layer}."
        h = ops.rms_norm(x, w.vector(p + "attn_norm.weight"), c.rms_eps)
        x = x + self._attention(layer, h, positions, cache)
        h = ops.rms_norm(x, w.vector(p + "ffn_norm.weight"), c.rms_eps)
        if not c.is_moe(layer):
            return x + ops.swiglu(
                h,
                w.matrix(p + "ffn_gate.weight"),
                w.matrix(p + "ffn_up.weight"),
                w.matrix(p + "ffn_down.weight"),
            )
        return x + self.moe(layer, h)

    def prepare(self, layers: range) -> None:
        self._fused.prepare(layers)

    def decode_fused(
        self, x: np.ndarray, positions: np.ndarray, cache: KVCache, layers: range
    ) -> np.ndarray | None:
        """One token through `layers`, one C call per layer (models/deepseek2_fused.py); None
        when a weight has no fused kernel (an F32 model runs `block`)."""
        return self._fused.run(x, positions, cache, layers)

    def decode_fused_many(
        self, x: np.ndarray, positions: np.ndarray, caches: list[KVCache], layers: range
    ) -> np.ndarray | None:
        """One token of each of n sequences (x (n, d), positions (n,)) through `layers`, the
        sequences' tokens sharing each pass over the weights; None: run them one by one."""
        return self._fused.run_many(x, positions, caches, layers)

    def moe(self, layer: int, h: np.ndarray, routing: Routing | None = None) -> np.ndarray:
        """Routed experts (held here, and `remote_experts`) plus shared experts: (T, d) ->
        (T, d). Remote experts are asked first, so they compute while this node does its own.
        With remote experts, every routed expert's weighted output is kept apart and they are
        summed at the end in ascending expert order (`sum_experts`): the additions one process
        makes, so the bits do not depend on which node holds which expert."""
        c, w, p = self.config, self.w, f"blk.{layer}."
        routing = self.routing(layer, h) if routing is None else routing
        remote = self.remote_experts
        gather = remote.scatter(layer, h, routing) if remote is not None else None
        if gather is None:  # all here: add as they come, no per-expert outputs kept
            out = held_experts_sum(w, layer, h, routing)
        else:
            mine = held_expert_outputs(w, layer, h, routing)
        shared = None
        if c.n_shared_experts:
            shared = ops.swiglu(
                h,
                w.matrix(p + "ffn_gate_shexp.weight"),
                w.matrix(p + "ffn_up_shexp.weight"),
                w.matrix(p + "ffn_down_shexp.weight"),
            )
        if gather is not None:
            out = sum_experts(h.shape, routing, {**gather(), **mine})
        return out if shared is None else out + shared

    def routing(self, layer: int, h: np.ndarray) -> Routing:
        """The routed experts of a MoE layer for normed hidden states h (T, d)."""
        p = f"blk.{layer}."
        logits = self.w.matrix(p + "ffn_gate_inp.weight").matmul(h)  # (T, E)
        return route(logits, self.config, self.w.optional_vector(p + "exp_probs_b.bias"))

    def _attention(
        self, layer: int, h: np.ndarray, positions: np.ndarray, cache: LayerCache
    ) -> np.ndarray:
        c, w, p, t = self.config, self.w, f"blk.{layer}.", h.shape[0]
        n_heads, nope, lat = c.n_heads, c.qk_nope_dim, c.kv_lora_rank
        if c.q_lora_rank:
            q = w.matrix(p + "attn_q_a.weight").matmul(h)  # (T, q_lora)
            q = ops.rms_norm(q, w.vector(p + "attn_q_a_norm.weight"), LATENT_NORM_EPS)
            q = w.matrix(p + "attn_q_b.weight").matmul(q)  # (T, H * (N + R))
        else:
            q = w.matrix(p + "attn_q.weight").matmul(h)  # (T, H * (N + R))
        q = q.reshape(t, n_heads, c.qk_head_dim)
        q_nope = q[..., :nope]  # (T, H, N)
        q_rope = ops.rope(self.rope, q[..., nope:], positions)  # (T, H, R)

        kv = w.matrix(p + "attn_kv_a_mqa.weight").matmul(h)  # (T, L + R)
        latent = ops.rms_norm(kv[:, :lat], w.vector(p + "attn_kv_a_norm.weight"), LATENT_NORM_EPS)
        k_rope = ops.rope(self.rope, kv[:, None, lat:], positions)[:, 0]  # (T, R): all heads
        start, end = int(positions[0]), int(positions[-1]) + 1
        cache.write(start, latent=latent, k_rope=k_rope)
        latents, k_ropes = cache.read("latent", end), cache.read("k_rope", end)  # (S, L), (S, R)

        if kernels.enabled():  # per head and per query as a decode step: the same bits
            uk, uv = self.head_matrices(layer)
            q_lat = np.stack([uk[h].matmul(q_nope[:, h]) for h in range(n_heads)], axis=1)
            ctx_t = kernels.mla_attend(q_lat, q_rope, latents, k_ropes, self.scale)  # (T, H, L)
            out = np.stack([uv[h].matmul(ctx_t[:, h]) for h in range(n_heads)], axis=1)
            return w.matrix(p + "attn_output.weight").matmul(out.reshape(t, -1))  # (T, d)
        w_uk, w_uv = self.absorbed(layer)  # (H, N, L), (H, V, L)
        q_lat = q_nope.transpose(1, 0, 2) @ w_uk  # (H, T, L): queries in latent space
        q_rope = q_rope.transpose(1, 0, 2)  # (H, T, R)
        ctx = np.concatenate([  # (H, T, L): attention output still in latent space
            self._latent_attention(q_lat[:, a:b], q_rope[:, a:b], latents[:seen], k_ropes[:seen])
            for a, b, seen in ops.query_blocks(t, end)
        ], axis=1)  # fmt: skip
        out = ctx @ w_uv.transpose(0, 2, 1)  # (H, T, V)
        out = out.transpose(1, 0, 2).reshape(t, n_heads * c.v_head_dim)  # (T, H * V)
        return w.matrix(p + "attn_output.weight").matmul(out)  # (T, d)

    def _latent_attention(
        self, q_lat: np.ndarray, q_rope: np.ndarray, latents: np.ndarray, k_ropes: np.ndarray
    ) -> np.ndarray:
        """Causal attention of the last T of S positions: q_lat (H, T, L), q_rope (H, T, R),
        latents (S, L), k_ropes (S, R) -> (H, T, L)."""
        scores = q_lat @ latents.T + q_rope @ k_ropes.T  # (H, T, S)
        mask = ops.causal_mask(q_lat.shape[1], latents.shape[0])
        return ops.softmax(scores * np.float32(self.scale) + mask) @ latents

    def head_matrices(self, layer: int) -> tuple[list[PackedMatrix], list[PackedMatrix]]:
        """W_UK^T (L, N) and W_UV (V, L) of each head as matrices, as the fused decode layer
        reads them (deepseek2_fused: _kv_up): attn_k_b / attn_v_b as the file has them where
        a kernel reads their format (Q5_0 reads as the same values in Q8_0), else the float32
        copies of `absorbed`. A prefill multiplies by these, so its bits are a decode's."""
        cached = self._heads.get(layer)
        if cached is not None:
            return cached
        c, p = self.config, f"blk.{layer}."
        n_heads, lat, v = c.n_heads, c.kv_lora_rank, c.v_head_dim
        readable = {*kernels.FUSED_TYPES, *kernels.FLOAT_TYPES, "F32", "Q5_0"}
        # `in` first: a missing tensor is a MissingTensorError from [], not a KeyError
        k_b, v_b = (self.w[p + n] if p + n in self.w else None  # noqa: SIM401
                    for n in ("attn_k_b.weight", "attn_v_b.weight"))  # fmt: skip
        if all(isinstance(t, PackedMatrix | PackedExperts) and t.fmt.name in readable
               for t in (k_b, v_b)):  # fmt: skip
            mats = (_heads_of(k_b, n_heads, lat), _heads_of(v_b, n_heads, v))
        else:
            w_uk, w_uv = self.absorbed(layer)  # (H, N, L) as a view of (H, L, N) rows, (H, V, L)
            f32 = format_by_name("F32")
            uk_rows = w_uk.transpose(0, 2, 1)
            mats = ([PackedMatrix(uk_rows[h].view(np.uint8), f32) for h in range(n_heads)],
                    [PackedMatrix(w_uv[h].view(np.uint8), f32) for h in range(n_heads)])
        self._heads[layer] = mats
        return mats

    def absorbed(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """W_UK (H, N, L) and W_UV (H, V, L) of a layer as float32, decoded once and kept.

        Every token multiplies by all of them (per head, q_nope @ W_UK needs W_UK un-transposed,
        which a packed (out, in) matmul cannot do), so decoding them per step would redo the
        same work each token. They are small next to a layer's experts: H * (N + V) * L floats,
        16.8M = 64 MiB per layer for DeepSeek-V3 against ~11G expert weights; `absorbed_bytes`
        reports it for memory accounting.
        """
        cached = self._absorbed.get(layer)
        if cached is not None:
            return cached
        c, p = self.config, f"blk.{layer}."
        n_heads, nope, v, lat = c.n_heads, c.qk_nope_dim, c.v_head_dim, c.kv_lora_rank
        if p + "attn_k_b.weight" in self.w:
            # llama.cpp's current layout: k_b (H, L, N) — kv_b's key rows per head, transposed —
            # and v_b (H, V, L), both 3-D GGUF tensors, loaded as expert-like stacks.
            w_uk = _per_head(self.w[p + "attn_k_b.weight"], n_heads, lat, nope).transpose(0, 2, 1)
            w_uv = _per_head(self.w[p + "attn_v_b.weight"], n_heads, v, lat)
        else:
            # The older layout: attn_kv_b (H * (N + V), L), each head's N key rows then V rows.
            kv_b = self.w.matrix(p + "attn_kv_b.weight", (n_heads * (nope + v), lat))
            per_head = kv_b.dequantize().reshape(n_heads, nope + v, lat)
            w_uk, w_uv = per_head[:, :nope], per_head[:, nope:]
        # W_UK is kept as (H, L, N) rows, handed out as its (H, N, L) view: the fused decode
        # layer multiplies by its rows (models/deepseek2_fused.py), so one copy serves both.
        uk_rows = np.ascontiguousarray(np.asarray(w_uk, np.float32).transpose(0, 2, 1))
        cached = (uk_rows.transpose(0, 2, 1), np.ascontiguousarray(w_uv, dtype=np.float32))
        self._absorbed[layer] = cached
        return cached

    def absorbed_bytes(self) -> int:
        """Resident float32 bytes of `absorbed` per layer (beyond the packed weights)."""
        return self.config.absorbed_bytes_per_layer()

    def cache_spec(self, layer: int) -> CacheSpec:
        return self.config.cache_spec()

    def scratch_bytes(self, n_tokens: int, context: int) -> int:
        return self.config.scratch_bytes(n_tokens, context, self._attn_layers)


def _heads_of(t: Any, n_heads: int, rows: int) -> list[PackedMatrix]:
    """Each head's matrix of a per-head stack (H, rows, cols), or of one flattened to
    (H * rows, cols) by some converters."""
    if isinstance(t, PackedExperts):
        return [t.expert(h) for h in range(n_heads)]
    return [t.rows(h * rows, (h + 1) * rows) for h in range(n_heads)]


def _per_head(t: Any, n_heads: int, rows: int, cols: int) -> np.ndarray:
    """A per-head weight stack as float32 (H, rows, cols), from a 3-D stack or 2-D matrix."""
    if isinstance(t, PackedExperts):
        dense = t.dequantize()
    elif isinstance(t, PackedMatrix):
        dense = t.dequantize()  # some converters flattened the heads: (H * rows, cols)
    else:
        raise ModelFileError(f"per-head attention weight has unexpected type {type(t).__name__}")
    if dense.size != n_heads * rows * cols:
        raise ModelFileError(
            f"per-head attention weight has shape {dense.shape}, expected ({n_heads}, {rows}, "
            f"{cols})"
        )
    return dense.reshape(n_heads, rows, cols)


CONFIG = DeepseekConfig
MODEL = Deepseek2
