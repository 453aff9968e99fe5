"""NUMA: run on one node's CPUs with its memory (set_mempolicy), and a DRAM bandwidth probe."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from cellswarm.errors import RequestError


def numa_nodes() -> list[int]:
    base = Path("/sys/devices/system/node")
    return sorted(int(d.name[4:]) for d in base.glob("node[0-9]*")) if base.is_dir() else []


def _cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_numa(node: int) -> str:
    """Run this process's threads on NUMA node `node`'s CPUs and bind its new allocations
    to that node's memory (set_mempolicy MPOL_BIND). A no-op, said so, on a one-node box.
    Call before loading: pages are placed when first touched."""
    nodes = numa_nodes()
    if len(nodes) <= 1:
        return f"numa: {max(len(nodes), 1)} node on this machine; --numa is a no-op"
    if node not in nodes:
        raise RequestError(f"--numa {node}: this machine has NUMA nodes {nodes}")
    cpus = _cpulist(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())
    os.sched_setaffinity(0, cpus)
    bound = _bind_memory(node)
    return f"numa: threads on node {node} ({len(cpus)} CPUs), memory {bound}"


def _bind_memory(node: int) -> str:
    import ctypes
    import platform

    nr = {"x86_64": 238, "aarch64": 237}.get(platform.machine())
    if nr is None:
        return "first-touch (set_mempolicy unknown on this CPU)"
    mask = ctypes.c_ulong(1 << node)
    libc = ctypes.CDLL(None, use_errno=True)
    mpol_bind = 2
    if libc.syscall(nr, mpol_bind, ctypes.byref(mask), ctypes.c_ulong(64)) != 0:
        return f"first-touch (set_mempolicy failed: errno {ctypes.get_errno()})"
    return "bound (MPOL_BIND)"


def dram_bandwidth(nbytes: int = 32 << 20) -> float:
    """Bytes/s of one large copy within DRAM, best of three (a read and a write per byte;
    weights are only read, so this is a conservative read bandwidth)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
