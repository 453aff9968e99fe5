"""The runtime's own memory: what an idle worker process holds before it loads any weight.

Measured, not guessed: a fresh interpreter imports what a worker imports (numpy, the engine,
the GGUF reader, the architecture files), loads the fused kernels (a cached shared object
and the OpenMP runtime: +0.4 MiB, see bench/engine.py), runs one small matmul so BLAS has set
up its threads, and reports its resident set. The figure shipped in data/runtime.toml was measured
this way (`cellswarm plan --measure-overhead` re-measures and prints it).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import resources

IDLE_WORKER = """
import re
import numpy as np
import cellswarm.engine.model, cellswarm.io.gguf_file, cellswarm.models.llama
import cellswarm.models.deepseek2
from cellswarm import kernels
kernels.enabled()  # the fused kernels' shared object and OpenMP runtime, as a worker has them
a = np.ones((64, 64), np.float32)
a @ a
print(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
"""


def measure_idle_worker_rss_bytes() -> int:
    out = subprocess.run(
        [sys.executable, "-c", IDLE_WORKER], capture_output=True, text=True, check=True, timeout=120
    )
    return int(out.stdout.strip()) * 1024


def stored_overhead() -> dict[str, object]:
    text = resources.files("cellswarm.planner").joinpath("data/runtime.toml").read_text()
    return tomllib.loads(text)["idle_worker"]


def runtime_overhead_bytes() -> int:
    return int(stored_overhead()["rss_bytes"])  # type: ignore[call-overload]
