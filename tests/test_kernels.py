"""Fast kernels against the reference codec path: random packed blocks, odd shapes, batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cellswarm import kernels
from cellswarm.quant import PackedMatrix, format_by_name
from tests.random_blocks import random_blocks

pytestmark = pytest.mark.skipif(kernels.backend() != "c", reason="no C compiler on this machine")

# every quantized format the kernels read as stored (the low-bit ones: kernels/lowbit.c)
QUANT = list(kernels.FUSED_TYPES)
FLOAT = ["F16", "BF16"]
SCALE_OFFSETS = {  # where each block keeps its f16 scales: keep them small and finite
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82),
}  # fmt: skip


def random_packed(name: str, rows: int, cols: int, seed: int = 0) -> PackedMatrix:
    """Random bytes in every block, with sane float16 scales (random bytes can be NaN)."""
    fmt = format_by_name(name)
    rng = np.random.default_rng(seed)
    nb = cols // fmt.block_size
    data = rng.integers(0, 256, (rows, nb, fmt.type_size), dtype=np.uint8)
    if name not in SCALE_OFFSETS and name not in FLOAT:  # the low-bit formats
        blocks = random_blocks(fmt, (rows, cols), rng, lo=0.001, hi=0.02)
        return PackedMatrix(blocks, fmt)
    for off in SCALE_OFFSETS.get(name, ()):
        scales = rng.uniform(0.001, 0.02, (rows, nb)).astype(np.float16)
        data[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, nb, 2)
    if name in FLOAT:
        data = rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
        if name == "BF16":
            data = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16
            data = data.astype(np.uint16).view(np.uint8)
    return PackedMatrix(data.reshape(rows, -1), fmt)


def reference_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The activation quantization the kernels run, in numpy: per 32, d = amax/127,
    q = roundf(x * (1/d)) with halves away from zero."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = blocks * inv[..., None]
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    return q.reshape(x.shape), d


def split_outliers(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's outliers as take_outliers picks them (kernels.outlier_rule): up to `count`
    times the largest value left outside the blocks passed over (the first on ties), taken
    out if it is more than `dominance` times every other value of its block of 32, else its
    block passed over. -> (x with them at zero, them alone)."""
    rest, out = x.astype(np.float32).copy(), np.zeros_like(x, dtype=np.float32)
    count, dominance = kernels.outlier_rule(x.shape[1])
    for r in range(x.shape[0]):
        passed = np.zeros(x.shape[1] // 32, bool)
        for _ in range(count):
            mag = np.where(np.repeat(passed, 32), 0, np.abs(rest[r]))
            j = int(mag.argmax())
            if mag[j] == 0:
                break
            others = np.delete(np.abs(rest[r, j // 32 * 32 : j // 32 * 32 + 32]), j % 32)
            if not mag[j] > np.float32(dominance) * others.max():
                passed[j // 32] = True
                continue
            out[r, j], rest[r, j] = rest[r, j], 0
    return rest, out


def codec_reference(name: str, w: PackedMatrix, x: np.ndarray) -> np.ndarray:
    """x @ W.T in float64 from the codec's weights and the kernels' activations (float for float
    weights; else each row's few largest values in float and the rest as int8 blocks): what the
    fused kernels compute, up to summation order."""
    xr = x.astype(np.float64)
    if name not in FLOAT:
        rest, out = split_outliers(x)
        q, d = reference_act(rest)
        xr = (q.reshape(x.shape[0], -1, 32) * d[..., None].astype(np.float64)).reshape(x.shape)
        xr += out
    return xr @ w.dequantize().astype(np.float64).T


def assert_close_to_codec(out: np.ndarray, name: str, w: PackedMatrix, x: np.ndarray) -> None:
    ref = codec_reference(name, w, x)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_activation_quantization_is_exact() -> None:
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32) * 5
    x[1, :32] = 0  # an all-zero block
    xq, xd, xs = kernels.quantize_act(x)
    q, d = reference_act(x)
    np.testing.assert_array_equal(xq, q)
    np.testing.assert_array_equal(xd, d)
    np.testing.assert_array_equal(xs, q.reshape(3, -1, 16).astype(np.int32).sum(-1))


@pytest.mark.parametrize("name", QUANT)
def test_a_nan_or_infinite_activation_makes_nan_outputs(name: str) -> None:
    """As float math does: the int8 quantization must not turn a NaN into a finite value
    (fmaxf skips NaNs), or a corrupt weight's NaN would vanish a matmul later."""
    m = random_packed(name, 8, 256)
    x = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    x[0, 40], x[2, 200] = np.nan, np.inf
    y = m.matmul(x)
    assert np.isnan(y[0]).all() and np.isnan(y[2]).all() and np.isfinite(y[1]).all()
    xq, xd, _ = kernels.quantize_act(x)
    assert np.isnan(xd[0, 1]) and np.isfinite(np.delete(xd[0], 1)).all() and not xq[0, 32:64].any()


@pytest.mark.parametrize("name", QUANT + FLOAT)
@pytest.mark.parametrize(("rows", "cols", "batch"), [(7, 256, 1), (33, 512, 3), (5, 1024, 16)])
def test_fused_matmul_equals_codec_path(name: str, rows: int, cols: int, batch: int) -> None:
    w = random_packed(name, rows, cols)
    x = np.random.default_rng(2).standard_normal((batch, cols)).astype(np.float32)
    out = np.empty((batch, rows), np.float32)
    kernels.matmul(name, np.ascontiguousarray(w.data), cols, x, out)
    assert_close_to_codec(out, name, w, x)


def with_outliers(batch: int, cols: int, seed: int) -> np.ndarray:
    """Activations as a trained model's: in each row three values 20-100x the rest, each in a
    block of its own, and a block whose largest value (8x) does not dominate it (-6x)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    for r in range(batch):
        b = rng.choice(cols // 32, 4, replace=False) * 32 + rng.integers(0, 31, 4)
        x[r, b[:3]] = rng.choice([-1, 1], 3) * rng.uniform(20, 100, 3)
        x[r, b[3]], x[r, b[3] + 1] = 8.0, -6.0
    return x


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_outliers_are_multiplied_in_float(name: str, batch: int) -> None:
    """A vector's few dominant values leave their int8 blocks and are multiplied in float: the
    result is the codec path's with them exact (each row its own), and closer to float math
    than int8 blocks alone."""
    cols = {256: 1024, 64: 640}.get(format_by_name(name).block_size, 608)
    w = random_packed(name, 37, cols, seed=batch)
    x = with_outliers(batch, cols, seed=batch)
    _, out = split_outliers(x)
    assert (np.count_nonzero(out, axis=1) == 3).all()
    y = w.matmul(x)
    assert_close_to_codec(y, name, w, x)
    exact = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    q, d = reference_act(x)  # int8 blocks alone
    plain = (q.reshape(batch, -1, 32) * d[..., None].astype(np.float64)).reshape(x.shape)
    plain_err = np.abs(plain @ w.dequantize().astype(np.float64).T - exact).mean()
    assert np.abs(y - exact).mean() < 0.5 * plain_err
    for r in range(batch):  # a row of a batch is the same bits as that row alone
        np.testing.assert_array_equal(w.matmul(x[r : r + 1])[0], y[r])


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_fused_matmul_odd_block_counts(name: str, batch: int) -> None:
    """Rows whose block count is not a multiple of the kernels' groups (16 blocks of 32, pairs;
    3 blocks of 256), as in d_model 576 or 608: the tails take the masked paths."""
    size = format_by_name(name).block_size
    for cols in ((32 * 19, 32 * 18, 32 * 3, 32) if size == 32 else (64 * 5, 64) if size == 64
                 else (256 * 3, 256)):  # fmt: skip
        w = random_packed(name, 11, cols, seed=cols)
        x = np.random.default_rng(cols).standard_normal((batch, cols)).astype(np.float32)
        out = np.empty((batch, 11), np.float32)
        kernels.matmul(name, np.ascontiguousarray(w.data), cols, x, out)
        assert_close_to_codec(out, name, w, x)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "F16"])
def test_threads_and_chunks_do_not_change_bits(name: str) -> None:
    """Big enough to be split over threads (dynamic chunks of rows): every row is computed by
    one thread alone, so the result is the same bits at 1 and 2 threads."""
    w = random_packed(name, 1500, 1024)
    x = np.random.default_rng(6).standard_normal((3, 1024)).astype(np.float32)
    before = kernels.threads()
    try:
        outs = []
        for n in (1, 2):
            kernels.set_threads(n)
            outs.append([w.matmul(x[:1]), w.matmul(x)])
    finally:
        kernels.set_threads(before)
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "flags",
    [("-mno-avx512vbmi",), ("-mno-avx512f",),
     ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")],
    ids=["avx512-no-vbmi", "avx2", "portable"],
)  # fmt: skip
def test_other_instruction_set_paths_equal_codec_path(flags: tuple[str, ...]) -> None:
    """This CPU's kernels take the AVX-512 paths; the others (AVX-512 without byte permutes as
    on Cascade Lake, AVX2 as on older x86, the plain C loops of aarch64 and ppc64) are built
    here with those extensions turned off, and checked. Skipped where the CPU lacks them."""
    import ctypes

    cpu = kernels._cpu_signature()
    if flags == ("-mno-avx512vbmi",) and not {"avx512vbmi", "avx512_vnni"} <= set(cpu.split()):
        pytest.skip("no AVX-512 VBMI and VNNI here: the default build is that path already")
    lib = ctypes.CDLL(str(kernels.build(extra=flags)))
    kernels._declare(lib)
    lib.cs_set_threads(1)
    for name in QUANT + FLOAT:
        tail = 608 if format_by_name(name).block_size == 32 else 512  # a tail of 3 blocks of 32
        for rows, cols, batch in ((7, tail, 1), (33, 1024, 3)):
            w = random_packed(name, rows, cols)
            x = np.random.default_rng(2).standard_normal((batch, cols)).astype(np.float32)
            out = np.empty((batch, rows), np.float32)
            data = np.ascontiguousarray(w.data)
            kind, code, ptr, _, row_bytes = kernels.weight_args(name, data, cols)
            if kind:
                lib.cs_matmul_f(code, ptr, rows, cols, x.ctypes.data, batch, out.ctypes.data)
            else:
                args = (code, ptr, rows, row_bytes, cols, x.ctypes.data, batch, out.ctypes.data)
                lib.cs_matmul_qx(*args)
            assert_close_to_codec(out, name, w, x)


@pytest.mark.parametrize("name", QUANT)
def test_dequantize_equals_codec(name: str) -> None:
    w = random_packed(name, 9, 512)
    out = np.empty((9, 512), np.float32)
    kernels.dequantize(name, np.ascontiguousarray(w.data), 512, out)
    np.testing.assert_array_equal(out, w.dequantize())


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "F16"])
def test_packed_matmul_dispatch_matches_numpy_backend(name: str) -> None:
    """The same PackedMatrix through both backends, incl. a non-contiguous input and a batch
    bigger than MAX_BATCH (int8 activations at any batch, as decode: kernels/exact.c)."""
    w = random_packed(name, 40, 512)
    base = np.random.default_rng(3).standard_normal((40, 1024)).astype(np.float32)
    for x in (base[:1, ::2], base[:5, :512], base[:, 512:]):  # strided, small batch, large
        fast = w.matmul(x)
        kernels.use("numpy")
        try:
            slow = w.matmul(x)
        finally:
            kernels.use("c")
        tol = 1e-5 if name == "F16" else 2e-2
        np.testing.assert_allclose(fast, slow, rtol=tol, atol=tol * np.abs(slow).max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_quantized_model_fast_path_vs_reference_path(tmp_path: Path, arch: str) -> None:
    """A tiny llama re-packed as Q8_0: the fused path (int8 activations) against the numpy
    codec path (float activations) through prefill and decode; 5e-2 of the largest logit,
    see test_demo_model.py for why."""
    import cellswarm
    from tests.conftest import max_rel_diff, prefill_then_decode
    from tests.hf_reference import LLAMA_FAMILY, build_hf_model, save_hf

    folder = save_hf(build_hf_model(LLAMA_FAMILY[arch]), tmp_path / "m")
    model = cellswarm.load(folder, quant="q8_0")
    ids = np.random.default_rng(0).integers(0, 128, 24)
    fast = prefill_then_decode(model, ids, 8)  # 8-token prefill, 16 decode steps: fused layers
    # the decode steps above ran the fused layers: one layer of it by hand, against the
    # layer-by-layer path (the same int8 kernels, called per matrix)
    h = model.arch.embed(ids[:1])  # (1, d)
    fused = model.arch.decode_fused(h, np.arange(1), model.new_cache(1), range(1))
    assert fused is not None and fused.shape == h.shape
    by_layer = model.arch.block(0, h, np.arange(1), model.new_cache(1).layer(0))
    np.testing.assert_allclose(fused, by_layer, rtol=0, atol=1e-4 * np.abs(by_layer).max())
    with kernels.using("numpy"):
        slow = prefill_then_decode(model, ids, 8)
    assert max_rel_diff(fast, slow) <= 5e-2


def test_refined_head_candidates_are_the_float_logits() -> None:
    from cellswarm.models.ops import refine_top

    w = random_packed("Q8_0", 500, 256)
    h = np.random.default_rng(4).standard_normal((2, 256)).astype(np.float32)
    logits = w.matmul(h)  # fused: int8 activations
    refine_top(logits, w, h, k=8)
    exact = h @ w.dequantize().T
    for r in range(2):
        top = np.argsort(-logits[r])[:8]
        np.testing.assert_allclose(logits[r, top], exact[r, top], rtol=1e-5, atol=1e-4)
        assert np.argmax(logits[r]) == np.argmax(exact[r])


@pytest.mark.parametrize(
    ("size", "k", "rounding"),
    [(5, 5, None), (40, 32, None), (600, 32, None), (49152, 32, None), (49152, 32, 1),
     (151936, 64, 0), (49152, 1, None)],
)  # fmt: skip
def test_top_k_finds_the_k_largest_whatever_the_ties(size: int, k: int, rounding: int) -> None:
    from cellswarm.models.ops import top_k

    x = np.random.default_rng(size + k).standard_normal(size).astype(np.float32)
    if rounding is not None:
        x = np.round(x, rounding)  # many ties, at the k-th value too
    got = top_k(x, k)
    assert len(set(got.tolist())) == k
    np.testing.assert_array_equal(np.sort(x[got]), np.sort(x)[size - k :])


@pytest.mark.parametrize(("t", "s"), [(1, 7), (5, 5), (128, 300), (3, 40)])
def test_prefill_attention_softmax_matches_numpy(t: int, s: int) -> None:
    """ops.attention's softmax in C (scale, causal mask, softmax in one pass) against the numpy
    path: t queries at the last t of s positions, grouped query heads."""
    from unittest import mock

    from cellswarm.models import ops

    rng = np.random.default_rng(t * s)
    q = rng.standard_normal((t, 8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((2, s, 64)).astype(np.float32) for _ in range(2))
    fast = ops.attention(q, k, v, 0.125)
    with mock.patch.object(kernels, "enabled", lambda: False):
        ref = ops.attention(q, k, v, 0.125)
    assert np.abs(fast - ref).max() < 1e-5 * np.abs(ref).max()


def test_prefill_attention_softmax_keeps_a_nan() -> None:
    """A NaN in a query makes its heads' outputs NaN, as numpy's softmax does (exp_neg clamps
    its input, so the C softmax tests each row first): the layer's check then names it."""
    from cellswarm.models import ops

    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((2, 10, 64)).astype(np.float32) for _ in range(2))
    q[2, 3, 5] = np.nan
    out = ops.attention(q, k, v, 0.125)
    assert np.isnan(out[2, 3]).all() and np.isfinite(np.delete(out.reshape(32, 64), 19, 0)).all()


def test_silu_matches_float64_and_keeps_nan_and_infinities() -> None:
    """The fused layers' silu (vectorized exp, clamped on its bits): within 2e-7 of float64
    where it is not ~0, and NaN, infinities and the far ends as numpy's float32 silu."""
    g = np.linspace(-100, 100, 20001, dtype=np.float32)
    out = kernels.silu_mul(g[None].copy(), np.ones_like(g)[None])[0]
    ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
    big = np.abs(ref) > 1e-30
    assert (np.abs(out[big] - ref[big]) / np.abs(ref[big])).max() < 2e-7
    assert np.abs(out[~big]).max() < 1e-30
    ends = np.array([np.nan, np.inf, -np.inf, 3e38, -3e38, -1e4, 1e4], np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        ref32 = ends / (np.float32(1) + np.exp(-ends))
    out = kernels.silu_mul(ends[None].copy(), np.ones_like(ends)[None])[0]
    assert np.array_equal(out, ref32, equal_nan=True)


@pytest.mark.parametrize("layout", ["norm", "neox"])
@pytest.mark.parametrize(("d", "dim"), [(128, 128), (96, 32)])
def test_rope_in_c_is_the_numpy_rope_bit_for_bit(layout: str, d: int, dim: int) -> None:
    """ops.rope (the fused layers' rope over the tokens) against Rope.apply: partial rotary
    dims too (DeepSeek's), and YaRN's attention factor in the tables."""
    from cellswarm.models import ops
    from cellswarm.models.rope import Rope, base_inv_freq

    r = Rope(dim, base_inv_freq(dim, 10000.0), layout, 1.3)
    x = np.random.default_rng(d + dim).standard_normal((37, 5, d)).astype(np.float32)
    positions = np.arange(100, 137)
    fast, ref = ops.rope(r, x, positions), r.apply(x, positions)
    assert np.array_equal(fast.view(np.uint32), ref.view(np.uint32))
