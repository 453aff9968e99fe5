"""Scoring: log-probabilities of given tokens from logits, with the same bits everywhere.

The ring's last stage and the one-process engine both use these: a job's score, a
completion's per-token log-probabilities (OpenAI's logprobs), a batch line's labels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_TOP = 20  # alternatives a scored token may list (OpenAI's top_logprobs allows 20)


def token_detail(logits: np.ndarray, norms: np.ndarray, ids: np.ndarray,
                 top: int) -> list[list[Any]]:  # fmt: skip
    """Each scored token as [its log-probability, whether it is the row's argmax (greedy:
    the first index on ties, as the sampler), the row's `top` likeliest as [id, logprob]
    pairs] — logits (C, vocab) float64, norms (C,) their log_norms, ids (C,) the tokens.
    Each log-probability is logit - norm, the terms sum_log_probs adds."""
    out = []
    for row, z, t in zip(logits, norms.tolist(), ids.tolist(), strict=True):
        best = np.argpartition(-row, top - 1)[:top] if top else np.zeros(0, np.int64)
        best = best[np.lexsort((best, -row[best]))]  # likeliest first, then lower id
        alts = [[int(i), float(row[i]) - z] for i in best]
        out.append([float(row[t]) - z, int(np.argmax(row)) == t, alts])
    return out


def log_likelihood(logits: np.ndarray, ids: np.ndarray) -> float:
    """sum_i log softmax(logits[i])[ids[i]] for logits (C, vocab) float64."""
    return sum_log_probs(logits[np.arange(len(ids)), ids], log_norms(logits))


def log_norms(logits: np.ndarray) -> np.ndarray:
    """log sum_j exp(logits[i, j]) of each row (C, vocab) float64. With the kernels, exp, log
    and the sums are their own, in one order: the same bits on every CPU, so two replicas'
    scores of one job agree exactly (--verify compares them)."""
    from cellswarm import kernels

    top = logits.max(axis=-1)
    if not kernels.enabled():
        return top + np.log(np.exp(logits - top[:, None]).sum(axis=-1))
    return np.array([float(t) + kernels.natural_log(kernels.sum64(kernels.exp64(row - t)))
                     for row, t in zip(logits, top, strict=True)])  # fmt: skip


def sum_log_probs(picked: np.ndarray, norms: np.ndarray) -> float:
    """sum_i picked[i] - norms[i]: each scored token's logit less its row's log_norms, summed
    in order with the kernels (numpy's pairwise order without)."""
    from cellswarm import kernels

    if not kernels.enabled():
        return float((picked - norms).sum())
    total = 0.0
    for x, z in zip(picked.tolist(), norms.tolist(), strict=True):
        total += x - z
    return total
