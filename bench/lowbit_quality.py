"""The big-MoE mixes, as their users make them: quality beside llama.cpp's, and a swarm run.

    python -m bench.lowbit_quality [--model deepseek-moe-0.8B] [--mixes IQ1_M,IQ2_XXS,Q2_K,DYNAMIC]
                                   [--ctx 128] [--threads 2]

The DeepSeek-V3-shaped random MoE of bench/peers.py (MLA, 64 routed experts, a shared expert:
Kimi K2/K3's architecture, smaller) is written as F32, llama-imatrix makes an importance
matrix over tests/data/sample_text.txt, and llama-quantize makes each mix with it: its
IQ1_M, IQ2_XXS and Q2_K file types, and DYNAMIC, the big MoEs' "1-bit dynamic" recipe through
per-tensor overrides (routed experts IQ1_S, attention and the shared expert Q6_K, embeddings
and head Q8_0). Each file is then scored against the F32 file by both engines on the same
text in llama-perplexity's scheme (chunks of --ctx tokens from an empty cache, each chunk's
second half scored): mean KL divergence and top-1 agreement, llama.cpp's from
`llama-perplexity --kl-divergence`, cellswarm's from its own F32 logits. Last, each file runs
greedily over a swarm of 2 stages with the routed experts on 2 expert nodes (real processes),
which must give one process's tokens.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from bench import peers

DYNAMIC = ["--tensor-type", "ffn_gate_exps=iq1_s", "--tensor-type", "ffn_up_exps=iq1_s",
           "--tensor-type", "ffn_down_exps=iq1_s", "--token-embedding-type", "q8_0",
           "--output-tensor-type", "q8_0"]  # fmt: skip


def make_mix(llama: peers.LlamaCpp, model: peers.PeerModel, mix: str) -> Path:
    if mix != "DYNAMIC":
        return peers.llama_quantize(llama, model, mix)
    path = peers.peers_dir() / "models" / f"{model.name}-DYNAMIC-lq-v{peers.MAKER_VERSION}.gguf"
    if not path.is_file():
        source = peers.make_model(model, "f32")
        imatrix = peers.imatrix(llama, model)
        tmp = path.with_suffix(".tmp")
        args = ["--imatrix", str(imatrix), *DYNAMIC, str(source), str(tmp), "Q6_K"]
        subprocess.run([llama.exe("llama-quantize"), *args], check=True, capture_output=True)
        tmp.replace(path)
    return path


def llama_kl(llama: peers.LlamaCpp, f32: Path, files: list[Path], ctx: int, threads: int,
             folder: Path) -> dict[str, tuple[float, float]]:  # fmt: skip
    """{file name: (mean KL, top-1 agreement)} by llama-perplexity --kl-divergence."""
    base = folder / "base.kld"
    common = ["-f", str(peers.TEXT), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    first = ["-m", str(f32), *common, "--kl-divergence-base", str(base)]
    subprocess.run([llama.exe("llama-perplexity"), *first], check=True, capture_output=True)
    out: dict[str, tuple[float, float]] = {}
    for f in files:
        done = subprocess.run([llama.exe("llama-perplexity"), "-m", str(f), *common,
                               "--kl-divergence-base", str(base), "--kl-divergence"],
                              capture_output=True, text=True)  # fmt: skip
        text = done.stdout + done.stderr
        kl = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", text)
        top = re.search(r"Same top p:\s+([0-9.]+)", text)
        if kl and top:
            out[f.name] = (float(kl.group(1)), float(top.group(1)) / 100)
    return out


def chunk_logits(path: Path, ids: list[int], ctx: int) -> np.ndarray:
    """Logits of positions ctx/2 .. ctx-2 of every whole chunk (llama-perplexity's scored
    ones), as the engine runs the file."""
    from cellswarm.loader import load

    model = load(path, tokenizer=False)
    first = ctx // 2
    parts = [model.logits(ids[s : s + ctx])[first : ctx - 1]
             for s in range(0, len(ids) // ctx * ctx, ctx)]  # fmt: skip
    return np.concatenate(parts)


def our_kl(f32: Path, files: list[Path], ctx: int) -> dict[str, tuple[float, float]]:
    from cellswarm.engine.quality import compare
    from cellswarm.loader import load

    ids = load(f32).tokenizer.encode(peers.TEXT.read_text())
    ref = chunk_logits(f32, ids, ctx)
    labels = np.zeros(len(ref), np.int64)  # KL and top-1 only: the labels are not read
    out = {}
    for f in files:
        q = compare(ref, chunk_logits(f, ids, ctx), labels)
        out[f.name] = (q.mean_kl, q.top1_agreement)
    return out


def swarm_agrees(path: Path, n_layers: int) -> bool:
    from cellswarm.engine.model import GenerateOptions
    from cellswarm.loader import load
    from cellswarm.planner.placement import even_split
    from cellswarm.swarm.local.pipeline import LocalPipeline

    prompt = load(path).tokenizer.encode(peers.PROMPT)
    alone = load(path, tokenizer=False).generate(prompt, GenerateOptions(8, stop_ids=frozenset()))
    with LocalPipeline(str(path), even_split(n_layers, 2), expert_nodes=2) as pipe:
        (res,) = pipe.generate([{"prompt": prompt, "max_tokens": 8}])
    return list(res.tokens) == list(alone.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-moe-0.8B")
    parser.add_argument("--mixes", default="IQ1_M,IQ2_XXS,Q2_K,DYNAMIC")
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llama = peers.install_llama_cpp()
    (model,) = [m for m in peers.peer_models() if m.name == args.model]
    f32 = peers.make_model(model, "f32")
    files = [make_mix(llama, model, m) for m in args.mixes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        theirs = llama_kl(llama, f32, files, args.ctx, args.threads, Path(tmp))
    ours = our_kl(f32, files, args.ctx)
    print(f"\n{model.name}: KL and top-1 against its F32 file, {peers.TEXT.name}, chunks of "
          f"{args.ctx} (second halves scored); {llama.label}")
    print(f"{'file':<44} {'MiB':>6} {'KL llama.cpp':>13} {'KL cellswarm':>13} "
          f"{'top-1 llama.cpp':>16} {'top-1 cellswarm':>16} {'swarm = one process':>20}")
    for f in files:
        lk, lt = theirs.get(f.name, (float("nan"), float("nan")))
        ck, ct = ours[f.name]
        agree = swarm_agrees(f, model.config.n_layers)
        print(f"{f.name:<44} {f.stat().st_size / 2**20:>6.0f} {lk:>13.5f} {ck:>13.5f} "
              f"{100 * lt:>15.2f}% {100 * ct:>15.2f}% {'yes' if agree else 'NO':>20}")


if __name__ == "__main__":
    main()
