"""The one-token path of models/deepseek2.py: one C call per layer (kernels/deepseek.c).

A layer's weights are described to C once (`DsLayer`: pointers into the packed, memory-mapped
tensors, nothing copied), with one scratch buffer per model. Routed experts stay where they
are: the C code reads the held experts straight out of their stacks; when some live on
other nodes or in the tiered cache (`Deepseek2.remote_experts`), C runs the attention and the
router, and the experts go through `Deepseek2.moe` as before. Every expert's SwiGLU, here or
there, is the same C arithmetic (`kernels.swiglu1`), so the layout does not change the bits.

W_UK and W_UV run packed when the file has them as llama.cpp's current converter writes them
(attn_k_b (H, L, N), attn_v_b (H, V, L)): per head they are rows times a vector, as any
matrix. From the older attn_kv_b the key half would need a transpose, so both come from the
float32 copies `Deepseek2.absorbed` keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from cellswarm import kernels
from cellswarm.models.kv_cache import check_room
from cellswarm.quant import PackedExperts, PackedMatrix
from cellswarm.quant.formats import q5_0_as_q8_0
from cellswarm.quant.packed import release_file_pages

if TYPE_CHECKING:
    from cellswarm.models.deepseek2 import Deepseek2
    from cellswarm.models.kv_cache import KVCache

Args = tuple[int, int, int, int, int]  # kernels.weight_args: kind, format, pointer, rows, bytes
NO_MAT: Args = (0, 0, 0, 0, 0)
# Weights the layer's big matrix-vector products may be in: quantized or F16/BF16 (F32 would
# be 4-8x the bytes of the file it came from; such a model runs the numpy path).
_PACKED = {**kernels.FUSED_TYPES, **kernels.FLOAT_TYPES}


def _args(
    t: PackedMatrix | PackedExperts, float32_ok: bool = False, repack: bool = True
) -> Args | None:
    """weight_args of a packed tensor (a stack: its first member, rows and row bytes), or None
    when no fused kernel reads its format. With `repack`, the tensor is first laid out for the
    fastest kernel where there is one (PackedMatrix.repack: the same bits, the same memory)."""
    name = t.fmt.name
    if name not in _PACKED and not (float32_ok and name == "F32"):
        return None
    if not kernels.can_fuse("Q8_0") or not t.data.flags.c_contiguous:
        return None
    if repack and t.repack():
        code, data = t._repacked  # type: ignore[misc]
        return 0, code, int(data.ctypes.data), *data.shape[-2:]
    return kernels.weight_args(name, t.data, t.shape[-1])


def _q5_0_args(t: PackedMatrix | PackedExperts, keep: list[Any]) -> Args | None:
    """weight_args of a Q5_0 tensor (a stack: its first member) as Q8_0, repacked where this
    CPU has the layout. llama-quantize falls back to Q5_0 where a K-quant's 256-blocks do not
    fit a row (attn_k_b's 64 columns), and no kernel reads Q5_0; Q8_0 holds its values to the
    bit (formats.q5_0_as_q8_0). Read instead as the float32 copy (5.8x the file's bytes a
    token) or as Q8_0 rows one at a time (two blocks a row: the reductions across lanes
    dominate), the 0.8B Q4_K MoE decoded ~10% slower. The copy (34/22 of the file's bytes)
    goes in `keep`; the file's pages under the Q5_0 bytes are let go."""
    if not kernels.can_fuse("Q8_0"):
        return None
    q8 = q5_0_as_q8_0(t.data)
    release_file_pages(t.data)
    stack = q8.reshape(-1, *q8.shape[-2:])
    code = kernels.repacked_code("Q8_0", stack.shape[1])
    if code is not None:  # each member (a head) in groups of its own rows, as a repacked stack
        for member in stack:
            kernels.repack("Q8_0", member.copy(), member)  # from a copy: not in place
    keep.append(q8)
    if code is None:
        return kernels.weight_args("Q8_0", q8, t.shape[-1])
    return 0, code, int(q8.ctypes.data), *stack.shape[1:]


def _float_args(a: np.ndarray) -> Args:
    """A float32 (..., rows, cols) array as an F32 matrix (stacks: the first member)."""
    return 2, 0, int(a.ctypes.data), a.shape[-2], a.shape[-1] * 4


@dataclass
class FusedLayer:
    struct: Any  # kernels.DsLayer
    keep: list[Any]  # what the struct's pointers point into


class FusedDecode:
    """Builds each layer's `DsLayer` on first use and runs one token through a layer range."""

    def __init__(self, model: Deepseek2) -> None:
        self.model = model
        self._layers: dict[int, FusedLayer | None] = {}
        self._scratch: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def prepare(self, layers: range) -> None:
        """Build `layers` (which repacks their matrices) before their first step of any kind."""
        if kernels.enabled():
            for i in layers:
                self.layer(i)

    def run(
        self, x: np.ndarray, positions: np.ndarray, cache: KVCache, layers: range
    ) -> np.ndarray | None:
        """x (1, d) -> (1, d) through `layers`; None when a layer cannot run fused."""
        if not kernels.enabled():
            return None
        built = [self.layer(i) for i in layers]
        if any(b is None for b in built):
            return None
        m, c = self.model, self.model.config
        if x.shape != (1, c.d_model):
            raise ValueError(f"decode_fused takes hidden states (1, d_model), got {x.shape}")
        out = np.array(x[0], dtype=np.float32)  # (d,): the residual stream, updated in place
        cos, sin = (np.ascontiguousarray(t[0, 0]) for t in m.rope._tables(positions))
        pos = int(positions[0])
        if m.remote_experts is None:  # every layer whole in C: one call for the stack
            return self._run_stack(out, pos, cos, sin, cache, layers)[None]
        for i, b in zip(layers, built, strict=True):
            assert b is not None
            lc = cache.layer(i)
            latent, k_rope = lc.storage("latent"), lc.storage("k_rope")
            check_room(latent.shape[0], pos + 1)
            scratch = self.scratch(latent.shape[0], layers)
            if m.remote_experts is None or not c.is_moe(i):
                kernels.ds_layer_call("decode", b.struct, out, pos, cos, sin, latent, k_rope,
                                      scratch, cache.kind)  # fmt: skip
                continue
            kernels.ds_layer_call("attention", b.struct, out, pos, cos, sin, latent, k_rope,
                                  scratch, cache.kind)  # fmt: skip
            h, ids, weights = kernels.ds_route(b.struct, out, scratch)
            routing = _routing(ids, weights)
            out = out + m.moe(i, h[None], routing)[0]
        return out[None]

    def _run_stack(
        self, out: np.ndarray, pos: int, cos: np.ndarray, sin: np.ndarray, cache: KVCache,
        layers: range,
    ) -> np.ndarray:  # fmt: skip
        check_room(cache.capacity, pos + 1)
        key = ("deepseek2", layers.start, layers.stop)
        if key not in cache.memo:  # the layers, and each one's caches, as C pointers
            built = [cast(FusedLayer, self.layer(i)).struct for i in layers]
            cache.memo[key] = (kernels.pointers(built), *(
                kernels.pointers([cache.layer(i).storage(n) for i in layers])
                for n in ("latent", "k_rope")
            ))  # fmt: skip
        structs, latents, k_ropes = cache.memo[key]
        scratch = self.scratch(cache.capacity, layers)
        kernels.ds_decode_layers(structs, out, pos, cos, sin, latents, k_ropes, cache.capacity,
                                 scratch, cache.kind)  # fmt: skip
        return out

    def run_many(
        self, x: np.ndarray, positions: np.ndarray, caches: list[KVCache], layers: range
    ) -> np.ndarray | None:
        """One token of each of n sequences: x (n, d) -> (n, d), each weight row read once
        for all of them, each routed expert once for the tokens routed to it. None when a
        layer cannot run fused or experts live elsewhere (then each runs alone)."""
        n = x.shape[0]
        if not kernels.enabled() or self.model.remote_experts is not None:
            return None
        if not 1 <= n <= kernels.MAX_BATCH:
            return None
        built = [self.layer(i) for i in layers]
        if any(b is None for b in built):
            return None
        out = np.array(x, dtype=np.float32)  # (n, d)
        cos, sin = (np.ascontiguousarray(t[:, 0]) for t in self.model.rope._tables(positions))
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        for i, b in zip(layers, built, strict=True):
            assert b is not None
            stores = [c.layer(i) for c in caches]
            latents = [s.storage("latent") for s in stores]
            k_ropes = [s.storage("k_rope") for s in stores]
            for p, lat in zip(pos, latents, strict=True):
                check_room(lat.shape[0], int(p) + 1)
            cap = max(lat.shape[0] for lat in latents)
            scratch = self.scratch(cap, layers, n)
            kernels.ds_decode_many(b.struct, out, pos, cos, sin, latents, k_ropes, scratch,
                                   caches[0].kind)  # a model's caches are of one type
        return out

    def scratch(
        self, capacity: int, layers: range, n: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        """One buffer pair for every layer (the widest layer's needs), per cache capacity and
        number of sequences; a new pair only for a larger one."""
        held = self._scratch.get((capacity, n))
        if held is None:
            self._scratch.clear()  # keep one pair: the last shape asked for
            pairs = [kernels.ds_scratch(b.struct, capacity, n) for b in self._built(layers)]
            held = (max((p[0] for p in pairs), key=len), max((p[1] for p in pairs), key=len))
            self._scratch[(capacity, n)] = held
        return held

    def _built(self, layers: range) -> list[FusedLayer]:
        return [b for b in (self.layer(i) for i in layers) if b is not None]

    def layer(self, i: int) -> FusedLayer | None:
        if i not in self._layers:
            self._layers[i] = self._build(i)
        return self._layers[i]

    def _build(self, layer: int) -> FusedLayer | None:
        m, c, w, p = self.model, self.model.config, self.model.w, f"blk.{layer}."
        keep: list[Any] = []
        names = ["attn_kv_a_mqa", "attn_output"]
        names += ["attn_q_a", "attn_q_b"] if c.q_lora_rank else ["attn_q"]
        moe = c.is_moe(layer)
        if not moe:
            names += ["ffn_gate", "ffn_up", "ffn_down"]
        elif c.n_shared_experts:
            names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
        mats: dict[str, Args] = {}
        for n in names:
            t = w.matrix(p + n + ".weight")
            a = _args(t)
            if a is None:
                return None
            mats[n] = a
            keep.append(t)
        kb_vb = self._kv_up(layer, keep)
        if kb_vb is None:
            return None
        exps = {"gate": NO_MAT, "up": NO_MAT, "down": NO_MAT}
        strides = {"gate": 0, "up": 0, "down": 0}
        held = None
        router = NO_MAT
        if moe:
            r = w.matrix(p + "ffn_gate_inp.weight")
            router_args = _args(r, float32_ok=True)
            if router_args is None:
                return None
            router = router_args
            keep.append(r)
            for k in exps:
                stack = w.experts(f"{p}ffn_{k}_exps.weight")
                # not where a cache serves the experts from slow memory (the tiered engine)
                a = _args(stack, repack=m.remote_experts is None)
                if a is None:
                    return None
                exps[k], strides[k] = a, stack.data.strides[0]
                keep.append(stack)
                held = np.zeros(c.n_experts, np.uint8)
                held[list(stack.held)] = 1
            keep.append(held)
        vec = {n: w.optional_vector(p + n) for n in (
            "attn_norm.weight", "ffn_norm.weight", "attn_q_a_norm.weight",
            "attn_kv_a_norm.weight", "exp_probs_b.bias")}  # fmt: skip
        vec = {n: None if a is None else np.ascontiguousarray(a, np.float32)
               for n, a in vec.items()}  # fmt: skip
        keep.append(vec)
        shared = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
        dense = ("ffn_gate", "ffn_up", "ffn_down")
        ffn = [mats.get(n, NO_MAT) for n in (dense if not moe else shared)]
        struct = kernels.DsLayer(
            *[kernels.Mat(*mats.get(n, NO_MAT)) for n in ("attn_q_a", "attn_q_b", "attn_q",
                                                          "attn_kv_a_mqa")],
            kernels.Mat(*kb_vb[0]), kernels.Mat(*kb_vb[1]), kernels.Mat(*mats["attn_output"]),
            *[kernels.Mat(*a) for a in ffn],
            kernels.Mat(*router),
            *[kernels.Mat(*exps[k]) for k in ("gate", "up", "down")],
            strides["gate"], strides["up"], strides["down"],
            kernels.ptr(held), *[kernels.ptr(a) for a in vec.values()],
            c.d_model, c.n_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_dim, c.qk_rope_dim,
            c.v_head_dim, c.ffn_dim, c.moe_ffn_dim, c.n_experts, c.n_experts_used, c.n_groups,
            c.topk_groups, int(c.gating == "sigmoid"), int(c.norm_topk_prob), int(moe),
            c.rms_eps, _latent_eps(), m.scale, c.routed_scaling_factor,
        )  # fmt: skip
        return FusedLayer(struct, keep)

    def _kv_up(self, layer: int, keep: list[Any]) -> tuple[Args, Args] | None:
        """W_UK^T per head (H, L, N) and W_UV (H, V, L) as matrices: packed from attn_k_b /
        attn_v_b (Q5_0 as the same values in Q8_0), else float32 from the model's decoded
        copies."""
        m, c, p = self.model, self.model.config, f"blk.{layer}."
        lat, nope, v = c.kv_lora_rank, c.qk_nope_dim, c.v_head_dim
        if p + "attn_k_b.weight" in m.w:
            k_b, v_b = m.w[p + "attn_k_b.weight"], m.w[p + "attn_v_b.weight"]
            if isinstance(k_b, PackedMatrix | PackedExperts) and isinstance(
                v_b, PackedMatrix | PackedExperts
            ):
                ka, va = (_q5_0_args(t, keep) if t.fmt.name == "Q5_0"
                          else _args(t, float32_ok=True) for t in (k_b, v_b))  # fmt: skip
                if ka is not None and va is not None:
                    keep += [k_b, v_b]
                    # rows per head (the stack may have come flattened to (H * rows, cols))
                    return (ka[0], ka[1], ka[2], lat, ka[4]), (va[0], va[1], va[2], v, va[4])
        w_uk, w_uv = m.absorbed(layer)  # (H, N, L) as a view of (H, L, N) rows, (H, V, L)
        uk_t = w_uk.transpose(0, 2, 1)  # (H, L, N), contiguous: no copy
        assert uk_t.flags.c_contiguous
        keep += [uk_t, w_uv]
        assert uk_t.shape[1:] == (lat, nope) and w_uv.shape[1:] == (v, lat)
        return _float_args(uk_t), _float_args(w_uv)


def _latent_eps() -> float:
    from cellswarm.models.deepseek2 import LATENT_NORM_EPS

    return LATENT_NORM_EPS


def _routing(ids: np.ndarray, weights: np.ndarray) -> Any:
    from cellswarm.models.deepseek2 import Routing

    return Routing(ids[None].astype(np.int64), weights[None].astype(np.float32))
