"""deepseek2 (DeepSeek-V3 / Kimi-K2 MLA + MoE) against transformers' DeepseekV3ForCausalLM on a
tiny random model: absorbed attention over the latent-only KV cache, YaRN, grouped routing
with the correction bias, both llama.cpp kv_b layouts, with and without a q LoRA."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cellswarm
from cellswarm.errors import MissingTensorError
from cellswarm.io import hf_dir
from cellswarm.io.gguf_write import write_gguf
from cellswarm.io.weights import WeightStore
from cellswarm.models import deepseek2
from cellswarm.models.deepseek2 import (
    Deepseek2,
    DeepseekConfig,
    Routing,
    apply_experts,
    expert_outputs,
    hf_tensors_to_gguf,
    route,
    sum_experts,
)
from cellswarm.models.kv_cache import KVCache
from cellswarm.models.rope import Yarn
from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name
from tests.conftest import max_rel_diff, prefill_then_decode
from tests.hf_reference import build_hf_model, hf_logits, save_hf

TOLERANCE = 1e-4  # of the largest absolute logit, f32 weights on both sides
PREFILL, DECODE = 32, 8
F32 = format_by_name("f32")

DEEPSEEK_V3: dict[str, Any] = dict(
    model_type="deepseek_v3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


def _build(q_lora: bool) -> Any:
    kwargs = dict(DEEPSEEK_V3, q_lora_rank=DEEPSEEK_V3["q_lora_rank"] if q_lora else None)
    hf = build_hf_model(kwargs, seed=3)
    torch.manual_seed(4)
    with torch.no_grad():  # zero by default; the bias must matter for choosing experts
        for layer in hf.model.layers[hf.config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return hf


@pytest.fixture(scope="module", params=[True, False], ids=["q_lora", "plain_q"])
def reference(request: pytest.FixtureRequest) -> tuple[Any, np.ndarray, np.ndarray]:
    hf = _build(request.param)
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, PREFILL + DECODE)
    return hf, ids, hf_logits(hf, ids)


def _store(tensors: dict[str, np.ndarray]) -> WeightStore:
    """Float arrays under GGUF names -> the packed store a GGUF file would give (F32)."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if t.ndim == 1:
            out[name] = t
        elif t.ndim == 2:
            out[name] = PackedMatrix.from_float(t, F32)
        else:
            out[name] = PackedExperts.from_float(t, F32)
    return WeightStore(out)


def _state_dict(hf: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}


def _run(model: Deepseek2, ids: np.ndarray) -> np.ndarray:
    """Prefill, then one token per step, through a KV cache of the model's own spec."""
    c = model.config
    cache = KVCache({i: model.cache_spec(i) for i in range(c.n_layers)}, len(ids), None, "f32")
    out = []
    for lo, hi in [(0, PREFILL)] + [(i, i + 1) for i in range(PREFILL, len(ids))]:
        x, positions = model.embed(ids[lo:hi]), np.arange(lo, hi)
        for layer in range(c.n_layers):
            x = model.block(layer, x, positions, cache.layer(layer))
        out.append(model.head(x))
    return np.concatenate(out)


@pytest.mark.parametrize("split_kv_b", [False, True], ids=["attn_kv_b", "attn_k_b_v_b"])
def test_matches_transformers(reference: Any, split_kv_b: bool) -> None:
    hf, ids, ref = reference
    config = DeepseekConfig.from_hf(hf.config.to_dict())
    tensors = hf_tensors_to_gguf(config, _state_dict(hf), split_kv_b=split_kv_b)
    assert ("blk.1.attn_k_b.weight" in tensors) == split_kv_b
    assert ("blk.1.attn_kv_b.weight" in tensors) != split_kv_b
    assert tensors["blk.1.ffn_gate_exps.weight"].shape == (8, 32, 64)
    model = Deepseek2(config, _store(tensors))
    ours = _run(model, ids)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert max_rel_diff(ours, ref) <= TOLERANCE


def test_cache_holds_only_latent_and_rope_key(reference: Any) -> None:
    hf, _, _ = reference
    config = DeepseekConfig.from_hf(hf.config.to_dict())
    model = Deepseek2(config, _store(hf_tensors_to_gguf(config, _state_dict(hf))))
    assert model.cache_spec(0) == {"latent": (16,), "k_rope": (8,)}
    cache = KVCache({i: model.cache_spec(i) for i in range(3)}, 40, None)
    assert cache.nbytes == 40 * 3 * (16 + 8) * 2  # f16, the default


@pytest.mark.parametrize("split_kv_b", [False, True], ids=["attn_kv_b", "attn_k_b_v_b"])
def test_expected_tensors_match_conversion(reference: Any, split_kv_b: bool) -> None:
    hf, _, _ = reference
    config = DeepseekConfig.from_hf(hf.config.to_dict())
    tensors = hf_tensors_to_gguf(config, _state_dict(hf), split_kv_b=split_kv_b)
    expected = config.expected_tensors(range(config.n_layers))
    assert {n: tensors[n].shape for n in expected} == expected
    unlisted = {n.split(".", 2)[-1] for n in set(tensors) - set(expected)}
    assert unlisted == (
        {"attn_k_b.weight", "attn_v_b.weight"} if split_kv_b else {"attn_kv_b.weight"}
    ) | {"exp_probs_b.bias"}
    up_projections = ("attn_kv_b.weight", "attn_k_b.weight", "attn_v_b.weight")
    without = {n: t for n, t in tensors.items() if not n.endswith(up_projections)}
    with pytest.raises(MissingTensorError, match="attn_kv_b"):
        Deepseek2(config, _store(without))


def test_saved_folder_and_gguf_copy(tmp_path: Path) -> None:
    """save_pretrained writes experts one by one (the model holds them fused); load that
    folder, and a GGUF written from it with llama.cpp's split k_b/v_b, through the loader."""
    hf = _build(q_lora=True)
    ids = np.random.default_rng(2).integers(0, hf.config.vocab_size, PREFILL + DECODE)
    ref = hf_logits(hf, ids)
    folder = save_hf(hf, tmp_path / "hf")
    saved = hf_dir.read_safetensors(folder)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in saved
    ours = prefill_then_decode(cellswarm.load(folder, cache_type="f32"), ids, PREFILL)
    assert max_rel_diff(ours, ref) <= TOLERANCE  # the math (an f16 cache adds ~1e-3)

    hf_cfg = json.loads((folder / "config.json").read_text())
    config = DeepseekConfig.from_hf(hf_cfg)
    path = tmp_path / "model.gguf"
    write_gguf(path, config.to_gguf_metadata(), hf_tensors_to_gguf(config, saved, split_kv_b=True))
    model = cellswarm.load(path, cache_type="f32")
    assert model.config.rms_eps == pytest.approx(config.rms_eps)  # stored as float32
    assert replace(model.config, rms_eps=config.rms_eps) == config
    assert max_rel_diff(prefill_then_decode(model, ids, PREFILL), ref) <= TOLERANCE


def test_config_round_trips() -> None:
    hf = build_hf_model(DEEPSEEK_V3)
    config = DeepseekConfig.from_hf(hf.config.to_dict())
    assert config.yarn == Yarn(4.0, 64, 32.0, 1.0, mscale=1.0, mscale_all_dim=1.0)
    assert (config.gating, config.n_groups, config.topk_groups) == ("sigmoid", 4, 2)
    assert DeepseekConfig.from_gguf(config.to_gguf_metadata(), 128) == config
    plain = DeepseekConfig.from_hf(dict(hf.config.to_dict(), q_lora_rank=None))
    assert plain.q_lora_rank == 0
    assert DeepseekConfig.from_gguf(plain.to_gguf_metadata(), 128) == plain
    dense = DeepseekConfig.from_hf(dict(hf.config.to_dict(), n_routed_experts=None))
    assert not any(dense.is_moe(i) for i in range(3))
    assert DeepseekConfig.from_gguf(dense.to_gguf_metadata(), 128) == dense
    # transformers 4.x / Hub configs: rope_theta and rope_scaling ("type") at the top level
    legacy = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 10000.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    legacy["rope_scaling"] = dict(DEEPSEEK_V3["rope_parameters"], type="yarn")
    del legacy["rope_scaling"]["rope_type"], legacy["rope_scaling"]["rope_theta"]
    assert DeepseekConfig.from_hf(legacy) == config
    # DeepSeek-V3 itself: 61 layers of (512 + 64) f32 cached per token
    v3 = dict(legacy, num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)
    model = Deepseek2(DeepseekConfig.from_hf(v3), WeightStore({}))
    assert sum(4 * sum(math.prod(s) for s in model.cache_spec(i).values()) for i in range(61)) == (
        61 * 576 * 4
    )


@pytest.mark.parametrize(
    "params",
    [
        dict(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0),
        dict(
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=0.707,
            mscale_all_dim=0.707,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
        dict(
            factor=32.0,
            original_max_position_embeddings=4096,
            mscale_all_dim=1.0,
            beta_fast=1.0,
            beta_slow=1.0,
        ),
        dict(
            factor=8.0, original_max_position_embeddings=128, attention_factor=0.9, truncate=False
        ),
    ],
)
def test_yarn_matches_transformers(params: dict[str, Any]) -> None:
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(params, rope_type="yarn", rope_theta=50000.0)
    hf_cfg = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    yarn = DeepseekConfig.from_hf(hf_cfg.to_dict()).yarn
    assert yarn is not None
    np.testing.assert_allclose(yarn.inv_freq(64, 50000.0), inv_freq.numpy(), rtol=1e-6)
    assert yarn.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def _logit(p: list[float]) -> np.ndarray:
    q = np.asarray(p, dtype=np.float64)
    return np.log(q / (1 - q)).astype(np.float32)[None, :]


def _config(**kw: Any) -> DeepseekConfig:
    hf = dict(DEEPSEEK_V3, n_routed_experts=8, num_experts_per_tok=2, **kw)
    return DeepseekConfig.from_hf(hf)


def test_route_groups_by_biased_top_two_and_weighs_unbiased() -> None:
    # 4 groups of 2. Biased choice scores: [.9 .1 | .6 .6 | .7 .8 | .5 .55]; group sums
    # 1.0, 1.2, 1.5, 1.05 -> groups 2 and 1 are kept, so expert 0 (the single best) is out;
    # experts 5 (.8) and 4 (.7) win. Weights come from the unbiased scores .3 and .2:
    # normalized .6 and .4, times 2.5.
    scores = [0.9, 0.1, 0.6, 0.6, 0.2, 0.3, 0.5, 0.55]
    bias = np.array([0, 0, 0, 0, 0.5, 0.5, 0, 0], dtype=np.float32)
    r = route(_logit(scores), _config(), bias)
    assert r.expert_ids.tolist() == [[5, 4]]
    np.testing.assert_allclose(r.weights, [[1.5, 1.0]], rtol=1e-5)


def test_route_group_score_is_sum_of_best_two() -> None:
    # 2 groups of 4, keep 1. Group 0 [.9 .1 .1 .1] wins on max (.9) and on sum (1.2);
    # group 1 [.55 .5 .05 .05] wins on the sum of its best two (1.05 > 1.0), which is the rule.
    scores = [0.9, 0.1, 0.1, 0.1, 0.55, 0.5, 0.05, 0.05]
    config = _config(n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    r = route(_logit(scores), config)
    assert r.expert_ids.tolist() == [[4, 5]]
    np.testing.assert_allclose(r.weights, [[0.55, 0.5]], rtol=1e-5)


def test_route_softmax_greedy() -> None:
    config = _config(
        model_type="deepseek_v2",
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )
    assert (config.gating, config.n_groups) == ("softmax", 1)
    logits = np.log(np.array([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=np.float32))
    r = route(logits, config)
    assert r.expert_ids.tolist() == [[7, 6]]
    np.testing.assert_allclose(r.weights, [[8 / 36, 7 / 36]], rtol=1e-5)


def test_experts_split_across_holders_add_up() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    gate, up, down = (
        PackedExperts.from_float(rng.standard_normal(s).astype(np.float32), F32)
        for s in [(4, 3, 6), (4, 3, 6), (4, 6, 3)]
    )
    routing = Routing(
        rng.permuted(np.tile(np.arange(4), (5, 1)), axis=1)[:, :2],
        rng.random((5, 2)).astype(np.float32),
    )
    full = apply_experts(x, routing, gate, up, down)
    halves = sum(
        apply_experts(x, routing, gate.select(ids), up.select(ids), down.select(ids))
        for ids in [(0, 2), (1, 3)]
    )
    np.testing.assert_allclose(halves, full, rtol=1e-6, atol=1e-6)
    # kept apart per expert and summed by the owner: one process's additions, bit for bit
    outputs = {}
    for ids in [(1, 3), (0, 2)]:
        outputs |= expert_outputs(x, routing, gate.select(ids), up.select(ids), down.select(ids))
    assert np.array_equal(sum_experts(x.shape, routing, outputs), full)
    ref = np.zeros_like(x)
    for t in range(5):
        for e, w in zip(routing.expert_ids[t], routing.weights[t], strict=True):
            g = gate.expert(int(e)).dequantize() @ x[t]
            h = (g / (1 + np.exp(-g))) * (up.expert(int(e)).dequantize() @ x[t])
            ref[t] += w * (down.expert(int(e)).dequantize() @ h)
    np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-5)


def test_registry_points_here() -> None:
    from cellswarm.models import entry_for_gguf, entry_for_hf, module_of

    assert module_of(entry_for_gguf("deepseek2")) is deepseek2
    assert module_of(entry_for_hf("kimi_k2")) is deepseek2
    assert deepseek2.CONFIG is DeepseekConfig and deepseek2.MODEL is Deepseek2
