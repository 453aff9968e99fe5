"""A tiered box on this machine: a random DeepSeek-style MoE model whose experts dominate,
generated under a DRAM budget with the file on a throttled slow tier, against the planner's
tiered prediction.

    python -m bench.tiered [--budget 100M] [--slow-bandwidth 40M] [--tokens 16]

The slow tier is emulated: expert reads are paced to --slow-bandwidth bytes/s by sleeping
after each copy (we cannot mount PMem here). The planner gets this host's measured tiers:
DRAM bandwidth from a large copy, the slow tier's achieved read rate, the measured hit rate,
and a compute rate calibrated on an all-DRAM run of the same model (2 x active params per
token / its decode time); it predicts max(compute, memory) per token.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from cellswarm.engine.tiered import dram_bandwidth
from cellswarm.io.gguf_write import write_gguf
from cellswarm.models.deepseek2 import DeepseekConfig
from cellswarm.planner.api import predict_tiered_tokens_per_s

# Experts: 13 MoE layers x 64 experts x 3 x 256 x 128 f32 = 327 MB; everything else ~11 MB.
CONFIG = DeepseekConfig(
    n_layers=14, d_model=256, n_heads=4, vocab_size=512, context_length=512, rms_eps=1e-6,
    q_lora_rank=64, kv_lora_rank=32, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=32,
    ffn_dim=256, moe_ffn_dim=128, n_experts=64, n_experts_used=4, n_shared_experts=1,
    first_k_dense=1, n_groups=8, topk_groups=4, routed_scaling_factor=2.5,
    norm_topk_prob=True, gating="sigmoid", rope_theta=10000.0,
)  # fmt: skip


def build_model(path: Path, config: DeepseekConfig = CONFIG, seed: int = 0) -> Path:
    """Write a random-weight model of `config` (all f32) to `path`."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for name, shape in config.expected_tensors(range(config.n_layers)).items():
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape, np.float32)).astype(np.float32)
        else:
            fan_in = shape[-1]
            w = rng.standard_normal(shape, np.float32)
            w *= np.float32(fan_in**-0.5)
            tensors[name] = w
    c = config
    for i in range(c.n_layers):
        p = f"blk.{i}."
        tensors[p + "attn_kv_b.weight"] = rng.standard_normal(
            (c.n_heads * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank), np.float32
        ) * np.float32(c.kv_lora_rank**-0.5)
        if c.is_moe(i):
            tensors[p + "exp_probs_b.bias"] = rng.uniform(-0.1, 0.1, c.n_experts).astype(np.float32)
    write_gguf(path, c.to_gguf_metadata(), tensors)
    return path


def _generate(path: Path, args: list[str]) -> dict[str, Any]:
    """`cellswarm generate --json` in a fresh process (so RssAnon is its own)."""
    cmd = [sys.executable, "-m", "cellswarm", "generate", "3,17,101,5,64", "--ids", "--json"]
    cmd += ["--model", str(path)]
    out = subprocess.run(cmd + args, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", default="100M")
    ap.add_argument("--slow-bandwidth", action="append", help="bytes/s, repeatable")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--model", type=Path, help="reuse this file instead of building one")
    args = ap.parse_args(argv)
    bands = args.slow_bandwidth or ["20M", "60M", "200M"]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_model(Path(tmp) / "moe.gguf")
        size = path.stat().st_size
        common = ["--max-tokens", str(args.tokens)]
        ref = _generate(path, common)
        from cellswarm.planner import inventory

        inv = inventory.from_gguf(path)
        per_token = 1.0 / ref["stats"]["decode_tokens_per_s"]
        flops = 2 * inv.active_params / per_token
        dram_bw = dram_bandwidth()
        print(
            f"model {size / 1e6:.0f} MB, budget {args.budget}; all-DRAM decode "
            f"{ref['stats']['decode_tokens_per_s']:.2f} tok/s (calibrates compute: "
            f"{flops / 1e9:.2f} GFLOP/s effective); DRAM copy {dram_bw / 1e9:.1f} GB/s"
        )
        header = (
            f"{'slow B/s':>9} {'hit':>6} {'DRAM B/tok':>11} {'slow B/tok':>11} "
            f"{'peak anon':>10} {'peak file':>10} {'measured':>9} {'predicted':>9} {'err':>6}"
        )
        print(header)
        for bw in bands:
            run = _generate(path, [*common, "--dram-budget", args.budget, "--slow-bandwidth", bw])
            t = run["tiered"]
            assert run["token_ids"] == ref["token_ids"], "tiered output differs"
            measured = run["stats"]["decode_tokens_per_s"]
            predicted = predict_tiered_tokens_per_s(path, run["tiered"], dram_bw, flops)
            err = measured / predicted - 1
            print(
                f"{bw:>9} {t['decode_hit_rate']:6.1%} {t['dram_bytes_per_token'] / 1e6:9.2f}MB "
                f"{t['slow_bytes_per_token'] / 1e6:9.2f}MB {t['peak_rss_anon'] / 1e6:8.1f}MB "
                f"{t['peak_rss_file'] / 1e6:8.1f}MB {measured:7.2f}/s {predicted:7.2f}/s "
                f"{err:+6.1%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
