"""What `cellswarm doctor --coordinator` asks of every node, and the fixed inputs both sides use.

The coordinator puts a check in a node's heartbeat answer; the node runs it where its steps
run (never beside one) and sends the result with its next heartbeat:

- echo: its heartbeat's round trip to the coordinator, as last measured (latency);
- matmul: a Q8_0 matrix-vector product of known inputs in the node's own kernels — the
  coordinator's kernels give the same bits on any CPU (kernels/exact.c), so it compares them
  exactly, and says how far both are from the float product of the same blocks;
- forward: one forward step of the node's shard on a fixed hidden state, as a digest (the
  sha256 of its bits, its norm and 16 fixed projections) — the coordinator computes the same
  layers from its copy and compares the bits (a node on the numpy path: the projections);
- environment: free memory and disk, versions (cellswarm, Python, numpy, the kernels' build),
  CPU flags, OOM kills seen — compared across nodes by the coordinator.

The inputs come from a seed the coordinator picks per round, so a node cannot pass by
repeating an old answer. Pure functions over numpy arrays, shared by both sides.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from cellswarm.swarm.protocol.messages import CheckResult, ForwardDigest, HostFacts

if TYPE_CHECKING:
    from cellswarm.engine.model import Model

MATMUL_SHAPE = (64, 256)  # rows, cols: 16 KiB of Q8_0, microseconds on any node
PROJECTIONS = 16  # a forward step's output is sent as this many fixed projections + its norm
CPU_FLAGS = ("avx2", "avx512f", "avx512vnni", "avx512_vnni", "avx512vbmi", "f16c", "fma",
             "asimd", "neon", "sve")  # the ones the kernels' build depends on  # fmt: skip


def matmul_inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The round's float weights (rows, cols) and activation (1, cols)."""
    rng = np.random.default_rng(seed)
    rows, cols = MATMUL_SHAPE
    return (rng.standard_normal((rows, cols)).astype(np.float32),
            rng.standard_normal((1, cols)).astype(np.float32))  # fmt: skip


def matmul_here(seed: int) -> list[float]:
    """The round's product in this process's kernels (what a node sends back)."""
    from cellswarm.quant import PackedMatrix, format_by_name

    w, x = matmul_inputs(seed)
    return [float(v) for v in PackedMatrix.from_float(w, format_by_name("Q8_0")).matmul(x)[0]]


def matmul_reference(seed: int) -> np.ndarray:
    """The same product in float from the same Q8_0 blocks (no kernels involved)."""
    from cellswarm.quant import PackedMatrix, format_by_name

    w, x = matmul_inputs(seed)
    return np.asarray((x @ PackedMatrix.from_float(w, format_by_name("Q8_0")).dequantize().T)[0])


def hidden_input(seed: int, d_model: int) -> np.ndarray:
    """The fixed hidden state (1, d) a forward check starts from: RMS ~1, as a layer sees."""
    return np.random.default_rng(seed + 1).standard_normal((1, d_model)).astype(np.float32)


def bits(values: npt.ArrayLike) -> str:
    """The sha256 of float32 values' bytes, 16 hex digits."""
    return hashlib.sha256(np.ascontiguousarray(values, np.float32).tobytes()).hexdigest()[:16]


def forward_of(out: np.ndarray, seed: int) -> ForwardDigest:
    """A forward step's output (1, n) as its bits' sha256, its norm and PROJECTIONS
    projections onto fixed +-1 vectors (how far, when the bits differ), ~250 bytes."""
    v = np.asarray(out, np.float64).reshape(-1)
    signs = np.random.default_rng(seed + 2).integers(0, 2, (PROJECTIONS, v.size)) * 2 - 1
    return ForwardDigest(n=int(v.size), bits=bits(out), norm=float(np.linalg.norm(v)),
                         proj=[float(p) for p in signs @ v / np.sqrt(v.size)])  # fmt: skip


def digest(out: np.ndarray, seed: int) -> dict[str, object]:
    """forward_of's digest as plain data, as the coordinator judges it (control/checkup.py)."""
    plain: dict[str, object] = msgspec.to_builtins(forward_of(out, seed))
    return plain


def digest_error(got: Mapping[str, object], want: Mapping[str, object]) -> float:
    """Relative distance of two digests (0 equal; int8 rounding gives ~1e-3..1e-2)."""
    if got.get("n") != want.get("n"):
        return float("inf")
    a, b = np.asarray(got["proj"], np.float64), np.asarray(want["proj"], np.float64)
    norm = want["norm"]
    if not isinstance(norm, int | float):
        raise TypeError(f"a digest's norm is a number, not {str(norm)[:20]}")
    scale = max(float(np.linalg.norm(b)), float(norm) * 1e-3, 1e-12)
    return float(np.linalg.norm(a - b) / scale)


def forward_digest(model: Model, seed: int, perturb: float = 0.0) -> ForwardDigest:
    """One forward step of `model`'s layers (a stage's shard) at position 0 on the fixed
    hidden state, digested (times 1 + perturb: tests). The cache is the step's own: nothing
    of a request is touched."""
    cache = model.new_cache(1)
    x = hidden_input(seed, int(model.config.d_model))
    out = model.forward(x, cache)
    return forward_of(out * np.float32(1 + perturb) if perturb else out, seed)


def run(seed: int, model: Model | None, folders: Iterable[str | Path | None],
        perturb: float = 0.0) -> CheckResult:  # fmt: skip
    """Everything a node answers for one round (its worker adds the round, the echo and
    its layers). `perturb` (tests: a node whose arithmetic is wrong) scales its numbers by
    1 + perturb."""
    env = environment(folders)
    matmul = forward = None
    try:
        matmul = [v * (1 + perturb) for v in matmul_here(seed)]
        if model is not None:
            forward = forward_digest(model, seed, perturb)
    except Exception as exc:  # whatever breaks, the doctor says so (and which node)
        return CheckResult(env=env, matmul=matmul, error=f"{type(exc).__name__}: {exc}")
    return CheckResult(env=env, matmul=matmul, forward=forward)


def environment(folders: Iterable[str | Path | None]) -> HostFacts:
    """This host's facts that make nodes differ: versions, CPU, free memory and disk."""
    import numpy

    from cellswarm import kernels
    from cellswarm.engine.memory import available_bytes, cgroup_memory
    from cellswarm.version import __version__

    cgroup = cgroup_memory()
    disks = {}
    for folder in folders:
        if folder is None:
            continue
        p = Path(folder)
        while not p.exists() and p != p.parent:
            p = p.parent
        try:
            disks[str(folder)] = shutil.disk_usage(p).free
        except OSError:
            continue
    return HostFacts(
        cellswarm=__version__, python=platform.python_version(),
        numpy=numpy.__version__, kernels=kernels.backend(),
        kernel_build=kernels.build_id(), machine=platform.machine(),
        os=f"{platform.system()} {platform.release()}", cpu_flags=cpu_flags(),
        memory_available_bytes=available_bytes(), disk_free_bytes=disks,
        oom_kills_cgroup=cgroup.get("oom_kills", 0),  # this node's own
        cgroup_limit_bytes=cgroup.get("limit_bytes"),
        oom_kills=kernel_log_oom_kills(),  # anyone's on this host (where readable)
        pid=os.getpid(),
    )  # fmt: skip


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.partition(":")[2].split())
            return sorted(f for f in CPU_FLAGS if f in have)
    return []


def kernel_log_oom_kills() -> int:
    """Processes the kernel's OOM killer ended, as its log says (where this process may read
    it: /dev/kmsg needs root or CAP_SYSLOG; 0 otherwise)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return 0
    kills = 0
    try:
        for _ in range(100_000):  # the ring buffer is bounded; so is this loop
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the buffer
            except OSError:
                continue  # a record overwritten while reading: skip it
            if b"Killed process" in record and b"out of memory" in record.lower():
                kills += 1
    finally:
        os.close(fd)
    return kills
