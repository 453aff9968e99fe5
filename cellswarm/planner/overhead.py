"""The runtime's own costs, measured and stored in data/runtime.toml: the memory an idle
worker process holds before it loads any weight, the time it spends per step besides the
kernels, and the control-plane bytes every node exchanges with the coordinator.

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
from dataclasses import replace
from importlib import resources
from typing import Any

from cellswarm.planner.cost import CostOptions
from cellswarm.planner.network import ControlTraffic

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


def _stored() -> dict[str, Any]:
    text = resources.files("cellswarm.planner").joinpath("data/runtime.toml").read_text()
    return tomllib.loads(text)


def stored_overhead() -> dict[str, object]:
    return dict(_stored()["idle_worker"])


def software_cost(opts: CostOptions | None = None) -> CostOptions:
    """`opts` with the runtime's measured time per stage step and per message."""
    sw = _stored()["software"]
    step_s, hop_s = float(sw["stage_step_s"]), float(sw["hop_s"])
    return replace(opts or CostOptions(), stage_step_s=step_s, hop_s=hop_s)


def control_traffic(heartbeat_s: float | None = None) -> ControlTraffic:
    """The measured control plane per node, at this heartbeat interval (default: the
    coordinator's)."""
    c = _stored()["control"]
    every_s = float(c["heartbeat_s"]) if heartbeat_s is None else heartbeat_s
    return ControlTraffic(float(c["heartbeat_bytes"]) / every_s, float(c["head_bytes_per_s"]))


# This process's own runtime, when it noted it (a worker does, at start): see note_runtime
_noted_bytes = 0


def note_runtime_bytes(rss_bytes: int) -> None:
    """A worker's resident set at start, before it holds any weight: its runtime on this
    machine. The stored figure measures the engine's imports only; a worker also holds its
    HTTP and TLS clients, its event loop and threads (52.9 against 40.5 MB here, 2026-12-07),
    and a budget that counted the smaller figure let a 128 MiB node's peak pass --memory by
    up to a MB. Counted where it is the larger; the planner, with no worker, keeps the
    stored figure."""
    global _noted_bytes
    _noted_bytes = max(_noted_bytes, int(rss_bytes))


def runtime_overhead_bytes() -> int:
    stored = int(stored_overhead()["rss_bytes"])  # type: ignore[call-overload]
    return max(stored, _noted_bytes)
