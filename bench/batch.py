"""Batch work at the speed of the hardware (issue 33): many sequences per read of the weights.

    python -m bench.batch [--threads 2] [--quick] [--pairs 3] [--items 2000] [--plot F.svg]
                          [--parts one,classify,pipeline]

1. One process. Decode tokens/s summed over B sequences (each a 128-token prompt, then 64
   greedy steps), B = 1, 4, 16, 32: cellswarm's `Model.step_many` (one pass over the weights
   for up to 16 sequences, `cs_llama_decode_many` / `cs_ds_decode_many`) against llama.cpp's
   `llama-batched-bench -npp 128 -ntg 64 -npl 1,4,16,32` on the same llama-quantize files,
   and the bound memory bandwidth sets: B tokens per read of the bytes one step at batch B
   must read (a MoE's routed experts: those B tokens are expected to touch). `--pairs` runs
   of each engine, interleaved: the medians, and the median of the pairs' ratios.
2. A classification batch: `--items` lines sharing a ~190-token instruction, each ~37 tokens
   of its own and 2 to 5 one-token labels, on the local swarm `cellswarm up` runs (3 stages,
   one worker and one thread each, the prefix cache and one-pass scoring) against
   llama-server (`-np 16 -cb --cache-reuse 64`, 2 threads, 16 clients at once, each item
   one /completion constrained to its labels by a grammar): items/s, and how many items got
   the same label from both.
3. A generation batch through 3 stage processes on loopback (`LocalPipeline`, one thread
   each): N prompts x 64 tokens with the stages batching (max_batch 32, every sequence in
   flight), the same with batching off (max_batch 1: each step alone, as before), and 3 x
   one process at batch 1 (what pipelining alone promises, bench.swarm's figure).

Beside each row: the planner's figure (cost.pipeline_decode) or the simulator's
(sim.local.predict_local), on this machine measured as a planner node by its own kernels
(`host_profile`: bandwidth, the file's matrices at batch 1 and 16) and one fitted
per-sequence cost (`sequence_overhead`), and the ratio measured / predicted.

The ratios are what to quote. llama.cpp and llama-server are built by bench.peers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.peers import TEXT
from cellswarm import kernels
from cellswarm.kernels.awake import awake
from cellswarm.loader import load
from cellswarm.planner import api, cost, profiles
from cellswarm.planner.placement import even_split, layer_placement
from cellswarm.planner.profiles import NodeProfile

NPP, NTG = 128, 64
BATCHES = (1, 4, 16, 32)


def cellswarm_rates(path: str, threads: int, batches: tuple[int, ...],
                    prompt: int = NPP) -> dict[int, float]:  # fmt: skip
    """Decode tokens/s summed over the batch, for each batch size: prefill excluded."""
    kernels.set_threads(threads)
    model = load(path, tokenizer=False)
    rng = np.random.default_rng(0)
    out = {}
    for b in (1, *batches):  # the first: a warm-up (pages in, kernels' arguments made)
        prompts = [rng.integers(3, model.config.vocab_size, prompt) for _ in range(b)]
        caches = [model.new_cache(prompt + NTG + 1) for _ in range(b)]
        last = [model.step(p, c, last_only=True)[-1] for p, c in zip(prompts, caches, strict=True)]
        ids = [int(np.argmax(x)) for x in last]
        with awake(threads > 1):
            t0 = time.perf_counter()
            for _ in range(NTG):
                ids = [int(np.argmax(r)) for r in model.step_many(ids, caches)]
            out[b] = b * NTG / (time.perf_counter() - t0)
    return out


def llama_rates(exe: str, path: str, threads: int, batches: tuple[int, ...]) -> dict[int, float]:
    """llama-batched-bench's S_TG (generation tokens/s over the batch) per batch size."""
    ctx = max(batches) * (NPP + NTG) + 256
    cmd = [exe, "-m", path, "-t", str(threads), "-npp", str(NPP), "-ntg", str(NTG),
           "-npl", ",".join(map(str, batches)), "-c", str(ctx)]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rates = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and all(re.fullmatch(r"[\d.]+", c) for c in cells[:8]):
            rates[int(cells[2])] = float(cells[7])  # PP TG B N_KV T_PP S_PP T_TG S_TG ...
    return rates


def step_bytes(path: str, batch: int) -> float:
    """The weight bytes one decode step of `batch` sequences reads: every matrix once, a
    routed expert stack only for the experts the batch is expected to touch (each token
    picks k of E: 1 - (1 - k/E)^B of them), the embedding only when it is the head too."""
    model = load(path, tokenizer=False)
    w, c = model.weights, model.config
    used, experts = getattr(c, "n_experts_used", 0), getattr(c, "n_experts", 0)
    touched = 1 - (1 - used / experts) ** batch if experts else 1.0
    total = 0.0
    for name in w:
        if name == "token_embd.weight" and "output.weight" in w:
            continue
        total += w.nbytes([name]) * (touched if "_exps." in name else 1.0)
    return total


def host_profile(path: str, threads: int, bandwidth: float) -> NodeProfile:
    """This machine as a planner node for `path`, from two microbenchmarks of its own
    kernels: the streaming-read bandwidth (measured by the caller) and the matrix products of
    the file's first layer and output head (each in the file's own format) at batch 1 and 16.
    Batch 1 gives the effective FLOP/s; the growth to 16 splits it into what is done per read
    of the weights (unpacking: `unpack_share`) and per sequence. Attention, norms, the cache
    and the Python around the step are not in it: the planner composes those."""
    kernels.set_threads(threads)
    w = load(path, tokenizer=False).weights
    mats = [w.matrix(n) for n in w if (n.startswith("blk.0.") or n == "output.weight")
            and n.endswith(".weight") and len(w[n].shape) == 2 and "norm" not in n]  # fmt: skip
    for m in mats:
        m.repack()
    rng = np.random.default_rng(0)

    def seconds(b: int) -> float:  # the fastest of 5 runs over all the matrices
        xs = [rng.standard_normal((b, m.shape[1])).astype(np.float32) for m in mats]
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for m, x in zip(mats, xs, strict=True):
                m.matmul(x)
            best = min(best, time.perf_counter() - t0)
        return best

    one, sixteen = seconds(1), seconds(16)
    per_seq = (sixteen - one) / 15
    params = sum(m.shape[0] * m.shape[1] for m in mats)
    return NodeProfile(
        name="this-host", description=f"this machine, {threads} threads (bench.batch)",
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        memory_bandwidth_bytes_per_s=bandwidth, memory_efficiency=1.0,
        flops=2 * params / one, compute_efficiency=1.0, cores=threads,
        link_bits_per_s=1e10, link_rtt_s=5e-5, power_busy_w=1.0, power_idle_w=1.0,
        unpack_share=max(0.0, min(0.99, 1 - per_seq / one)),
    )  # fmt: skip


def predicted_rate(path: str, node: NodeProfile, batch: int, context: int,
                   opts: cost.CostOptions) -> float:  # fmt: skip
    """The planner's decode tokens/s for one process at `batch` (cost.pipeline_decode on one
    slot holding every layer), each sequence reading `context` tokens of KV cache."""
    inv = api.resolve_model(path)
    placement = layer_placement(inv, [(0, inv.n_layers)])
    step = cost.pipeline_decode(inv, placement, node, opts, batch, context)
    return batch / (step.total_s - node.link_rtt_s / 2)  # one process: no token goes back


def sequence_overhead(path: str, node: NodeProfile, threads: int) -> cost.CostOptions:
    """The planner's one fitted figure, `sequence_layer_s`: a real step of 16 sequences a few
    tokens into their caches, less what the planner predicts for it without that term (its
    attention at the rate `attention_rate` measures), per sequence and layer. Fitted on
    this one point of each file; every row is predicted at another context (160 tokens, not
    36), and all but B=16 at another batch size. Returned with that attention rate."""
    kernels.set_threads(threads)
    attention = cost.CostOptions(attention_flops_per_s=attention_rate(path, 16, 4 + NTG))
    rate = cellswarm_rates(path, threads, (16,), prompt=4)[16]
    bare = predicted_rate(path, node, 16, 4 + NTG // 2, attention)
    layers = api.resolve_model(path).n_layers
    fitted = max(0.0, (16 / rate - 16 / bare) / (16 * layers))
    return dataclasses.replace(attention, sequence_layer_s=fitted)


def one_process_rows(files: list[tuple[str, str]], threads: int, exe: str,
                     pairs: int = 1) -> list[dict]:  # fmt: skip
    """Each file's rates at every batch size: `pairs` runs of each engine, interleaved
    (cellswarm, llama.cpp, cellswarm, ...: a drifting VM drifts both), the medians and the
    median of the pairs' ratios."""
    from bench.engine import read_bandwidth_bytes_per_s

    kernels.set_threads(threads)
    bw = read_bandwidth_bytes_per_s()
    print(f"streaming-read bandwidth at {threads} threads: {bw / 1e9:.1f} GB/s")
    rows = []
    for label, path in files:
        node = host_profile(path, threads, bw)
        opts = sequence_overhead(path, node, threads)  # its architecture's own: MLA, a router
        print(f"{label}: host profile {node.flops / 1e9:.0f} GFLOP/s at batch 1, unpack "
              f"share {node.unpack_share:.2f}; attention {opts.attention_flops_per_s / 1e9:.0f}"
              f" GFLOP/s; {opts.sequence_layer_s * 1e6:.0f} us a sequence and layer")
        runs = [(cellswarm_rates(path, threads, BATCHES), llama_rates(exe, path, threads,
                                                                       BATCHES))
                for _ in range(pairs)]  # fmt: skip
        for b in BATCHES:
            ours = float(np.median([o[b] for o, _ in runs]))
            theirs = float(np.median([t.get(b, np.nan) for _, t in runs]))
            ratios = [o[b] / t.get(b, np.nan) for o, t in runs]
            bound = b * bw / step_bytes(path, b)
            planned = predicted_rate(path, node, b, NPP + NTG // 2, opts)
            row = {"file": label, "threads": threads, "batch": b, "cellswarm": ours,
                   "llama.cpp": theirs, "ratio": float(np.median(ratios)),
                   "ratios": ratios, "bound": bound, "planner": planned}  # fmt: skip
            rows.append(row)
            spread = f" (pairs {min(ratios):.2f}-{max(ratios):.2f})" if pairs > 1 else ""
            print(f"{label:<28} B={b:<3} cellswarm {ours:8.1f}  llama.cpp {theirs:8.1f}  "
                  f"ratio {row['ratio']:5.2f}{spread}  bound {bound:8.1f}  "
                  f"of bound {ours / bound:4.2f}  planner {planned:8.1f} "
                  f"(measured/planned {ours / planned:4.2f})")
    return rows


def pipeline_rate(path: str, prompts: int, max_batch: int) -> float:
    """Tokens/s of `prompts` sequences x NTG tokens through 3 stages, all in flight."""
    from cellswarm.swarm.local.pipeline import LocalPipeline

    stamps: list[float] = []
    with LocalPipeline(path, even_split(30, 3), max_sequences=prompts,
                       max_batch=max_batch) as pipe:  # fmt: skip
        pipe.generate([{"prompt": list(range(100, 108)), "max_tokens": 2}])  # warm
        reqs = [{"prompt": list(range(100 + i, 108 + i)), "max_tokens": NTG, "stop_ids": []}
                for i in range(prompts)]  # fmt: skip
        pipe.generate(reqs, on_token=lambda _i, _t: stamps.append(time.perf_counter()))
    return (len(stamps) - prompts) / (stamps[-1] - stamps[prompts - 1])


def attention_rate(path: str, queries: int = 36, keys: int = 228) -> float:
    """FLOP/s of the file's attention kernel (fp32; its own head shapes: attend_keys, or
    mla_attend for latent attention) for `queries` after `keys - queries` cached tokens, at
    the current threads: the planner's `attention_flops_per_s` (cost.attention_s counts the
    same flops: inventory.attention_macs a query and key)."""
    c = load(path, tokenizer=False).config
    rng = np.random.default_rng(0)

    def data(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    if getattr(c, "kv_lora_rank", 0):
        args = (data(queries, c.n_heads, c.kv_lora_rank), data(queries, c.n_heads, c.qk_rope_dim),
                data(keys, c.kv_lora_rank), data(keys, c.qk_rope_dim), 0.1)  # fmt: skip
        call = kernels.mla_attend
    else:  # the keys as the cache keeps them: a stage's call
        args = (data(queries, c.n_heads, c.head_dim),
                data(c.n_kv_heads, c.head_dim, kernels.keys_ld(keys)),
                data(c.n_kv_heads, keys, c.head_dim), 0.1)  # fmt: skip
        call = kernels.attend_keys
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        call(*args)
        best = min(best, time.perf_counter() - t0)
    mean_keys = keys - queries + (queries + 1) / 2  # causal: query i sees i + 1 of its own
    return 2 * queries * mean_keys * api.resolve_model(path).attention_macs / best


def stage_node(path: str) -> tuple[NodeProfile, cost.CostOptions, list[tuple[int, int]]]:
    """A stage process of the local swarm or pipeline as a planner node, for the simulator:
    this machine measured at one thread (a stage's), slowed 1.5x because three stage
    processes share two cores; its fitted per-sequence cost and its attention rate slowed
    alike; the 3-stage split."""
    from bench.engine import read_bandwidth_bytes_per_s

    kernels.set_threads(1)
    node = host_profile(path, 1, read_bandwidth_bytes_per_s())
    fitted = sequence_overhead(path, node, 1).sequence_layer_s
    split = even_split(api.resolve_model(path).n_layers, 3)
    opts = cost.CostOptions(sequence_layer_s=1.5 * fitted,
                            attention_flops_per_s=attention_rate(path) / 1.5)  # fmt: skip
    return profiles.dilate(node, 1.5), opts, split


def pipeline_predictions(path: str, prompts: int) -> dict[int, float]:
    """The simulator's tokens/s for the pipeline rows (`sim.local.predict_local`: the same
    Simulator and cost model as `cellswarm simulate`) on `stage_node`. max_batch 1 is one
    sequence per stage in flight (more only queue); 32 is all."""
    from cellswarm.sim.local import predict_local

    node, opts, split = stage_node(path)
    return {b: predict_local(split, node=node, in_flight=3 if b == 1 else prompts,
                             jobs=prompts, tokens=NTG, prompt_tokens=8, model=path,
                             opts=opts).tokens_per_s
            for b in (1, 32)}  # fmt: skip


def pipeline_rows(path: str, prompts: int) -> list[dict]:
    from bench.swarm import single_process_tokens_per_s

    one = single_process_tokens_per_s(path, NTG)
    simulated = pipeline_predictions(path, prompts)
    rows = []
    for max_batch in (1, 32):
        rate = pipeline_rate(path, prompts, max_batch)
        rows.append({"stages": 3, "prompts": prompts, "max_batch": max_batch, "tokens_s": rate,
                     "three_x_one": 3 * one, "simulator": simulated[max_batch]})  # fmt: skip
        print(f"3 stages, {prompts} prompts x {NTG} tokens, max_batch {max_batch:>2}: "
              f"{rate:7.1f} tokens/s = {rate / (3 * one):4.2f} x (3 x one process {one:.1f}); "
              f"simulator {simulated[max_batch]:7.1f} (measured/simulated "
              f"{rate / simulated[max_batch]:4.2f})")
    return rows


LABELS = (" positive", " negative", " neutral", " mixed", " unclear")
CLASSIFY_CONTEXT = 512
SLOTS = 16  # llama-server's parallel slots (-np), and the clients that keep them busy


def classify_items(n: int) -> list[dict]:
    """One shared instruction of ~200 tokens, then n items of ~40 distinct tokens each, each
    with 2 to 5 labels (single tokens in this vocabulary: scoring them is one step)."""
    words = TEXT.read_text().split()
    instruction = ("You label the sentiment of short texts. Read the text, then answer with "
                   "one word from the list you are given. " + " ".join(words[:140]))
    rng = np.random.default_rng(33)
    items = []
    for i in range(n):
        at = int(rng.integers(0, len(words) - 30))
        text = " ".join(words[at : at + 28])
        items.append({"id": str(i), "prompt": f"{instruction}\nText: {text}\nLabel:",
                      "labels": list(LABELS[: 2 + i % 4])})  # fmt: skip
    return items


def swarm_classify(path: str, items: list[dict], threads: int) -> tuple[float, dict[str, str]]:
    """Items/s of a labels batch through `cellswarm up`'s local swarm: 3 stages, one worker
    each, `threads` threads each; and the label each item got."""
    import tempfile

    from cellswarm.swarm.api import client
    from cellswarm.swarm.local.up import LocalSwarm

    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(
        path, 3, "600M", Path(tmp), stages=3, replicas=1, threads=threads,
        context=CLASSIFY_CONTEXT, max_sequences=32, rebalance=False,
    ) as swarm:  # fmt: skip
        swarm.wait_ready(timeout_s=300)

        def run(lines: list[dict]) -> tuple[float, list[dict]]:
            t0 = time.perf_counter()
            batch = client.call(swarm.url, "/v1/batches", {"items": lines})["batch_id"]
            while client.call(swarm.url, f"/v1/batches/{batch}")["finished"] < len(lines):
                time.sleep(0.05)
            took = time.perf_counter() - t0
            return took, client.call(swarm.url, f"/v1/batches/{batch}/results")["results"]

        run([{**it, "id": f"warm-{it['id']}"} for it in items[:8]])  # pages in, kernels made
        took, rows = run(items)
    return len(items) / took, {r["id"]: r.get("label", r.get("error", "?")) for r in rows}


def server_classify(exe: str, path: str, items: list[dict],
                    threads: int) -> tuple[float, dict[str, str]]:  # fmt: skip
    """Items/s of the same items through llama-server (-np 16 -cb --cache-reuse), SLOTS
    clients at once, each item one /completion whose one token is constrained to its labels
    by a grammar (greedy: the most likely label, as cellswarm's labels line gives)."""
    import concurrent.futures
    import json
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [exe, "-m", path, "-t", str(threads), "-np", str(SLOTS), "-cb", "--cache-reuse",
           "64", "-c", str(SLOTS * CLASSIFY_CONTEXT), "--port", str(port), "--host",
           "127.0.0.1", "--no-webui"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)

        def label(it: dict) -> tuple[str, str]:
            grammar = "root ::= " + " | ".join(json.dumps(x) for x in it["labels"])
            body = {"prompt": it["prompt"], "n_predict": 1, "temperature": 0.0,
                    "grammar": grammar, "cache_prompt": True}  # fmt: skip
            req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=600) as r:
                return it["id"], json.loads(r.read())["content"]

        with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
            list(pool.map(label, items[:8]))  # warm
            t0 = time.perf_counter()
            got = dict(pool.map(label, items))
            took = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)
    return len(items) / took, got


def classify_prediction(path: str, items: list[dict]) -> float:
    """The simulator's items/s for the classification row: each item a prompt of the tokens
    the prefix cache does not hold, attending to the instruction's whole 64-token blocks
    the stages hold (`prefix_tokens`), and one step, 32 in flight through `stage_node`s."""
    from cellswarm.sim.local import predict_local

    tok = load(path).tokenizer
    assert tok is not None
    a, b = (tok.encode(it["prompt"]) for it in items[:2])
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    shared = common // 64 * 64  # the prefix cache's whole blocks
    own = float(np.mean([len(tok.encode(it["prompt"])) - shared for it in items[:200]]))
    node, opts, split = stage_node(path)
    p = predict_local(split, node=node, in_flight=32, jobs=len(items), tokens=1,
                      prompt_tokens=round(own), model=path, opts=opts,
                      prefix_tokens=shared)  # fmt: skip
    return p.tokens_per_s  # one token an item: items/s


def classify_row(path: str, llama_server: str, n: int, threads: int) -> dict:
    items = classify_items(n)
    simulated = classify_prediction(path, items)
    ours, our_labels = swarm_classify(path, items, 1)
    theirs, their_labels = server_classify(llama_server, path, items, threads)
    same = sum(our_labels[k] == their_labels.get(k) for k in our_labels) / len(our_labels)
    row = {"items": n, "cellswarm_items_s": ours, "llama_server_items_s": theirs,
           "ratio": ours / theirs, "same_label": same, "simulator": simulated}  # fmt: skip
    print(f"classify {n} items (3 stages x 1 thread vs llama-server -t {threads} -np {SLOTS}"
          f" -cb --cache-reuse): cellswarm {ours:.1f} items/s, llama-server {theirs:.1f} "
          f"items/s, ratio {ours / theirs:.2f}; the same label on {same:.1%} of items; "
          f"simulator {simulated:.1f} items/s (measured/simulated {ours / simulated:.2f})")
    return row


def svg_plot(rows: list[dict], path: Path) -> None:
    """Tokens/s against batch size, one line per engine and file (a small hand-made SVG)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for engine in ("cellswarm", "llama.cpp"):
            series.setdefault(f"{engine} {r['file']}", []).append((r["batch"], r[engine]))
    top = max(v for pts in series.values() for _, v in pts if v == v) * 1.1
    xs = {b: 60 + i * 150 for i, b in enumerate(BATCHES)}
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="640" height="400" '
             'font-family="sans-serif" font-size="11">',
             '<line x1="50" y1="300" x2="560" y2="300" stroke="black"/>',
             '<line x1="50" y1="20" x2="50" y2="300" stroke="black"/>',
             f'<text x="5" y="15">tokens/s (top {top:.0f})</text>']  # fmt: skip
    for b, x in xs.items():
        parts.append(f'<text x="{x - 5}" y="318">B={b}</text>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        colour = colours[i % len(colours)]
        dash = ' stroke-dasharray="5,4"' if name.startswith("llama") else ""
        line = " ".join(f"{xs[b]},{300 - 280 * v / top:.1f}" for b, v in pts if v == v)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{colour}"{dash}/>')
        parts.append(f'<text x="60" y="{340 + 14 * i}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    from bench.peers import PeerFile, file_path, install_llama_cpp, peer_models

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the dense file only")
    parser.add_argument("--prompts", type=int, default=48, help="the pipeline row's batch")
    parser.add_argument("--plot", type=Path, default=None, help="write the SVG plot here")
    parser.add_argument("--items", type=int, default=2000, help="the classification batch")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved runs per engine")
    parser.add_argument("--parts", default="one,classify,pipeline",
                        help="which rows: one (one process), classify, pipeline")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    llama = install_llama_cpp()
    models = {m.name: m for m in peer_models()}
    wanted = ["llama-0.3B"] if args.quick else ["llama-0.3B", "deepseek-moe-0.8B"]
    files = [(f"{n} Q4_0 (llama-quantize)",
              str(file_path(llama, PeerFile(models[n], "Q4_0", "llama-quantize"))))
             for n in wanted]  # fmt: skip
    if "one" in parts:
        rows = one_process_rows(files, args.threads, llama.exe("llama-batched-bench"),
                                args.pairs)  # fmt: skip
        if args.plot:
            svg_plot(rows, args.plot)
    if "classify" in parts:
        classify_row(files[0][1], llama.exe("llama-server"), args.items, args.threads)
    if "pipeline" in parts:
        from cellswarm.demo import demo_model_path

        pipeline_rows(str(demo_model_path()), args.prompts)


if __name__ == "__main__":
    main()
