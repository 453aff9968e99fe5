"""How much a quantization changes a model: perplexity, KL divergence, top-1 agreement.

All three compare next-token distributions on the same text: the reference is the model with
unpacked (float32) weights, the candidate a re-quantized copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Quality:
    perplexity: float
    mean_kl: float  # KL(reference || candidate), nats per token
    top1_agreement: float  # fraction of positions with the same argmax


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """logits (T, vocab) predict ids[1:]; the last row has no target."""
    logp = log_softmax(logits[:-1])
    nll = -logp[np.arange(len(ids) - 1), ids[1:]]
    return float(np.exp(nll.mean()))


def compare(reference: np.ndarray, candidate: np.ndarray, ids: np.ndarray) -> Quality:
    ref_lp, cand_lp = log_softmax(reference), log_softmax(candidate)
    kl = (np.exp(ref_lp) * (ref_lp - cand_lp)).sum(axis=-1)
    top1 = reference.argmax(axis=-1) == candidate.argmax(axis=-1)
    return Quality(perplexity(candidate, ids), float(kl.mean()), float(top1.mean()))
