"""What one CPU path computes, as digests: `python -m tests.bits_probe MODEL.gguf...` prints
one JSON object {model: {check: digest}}. tests/test_bits_everywhere.py runs it under other
kernel builds (CELLSWARM_CFLAGS, each with its own empty CELLSWARM_CACHE), BLAS core types
and thread counts, and compares the digests: every one must be the same bits everywhere.

Per model:
- "alone": a 48-token prefill then 32 greedy decode steps, every step's logits;
- "batch16": the same sequence decoded among 15 others (step_many), its logits;
- "stages2" / "stages4": the same tokens through the layers split over 2 and 4 stage models
  (each loading only its layers, as a stage node does), the last stage's logits;
- "replayed": the prompt and the 32 greedy tokens as one prefill, its logits cut where the
  steps were (a prefill gives each position what a decode step gave it: a request recovered
  by re-prefilling its text, k drafted tokens verified in one pass);
- "rounds" / "stages4_rounds": the 32 tokens fed as speculative decoding's rounds (the last
  token and its drafts: 1, 2, 3, 5, 9 and 12 rows, each a step of a few rows of one
  sequence: Model._rows_fused), in one process and over 4 stage models;
- "tokens": the greedy tokens (readable when a digest differs).
All of these run on the default KV cache (f16); "alone_q8_0" / "replayed_q8_0" and
"alone_f32" are "alone" and "replayed" on the other cache types (kernels/kv.c).
In-process equalities ("alone" = "batch16" = "stages*" = "replayed") are the test's too: it
asserts them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
from collections.abc import Sequence

import numpy as np

import cellswarm
from cellswarm import kernels
from cellswarm.engine.model import Model
from cellswarm.io.weights import Selection

PREFILL, DECODE, BATCH = 48, 32, 16
ROUNDS = (1, 2, 3, 5, 9, 12)  # rows of each speculative round: DECODE tokens in all
OTHERS = 8  # the prompt of each other sequence of the batch


def _digest(arrays: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, np.float32).tobytes())
    return h.hexdigest()[:16]


def _prompt(vocab: int, seed: int) -> np.ndarray:
    return (np.arange(PREFILL) * (7919 + 2 * seed) + 13 * seed) % (vocab - 3) + 3


def alone(m: Model, prompt: np.ndarray) -> tuple[list[np.ndarray], list[int]]:
    cache = m.new_cache(PREFILL + DECODE + 1)
    logits = m.step(prompt, cache)
    steps, tokens = [logits], []
    for _ in range(DECODE):
        tokens.append(int(np.argmax(steps[-1][-1])))
        steps.append(m.step(np.array(tokens[-1:]), cache))
    return steps, tokens


def batched(m: Model, prompts: list[np.ndarray], tokens: list[int]) -> list[np.ndarray]:
    """Sequence 0 fed `tokens` (its greedy ones), the others (short prompts of their own)
    their own greedy tokens, all decoded together: sequence 0's logits per step."""
    caches = [m.new_cache(PREFILL + DECODE + 1) for _ in prompts]
    last = [m.step(p if i == 0 else p[:OTHERS], c)[-1]
            for i, (p, c) in enumerate(zip(prompts, caches, strict=True))]  # fmt: skip
    out = [m.step(prompts[0], m.new_cache(PREFILL + 1))]  # the prefill, as alone's first
    for step in range(DECODE):
        ids = [tokens[step]] + [int(np.argmax(x)) for x in last[1:]]
        logits = m.step_many(ids, caches)
        out.append(logits[:1])
        last = list(logits)
    return out


def staged(path: str, n_stages: int, prompt: np.ndarray, tokens: list[int],
           rounds: Sequence[int] = (1,) * DECODE) -> list[np.ndarray]:  # fmt: skip
    """The layers over n_stages models, each holding only its own (as stage nodes do); the
    tokens fed `rounds` rows at a time."""
    n_layers = cellswarm.load(path, tokenizer=False).config.n_layers
    parts = np.array_split(np.arange(n_layers), min(n_stages, n_layers))
    stages = [cellswarm.load(path, tokenizer=False, selection=Selection(
        layers=(int(p[0]), int(p[-1]) + 1), embed=i == 0, head=i == len(parts) - 1))
        for i, p in enumerate(parts)]  # fmt: skip
    caches = [s.new_cache(PREFILL + DECODE + 1) for s in stages]
    out = []
    for ids in [prompt, *_chunks(tokens, rounds)]:
        h = stages[0].arch.embed(np.asarray(ids))
        for s, c in zip(stages, caches, strict=True):
            h = s.forward(h, c)
            c.length += len(ids)
        out.append(stages[-1].arch.head(h))
    return out


def _chunks(tokens: list[int], sizes: Sequence[int]) -> list[list[int]]:
    starts = [int(x) for x in np.cumsum([0, *sizes])]
    assert starts[-1] == len(tokens)
    return [tokens[a:b] for a, b in itertools.pairwise(starts)]


def in_rounds(m: Model, prompt: np.ndarray, tokens: list[int]) -> list[np.ndarray]:
    """The prefill, then `tokens` verified as speculative rounds of ROUNDS rows."""
    cache = m.new_cache(PREFILL + DECODE + 1)
    return [m.step(prompt, cache)] + [m.step(np.asarray(c), cache) for c in _chunks(tokens, ROUNDS)]


def replayed(m: Model, prompt: np.ndarray, tokens: list[int]) -> list[np.ndarray]:
    """The prompt and `tokens` as one prefill, its logits in alone's steps."""
    rows = m.step(np.concatenate([prompt, tokens]), m.new_cache(PREFILL + DECODE + 1))
    return [rows[:PREFILL]] + [rows[PREFILL + i : PREFILL + i + 1] for i in range(DECODE)]


def probe(path: str) -> dict[str, str]:
    m = cellswarm.load(path, tokenizer=False)
    vocab = m.config.vocab_size
    prompts = [_prompt(vocab, s) for s in range(BATCH)]
    steps, tokens = alone(m, prompts[0])
    return {
        "alone": _digest(steps),
        "batch16": _digest(batched(m, prompts, tokens)),
        "stages2": _digest(staged(path, 2, prompts[0], tokens)),
        "stages4": _digest(staged(path, 4, prompts[0], tokens)),
        "replayed": _digest(replayed(m, prompts[0], tokens)),
        "rounds": _digest(in_rounds(m, prompts[0], tokens)),
        "stages4_rounds": _digest(staged(path, 4, prompts[0], tokens, ROUNDS)),
        "tokens": ",".join(map(str, tokens)),
        **other_caches(m, prompts[0]),
    }


def other_caches(m: Model, prompt: np.ndarray) -> dict[str, str]:
    """"alone" (and for q8_0 "replayed", its numpy-written cache) on the other cache types."""
    out = {}
    for cache_type in ("q8_0", "f32"):
        m.set_cache_type(cache_type)
        steps, tokens = alone(m, prompt)
        out[f"alone_{cache_type}"] = _digest(steps)
        if cache_type == "q8_0":
            out["replayed_q8_0"] = _digest(replayed(m, prompt, tokens))
    m.set_cache_type("f16")
    return out


def main(argv: list[str]) -> None:
    kernels.set_threads(int(os.environ.get("BITS_THREADS", "1")))
    print(json.dumps({os.path.basename(p): probe(p) for p in argv}))


if __name__ == "__main__":
    main(sys.argv[1:])
