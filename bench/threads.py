"""Decode speed with 1 and 2 threads, on a quiet machine and beside a busy process.

    python -m bench.threads [--tokens 96] [--repeats 3] [--threads 1,2] [--env K=V ...]

Each figure is the demo model's decode tokens/s in a fresh process (the OpenMP runtime reads
its environment once, when the kernels load), the best of --repeats runs. "hog" runs start a
process of our own spinning on one core (`while True: pass`), as a busy neighbour would, and
stop it after. Prints the ratio the kernels' thread policy is judged by: 2 threads beside a
hog against 1 thread beside it (above ~0.9: the second thread does not hold the first), and
2 threads quiet against 1 thread quiet. The machine's other load is not controlled: repeat,
and read the figures as best-of.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DECODE = """
import cellswarm  # first, as the CLI does (its settings for numpy's threads)
import time, numpy as np
from cellswarm import kernels
from cellswarm.kernels.awake import awake
from cellswarm.demo import demo_model_path
from cellswarm.loader import load
threads = {threads}
kernels.set_threads(threads or None)
m = load(demo_model_path())
ids = np.random.default_rng(0).integers(0, m.config.vocab_size, 8)
cache = m.new_cache(8 + {tokens} + 2)
with awake(kernels.threads() > 1):  # as a generation does (kernels/awake.py)
    m.step(ids, cache)
    m.step(ids[:1], cache)
    t0 = time.perf_counter()
    for _ in range({tokens}):
        m.step(ids[:1], cache)
    rate = {tokens} / (time.perf_counter() - t0)
print(rate, kernels.threads())
"""


def decode_rate(
    threads: int, tokens: int, env: dict[str, str], source: Path | None = None
) -> tuple[float, int]:
    """Decode tokens/s of the demo model in a new process; threads 0: the default. -> (rate,
    threads the kernels used)."""
    code = DECODE.format(threads=threads, tokens=tokens)
    cwd = source or Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=cwd,
        env={**os.environ, **env},
    )  # fmt: skip
    rate, used = out.stdout.split()
    return float(rate), int(used)


@contextmanager
def hog(on: bool) -> Iterator[None]:
    """A process of ours keeping one core busy for the block's duration."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="comma-separated; 0 = the default")
    parser.add_argument(
        "--env", action="append", default=[], metavar="K=V",
        help="environment of the decoding processes, e.g. GOMP_SPINCOUNT=0",
    )  # fmt: skip
    parser.add_argument("--source", type=Path, help="another checkout's cellswarm (before/after)")
    args = parser.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    counts = [int(t) for t in args.threads.split(",")]
    rates: dict[tuple[bool, int], float] = {}
    for busy in (False, True):
        with hog(busy):
            best = {t: 0.0 for t in counts}
            used = dict.fromkeys(counts, 0)
            for _ in range(args.repeats):  # interleaved, so drifting load hits every count alike
                for t in counts:
                    rate, used[t] = decode_rate(t, args.tokens, env, args.source)
                    best[t] = max(best[t], rate)
        for t in counts:
            rates[busy, t] = best[t]
            label = f"{t} threads" if t else f"default ({used[t]})"
            where = "hog" if busy else "quiet"
            print(f"{where:<6} {label:<12} {best[t]:7.1f} tokens/s", flush=True)
    if 1 in counts and 2 in counts:
        print(f"2 threads / 1 thread: quiet {rates[False, 2] / rates[False, 1]:.2f}, "
              f"beside a hog {rates[True, 2] / rates[True, 1]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
