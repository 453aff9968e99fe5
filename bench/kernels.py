"""Fused kernels: effective weight bandwidth of one matrix-vector product, against memory.

    python -m bench.kernels [--quick]

For every format, threads (1, 2) and packed matrix size (0.5 MB to 64 MB), prints GB/s of
packed weight bytes streamed per matvec and its ratio to this machine's streaming-read
bandwidth, measured in the same run (a float32 GEMV over 512 MB, all threads). Matrices
bigger than the last-level cache are the ones that say what decode will do. A format this
CPU repacks at load (16-row groups: kernels.repack) gets a second line, "FMT r16", read as
a loaded model reads it; the first line is the row kernel (a tail row, or another CPU).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.engine import read_bandwidth_bytes_per_s
from cellswarm import kernels
from cellswarm.quant import PackedMatrix, format_by_name
from cellswarm.quant.formats import quantize

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q2_K", "F16", "BF16"]
SIZES_MB = [0.5, 2, 8, 32, 64]
COLS = 4096

K_BLOCK = {  # bytes, where its f16s are, how many
    "Q4_K": (144, 0, 2), "Q6_K": (210, 208, 1), "Q2_K": (84, 80, 2), "Q3_K": (110, 108, 1),
    "Q5_K": (176, 0, 2), "TQ2_0": (66, 64, 1), "IQ4_XS": (136, 0, 1), "IQ4_NL": (18, 0, 1),
    "IQ1_S": (50, 0, 1), "IQ2_XXS": (66, 0, 1), "IQ1_M": (56, 48, 0), "IQ2_XS": (74, 0, 1),
    "IQ3_XXS": (98, 0, 1), "IQ3_S": (110, 0, 1), "IQ2_S": (82, 0, 1), "TQ1_0": (54, 52, 1),
    "MXFP4": (17, 0, 0),
}


def random_weights(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random packed rows with a model's small, finite scales: the formats cellswarm writes
    quantized from normal floats, the rest (which it reads but does not write) as random
    blocks with small f16 scales: Q4_K's and Q5_K's d and dmin first, Q6_K's and Q3_K's d
    and Q2_K's d and dmin last."""
    if name not in K_BLOCK:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), format_by_name(name))
    size, at, n = K_BLOCK[name]
    nb = cols // format_by_name(name).block_size
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (rows, nb, n)).astype(np.float16)
    blocks[..., at : at + 2 * n] = scales.view(np.uint8).reshape(rows, nb, 2 * n)
    if name == "MXFP4":  # its E8M0 scale, 2^(e - 128): near 2^-7, and the extremes
        blocks[..., 0] = rng.integers(115, 125, (rows, nb))
        blocks[0, 0, 0], blocks[-1, -1, 0] = 0, 1
    if name == "IQ1_M":  # its d: an f16's 4 nibbles, the top nibble of each scale word
        bits = rng.uniform(1e-3, 1e-2, (rows, nb)).astype(np.float16).view(np.uint16)
        for k in range(4):
            top = blocks[..., at + 2 * k + 1] & 0x0F
            blocks[..., at + 2 * k + 1] = top | (((bits >> (4 * k)) & 0xF) << 4).astype(np.uint8)
    return blocks.reshape(rows, -1)


def random_matrix(name: str, nbytes: float) -> PackedMatrix:
    fmt = format_by_name(name)
    row_bytes = fmt.row_bytes(COLS)
    rows = max(1, int(nbytes // row_bytes))
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    if name in ("F16", "BF16"):  # finite values; quantized scales may be anything, speed-wise
        data = rng.standard_normal((rows, COLS)).astype(np.float16).view(np.uint8)
    return PackedMatrix(data, fmt)


def repacked(w: PackedMatrix) -> PackedMatrix | None:
    """w laid out in 16-row groups as a model's load lays it (PackedMatrix.repack, which only
    repacks a file's pages), or None where this CPU has no such layout for the format."""
    out = kernels.repack(w.fmt.name, w.data)
    if out is None:
        return None
    r = PackedMatrix(w.data, w.fmt)
    r._repacked = out  # a bench's shortcut past the file-pages rule (repack())
    return r


def seconds_per_matvec(w: PackedMatrix) -> float:
    x = np.random.default_rng(1).standard_normal((1, COLS)).astype(np.float32)
    w.matmul(x)
    repeats = max(3, int(2e8 // w.nbytes))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            w.matmul(x)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="largest size only")
    args = parser.parse_args()
    bw = read_bandwidth_bytes_per_s()
    print(f"kernels: {kernels.backend()}; streaming-read bandwidth: {bw / 1e9:.2f} GB/s")
    sizes = SIZES_MB[-1:] if args.quick else SIZES_MB
    print(f"{'format':<8} {'threads':>7} " + " ".join(f"{s:>6g}MB" for s in sizes))
    for name in FORMATS:
        for layout in ("", " r16"):
            for threads in (1, 2):
                kernels.set_threads(threads)
                cells = []
                for mb in sizes:
                    w: PackedMatrix | None = random_matrix(name, mb * 1e6)
                    if layout and w is not None:
                        w = repacked(w)
                    if w is None:
                        break
                    gbs = w.nbytes / seconds_per_matvec(w)
                    cells.append(f"{gbs / 1e9:4.1f}/{gbs / bw:.2f}")
                if cells:
                    row = f"{name}{layout}"
                    print(f"{row:<8} {threads:>7} " + " ".join(f"{c:>8}" for c in cells))
    kernels.set_threads(None)
    print("cells: GB/s of packed weights / ratio to streaming-read bandwidth")


if __name__ == "__main__":
    main()
