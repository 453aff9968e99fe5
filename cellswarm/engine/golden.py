"""Fixed-prompt regression checks (the seed's "same input, same output"): each prompt's greedy
tokens stored with the margin the choice had, then checked against a later run.

A greedy step whose top two logits were nearly tied can flip on another CPU (other SIMD
paths sum in another order) without anything being wrong, and every token after a flip
differs. So each stored token carries its margin (top-1 minus top-2 logit), and a check
compares tokens up to the first step whose stored margin is below `min_margin`: a wrong
token before that is a regression; after it, nothing is asserted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

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


@dataclass(frozen=True)
class Check:
    prompt: str
    checked: int  # tokens compared (up to the first near tie)
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
    for _ in range(max_tokens):
        top2 = np.partition(logits, -2)[-2:]
        tokens.append(int(np.argmax(logits)))
        margins.append(round(float(top2[1] - top2[0]), 4))
        logits = model.step(np.asarray(tokens[-1:]), cache)[-1]
    return Golden(prompt, tokens, margins, model.tokenizer.decode(tokens))


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
    out = []
    for g in goldens:
        run = greedy(model, g.prompt, len(g.tokens))
        sure = next((i for i, m in enumerate(g.margins) if m < min_margin), len(g.tokens))
        mismatch = next((i for i in range(sure) if run.tokens[i] != g.tokens[i]), None)
        out.append(Check(g.prompt, sure, mismatch, g.text, run.text))
    return out
