"""Prefill and decode speed of the engine, against this machine's limits measured in the run.

    python -m bench.engine [--quick] [--threads N]

Decode of one token must stream every weight byte it uses once, so tokens/s can never exceed
streaming-read bandwidth / weight bytes per token: the "of bound" column is decode tokens/s
over that. For a mixture of experts the bytes are those a token really reads: attention,
router, the k selected experts, the shared expert, one embedding row and the head.
Prefill of a 512-token prompt is matrix-matrix work: its column is achieved FLOP/s
over this machine's float32 GEMM rate. "outside" is the share of a decode step spent outside
the fused kernels (Python, numpy glue, attention). Then a worker's cold start to its first
token (warm and empty kernel cache) and the resident memory the fast path adds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cellswarm import kernels
from cellswarm.engine.model import Model
from cellswarm.io.hf_dir import pack_tensors
from cellswarm.loader import load
from cellswarm.models.llama import Llama
from cellswarm.models.llama_config import LlamaConfig


def read_bandwidth_bytes_per_s(size_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Streaming-read bandwidth of 512 MB (far beyond the caches), all threads: the faster of
    a BLAS float32 matrix-vector product and a plain C summing loop."""
    a = np.ones((size_bytes // 4 // 4096, 4096), dtype=np.float32)
    x = np.ones(4096, dtype=np.float32)
    a @ x  # fault the pages in
    best = min(_timed(lambda: a @ x) for _ in range(repeats))
    if kernels.enabled():
        kernels.stream_read(a)
        best = min(best, *(_timed(lambda: kernels.stream_read(a)) for _ in range(repeats)))
    return a.nbytes / best


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_bytes_per_token(model: Model) -> int:
    """Weight bytes one decode step streams: every layer weight (of a routed expert stack, the
    k experts a token uses), one embedding row and the output head."""
    w, c = model.weights, model.config
    head = "output.weight" if "output.weight" in w else "token_embd.weight"
    total = int(w[head].nbytes) + int(w["token_embd.weight"].nbytes) // c.vocab_size
    for name, t in w.items():
        if not name.startswith("blk."):
            continue
        if name.endswith("_exps.weight"):  # (E, rows, row bytes): k of E are read
            total += int(t.nbytes) * c.n_experts_used // c.n_experts
        else:
            total += int(t.nbytes)
    return total


def gemm_flops_per_s(n: int = 2048) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    a @ a
    return 2 * n**3 / min(_timed(lambda: a @ a) for _ in range(3))


def measure(model: Model, prompt_len: int, decode_steps: int) -> tuple[float, float, float]:
    """-> (prefill tokens/s, decode tokens/s, fraction of decode outside the kernels).

    As llama-bench's pp512 / tg runs: prefill of a prompt_len prompt; decode of decode_steps
    tokens after a short (8-token) prompt, in its own sequence."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, prompt_len)
    t_prefill = _timed(lambda: model.step(ids, model.new_cache(prompt_len)))
    cache = model.new_cache(8 + decode_steps + 1)
    model.step(ids[:8], cache)
    model.step(ids[:1], cache)  # first decode step: lazily prepared kernel arguments
    inside = [0.0]
    names = ("matmul_args", "attend_keys", "llama_decode_layers", "ds_decode_layers",
             "ds_layer_call", "swiglu1", "ds_route")  # fmt: skip
    real = {name: getattr(kernels, name) for name in names}

    def timed(fn):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = fn(*args)
            inside[0] += time.perf_counter() - t
            return out

        return run

    for name, fn in real.items():
        setattr(kernels, name, timed(fn))
    try:
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            model.step(ids[:1], cache)
        t_decode = time.perf_counter() - t0
    finally:
        for name, fn in real.items():
            setattr(kernels, name, fn)
    return prompt_len / t_prefill, decode_steps / t_decode, 1 - inside[0] / t_decode


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


def model_file(name: str, make: Callable[[], Model]) -> Path:
    """A random model as a GGUF under ~/.cache/cellswarm/bench (written once, seeded): loaded
    from there, as users run a model, its weights are a mapped file and the fused layers
    repack them (kernels.repack), which a model built in memory never is."""
    path = Path.home() / ".cache" / "cellswarm" / "bench" / f"{name}.gguf"
    if not path.exists():
        from cellswarm.io.gguf_write import write_gguf

        model = make()
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        write_gguf(part, model.config.to_gguf_metadata(), dict(model.weights.items()))
        part.rename(path)
    return path


def in_flight(model: Model, n: int, steps: int = 16) -> float:
    """Decode tokens/s of n sequences stepped together (`Model.step_many`)."""
    caches = [model.new_cache(8 + steps + 2) for _ in range(n)]
    for i, c in enumerate(caches):
        model.step(np.arange(8) + i, c)
    ids = list(range(n))
    model.step_many(ids, caches)
    t0 = time.perf_counter()
    for _ in range(steps):
        model.step_many(ids, caches)
    return n * steps / (time.perf_counter() - t0)


def random_deepseek(quant: str) -> Model:
    """A DeepSeek-V3-shaped MoE of ~0.8B: 8 layers (the first dense), 64 routed experts top-6
    in 8 groups (best 4) plus one shared, sigmoid routing with a bias, MLA with q LoRA and
    kv_lora 256; W_UK/W_UV as llama.cpp's converter writes them (attn_k_b, attn_v_b)."""
    from cellswarm.io.weights import Selection, WeightStore
    from cellswarm.models.deepseek2 import Deepseek2, DeepseekConfig

    c = DeepseekConfig(
        n_layers=8, d_model=1024, n_heads=16, vocab_size=32000, context_length=4096,
        rms_eps=1e-6, q_lora_rank=384, kv_lora_rank=256, qk_nope_dim=64, qk_rope_dim=32,
        v_head_dim=64, ffn_dim=2816, moe_ffn_dim=512, n_experts=64, n_experts_used=6,
        n_shared_experts=1, first_k_dense=1, n_groups=8, topk_groups=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, gating="sigmoid", rope_theta=10000.0,
    )  # fmt: skip
    shapes = dict(c.expected_tensors(range(c.n_layers)))
    for i in range(c.n_layers):
        shapes[f"blk.{i}.attn_k_b.weight"] = (c.n_heads, c.kv_lora_rank, c.qk_nope_dim)
        shapes[f"blk.{i}.attn_v_b.weight"] = (c.n_heads, c.v_head_dim, c.kv_lora_rank)
        if c.is_moe(i):
            shapes[f"blk.{i}.exp_probs_b.bias"] = (c.n_experts,)
    rng = np.random.default_rng(0)
    store = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            store[name] = np.ones(shape, np.float32)
            continue
        w = rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(shape[-1]))
        # llama.cpp keeps the router in F32; everything else in the format under test
        store |= pack_tensors({name: w}, "f32" if "ffn_gate_inp" in name else quant)
    weights = WeightStore(store)
    return Model(c, Deepseek2(c, weights), weights, None, Selection())


def report(name: str, model: Model, bw: float, gemm: float, prompt_len: int, steps: int) -> None:
    prefill, decode, outside = measure(model, prompt_len, steps)
    per_token = decode_bytes_per_token(model)
    bound = bw / per_token
    c = model.config
    used = getattr(c, "n_experts_used", 0) / max(1, getattr(c, "n_experts", 0))
    flops = 2 * sum(
        int(np.prod(t.shape)) * (used if n.endswith("_exps.weight") else 1)
        for n, t in model.weights.items() if n != "token_embd.weight"
    )  # fmt: skip
    print(
        f"{name:<30} {per_token / 2**20:>8.1f} {decode:>8.2f} {bound:>8.1f} {decode / bound:>6.2f} "
        f"{100 * outside:>6.1f}% {prefill:>8.1f} {prefill * flops / gemm:>6.2f}"
    )


COLD_START = """
import time; t0 = time.perf_counter()
import cellswarm
m = cellswarm.load({path!r})
m.generate("Hello", cellswarm.engine.model.GenerateOptions(max_tokens=1))
print(time.perf_counter() - t0)
"""

IDLE_RSS = """
import re, numpy as np
import cellswarm.engine.model, cellswarm.io.gguf_file, cellswarm.models.llama
from cellswarm import kernels
{extra}
a = np.ones((64, 64), np.float32); a @ a
print(int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024)
"""


USED_RSS = """
import re, numpy as np
import cellswarm
m = cellswarm.load({path!r})
ids = np.arange(256, dtype=np.int64) + 5
cache = m.new_cache(300)
m.step(ids, cache)  # a prefill, then decode: every layer's matrices read, and repacked or not
for i in range(16):
    m.step(ids[i : i + 1], cache)
print(int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024)
"""


def _run(code: str, env: dict[str, str] | None = None) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def startup_and_memory() -> None:
    from cellswarm.demo import demo_model_path

    code = COLD_START.format(path=str(demo_model_path()))
    warm = _run(code)
    with tempfile.TemporaryDirectory() as empty:
        cold = _run(code, {"CELLSWARM_CACHE": empty})
    print(f"cold start to first token (demo model): {warm:.2f} s with cached kernels, "
          f"{cold:.2f} s with an empty kernel cache (compiles once)")  # fmt: skip
    base = _run(IDLE_RSS.format(extra="kernels.use('numpy')"))
    fast = _run(IDLE_RSS.format(extra="kernels.enabled(); kernels.set_threads(None)"))
    print(f"idle worker RSS: {base / 2**20:.1f} MiB numpy path, {fast / 2**20:.1f} MiB with the "
          f"fast kernels loaded (+{(fast - base) / 2**20:.1f} MiB)")  # fmt: skip



def repacked_memory(path: Path) -> None:
    """Resident memory after a prefill and 16 decode steps, the file's layout against weights
    repacked at load (which let go of the file's pages: held once, not twice)."""
    code = USED_RSS.format(path=str(path))
    file = _run(code, {"CELLSWARM_REPACK": "0"})
    repacked = _run(code, {"CELLSWARM_REPACK": "1"})
    print(f"resident after prefill + decode ({path.name}, {path.stat().st_size / 2**20:.0f} MiB "
          f"file): {file / 2**20:.1f} MiB as in the file, {repacked / 2**20:.1f} MiB repacked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="demo model only")
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    args = parser.parse_args()
    threads = kernels.set_threads(args.threads)
    bw, gemm = read_bandwidth_bytes_per_s(), gemm_flops_per_s()
    print(
        f"kernels: {kernels.backend()}, {threads} threads; streaming-read bandwidth "
        f"(512 MB, best of GEMV and a C read loop): {bw / 1e9:.2f} GB/s; float32 GEMM: "
        f"{gemm / 1e9:.1f} GFLOP/s"
    )
    print(f"{'model':<30} {'MiB/tok':>8} {'decode/s':>8} {'bound/s':>8} {'ratio':>6} "
          f"{'outside':>7} {'prefill/s':>8} {'/GEMM':>6}")  # fmt: skip
    from cellswarm.demo import demo_model_path

    report("SmolLM2-135M (demo GGUF)", load(demo_model_path()), bw, gemm, 512, 64)
    if not args.quick:
        for quant in ("q8_0", "q4_0"):
            model = load(model_file(f"random-llama-1.1b-{quant}", lambda q=quant: random_llama(
                q, d_model=2048, n_layers=16, ffn=8192, vocab=32000)))  # fmt: skip
            n_params = sum(np.prod(t.shape) for t in model.weights.values())
            report(f"random llama {n_params / 1e9:.2f}B {quant.upper()}", model, bw, gemm, 512, 16)
        for quant in ("q8_0", "q4_0"):
            model = load(model_file(f"random-deepseek-0.8b-{quant}",
                                    lambda q=quant: random_deepseek(q)))  # fmt: skip
            n_params = sum(np.prod(t.shape) for t in model.weights.values())
            name = f"DeepSeek-V3-shaped {n_params / 1e9:.2f}B {quant.upper()}"
            report(name, model, bw, gemm, 512, 32)
            rate = in_flight(model, 4)
            print(f"{'':<30} {rate:.2f} tokens/s with 4 sequences in flight "
                  "(Model.forward_many: one pass over weights and chosen experts)")  # fmt: skip
    startup_and_memory()
    if not args.quick:
        repacked_memory(model_file("random-llama-1.1b-q4_0", lambda: random_llama(
            "q4_0", d_model=2048, n_layers=16, ffn=8192, vocab=32000)))  # fmt: skip


if __name__ == "__main__":
    main()
