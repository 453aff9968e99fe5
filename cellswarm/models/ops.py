"""Building blocks shared by the architecture files. All math is float32.

With the C kernels (the default) every reduction, exp and RMS norm here runs in their one
fixed order (kernels/exact.c), so a result is the same bits on any CPU, thread count, batch
or layout; the numpy expressions beside them are the reference path (CELLSWARM_KERNELS=numpy).

Shapes use T for new tokens, S for all cached tokens (S >= T), H for query heads, Hkv for
key/value heads, D for head dims.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from cellswarm import kernels
from cellswarm.models.llama_config import QUERY_BLOCK  # a prefill's queries a block
from cellswarm.quant import PackedMatrix
from cellswarm.quant.packed import matmul_shared

if TYPE_CHECKING:
    from cellswarm.io.weights import WeightStore
    from cellswarm.models.rope import Rope


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # x: (..., d), weight: (d,); statistics in float32 as in the reference implementations.
    if kernels.enabled():
        return kernels.rms_rows(x, weight, eps)
    # (x*x).sum() / d rather than np.mean: same float32 math, a third of the call overhead.
    var = (x * x).sum(axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * weight


def linear(x: np.ndarray, w: PackedMatrix, bias: np.ndarray | None = None) -> np.ndarray:
    # x: (T, in) -> (T, out); w is packed, dequantized tile by tile inside matmul.
    y = w.matmul(x)
    return y + bias if bias is not None else y


def linears(
    x: np.ndarray, weights: list[tuple[PackedMatrix, np.ndarray | None]]
) -> list[np.ndarray]:
    """linear(x, w, bias) for each (w, bias): x (T, in) read once by all (Q, K and V), its
    activations quantized once for the lot where the kernels can (the same bits)."""
    ys = matmul_shared([w for w, _ in weights], x)
    return [y if b is None else y + b for y, (_, b) in zip(ys, weights, strict=True)]


def rope(r: Rope, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """r.apply(x, positions), x (T, heads, D): in C where it can be, tokens over the threads,
    as the fused layers rotate a decode step's q and k (the same bits)."""
    if not (kernels.enabled() and x.dtype == np.float32 and x.ndim == 3):
        return r.apply(x, positions)
    cos, sin = (np.ascontiguousarray(a[:, 0]) for a in r._tables(positions))  # (T, dim/2)
    return kernels.rope(np.array(x, order="C"), r.dim, r.layout == "neox", cos, sin)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x) if kernels.enabled() else x / (np.float32(1.0) + np.exp(-x))


def swiglu(x: np.ndarray, gate: PackedMatrix, up: PackedMatrix, down: PackedMatrix) -> np.ndarray:
    # (T, d) -> (T, ffn) -> (T, d)
    if x.ndim == 2 and x.shape[0] == 1 and kernels.enabled():
        g, u, d = gate._fused, up._fused, down._fused
        if g is not None and u is not None and d is not None:
            # one row in C, as the fused DeepSeek layer computes an expert: the same bits
            # whichever node (or cache tier) holds the expert
            return kernels.swiglu1(g[0], u[0], d[0], x[0])[None]
    gx, ux = matmul_shared([gate, up], x)  # x's activations quantized once for both
    if kernels.enabled() and gx.size:  # the fused layers' silu, rows over the threads
        hidden = kernels.silu_mul(gx.reshape(-1, gx.shape[-1]), ux.reshape(-1, ux.shape[-1]))
        return down.matmul(hidden.reshape(gx.shape))
    return down.matmul(silu(gx) * ux)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    if kernels.enabled() and axis in (-1, x.ndim - 1):
        return kernels.softmax_rows(x)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    if kernels.enabled():
        return kernels.sigmoid(x)
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def causal_mask(t: int, s: int) -> np.ndarray:
    """(T, S) additive mask: the T new tokens sit at positions S-T .. S-1 of the sequence."""
    q_pos = np.arange(s - t, s)[:, None]
    k_pos = np.arange(s)[None, :]
    return np.where(k_pos > q_pos, np.float32(-np.inf), np.float32(0.0)).astype(np.float32)


def query_blocks(t: int, s: int) -> list[tuple[int, int, int]]:
    """(first, last + 1, keys seen) per block of a prefill's T queries at positions S-T..S-1:
    a causal block sees only keys [0, S - T + last + 1), so the masked upper triangle (half
    the scores of a long prompt, and half the probabilities times values) is never computed."""
    return [(a, min(a + QUERY_BLOCK, t), s - t + min(a + QUERY_BLOCK, t))
            for a in range(0, t, QUERY_BLOCK)]  # fmt: skip


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal grouped-query attention over the whole cached sequence.

    q: (T, H, D); k: (Hkv, S, D) and v: (Hkv, S, Dv), head-major as the KV cache keeps them
    -> (T, H, Dv). H is a multiple of Hkv.
    """
    if kernels.enabled():  # each query as a decode step computes it (the same bits)
        return kernels.attend(q, k, v, scale)
    t, s = q.shape[0], k.shape[1]
    if t > QUERY_BLOCK:
        return np.concatenate([
            _attention(q[a:b], k[:, :seen], v[:, :seen], scale)
            for a, b, seen in query_blocks(t, s)
        ])  # fmt: skip
    return _attention(q, k, v, scale)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    t, h, d = q.shape
    hkv, s, dv = v.shape
    g = h // hkv
    qg = q.reshape(t, hkv, g, d).transpose(1, 2, 0, 3).reshape(hkv, g * t, d)  # (Hkv, g*T, D)
    scores = qg @ k.transpose(0, 2, 1)  # (Hkv, g*T, S): rows are (kv head, group, query)
    scores = scores * np.float32(scale)
    if t > 1:  # one new token sees every cached one: no mask needed
        scores = scores.reshape(hkv, g, t, s) + causal_mask(t, s)
    probs = softmax(scores.reshape(hkv, g * t, s))
    out = probs @ v  # (Hkv, g*T, Dv)
    return out.reshape(hkv, g, t, dv).transpose(2, 0, 1, 3).reshape(t, h, dv)


def embed(w: WeightStore, token_ids: np.ndarray) -> np.ndarray:
    """(T,) ids -> (T, d): only the rows asked for are dequantized."""
    return w.matrix("token_embd.weight").take_rows(token_ids)


class Rows(Protocol):
    """What the output head needs of its matrix: a PackedMatrix, or vocabulary rows spread
    over part servers (swarm/ring/parts.py) that answer the same two calls."""

    def matmul(self, x: npt.ArrayLike) -> np.ndarray: ...

    def take_rows(self, ids: npt.ArrayLike) -> np.ndarray: ...


HEAD_REFINE = 32  # candidates whose logits are recomputed in float after a fused head


def head_matrix(w: WeightStore, name: str) -> PackedMatrix:
    """The output head's rows held here, laid out for the fastest kernel on first use
    (PackedMatrix.repack: same bits, same memory), its best rows then read back from that
    copy. An embedding tied to it too: its token lookups (take_rows) read the same copy, and
    the head makes every row of it resident anyway. In the file's layout a batch of 16 rows
    cost 16 one-row passes over the vocabulary (the demo's head: 5.6 ms a token, 101 ms for
    16), where the 16-row groups share each weight read among the batch."""
    m = w.matrix(name)
    m.repack()
    return m


def lm_head(
    w: WeightStore, x: np.ndarray, d_model: int, eps: float, head: Rows | None = None
) -> np.ndarray:
    """(T, d) -> (T, vocab rows held): final RMSNorm, then the output head (or the embedding
    matrix when the model ties them, as llama.cpp does when a file has no output.weight).
    `head` replaces the held matrix, e.g. with rows held by other nodes."""
    if head is None:
        head = head_matrix(w, "output.weight" if "output.weight" in w else "token_embd.weight")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # tested below
        h = rms_norm(x, w.vector("output_norm.weight", d_model), eps)
        if isinstance(head, PackedMatrix):  # the whole head: in the blocks vocab parts use too
            logits = head.matmul(h, rows_of=(0, head.shape[0]))
        else:
            logits = head.matmul(h)
    # One pass over the logits (the head read vocab x d weights to make them): a corrupt row
    # of the head is named here rather than sampled as a NaN.
    if not np.isfinite(logits).all():
        from cellswarm.io.weights import non_finite

        names = ["output_norm.weight", "output.weight", "token_embd.weight"]
        raise non_finite("the output head", w, names)
    if kernels.enabled():
        refine_top(logits, head, h)
    return logits


def refine_top(logits: np.ndarray, head: Rows, h: np.ndarray, k: int = HEAD_REFINE) -> None:
    """The fused head quantizes activations to int8 (~1% of a logit of noise), enough to swap
    two near-tied tokens; the k best candidates of each row are recomputed in float32 from
    their dequantized rows, so greedy choices match the float path. In place."""
    k = min(k, logits.shape[1])
    for r in range(logits.shape[0]):
        top = top_k(logits[r], k)
        logits[r, top] = kernels.dot_rows(head.take_rows(top), h[r])


def top_k(x: np.ndarray, k: int, stride: int = 16) -> np.ndarray:
    """Indices of the k largest of x (1-D), in no order. A partition of the whole vocabulary
    took ~0.6 ms a token; the k-th largest of every stride-th value is at most the k-th largest
    of all, so the values at or above it hold the top k, and only those (a few hundred) are
    partitioned: ~0.05 ms."""
    if x.size <= k * stride or not np.isfinite(x).all():
        return np.argpartition(x, x.size - k)[x.size - k :]
    sample = x[::stride]
    floor = np.partition(sample, sample.size - k)[sample.size - k]
    candidates = np.flatnonzero(x >= floor)
    return candidates[np.argpartition(x[candidates], candidates.size - k)[candidates.size - k :]]
