"""Random GGUF models whose logits are near-tied, for the layout-invariance tests.

Float addition in another order changes the last bit of a hidden state; that changes a token
only where two logits are within a few ulps of each other. These models put every logit
there: the output head's rows are one shared row plus noise of ~1e-7 of it, so a greedy
choice turns on the last bits of the final hidden state.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from cellswarm.io.gguf_write import write_gguf
from cellswarm.models.deepseek2 import DeepseekConfig
from cellswarm.models.llama_config import LlamaConfig
from cellswarm.quant import PackedExperts, PackedMatrix, format_by_name

Q8_0 = format_by_name("q8_0")

# DeepSeek-shaped as llama.cpp's converter writes DeepSeek-V2-Lite: 64 routed experts, top-6,
# softmax gating over one group, two shared experts, the first layer dense, no q LoRA, k_b/v_b.
MOE = DeepseekConfig(
    n_layers=3, d_model=64, n_heads=4, vocab_size=256, context_length=256, rms_eps=1e-6,
    q_lora_rank=0, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16, ffn_dim=96,
    moe_ffn_dim=32, n_experts=64, n_experts_used=6, n_shared_experts=2, first_k_dense=1,
    n_groups=1, topk_groups=1, routed_scaling_factor=1.0, norm_topk_prob=False,
    gating="softmax", rope_theta=10000.0,
)  # fmt: skip


def near_tied_head(rng: np.random.Generator, vocab: int, d: int, noise: float) -> np.ndarray:
    """(vocab, d) float32: one random row repeated, each copy moved by `noise` of it."""
    base = rng.standard_normal(d).astype(np.float32)
    return (base + noise * rng.standard_normal((vocab, d))).astype(np.float32)


def write_moe(path: Path, seed: int = 0, noise: float = 1e-7) -> Path:
    """`MOE` with random weights, Q8_0 where a row is whole blocks (the fused kernels run it
    as they run a converted file), float32 for norms, k_b/v_b and the near-tied head."""
    c, rng = MOE, np.random.default_rng(seed)
    tensors: dict[str, np.ndarray | PackedMatrix | PackedExperts] = {}
    for name, shape in c.expected_tensors(range(c.n_layers)).items():
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
            continue
        w = (0.15 * rng.standard_normal(shape)).astype(np.float32)
        if name == "output.weight":
            tensors[name] = near_tied_head(rng, c.vocab_size, c.d_model, noise)
        elif len(shape) == 3:
            tensors[name] = PackedExperts.from_float(w, Q8_0)
        else:
            tensors[name] = PackedMatrix.from_float(w, Q8_0)
    for layer in range(c.n_layers):  # llama.cpp's current layout of the kv up-projection
        p = f"blk.{layer}."
        k_b = (c.n_heads, c.kv_lora_rank, c.qk_nope_dim)
        v_b = (c.n_heads, c.v_head_dim, c.kv_lora_rank)
        tensors[p + "attn_k_b.weight"] = (0.15 * rng.standard_normal(k_b)).astype(np.float32)
        tensors[p + "attn_v_b.weight"] = (0.15 * rng.standard_normal(v_b)).astype(np.float32)
    write_gguf(path, c.to_gguf_metadata(), tensors)
    return path


DENSE = LlamaConfig(
    arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
    vocab_size=256, context_length=256, rms_eps=1e-5, rope_theta=10000.0, rope_dim=16,
    rope_layout="norm",
)  # fmt: skip


def write_dense(path: Path, quant: str, seed: int = 0) -> Path:
    """`DENSE` (llama) with random weights in `quant` and the near-tied head in float32."""
    c, rng, fmt = DENSE, np.random.default_rng(seed), format_by_name(quant)
    tensors: dict[str, np.ndarray | PackedMatrix] = {}
    for name, shape in c.expected_tensors(range(c.n_layers)).items():
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "output.weight":
            tensors[name] = near_tied_head(rng, c.vocab_size, c.d_model, 1e-7)
        else:
            tensors[name] = PackedMatrix.from_float(0.15 * rng.standard_normal(shape), fmt)
    write_gguf(path, c.to_gguf_metadata(), tensors)
    return path


# -- the output head split by rows ----------------------------------------------------------

# Where vocab nodes' row ranges of the demo model's 49,152-row head end: LocalPipeline's even
# thirds, and uneven ones (an old 16 MiB tile edge at 7281, a two-row node, a one-row node).
HEAD_SPLITS = [[16384, 32768], [1000], [7281, 30000], [16383, 16385], [49151]]
HEAD_ROWS = (1, 4, 20, 33)  # decode, a small batch (fused + refine), prefills (BLAS)


class InProcessVocab:
    """VocabParts without sockets: PartServers over row ranges of `path` answer `logits` and
    `rows` frames in this process, each with one BLAS thread (as LocalPipeline's parts run,
    while this process has all its cores): what a split head computes, wherever it runs."""

    def __init__(self, path: str, bounds: list[int]) -> None:
        import cellswarm
        from cellswarm.swarm.ring.parts import PartConfig, PartServer, PartSpec

        self.bounds, self.servers = bounds, []
        for i, rows in enumerate(itertools.pairwise(bounds)):
            spec = PartSpec(f"vocab-{i}", 0, vocab_rows=rows)
            model = cellswarm.load(path, selection=spec.selection(), tokenizer=False)
            self.servers.append(PartServer(PartConfig(path, spec), model))

    def _ask(self, server: object, frame: object) -> np.ndarray:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1, user_api="blas"):
            out = server.answer(frame).array  # type: ignore[attr-defined]
        assert out is not None
        return out

    def matmul(self, x: object) -> np.ndarray:
        from cellswarm.swarm.ring.frames import Frame

        frame = Frame("logits", {"rows": self.bounds[-1]}, np.asarray(x, np.float32))
        return np.concatenate([self._ask(s, frame) for s in self.servers], axis=1)

    def take_rows(self, ids: object) -> np.ndarray:
        from cellswarm.swarm.ring.frames import Frame

        index = np.asarray(ids, np.int64)
        part = np.searchsorted(self.bounds, index, side="right") - 1
        pieces = {i: self._ask(s, Frame("rows", {"tensor": "head"}, index[part == i]))
                  for i, s in enumerate(self.servers) if (part == i).any()}  # fmt: skip
        out = np.empty((len(index), next(iter(pieces.values())).shape[1]), np.float32)
        for i, rows in pieces.items():
            out[part == i] = rows
        return out


def head_mismatches(path: str) -> list[str]:
    """Where the demo model's head split at HEAD_SPLITS differs from one process's head, for
    HEAD_ROWS rows of random hidden states: [] when every logit has the same bits."""
    import cellswarm
    from cellswarm.models.ops import lm_head

    model = cellswarm.load(path, tokenizer=False)
    c, rng = model.config, np.random.default_rng(2)
    bad = []
    for splits in HEAD_SPLITS:
        vocab = InProcessVocab(path, [0, *splits, c.vocab_size])
        for t in HEAD_ROWS:
            x = rng.standard_normal((t, c.d_model)).astype(np.float32)
            ref = model.arch.head(x)
            ours = lm_head(model.weights, x, c.d_model, c.rms_eps, head=vocab)
            if not np.array_equal(ours, ref):
                rows = int((ours != ref).any(axis=0).sum())
                bad.append(f"split at {splits}, {t} rows: {rows} logits differ")
    return bad


if __name__ == "__main__":  # `python -m tests.same_bits_models PATH`, e.g. under other BLAS kernels
    import json
    import sys

    print(json.dumps(head_mismatches(sys.argv[1])))
