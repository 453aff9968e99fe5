"""`cellswarm eval`: what a quantization costs, and fixed-prompt regression checks.

    cellswarm eval MODEL --quant q8_0,q5_0,q4_0 [--text FILE] [--window 256] [--plot F.png]
    cellswarm eval MODEL --cache-type f16,q8_0 [--text FILE] [--window 256]
    cellswarm eval MODEL --prompts FILE --golden FILE [--write] [--max-tokens 24]

The first scores a text with the model's weights unpacked to float32 (the reference) and
with each re-quantized copy: perplexity, mean KL divergence from the reference and top-1
agreement, per window of `--window` tokens. The second does the same for the KV cache: the
file's own weights, with an f32 cache (the reference) and each cache type asked for. The
third runs each prompt (one a line) greedily
and checks the tokens against a golden file (engine/golden.py), or writes it with --write;
the exit status says whether every prompt matched.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from cellswarm.engine import golden
from cellswarm.engine.quality import Quality, compare
from cellswarm.errors import RequestError

SAMPLE_TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "sample_text.txt"


def add_eval_command(sub: Any) -> None:
    p = sub.add_parser("eval", help="quantization cost (perplexity, KL, top-1) and golden "
                       "fixed-prompt checks")  # fmt: skip
    p.add_argument("model", help="a .gguf file or a Hugging Face folder")
    p.add_argument("--quant", help="comma-separated formats to compare with float32, of those "
                   "it can make: " + ",".join(quantizable()))  # fmt: skip
    p.add_argument("--files", help="comma-separated GGUF files of the same model made elsewhere "
                   "(llama-quantize's IQ1_M, Q2_K, ... mixes) to score against it, as the engine "
                   "runs them")  # fmt: skip
    p.add_argument("--cache-type", help="comma-separated KV cache types to compare with an f32 "
                   "cache (the file's own weights): f16,q8_0")  # fmt: skip
    p.add_argument("--text", type=Path, help="text to score (default: a sample shipped here)")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window")
    p.add_argument("--prompts", type=Path, help="fixed prompts, one a line")
    p.add_argument("--golden", type=Path, help="their golden outputs (JSON)")
    p.add_argument("--write", action="store_true", help="write the golden file instead")
    p.add_argument("--max-tokens", type=int, default=24, help="greedy tokens per prompt")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", type=Path, help="with --quant: also draw the table to this PNG")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    if not any((args.quant, args.prompts, args.files, args.cache_type)):
        raise RequestError("eval needs --quant FORMATS, --files FILES, --cache-type TYPES or "
                           "--prompts FILE --golden FILE")  # fmt: skip
    status = 0
    if args.cache_type:
        types = check_cache_types(args.cache_type)
        rows = cache_table(args.model, types, args.text, args.window, say=_say)
        print(json.dumps(rows) if args.json else format_table(rows, "KV cache"))
    if args.quant or args.files:
        quants = check_quants(args.quant) if args.quant else []
        files = check_files(args.files) if args.files else []
        if args.plot:
            need_matplotlib()  # before minutes of work, not after
        rows = quant_table(args.model, quants, args.text, args.window, say=_say, files=files)
        print(json.dumps(rows) if args.json else format_table(rows))
        if args.plot:
            plot_quant(rows, args.plot, Path(args.model).name)
            print(f"plot: {args.plot}")
    if args.prompts:
        status = golden_command(args)
    return status


def quantizable() -> list[str]:
    from cellswarm.quant.formats import FORMATS

    return [f.name.lower() for f in FORMATS.values() if f.can_quantize]


def check_quants(given: str) -> list[str]:
    """--quant's formats, each one this command can make (said before any work)."""
    quants = [q.strip().lower() for q in given.split(",") if q.strip()]
    can = quantizable()
    for q in quants:
        if q not in can:
            raise RequestError(f"--quant {q}: eval re-quantizes the weights itself and cannot "
                               f"make {q.upper()}; choose from {','.join(can)} (to score a "
                               "file made elsewhere, give it as the model)")  # fmt: skip
    if not quants:
        raise RequestError("--quant: give formats, e.g. q8_0,q4_0")
    return quants


def check_files(given: str) -> list[Path]:
    """--files: each one a file that exists (said before any work)."""
    files = [Path(f.strip()) for f in given.split(",") if f.strip()]
    for f in files:
        if not f.is_file():
            raise RequestError(f"--files {f}: no such file; give GGUF files of the same model")
    return files


def check_cache_types(given: str) -> list[str]:
    """--cache-type's types, each a KV cache type (said before any work)."""
    from cellswarm.cache_types import check_cache_type

    types = [check_cache_type(t.strip().lower()) for t in given.split(",") if t.strip()]
    if not types:
        raise RequestError("--cache-type: give types, e.g. f16,q8_0")
    return types


def need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RequestError("--plot needs matplotlib: .venv/bin/pip install 'cellswarm[plot]' "
                           "(or drop --plot)") from None


def _say(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def quant_table(model: str, quants: list[str], text: Path | None, window: int,
                say: Any = None, files: list[Path] | None = None) -> list[dict]:  # fmt: skip
    """One row per format, the float32 reference first: the text in windows of `window`
    tokens, each from an empty cache, on the float path (weights dequantized, float
    activations: what the weights' format costs, not the kernels), scored with
    engine/quality.compare over every position — bench/quant_quality.py's float-path
    columns, the same numbers. Then one row per file of `files` (the same model quantized
    elsewhere, e.g. by llama-quantize) as the engine runs it: its own formats, the kernels."""
    import cellswarm
    from cellswarm import kernels

    _check_window(window)  # before any loading
    reference = cellswarm.load(model, quant="f32")
    ids, windows = _windows(reference, text, window)

    def logits(m: Any) -> np.ndarray:
        with kernels.using("numpy"):
            return np.concatenate([m.logits(w) for w in windows])

    t0 = time.monotonic()

    def tell(i: int, what: str) -> None:
        if say is not None:
            say(f"eval: {what} ({i} of {len(quants) + 1}, {len(ids):,} tokens in "
                f"{len(windows)} windows; {time.monotonic() - t0:.0f} s so far)")

    tell(1, "scoring the float32 reference")
    ref = logits(reference)
    del reference
    rows = [_row("f32", compare(ref, ref, np.asarray(ids)))]
    for i, q in enumerate(quants, 2):
        tell(i, f"re-quantizing to {q} and scoring it")
        rows.append(_row(q, compare(ref, logits(cellswarm.load(model, quant=q)),
                                    np.asarray(ids))))  # fmt: skip
    for i, f in enumerate(files or [], len(quants) + 2):
        tell(i, f"scoring {f.name} as the engine runs it")
        m = cellswarm.load(f)
        ran = np.concatenate([m.logits(w) for w in windows])
        rows.append(_row(f.name, compare(ref, ran, np.asarray(ids))))
    return rows


def cache_table(model: str, types: list[str], text: Path | None, window: int,
                say: Any = None) -> list[dict]:  # fmt: skip
    """One row per KV cache type, an f32 cache first (the reference): the file's own weights
    on the float path, as quant_table (the kernels' int8 activations add noise of their own:
    any change of ~1e-3 moves some of their roundings; docs/design.md, "KV cache types"), the
    text in windows of `window` tokens, each prefilled from an empty cache (every position
    attends to the rounded keys and values of those before it), scored with
    engine/quality.compare."""
    import cellswarm
    from cellswarm import kernels

    _check_window(window)
    m = cellswarm.load(model, cache_type="f32")
    ids, windows = _windows(m, text, window)

    def logits(cache_type: str) -> np.ndarray:
        if say is not None:
            say(f"eval: scoring with a {cache_type} KV cache ({len(ids):,} tokens)")
        m.set_cache_type(cache_type)
        with kernels.using("numpy"):
            return np.concatenate([m.logits(w) for w in windows])

    ref = logits("f32")
    rows = [_row("f32", compare(ref, ref, np.asarray(ids)))]
    return rows + [_row(t, compare(ref, logits(t), np.asarray(ids))) for t in types]


def _check_window(window: int) -> None:
    if window < 2:
        raise RequestError(f"--window {window} must be at least 2")


def _windows(m: Any, text: Path | None, window: int) -> tuple[list[int], list[list[int]]]:
    """The text's tokens, and them in windows of `window` (each scored from an empty cache)."""
    ids = m.tokenizer.encode((text or SAMPLE_TEXT).read_text())
    return ids, [ids[i : i + window] for i in range(0, len(ids), window)]


def _row(quant: str, q: Quality) -> dict[str, Any]:
    return {"quant": quant, "perplexity": round(q.perplexity, 4), "mean_kl": round(q.mean_kl, 6),
            "top1_agreement": round(q.top1_agreement, 4)}  # fmt: skip


def format_table(rows: list[dict[str, Any]], what: str = "weights") -> str:
    width = max(8, *(len(r["quant"]) for r in rows))
    lines = [f"{what:<{width}} {'perplexity':>11} {'mean KL':>10} {'top-1':>8}"]
    lines += [f"{r['quant']:<{width}} {r['perplexity']:>11.3f} {r['mean_kl']:>10.5f} "
              f"{100 * r['top1_agreement']:>7.2f}%" for r in rows]  # fmt: skip
    return "\n".join(lines)


def plot_quant(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """The table as three bar charts: perplexity, mean KL (log scale) and top-1 agreement
    of each format against float32."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RequestError("--plot needs matplotlib: pip install 'cellswarm[plot]'") from None
    names = [r["quant"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    panels = (("perplexity", "perplexity", 1.0), ("mean_kl", "mean KL from float32", 1.0),
              ("top1_agreement", "top-1 agreement (%)", 100.0))  # fmt: skip
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        values = [r[key] * scale for r in rows]
        ax.bar(names, values, color=["tab:gray", *["tab:blue"] * (len(rows) - 1)])
        ax.set_title(label)
        if key == "mean_kl" and any(v > 0 for v in values):
            ax.set_yscale("symlog", linthresh=1e-4)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.4g}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{title}: what each format costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def golden_command(args: argparse.Namespace) -> int:
    import cellswarm

    if args.golden is None:
        raise RequestError("--prompts needs --golden FILE (to check, or with --write to write)")
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    model = cellswarm.load(args.model)
    if args.write:
        written = golden.record(model, prompts, args.max_tokens, args.golden)
        print(f"wrote {len(written)} golden outputs to {args.golden}")
        return 0
    checks = golden.check(model, golden.load(args.golden))
    for c in checks:
        verdict = "ok  " if c.ok else f"FAIL at token {c.mismatch}"
        print(f"{verdict} {c.prompt!r}: {c.checked} tokens checked; got {c.got!r}")
        if not c.ok:
            print(f"     expected {c.expected!r}")
    return 0 if all(c.ok for c in checks) else 1
