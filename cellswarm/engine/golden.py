"""Fixed-prompt regression checks (the seed's "same input, same output"): each prompt's greedy
tokens stored with the margin the choice had, then checked against a later run.

With the C kernels a step's logits are the same bits on every CPU, thread count and batch
(kernels/exact.c), so a check compares every token and every step's logits (a digest of their
bits) exactly: any difference is a regression. The numpy reference path sums in BLAS's order,
which differs by CPU: there a greedy step whose top two logits were nearly tied may flip
without anything being wrong, so each stored token carries its margin (top-1 minus top-2
logit) and that path compares tokens up to the first step whose stored margin is below
`min_margin`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cellswarm import kernels
from cellswarm.errors import RequestError

if TYPE_CHECKING:
    from cellswarm.engine.model import Model

MIN_MARGIN = 0.05  # logits: well above the int8 paths' noise on a trained model (~0.01)


@dataclass(frozen=True)
class Golden:
    prompt: str
    tokens: list[int]
    margins: list[float]
    text: str
    digests: list[str] | None = None  # per step: sha256 of the logits' bits, 12 hex digits


@dataclass(frozen=True)
class Check:
    prompt: str
    checked: int  # tokens compared (all; the numpy path: up to the first near tie)
    mismatch: int | None  # the first step that differs, or None
    expected: str
    got: str

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def greedy(model: Model, prompt: str, max_tokens: int) -> Golden:
    """Greedy tokens for `prompt` (no stop tokens: always max_tokens), with their margins."""
    ids = model.encode_prompt(prompt)
    cache = model.new_cache(len(ids) + max_tokens)
    logits = model.step(np.asarray(ids), cache, last_only=True)[-1]
    tokens: list[int] = []
    margins: list[float] = []
    digests: list[str] = []
    for _ in range(max_tokens):
        top2 = np.partition(logits, -2)[-2:]
        tokens.append(int(np.argmax(logits)))
        margins.append(round(float(top2[1] - top2[0]), 4))
        digests.append(_digest(logits))
        logits = model.step(np.asarray(tokens[-1:]), cache)[-1]
    return Golden(prompt, tokens, margins, model.tokenizer.decode(tokens), digests)


def _digest(logits: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()[:12]


def record(model: Model, prompts: Sequence[str], max_tokens: int, path: Path) -> list[Golden]:
    goldens = [greedy(model, p, max_tokens) for p in prompts]
    path.write_text(json.dumps([asdict(g) for g in goldens], indent=1, ensure_ascii=False) + "\n")
    return goldens


def load(path: Path) -> list[Golden]:
    try:
        return [Golden(**g) for g in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError) as exc:
        fix = "write one with `cellswarm eval MODEL --prompts FILE --golden FILE --write`"
        raise RequestError(f"golden file {path} is not readable ({exc}); {fix}") from None


def check(model: Model, goldens: Sequence[Golden], min_margin: float = MIN_MARGIN) -> list[Check]:
    exact = kernels.enabled()
    out = []
    for g in goldens:
        run = greedy(model, g.prompt, len(g.tokens))
        sure = len(g.tokens)
        if not exact:
            sure = next((i for i, m in enumerate(g.margins) if m < min_margin), sure)
        same = [run.tokens[i] == g.tokens[i] for i in range(sure)]
        if exact and g.digests and run.digests:  # the bits of every step's logits too
            same = [t and run.digests[i] == g.digests[i] for i, t in enumerate(same)]
        mismatch = next((i for i, ok in enumerate(same) if not ok), None)
        out.append(Check(g.prompt, sure, mismatch, g.text, run.text))
    return out
