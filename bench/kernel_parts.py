"""What a kernel's parts cost: each format's 16-row groups built as shipped and with one
part taken out, one thread, a model's shape (2816 x 1024: an FFN's up matrix).

    python -m bench.kernel_parts [--formats IQ3_XXS,Q5_K] [--rounds 2]

Two parts, each taken out by a build flag that makes the kernels give WRONG answers (a
build of its own, in its own cache entry; never a node's):

- `terms`: the same-bits order's float term per unit (16 or 32 weights) and activation row,
  `A + (float)n * (ws * xd)`, cut to `A + (float)n` (CELLSWARM_MEASURE_CHEAP_TERMS). A
  convert and an add is about what llama.cpp pays per unit for its integer sub-scale before
  one float term per 256-weight block, so the prefill ratio is what taking the block as the
  unit could give (docs/same-bits.md). Measured on a 256-token prefill.
- `gathers`: the codebook formats' grid gathers replaced by arithmetic on the index
  (CELLSWARM_MEASURE_NO_GATHERS; AVX-512 only). Measured on one token (decode).

Prints Gw/s (weights multiplied a second) as shipped and with the part out, and their ratio:
1.30 means that part is 23% of the kernel's time. Rounds alternate the builds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PARTS = {"terms": ("-DCELLSWARM_MEASURE_CHEAP_TERMS", 256),
         "gathers": ("-DCELLSWARM_MEASURE_NO_GATHERS", 1)}  # fmt: skip
FORMATS = ["Q4_0", "Q4_K", "Q5_K", "Q3_K", "Q6_K", "IQ4_XS", "IQ3_XXS", "IQ2_XS", "IQ2_XXS",
           "IQ1_M", "IQ1_S"]  # fmt: skip
ROWS, COLS = 2816, 1024


def gw_per_s(name: str, nx: int, repeats: int) -> float:
    """Best of `repeats` products of a random ROWS x COLS weight in `name` by nx rows, one
    thread, as this process's kernels build computes them."""
    import time

    import numpy as np

    from bench.kernels import random_weights
    from cellswarm import kernels

    kernels.set_threads(1)
    rng = np.random.default_rng(0)
    repacked = kernels.repack(name, random_weights(name, ROWS, COLS, rng))
    if repacked is None:
        raise SystemExit(f"{name}: no 16-row groups on this CPU (needs AVX-512 VNNI and VBMI)")
    code, w = repacked
    x = rng.standard_normal((nx, COLS)).astype(np.float32)
    out = np.empty((nx, ROWS), np.float32)
    args = (0, code, int(w.ctypes.data), *w.shape)
    best = float("inf")
    for _ in range(repeats + 1):  # the first builds and warms
        t0 = time.perf_counter()
        kernels.matmul_args(args, COLS, x, out)
        best = min(best, time.perf_counter() - t0)
    return ROWS * COLS * nx / best / 1e9


def measure(name: str, nx: int, flag: str) -> float:
    """gw_per_s in a fresh process whose kernels are built with `flag` added."""
    flags = f"{os.environ.get('CELLSWARM_CFLAGS', '')} {flag}".strip()
    env = dict(os.environ, CELLSWARM_CFLAGS=flags)
    repeats = 50 if nx == 1 else 9
    code = f"from bench.kernel_parts import gw_per_s; print(gw_per_s({name!r}, {nx}, {repeats}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    parser.add_argument("--parts", default=",".join(PARTS), help="terms, gathers")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    args = parser.parse_args()
    print(f"{ROWS} x {COLS}, one thread; Gw/s as shipped -> without the part (ratio)")
    for part in args.parts.split(","):
        flag, nx = PARTS[part]
        for name in args.formats.split(","):
            shipped, without = [], []
            for _ in range(args.rounds):
                shipped.append(measure(name, nx, ""))
                without.append(measure(name, nx, flag))
            a, b = max(shipped), max(without)
            if args.json:
                print(json.dumps({"part": part, "format": name, "tokens": nx, "shipped_gw_s": a,
                                  "without_gw_s": b, "ratio": b / a}))  # fmt: skip
            else:
                print(f"{part:8} {name:8} {nx:4} tokens  {a:6.1f} -> {b:6.1f}  ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
