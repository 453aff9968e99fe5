"""llama.cpp's own speculative decoding, measured on this box (issue 36's comparison row).

docs/speculative.md compares cellswarm's speculative decoding with llama.cpp's on the same
files and prompts. This module runs llama.cpp's example binaries (built by
bench.peers.install_llama_cpp) and reads their decode tokens/s and acceptance counts:

- "plain":  llama-lookup with `--spec-draft-n-max 0`: lookup's loop with no drafts is plain
  one-token-per-step greedy decoding, timed by the same code and run with the same `-t` as
  the two speculative modes (llama-simple takes no thread count and times prefill together
  with decode, so it is not the baseline here).
- "lookup": llama-lookup, prompt lookup decoding (drafts are n-grams from the context).
- "draft":  llama-speculative, `-md` a small draft model of the same vocabulary.

All greedy (`--temp 0 --top-k 1`), so the three modes write the same tokens and differ only
in speed. The figures are the binaries' own "decoded N tokens in S seconds" lines, which
leave out prompt processing.

`truncated_draft` makes a draft model from the target file itself: its first layers only,
which needs no second download and shares the tokenizer by construction.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from bench.peers import TEXT, install_llama_cpp

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")


def demo_prompts() -> dict[str, str]:
    """The prompts of the table: two that ask for text the prompt already holds (where prompt
    lookup can draft) and a free story (where it cannot). The passage is the whole of
    tests/data/sample_text.txt, 589 tokens for SmolLM2's tokenizer."""
    passage = TEXT.read_text().strip()
    return {
        "extraction": passage + "\n\nQuote the first two sentences of the text above exactly:\n",
        "summary": passage + "\nSummary of the text above:\n",
        "story": "Once upon a time, in a small village by the sea,",
    }


def parse_run(text: str) -> dict[str, Any]:
    """A lookup/speculative run's stderr -> tokens/s of decode, n_drafted, n_accept (None
    where not printed)."""
    speeds = DECODED.findall(text)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", text)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", text)
    return {
        "tokens_per_s": float(speeds[-1][2]) if speeds else None,
        "tokens": int(speeds[-1][0]) if speeds else None,
        "drafted": int(drafted[1]) if drafted else None,
        "accepted": int(accepted[1]) if accepted else None,
    }


def llama_cpp_speculative(
    model: Path,
    draft: Path | None,
    prompts: dict[str, str],
    n_predict: int,
    threads: int = 2,
    n_draft: int = 8,
) -> list[dict]:
    """For each prompt: plain, lookup and (given `draft`) draft-model decoding by llama.cpp,
    greedy, `n_predict` tokens, `threads` threads; at most `n_draft` tokens drafted per step.
    Rows {"prompt", "mode", "tokens_per_s", "drafted", "accepted", "text"}; a failed run has
    tokens_per_s None and its last stderr lines in "error"."""
    llama = install_llama_cpp()
    common = ["-m", str(model), "-n", str(n_predict), "-t", str(threads), "--temp", "0",
              "--top-k", "1", "-c", "4096"]  # fmt: skip
    modes: dict[str, list[str]] = {
        "plain": [llama.exe("llama-lookup"), *common, "--spec-draft-n-max", "0"],
        "lookup": [llama.exe("llama-lookup"), *common, "--spec-draft-n-max", str(n_draft)],
    }
    if draft is not None:
        modes["draft"] = [llama.exe("llama-speculative"), *common, "-md", str(draft),
                          "--spec-draft-n-max", str(n_draft)]  # fmt: skip
    rows = []
    for kind, prompt in prompts.items():
        for mode, cmd in modes.items():
            out = subprocess.run([*cmd, "-p", prompt], capture_output=True, text=True,
                                 timeout=600)  # fmt: skip
            row: dict[str, Any] = {"prompt": kind, "mode": mode, **parse_run(out.stderr)}
            if mode == "plain":  # lookup prints counts for its empty drafts too
                row["drafted"] = row["accepted"] = None
            row["text"] = out.stdout.split(prompt, 1)[-1].strip()
            if out.returncode != 0 or row["tokens_per_s"] is None:
                row["tokens_per_s"] = None
                row["error"] = out.stderr.strip().splitlines()[-3:]
            rows.append(row)
    return rows


def truncated_draft(src: Path, dst: Path, n_layers: int) -> Path:
    """A copy of the GGUF `src` with only its first `n_layers` blocks: `{arch}.block_count`
    set to n_layers, tensors blk.{n_layers}.. dropped, every other key (the tokenizer) and
    tensor (embedding, final norm, output head) copied byte for byte. A shallow copy of the
    target is a draft model with the target's vocabulary and, through the shared embedding
    and head, some of its guesses. Written once; an existing `dst` is reused."""
    from cellswarm.io.gguf_file import read_header
    from cellswarm.io.gguf_write import write_gguf
    from cellswarm.quant import PackedMatrix, format_for

    if dst.is_file():
        return dst
    header = read_header(src)
    meta = dict(header.metadata)
    meta[f"{meta['general.architecture']}.block_count"] = n_layers
    raw = np.memmap(src, dtype=np.uint8, mode="r")
    tensors: dict[str, Any] = {}
    for t in header.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        data = raw[t.offset : t.offset + t.n_bytes]
        if t.ggml_type == 0:  # F32: norms
            tensors[t.name] = data.view(np.float32).reshape(t.shape)
        else:  # packed rows, as the file holds them
            tensors[t.name] = PackedMatrix(data.reshape(t.shape[0], -1), format_for(t.ggml_type))
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(dst, meta, tensors)
    return dst
