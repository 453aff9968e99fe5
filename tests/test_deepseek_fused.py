"""The fused one-token DeepSeek layer (kernels/deepseek.c) against the layer-by-layer path.

Both paths quantize a matrix's input to int8 blocks (its few largest values kept in float)
where the weight is quantized, so with W_UK/W_UV in float32 they differ only in the order of
float additions (~1e-6). With W_UK/W_UV packed, the fused layer also quantizes their inputs
(as llama.cpp does): int8 noise, bounded looser. The same-bits tests (test_same_bits.py)
cover experts computed elsewhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cellswarm
from cellswarm import kernels
from cellswarm.engine.model import Model
from cellswarm.io.gguf_write import write_gguf
from cellswarm.models.deepseek2 import DeepseekConfig
from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="no C compiler: numpy path only")

# V3-shaped: sigmoid gating with a correction bias over groups, q LoRA, a shared expert
V3 = DeepseekConfig(
    n_layers=3, d_model=128, n_heads=4, vocab_size=512, context_length=256, rms_eps=1e-6,
    q_lora_rank=64, kv_lora_rank=64, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=32, ffn_dim=256,
    moe_ffn_dim=64, n_experts=16, n_experts_used=4, n_shared_experts=1, first_k_dense=1,
    n_groups=4, topk_groups=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    gating="sigmoid", rope_theta=10000.0,
)  # fmt: skip
# V2-Lite-shaped: softmax over one group, no q LoRA, two shared experts
V2 = dataclasses.replace(
    V3, gating="softmax", q_lora_rank=0, n_groups=1, topk_groups=1, norm_topk_prob=False,
    routed_scaling_factor=1.0, n_shared_experts=2,
)  # fmt: skip
DENSE = dataclasses.replace(V3, n_experts=0, n_experts_used=0, n_shared_experts=0)
TOKENS = [5, 17, 99, 3, 250, 7, 1, 2, 400, 9]


def write(
    path: Path, c: DeepseekConfig, quant: str, kv_layout: str, kv_quant: bool,
    kv_format: str | None = None,
) -> Path:  # fmt: skip
    """Random weights (1/sqrt(fan-in)), `quant` for matrices, a float32 router, and the key/
    value up-projection as attn_k_b/attn_v_b ("split") or attn_kv_b, packed (in `kv_format`,
    default `quant`) or float32."""
    rng, fmt = np.random.default_rng(0), format_by_name(quant)
    t: dict[str, np.ndarray | PackedMatrix | PackedExperts] = {}

    def packed(w: np.ndarray, as_: str | None = None) -> PackedMatrix | PackedExperts:
        f = format_by_name(as_) if as_ else fmt
        return (PackedExperts if w.ndim == 3 else PackedMatrix).from_float(w, f)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    for name, shape in c.expected_tensors(range(c.n_layers)).items():
        if len(shape) == 1:
            t[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w = rand(*shape)
            t[name] = w if "ffn_gate_inp" in name else packed(w)
    for layer in range(c.n_layers):
        p = f"blk.{layer}."
        if c.is_moe(layer):
            t[p + "exp_probs_b.bias"] = (0.1 * rng.standard_normal(c.n_experts)).astype(np.float32)
        h, lat, n, v = c.n_heads, c.kv_lora_rank, c.qk_nope_dim, c.v_head_dim
        if kv_layout == "split":
            k_b, v_b = rand(h, lat, n), rand(h, v, lat)
            t[p + "attn_k_b.weight"] = packed(k_b, kv_format) if kv_quant else k_b
            t[p + "attn_v_b.weight"] = packed(v_b, kv_format) if kv_quant else v_b
        else:
            kv_b = rand(h * (n + v), lat)
            t[p + "attn_kv_b.weight"] = packed(kv_b) if kv_quant else kv_b
    write_gguf(path, c.to_gguf_metadata(), t)
    return path


def decode(model: Model, fused: bool) -> np.ndarray:
    """Hidden states of TOKENS[3:] decoded one by one after a 3-token prefill: (n, d)."""
    cache = model.new_cache(64)
    model.step(np.array(TOKENS[:3]), cache)
    arch: object = model.arch
    if not fused:  # the layer-by-layer path: what Model runs when there is no fused one
        arch.decode_fused = lambda *a: None  # type: ignore[attr-defined]
    try:
        out = []
        for t in TOKENS[3:]:
            out.append(model.forward(model.arch.embed(np.array([t])), cache)[0])
            cache.length += 1
        return np.array(out)
    finally:
        if not fused:
            del arch.decode_fused  # type: ignore[attr-defined]


def layer_steps(model: Model) -> np.ndarray:
    """Each layer of each decode step of TOKENS[3:] (after a 3-token prefill), fused and layer
    by layer from the same input and the same cache: max |fused - ref| / max |ref| of each."""
    arch: Any = model.arch
    cache = model.new_cache(64)
    model.step(np.array(TOKENS[:3]), cache)
    errors = []
    for t in TOKENS[3:]:
        x, pos = arch.embed(np.array([t])), np.array([cache.length])
        for layer in model.layers:
            kept = {n: cache.layer(layer).storage(n).copy() for n in arch.cache_spec(layer)}
            fused = arch.decode_fused(x, pos, cache, range(layer, layer + 1))
            for n, a in kept.items():  # the reference writes this step's entries itself
                cache.layer(layer).storage(n)[:] = a
            ref = arch.block(layer, x, pos, cache.layer(layer))
            errors.append(np.abs(fused - ref).max() / np.abs(ref).max())
            x = ref
        cache.length += 1
    return np.array(errors)


@pytest.mark.parametrize(
    ("config", "quant", "kv_layout"),
    [(V3, "Q8_0", "split"), (V3, "Q4_0", "kv_b"), (V2, "Q8_0", "kv_b"), (V2, "Q4_1", "split"),
     (DENSE, "Q8_0", "split")],
    ids=["v3-q8_0-split", "v3-q4_0-kv_b", "v2-q8_0-kv_b", "v2-q4_1-split", "dense"],
)  # fmt: skip
def test_fused_layer_matches_layer_by_layer(
    tmp_path: Path, config: DeepseekConfig, quant: str, kv_layout: str
) -> None:
    model = cellswarm.load(write(tmp_path / "m.gguf", config, quant, kv_layout, False))
    assert model.arch.decode_fused(  # type: ignore[attr-defined]
        np.zeros((1, config.d_model), np.float32), np.array([0]), model.new_cache(4),
        model.layers,
    ) is not None  # fmt: skip
    # Float order alone (~1e-6), unless it moves a value across an int8 rounding boundary: that
    # value then lands one step apart (measured on ~1% of layer-steps, up to 5e-3 of a layer's
    # output, then compounding over the layers after it; so each layer-step starts from the
    # reference's input and cache). A wrong fused layer is off on every step.
    errors = layer_steps(model)
    assert (errors <= 1e-5).mean() >= 0.9
    assert errors.max() <= 1e-2


def test_packed_kv_up_projection_stays_within_int8_noise(tmp_path: Path) -> None:
    """attn_k_b / attn_v_b packed: their inputs are quantized too (no routing here to flip)."""
    model = cellswarm.load(write(tmp_path / "m.gguf", DENSE, "Q8_0", "split", True))
    fused, ref = decode(model, True), decode(model, False)
    assert np.abs(fused - ref).max() <= 0.03 * np.abs(ref).max()


def test_a_q5_0_kv_up_projection_runs_fused_as_the_same_values_in_q8_0(tmp_path: Path) -> None:
    """llama-quantize's Q5_0 fallback for attn_k_b / attn_v_b (64-column rows in a K-quant
    file) runs in the fused layer as Q8_0 (packed.exact_q8_0: the same values), not as a
    float32 copy of 5.8x the bytes: the same hidden states as a file written in Q8_0 with
    those values, and the fused layer's k_b / v_b are Q8_0 matrices."""
    q5 = cellswarm.load(write(tmp_path / "q5.gguf", DENSE, "Q8_0", "split", True, "Q5_0"))
    fused, ref = decode(q5, True), decode(q5, False)
    assert np.abs(fused - ref).max() <= 0.03 * np.abs(ref).max()
    layer: Any = q5.arch._fused.layer(0)  # type: ignore[attr-defined]
    q8 = kernels.FUSED_TYPES["Q8_0"]
    for m in (layer.struct.k_b, layer.struct.v_b):
        assert m.kind == 0 and m.fmt in (q8, kernels.repacked_code("Q8_0", 64) or q8)
    assert q5.weights["blk.0.attn_k_b.weight"].fmt.name == "Q5_0"  # the model's own: as read
    with kernels.repacking(False):  # the file's layout: the same bits
        natural = cellswarm.load(tmp_path / "q5.gguf")
        assert np.array_equal(decode(natural, True).view(np.uint32), fused.view(np.uint32))


def test_float32_weights_run_layer_by_layer(tmp_path: Path) -> None:
    model = cellswarm.load(write(tmp_path / "m.gguf", V3, "F32", "split", False))
    x = np.zeros((1, V3.d_model), np.float32)
    got = model.arch.decode_fused(x, np.array([0]), model.new_cache(4), model.layers)  # type: ignore[attr-defined]
    assert got is None


@pytest.mark.parametrize(("config", "kv_layout"), [(V3, "split"), (V2, "kv_b")], ids=["v3", "v2"])
def test_sequences_in_flight_decode_together_as_alone(
    tmp_path: Path, config: DeepseekConfig, kv_layout: str
) -> None:
    """Four sequences at different positions decoded as one batch (each weight row and each
    chosen expert read once for all) give the same bits each gives alone."""
    model = cellswarm.load(write(tmp_path / "m.gguf", config, "Q8_0", kv_layout, False))
    prompts = [[5, 17, 99], [3, 250, 7, 1], [2, 400], [9, 8, 7, 6, 5]]
    alone, together = [], []
    for p in prompts:
        cache = model.new_cache(32)
        model.step(np.array(p), cache)
        alone.append(model.forward(model.arch.embed(np.array([p[-1]])), cache)[0])
    caches = [model.new_cache(32) for _ in prompts]
    for p, cache in zip(prompts, caches, strict=True):
        model.step(np.array(p), cache)
    x = model.arch.embed(np.array([p[-1] for p in prompts]))
    assert model.arch.decode_fused_many(  # type: ignore[attr-defined]
        x, np.array([c.length for c in caches]), caches, model.layers
    ) is not None  # fmt: skip
    together = list(model.forward_many(x, caches))
    assert np.array_equal(np.array(together), np.array(alone))


def test_prefill_in_query_blocks_matches_one_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt's causal attention runs in blocks of queries against only the keys
    they see (ops.query_blocks): the same as one block with the upper triangle masked."""
    from cellswarm.models import ops

    model = cellswarm.load(write(tmp_path / "m.gguf", V3, "Q8_0", "split", False))
    ids = np.random.default_rng(1).integers(0, V3.vocab_size, 300)
    # float math throughout: an expert's few tokens would go through int8 kernels, where the
    # blocks' ~1e-6 differences can move a value across a rounding boundary
    with kernels.using("numpy"):
        blocked = model.logits(ids)
        monkeypatch.setattr(ops, "QUERY_BLOCK", 10**6)
        whole = model.logits(ids)
    assert np.abs(blocked - whole).max() <= 1e-4 * np.abs(whole).max()
    q = np.random.default_rng(2).standard_normal((300, 8, 16)).astype(np.float32)
    k, v = (np.random.default_rng(3).standard_normal((2, 300, 16)).astype(np.float32) for _ in "kv")
    monkeypatch.setattr(ops, "QUERY_BLOCK", 64)
    small = ops.attention(q, k, v, 0.25)
    monkeypatch.setattr(ops, "QUERY_BLOCK", 10**6)
    assert np.allclose(small, ops.attention(q, k, v, 0.25), atol=1e-5)
