"""Prefill and decode speed of the engine, against this machine's memory-bandwidth bound.

    python bench/engine.py [--quick]

Decode of one token must stream every weight byte once, so tokens/s can never exceed
streaming-read bandwidth / weight bytes per token. Both are measured in this run and the
ratio printed; 100% would be a kernel that runs at the speed of memory.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cellswarm.engine.model import Model
from cellswarm.io.hf_dir import pack_tensors
from cellswarm.loader import load
from cellswarm.models.llama import Llama, LlamaConfig


def read_bandwidth_bytes_per_s(size_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Streaming-read bandwidth: a float32 matrix-vector product (BLAS, all threads)."""
    a = np.ones((size_bytes // 4 // 4096, 4096), dtype=np.float32)
    x = np.ones(4096, dtype=np.float32)
    a @ x  # fault the pages in
    best = min(_timed(lambda: a @ x) for _ in range(repeats))
    return a.nbytes / best


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_bytes_per_token(model: Model) -> int:
    """Weight bytes one decode step streams: all layer weights and the output head."""
    w = model.weights
    head = "output.weight" if "output.weight" in w else "token_embd.weight"
    return sum(int(t.nbytes) for n, t in w.items() if n.startswith("blk.")) + int(w[head].nbytes)


def measure(model: Model, prompt_len: int, decode_steps: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, prompt_len)
    cache = model.new_cache(prompt_len + decode_steps + 1)
    t_prefill = _timed(lambda: model.step(ids, cache))
    t0 = time.perf_counter()
    for _ in range(decode_steps):
        model.step(ids[:1], cache)
    t_decode = time.perf_counter() - t0
    return prompt_len / t_prefill, decode_steps / t_decode


def random_llama(quant: str, d_model: int, n_layers: int, ffn: int, vocab: int) -> Model:
    cfg = LlamaConfig(
        arch="llama", n_layers=n_layers, d_model=d_model, n_heads=d_model // 64,
        n_kv_heads=d_model // 256, head_dim=64, ffn_dim=ffn, vocab_size=vocab,
        context_length=4096, rms_eps=1e-5, rope_theta=500000.0, rope_dim=64, rope_layout="norm",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, d_model), "output.weight": (vocab, d_model)}
    shapes["output_norm.weight"] = (d_model,)
    kv = cfg.n_kv_heads * cfg.head_dim
    for i in range(n_layers):
        p = f"blk.{i}."
        shapes |= {p + "attn_norm.weight": (d_model,), p + "ffn_norm.weight": (d_model,)}
        shapes |= {
            p + "attn_q.weight": (d_model, d_model),
            p + "attn_output.weight": (d_model, d_model),
        }
        shapes |= {p + "attn_k.weight": (kv, d_model), p + "attn_v.weight": (kv, d_model)}
        shapes |= {p + "ffn_gate.weight": (ffn, d_model), p + "ffn_up.weight": (ffn, d_model)}
        shapes |= {p + "ffn_down.weight": (d_model, ffn)}
    store = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            store[name] = np.ones(shape, np.float32)
        else:  # quantize one matrix at a time so the float copy never exists whole
            store |= pack_tensors({name: rng.standard_normal(shape, np.float32) * 0.02}, quant)
    from cellswarm.io.weights import Selection, WeightStore

    weights = WeightStore(store)
    return Model(cfg, Llama(cfg, weights), weights, None, Selection())


def report(name: str, model: Model, bw: float, prompt_len: int, steps: int) -> None:
    prefill, decode = measure(model, prompt_len, steps)
    per_token = decode_bytes_per_token(model)
    bound = bw / per_token
    print(
        f"{name:<34} {per_token / 2**20:>9.1f} {prefill:>10.1f} {decode:>9.2f} "
        f"{bound:>9.1f} {100 * decode / bound:>7.1f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="demo model only")
    args = parser.parse_args()
    bw = read_bandwidth_bytes_per_s()
    print(f"streaming-read bandwidth (float32 GEMV, all threads): {bw / 1e9:.2f} GB/s")
    header = f"{'model':<34} {'MiB/token':>9} {'prefill/s':>10} {'decode/s':>9} {'bound/s':>9}"
    print(header + f" {'of bound':>8}")
    from cellswarm.demo import demo_model_path

    report("SmolLM2-135M Q4_1/Q8_0 (demo)", load(demo_model_path()), bw, 64, 16)
    if args.quick:
        return
    for quant in ("q8_0", "q4_0"):
        model = random_llama(quant, d_model=2048, n_layers=16, ffn=8192, vocab=32000)
        n_params = sum(np.prod(t.shape) for t in model.weights.values())
        report(f"random llama {n_params / 1e9:.2f}B {quant.upper()}", model, bw, 32, 4)


if __name__ == "__main__":
    main()
