"""Rotary position embeddings: frequency tables (plain, llama3, YaRN) and the two rotation layouts.

Layouts: "norm" rotates adjacent pairs (x[2i], x[2i+1]) — llama.cpp's layout for llama, whose
converter permutes Q/K rows, and for deepseek2; "neox" rotates halves (x[i], x[i + D/2]) — the
layout of qwen2/qwen3 and of Hugging Face llama checkpoints before that permutation.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Rope:
    """A rotary embedding over the first `dim` dims of a head."""

    dim: int
    inv_freq: np.ndarray  # (dim/2,) float32
    layout: str = "norm"  # "norm" | "neox"
    attention_factor: float = 1.0  # YaRN multiplies cos/sin by this
    # The last (positions, cos, sin): every layer of a step rotates at the same positions.
    _memo: list[Any] = field(default_factory=lambda: [None, None, None], repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout not in ("norm", "neox"):
            raise ValueError(f"rope layout {self.layout!r} is not 'norm' or 'neox'")
        if self.inv_freq.shape != (self.dim // 2,):
            raise ValueError(f"rope inv_freq has shape {self.inv_freq.shape}, dim is {self.dim}")

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: (T, heads, D) with D >= dim; positions: (T,) -> rotated copy, same shape."""
        cos, sin = self._tables(positions)
        out = x.copy()
        r = x[..., : self.dim]
        if self.layout == "norm":
            a, b = r[..., 0::2], r[..., 1::2]
            out[..., 0 : self.dim : 2] = a * cos - b * sin
            out[..., 1 : self.dim : 2] = b * cos + a * sin
        else:
            half = self.dim // 2
            a, b = r[..., :half], r[..., half:]
            out[..., :half] = a * cos - b * sin
            out[..., half : self.dim] = b * cos + a * sin
        return out

    def _tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        memo = self._memo
        if memo[0] is not positions:
            angles = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # (T, dim/2)
            factor = np.float32(self.attention_factor)
            cos, sin = _sincos(angles)
            memo[:] = [positions, (cos * factor)[:, None, :], (sin * factor)[:, None, :]]
        return memo[1], memo[2]  # (T, 1, dim/2) each


def _kernels() -> Any:
    """The C kernels when they run, else None. Imported by name at first use: the config
    modules import this file and stay free of the kernels (and of their types)."""
    kernels = importlib.import_module("cellswarm.kernels")
    return kernels if kernels.enabled() else None


def _sincos(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of float32 angles: the kernels' own (the same bits on every CPU), or numpy's."""
    k = _kernels()
    return k.sincos(angles) if k else (np.cos(angles), np.sin(angles))


def _power(theta: float, exponents: np.ndarray) -> np.ndarray:
    """theta ** exponents in float32: the kernels' own, or numpy's."""
    k = _kernels()
    if k:
        return k.power(theta, exponents)
    return (np.float32(theta) ** exponents).astype(np.float32)


def _log(x: float) -> float:
    k = _kernels()
    return k.natural_log(x) if k else math.log(x)


def base_inv_freq(dim: int, theta: float) -> np.ndarray:
    # (dim/2,) float32, computed as the references do: theta ** (2i / dim) in float32.
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / _power(theta, exponents)).astype(np.float32)


def llama3_factors(
    inv_freq: np.ndarray,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> np.ndarray:
    """Per-frequency divisors for llama3 scaling (what llama.cpp stores as rope_freqs.weight)."""
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for freq in inv_freq.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * _log(scale) + 1.0


@dataclass(frozen=True)
class Yarn:
    """YaRN parameters as DeepSeek-V2/V3 and Kimi-K2 configs give them.

    Follows transformers' `_compute_yarn_parameters`: `mscale`/`mscale_all_dim` are None when
    a config leaves them out (None and 0 both mean "not given", as in transformers), and
    `attention_factor` overrides the cos/sin multiplier when the config states one.
    """

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None
    truncate: bool = True  # round the correction range outwards to whole dims

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """DeepSeek multiplies its softmax scale by this, squared (`yarn_apply_mscale`)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0

    def inv_freq(self, dim: int, theta: float) -> np.ndarray:
        pos_freqs = _power(theta, np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
        extrapolation = np.float32(1.0) / pos_freqs
        interpolation = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        low, high = self._correction_range(dim, theta)
        ramp = _linear_ramp(low, high, dim // 2)
        keep = np.float32(1.0) - ramp  # 1 where the frequency is extrapolated (kept as is)
        return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)

    def _correction_range(self, dim: int, theta: float) -> tuple[float, float]:
        def corr_dim(rotations: float) -> float:
            return (dim * _log(self.original_context / (rotations * 2 * math.pi))) / (
                2 * _log(theta)
            )

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, n: int) -> np.ndarray:
    if low == high:
        high += 0.001
    ramp = (np.arange(n, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    return np.clip(ramp, 0, 1).astype(np.float32)
