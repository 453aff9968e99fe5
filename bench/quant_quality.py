"""Quality of the demo model's two paths and of re-quantized copies, on real text.

    python -m bench.quant_quality [--no-llama-cpp]

The demo GGUF (Q4_1 layers, Q8_0 embedding) is unpacked to float32 — the reference — and
re-packed as Q8_0 and Q4_0. Each runs over tests/data/sample_text.txt in windows of 256
tokens, each from an empty cache, two ways:

- the float path (`kernels.using("numpy")`): weights dequantized to float32, float
  activations, BLAS, the window as one prefill. Its perplexity, and its mean KL divergence
  and top-1 agreement against the f32 reference: what the weights' format costs.
- the decode path: one token at a time through the KV cache, as generation runs — the fused
  C layers, activations quantized to int8 blocks of 32 with their few dominant values kept in
  float (kernels.c: take_outliers), the output head's 32 best refined in float. Its perplexity,
  KL and top-1 against the float path of the same weights: what the fast kernels cost. The
  last two columns: the same with int8 blocks alone (`kernels.set_outliers(0)`), as llama.cpp
  quantizes activations (Q8_0/Q8_1 per 32 for these formats).

Then llama.cpp (bench/peers.py builds it once into the cache folder) on the same files and
tokens, in llama-perplexity's scheme (chunks of 128 tokens from an empty cache, each one's
second half scored, as `python -m bench.peers --perplexity`): its perplexity on the text as it
tokenizes it, and — fed cellswarm's float-path log-probabilities with --kl-divergence-base —
its perplexity, KL and top-1 against cellswarm's float path on cellswarm's tokens, next to
cellswarm's decode path on the same chunks. (llama.cpp stores the reference log-probs in 16
bits; its KL then differs from an exact one by ~0.1%.)
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from cellswarm import kernels
from cellswarm.demo import demo_model_path
from cellswarm.engine.model import Model
from cellswarm.engine.quality import Quality, compare, log_softmax
from cellswarm.io.gguf_file import GGUFFile
from cellswarm.io.gguf_write import write_gguf
from cellswarm.loader import load

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "sample_text.txt"
WINDOW = 256
LLAMA_CTX = 128  # llama-perplexity -c, as bench.peers runs it
COPIES = (("f32 (unpacked)", "f32"), ("as shipped (Q4_1)", None), ("q8_0", "q8_0"),
          ("q4_0", "q4_0"))  # fmt: skip
FILE_TYPES = {"q8_0": 7, "q4_0": 2}  # llama_ftype (general.file_type) of the written copies


def chunks(ids: Sequence[int], size: int) -> list[list[int]]:
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


def float_logits(model: Model, windows: list[list[int]]) -> np.ndarray:
    """The float path: each window one prefill on dequantized float32 weights."""
    with kernels.using("numpy"):
        return np.concatenate([model.logits(w) for w in windows])


def decode_logits(model: Model, windows: list[list[int]]) -> np.ndarray:
    """The decode path: each window fed one token at a time through the KV cache."""
    out = []
    for w in windows:
        cache = model.new_cache(len(w))
        out += [model.step(np.array([t]), cache) for t in w]
    return np.concatenate(out)


@contextlib.contextmanager
def int8_alone() -> Iterator[None]:
    """Activations as int8 blocks alone, no values kept in float (then the default again)."""
    kernels.set_outliers(0)
    try:
        yield
    finally:
        kernels.set_outliers(4)


def quant_table(path: Path, ids: list[int]) -> None:
    windows = chunks(ids, WINDOW)
    reference = float_logits(load(path, quant="f32"), windows)
    print(f"{len(ids)} tokens of {TEXT.name}, windows of {WINDOW} from an empty cache")
    print(f"{'':<19}{'':>6} | {'float path':^26} | {'decode path, vs float':^26} | "
          f"{'int8 alone, vs float':^17}")  # fmt: skip
    print(f"{'weights':<19}{'MiB':>6} | {'ppl':>8} {'KL vs f32':>9} {'top-1':>7} | "
          f"{'ppl':>8} {'KL':>9} {'top-1':>7} | {'KL':>9} {'top-1':>7}")  # fmt: skip
    for name, quant in COPIES:
        model = load(path, quant=quant)
        fl = reference if quant == "f32" else float_logits(model, windows)
        f = compare(reference, fl, np.asarray(ids))
        d = compare(fl, decode_logits(model, windows), np.asarray(ids))
        row = f"{name:<19}{model.memory().weight_bytes / 2**20:>6.1f} | {cells(f)} | {cells(d)} |"
        if quant == "f32":  # float32 weights have no fused kernels: the decode path is float
            print(f"{row} {'-':>9} {'-':>7}")
            continue
        with int8_alone():
            plain = compare(fl, decode_logits(model, windows), np.asarray(ids))
        print(f"{row} {cells(plain)[9:]}")


def cells(q: Quality) -> str:
    return f"{q.perplexity:>8.3f} {q.mean_kl:>9.5f} {100 * q.top1_agreement:>6.2f}%"


# ------------------------------------------------------------------------------- llama.cpp


def write_logits_base(path: Path, logits: list[np.ndarray], tokens: list[int], n_ctx: int) -> None:
    """cellswarm's logits in llama-perplexity's --kl-divergence-base file (its
    perplexity.cpp: the scored rows' log-probabilities, 16 bits each over [max - 16, max])."""
    n_vocab = logits[0].shape[1]
    nv = 2 * ((n_vocab + 1) // 2) + 4
    with open(path, "wb") as f:
        f.write(b"_logits_")
        np.array([n_ctx, n_vocab, len(logits)], np.int32).tofile(f)
        np.asarray(tokens, np.int32).tofile(f)
        for chunk in logits:
            rows = chunk[n_ctx // 2 : n_ctx - 1].astype(np.float32)  # the scored rows
            top = rows.max(axis=1, keepdims=True)
            low = np.maximum(rows.min(axis=1, keepdims=True), top - np.float32(16))
            lse = np.log(np.exp(rows - top).astype(np.float64).sum(axis=1, keepdims=True))
            scale = (top - low) / np.float32(65535)
            q = np.where(rows > low, np.rint((rows - low) * (np.float32(1) / scale)), 0)
            out = np.zeros((len(rows), nv), np.uint16)
            head = np.concatenate([scale, low - top - lse.astype(np.float32)], axis=1)
            out[:, :4] = head.astype(np.float32).view(np.uint16)
            out[:, 4 : 4 + n_vocab] = q.astype(np.uint16)
            out.tofile(f)


def parse_kl_run(text: str) -> tuple[float, float, float] | None:
    """llama-perplexity --kl-divergence's summary -> (perplexity, mean KL, top-1 agreement)."""
    ppl = re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", text)
    kl = re.search(r"Mean\s+KLD:\s*([0-9.]+)", text)
    top = re.search(r"Same top p:\s*([0-9.]+)", text)
    if not (ppl and kl and top):
        return None
    return float(ppl.group(1)), float(kl.group(1)), float(top.group(1)) / 100


def scored(logits: list[np.ndarray], n_ctx: int) -> np.ndarray:
    return np.concatenate([c[n_ctx // 2 : n_ctx - 1] for c in logits])


def llama_cpp_table(path: Path, ids: list[int], tmp: Path) -> None:
    from bench.peers import install_llama_cpp, parse_perplexity

    try:
        llama = install_llama_cpp()
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"\nllama.cpp unavailable ({exc}): no comparison")
        return
    n = LLAMA_CTX

    def run(file: Path, *more: str) -> str:  # llama-perplexity's output
        args = [llama.exe("llama-perplexity"), "-m", str(file), "-c", str(n), "-b", str(n),
                "-t", str(kernels.threads()), *more]  # fmt: skip
        out = subprocess.run(args, capture_output=True, text=True)
        return out.stdout + out.stderr

    print(f"\n{llama.label}\nllama-perplexity's scheme: {len(ids) // n} chunks of {n} tokens "
          f"from an empty cache, positions {n // 2}..{n - 2} of each scored; KL and top-1 "
          "against cellswarm's float path")  # fmt: skip
    print(f"{'':<19} | {'llama.cpp':>9} | {'cellswarm':>9} | {'cellswarm decode path':^26} | "
          f"{'int8 alone':^17} | {'llama.cpp':^26}")  # fmt: skip
    print(f"{'file':<19} | {'own ppl':>9} | {'float ppl':>9} | {'ppl':>8} {'KL':>9} {'top-1':>7} | "
          f"{'KL':>9} {'top-1':>7} | {'ppl':>8} {'KL':>9} {'top-1':>7}")  # fmt: skip
    meta = GGUFFile(path).metadata
    for name, quant in COPIES[1:]:
        model = load(path, quant=quant)
        file = path
        if quant is not None:  # the same re-quantized copy for both engines
            file = tmp / f"demo-{quant}.gguf"
            write_gguf(file, {**meta, "general.file_type": FILE_TYPES[quant]}, dict(model.weights))
        add_bos = model.tokenizer.encode("") != []  # llama.cpp starts each chunk with BOS then
        windows = [[model.tokenizer.bos_id or c[0], *c[1:]] if add_bos else c
                   for c in chunks(ids[: len(ids) // n * n], n)]  # fmt: skip
        targets = np.concatenate([w[n // 2 + 1 :] for w in windows])
        floats = [float_logits(model, [w]) for w in windows]
        ref = scored(floats, n)
        fast = scored_quality(ref, scored([decode_logits(model, [w]) for w in windows], n), targets)
        with int8_alone():
            plain = scored_quality(ref, scored([decode_logits(model, [w]) for w in windows], n),
                                   targets)  # fmt: skip
        write_logits_base(tmp / "base.bin", floats, [t for w in windows for t in w], n)
        theirs = parse_kl_run(run(file, "--kl-divergence-base", str(tmp / "base.bin"),
                                  "--kl-divergence"))  # fmt: skip
        own = parse_perplexity(run(file, "-f", str(TEXT)))
        print(f"{name:<19} | {'-' if own is None else f'{own:.3f}':>9} | "
              f"{scored_quality(ref, ref, targets).perplexity:>9.3f} | {cells(fast)} | "
              f"{cells(plain)[9:]} | {'-' if theirs is None else cells(Quality(*theirs))}")


def scored_quality(reference: np.ndarray, candidate: np.ndarray, targets: np.ndarray) -> Quality:
    """As engine.quality.compare, for rows that each predict their own target token."""
    ref_lp, lp = log_softmax(reference), log_softmax(candidate)
    kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1)
    nll = -lp[np.arange(len(targets)), targets]
    top1 = reference.argmax(axis=-1) == candidate.argmax(axis=-1)
    return Quality(float(np.exp(nll.mean())), float(kl.mean()), float(top1.mean()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    args = parser.parse_args()
    path = demo_model_path()
    ids = load(path).tokenizer.encode(TEXT.read_text())
    quant_table(path, ids)
    if not args.no_llama_cpp:
        with tempfile.TemporaryDirectory() as tmp:
            llama_cpp_table(path, ids, Path(tmp))


if __name__ == "__main__":
    main()
