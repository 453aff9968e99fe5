"""The seed's question at scale (issue 57): a model many times a node, over many cold hosts.

    python -m bench.scale --make          # the model, into the cache folder (once)
    python -m bench.scale --reference     # one process's tokens and speed on it

What runs today (docs/scale.md says what is measured and what is not yet):

- **The model**: a random DeepSeek-V2-Lite-shaped MoE (27 layers, d_model 2048, MLA with a
  512-wide latent, 64 routed experts of 1408 top-6 and 2 shared, a 102,400-word vocabulary):
  15.7 B parameters, ~8.6 GiB in a Q4_K_M-like mix as llama-quantize lays it out (Q4_K,
  every other layer's expert down-projections and the output Q6_K, Q5_0/Q8_0 where a row is
  not a multiple of 256, norms and the router float). Written streamed, tensor by tensor
  (gguf-py's writer holds nothing but the header), from a pool of rows quantized from
  N(0, 0.02^2) floats by bench.peers' packers and drawn per tensor in a seeded order: real
  blocks with a model's scales, so activations stay finite through every layer, at disk speed
  rather than a quantizer's.
- **The reference**: one process on this machine (it fits in its RAM): greedy tokens for
  PROMPTS and its decode tokens/s, what the swarm's first request must equal.

Not built yet: the 48-host lab run, the plan and simulator beside it, the chaos batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from bench.peers import K_FALLBACK, pack, peers_dir, tensor_shapes, tokenizer_metadata

MAKER_VERSION = 1
POOL_ROWS = 1024  # quantized rows each (format, width) draws from
PROMPTS = [[1, 5, 9, 14, 3], [7, 7, 2], [100, 3, 64, 8, 8, 1, 90]]
TOKENS = 8


def scale_config() -> Any:
    from cellswarm.models.deepseek2 import DeepseekConfig

    return DeepseekConfig(
        n_layers=27, d_model=2048, n_heads=16, vocab_size=102400, context_length=4096,
        rms_eps=1e-6, q_lora_rank=0, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
        v_head_dim=128, ffn_dim=10944, moe_ffn_dim=1408, n_experts=64, n_experts_used=6,
        n_shared_experts=2, first_k_dense=1, n_groups=1, topk_groups=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, gating="softmax", rope_theta=10000.0,
    )  # fmt: skip


def model_path() -> Path:
    return peers_dir() / "models" / f"scale-moe-16B-Q4_K_M-v{MAKER_VERSION}.gguf"


def storage(name: str, shape: tuple[int, ...]) -> str:
    """The format of one tensor, as llama-quantize's Q4_K_M lays a DeepSeek out (simplified:
    Q6_K for the output and every other layer's expert down-projections, Q4_K elsewhere)."""
    if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):
        return "f32"
    quant = "q4_k"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (name.endswith("ffn_down_exps.weight") and layer % 2 == 0):
        quant = "q6_k"
    if shape[-1] % 256:
        quant = K_FALLBACK[quant]
    return quant


class Pools:
    """Quantized rows by (format, width), made once, drawn from per tensor."""

    def __init__(self) -> None:
        self.pools: dict[tuple[str, int], np.ndarray] = {}

    def rows(self, fmt: str, cols: int, n: int, rng: np.random.Generator) -> np.ndarray:
        key = (fmt, cols)
        if key not in self.pools:
            floats = np.random.default_rng(cols).standard_normal((POOL_ROWS, cols), np.float32)
            self.pools[key] = np.ascontiguousarray(pack(floats * np.float32(0.02), fmt).data)
        return self.pools[key][rng.integers(0, POOL_ROWS, n)]


def make(path: Path | None = None, log: Any = print) -> Path:
    """Write the model unless it is there: tensor infos first, then each tensor's bytes."""
    import gguf

    from cellswarm.io.gguf_write import add_value
    from cellswarm.quant import format_by_name

    path = path or model_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    config, t0 = scale_config(), time.perf_counter()
    shapes = tensor_shapes(config)
    meta = config.to_gguf_metadata() | tokenizer_metadata()
    meta |= {"general.name": "scale-moe-16B random (cellswarm bench)", "general.file_type": 15,
             "general.quantization_version": 2}  # fmt: skip
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(os.fspath(tmp), str(meta["general.architecture"]))
    for key, value in meta.items():
        if key != "general.architecture":
            add_value(writer, key, value)
    kinds = {name: storage(name, shape) for name, shape in shapes.items()}
    for name, shape in shapes.items():
        if kinds[name] == "f32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            continue
        fmt = format_by_name(kinds[name])
        byte_shape = (*shape[:-1], fmt.row_bytes(shape[-1]))
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                               raw_dtype=gguf.GGMLQuantizationType(int(fmt.ggml_type)))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    pools = Pools()
    for k, (name, shape) in enumerate(shapes.items()):
        rng = np.random.default_rng([MAKER_VERSION, zlib.crc32(name.encode())])
        if kinds[name] == "f32":
            data = (np.ones(shape, np.float32) if name.endswith("_norm.weight")
                    else rng.standard_normal(shape, np.float32) * np.float32(0.02))  # fmt: skip
        else:
            rows = int(np.prod(shape[:-1]))
            data = pools.rows(kinds[name], shape[-1], rows, rng)
        writer.write_tensor_data(data)
        if k % 50 == 0:
            log(f"  {k}/{len(shapes)} tensors, {tmp.stat().st_size / 2**30:.1f} GiB")
    writer.close()
    tmp.replace(path)
    log(f"wrote {path}: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s")
    return path


def reference(path: Path, threads: int | None = None) -> dict[str, Any]:
    """One process's greedy tokens for PROMPTS and its decode speed: the swarm's answer."""
    import cellswarm
    from cellswarm import kernels
    from cellswarm.engine.model import GenerateOptions

    if threads:
        kernels.set_threads(threads)
    t0 = time.perf_counter()
    model = cellswarm.load(path)
    load_s = time.perf_counter() - t0
    opts = GenerateOptions(TOKENS, stop_ids=frozenset())
    tokens, decode = [], []
    for prompt in PROMPTS:
        out = model.generate(prompt, opts)
        tokens.append(list(out.token_ids))
        decode.append(out.stats.decode_tokens_per_s)
    return {"model": path.name, "model_bytes": path.stat().st_size,
            "load_s": round(load_s, 1), "tokens": tokens,
            "decode_tokens_per_s": round(float(np.median(decode)), 2)}  # fmt: skip


def lab_run(path: Path, hosts: int, racks: int, stages: int, expert_nodes: int, vocab_nodes: int,
            context: int, expected: list[list[int]] | None, log: Any = print) -> dict[str, Any]:
    """The model over a `cellswarm lab` of `hosts` cold 256 MiB hosts in `racks` racks (1
    Gbit/s ports, 20:1 rack uplinks): each host compiles its own kernels (two at a time),
    the workers join and fetch their shards over the lab's network, and the first requests'
    tokens are compared with one process's. Times to ready and what each host holds."""
    import concurrent.futures
    import tempfile

    from cellswarm.lab.lab import Lab
    from cellswarm.lab.topology import LabSpec
    from cellswarm.swarm.api import client

    spec = LabSpec(hosts=hosts, racks=racks, memory_bytes=256 << 20, host_bits_per_s=1e9,
                   access_oversubscription=20.0, aggregation_oversubscription=4.0)  # fmt: skip
    args = ("--stages", str(stages), "--expert-nodes", str(expert_nodes), "--vocab-nodes",
            str(vocab_nodes), "--context", str(context), "--max-sequences", "1")  # fmt: skip
    out: dict[str, Any] = {"hosts": hosts, "racks": racks, "memory_bytes": 256 << 20,
                           "model_bytes": path.stat().st_size, "stages": stages,
                           "expert_nodes": expert_nodes, "vocab_nodes": vocab_nodes,
                           "context": context}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="cs-scale-") as tmp:
        lab = Lab(spec, Path(tmp), str(path), prefix="csscale", coordinator_args=args,
                  heartbeat_s=1.0, heartbeat_timeout_s=10.0, say=None)  # fmt: skip
        t0 = time.monotonic()
        lab.up(start=False)
        try:
            coordinator = next(h.name for h in lab.topology.hosts if h.role == "coordinator")
            lab.start_coordinator(coordinator)
            workers = [h.name for h in lab.topology.workers()]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                list(pool.map(lab.build_kernels, workers))
            out["kernels_s"] = round(time.monotonic() - t0, 1)
            log(f"kernels built on {len(workers)} hosts in {out['kernels_s']} s")
            for h in workers:
                lab.start_worker(h, wait=False)
            status = client.wait_wired(lab.url, 3600, on_change=log)
            out["ready_s"] = round(time.monotonic() - t0, 1)
            out["holds"] = {n["node_id"]: n.get("holds") for n in status["nodes"]}
            log(f"wired in {out['ready_s']} s")
            t1 = time.monotonic()
            ids = [client.submit(lab.url, {"prompt": p, "max_tokens": TOKENS}) for p in PROMPTS]
            got = [client.wait(lab.url, rid, timeout_s=3600)["tokens"] for rid in ids]
            out["first_requests_s"] = round(time.monotonic() - t1, 1)
            out["tokens"], out["identical"] = got, (got == expected if expected else None)
        finally:
            lab.down()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make", action="store_true", help="write the model (once)")
    parser.add_argument("--reference", action="store_true", help="one process's tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--lab", action="store_true", help="the model over a lab of hosts")
    parser.add_argument("--hosts", type=int, default=56)
    parser.add_argument("--racks", type=int, default=4)
    parser.add_argument("--stages", type=int, default=6)
    parser.add_argument("--expert-nodes", type=int, default=46)
    parser.add_argument("--vocab-nodes", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--expected", type=Path, help="a --reference JSON to compare with")
    args = parser.parse_args()
    path = make()
    if args.reference:
        print(json.dumps(reference(path, args.threads)))
    if args.lab:
        expected = json.loads(args.expected.read_text())["tokens"] if args.expected else None
        print(json.dumps(lab_run(path, args.hosts, args.racks, args.stages, args.expert_nodes,
                                 args.vocab_nodes, args.context, expected)))  # fmt: skip


if __name__ == "__main__":
    main()
