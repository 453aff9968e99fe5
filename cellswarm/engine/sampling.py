"""Token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty.

Order (as llama.cpp's default chain): repetition penalty, temperature, top-k, top-p, min-p,
then a draw from a seeded generator. Temperature 0 is greedy (argmax, first index on ties),
so greedy output never depends on the seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        checks = [
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


def sample(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history: Sequence[int]
) -> int:
    """logits: (vocab,) float32 -> the chosen token id."""
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
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
