"""Token sampling: greedy, temperature, top-k, top-p, min-p, and the penalties and biases.

Order (llama.cpp's default chain, OpenAI's logit_bias first): logit bias, repetition penalty
(over prompt and output, as transformers'), presence and frequency penalties (over the output
only, as OpenAI and vLLM define them: logit -= presence * [count > 0] + frequency * count),
temperature, top-k, top-p, min-p, then a draw from a seeded generator. Temperature 0 is
greedy (argmax, first index on ties) after the biases and penalties, so greedy output never
depends on the seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cellswarm import kernels
from cellswarm.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: -2..2, 0 off
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit -100..100)

    def __post_init__(self) -> None:
        pairs: Any = self.logit_bias  # a dict {id: bias} too (OpenAI's, its ids as strings)
        try:  # JSON carries pairs as lists
            bias = tuple(sorted((int(t), float(b)) for t, b in (
                pairs.items() if isinstance(pairs, dict) else pairs)))  # fmt: skip
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias {str(self.logit_bias)[:60]} must be (token id, "
                               "bias) pairs") from None  # fmt: skip
        object.__setattr__(self, "logit_bias", bias)
        checks = [
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty {self.presence_penalty} must be in -2..2"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty {self.frequency_penalty} must be in -2..2"),
            (all(t >= 0 and -100 <= b <= 100 for t, b in bias),
             "logit_bias: token ids must be >= 0 and biases in -100..100"),
            (self.temperature >= 0, f"temperature {self.temperature} must be >= 0"),
            (self.top_k >= 0, f"top_k {self.top_k} must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, f"top_p {self.top_p} must be in (0, 1]"),
            (0 <= self.min_p < 1, f"min_p {self.min_p} must be in [0, 1)"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty {self.repetition_penalty} must be > 0",
            ),
            (
                self.seed is None or 0 <= self.seed < 2**64,
                f"seed {self.seed} must be in 0..2^64-1 (or unset)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(
    logits: np.ndarray, history: Sequence[int], penalty: float
) -> np.ndarray:
    # As transformers' RepetitionPenaltyLogitsProcessor: shrink positive logits, grow negatives.
    if penalty == 1.0 or not history:
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(history, dtype=np.int64))
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def filter_probs(probs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Zero out tokens that top-k, top-p and min-p exclude; probs: (vocab,), sums to 1."""
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(probs.shape[0], dtype=bool)
    n = probs.shape[0] if params.top_k == 0 else min(params.top_k, probs.shape[0])
    if params.top_p < 1.0:
        cum = np.cumsum(probs[order[:n]])
        n = min(n, int(np.searchsorted(cum, params.top_p, side="left")) + 1)
    keep[order[:n]] = True
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs[order[0]]
    return np.where(keep, probs, 0.0)


def apply_output_penalties(logits: np.ndarray, output: Sequence[int],
                           params: SamplingParams) -> np.ndarray:  # fmt: skip
    """OpenAI's presence and frequency penalties over the tokens generated so far."""
    if not output or (params.presence_penalty == 0 and params.frequency_penalty == 0):
        return logits
    ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
    out = logits.copy()
    out[ids] -= (params.presence_penalty + params.frequency_penalty * counts).astype(out.dtype)
    return out


def apply_logit_bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    if not bias:
        return logits
    out = logits.copy()
    for t, b in bias:
        if t < out.shape[0]:  # the edge checks ids against the vocabulary
            out[t] += np.float32(b)
    return out


def sample(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
    history: Sequence[int], n_prompt: int | None = None,
) -> int:  # fmt: skip
    """logits: (vocab,) float32 -> the chosen token id. history: the prompt's tokens, then
    those generated; the first n_prompt are the prompt's (None: all are)."""
    logits = apply_logit_bias(logits, params.logit_bias)
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    output = history[len(history) if n_prompt is None else n_prompt :]
    logits = apply_output_penalties(logits, output, params)
    if params.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    if kernels.enabled():  # the same probabilities, to the bit, on every CPU
        probs = kernels.exp64(z - z.max())
        probs = filter_probs(probs / kernels.sum64(probs), params)
        return int(rng.choice(probs.shape[0], p=probs / kernels.sum64(probs)))
    probs = np.exp(z - z.max())
    probs = filter_probs(probs / probs.sum(), params)
    return int(rng.choice(probs.shape[0], p=probs / probs.sum()))
