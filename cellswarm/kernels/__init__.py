"""Fast kernels: C compiled once on this machine by its own gcc, cached on disk, loaded by ctypes.

Why C through the system compiler rather than a JIT (see docs/design.md): a worker on a
256 MB node must not carry LLVM (numba adds ~60 MB resident and seconds of JIT per kernel at
cold start); gcc exists on every platform a node may be (x86-64, aarch64, ppc64) and
`-march=native` vectorizes the plain loops for that host; the cached shared object costs
well under a megabyte and loads in milliseconds. Without a compiler, the numpy path runs.

Backend: `CELLSWARM_KERNELS=numpy` (or `use("numpy")`) forces the reference numpy path.
Repack: `repack` lays a weight out in 16-row groups for this CPU's fastest kernel (the same
numbers to the bit, see kernels.c); `CELLSWARM_REPACK=0` keeps every weight as in the file.
Threads: `set_threads(n)` sets OpenMP (these kernels) and BLAS (numpy) together; by default
as many as there are cores free of other work (`default_threads`). OpenMP threads wait for
work spinning only briefly (`SPIN_COUNT`), so a thread whose core is busy with another
process sleeps instead of burning the time that other thread needs.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")  # includes the other .c files beside it
# -ffp-contract=off: a * b + c is two roundings on every CPU (gcc would fuse it where the CPU
# has FMA and not where it has none: other last bits, see exact.c). -fno-math-errno lets sqrtf
# be the instruction (correctly rounded everywhere) rather than a call.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared",
          "-fPIC", "-std=c11")
# gcc's own garbage collector collects more often: cc1 peaks at ~120 MB on kernels.c, not
# ~210 MB, which a 128-256 MB node (a PS3, a small Pi) has (at ~20% more compile time). It
# changes how the compiler manages its memory, never the code: not in CFLAGS or the cache key.
LOW_MEMORY = ("--param", "ggc-min-expand=10", "--param", "ggc-min-heapsize=16384")
# Formats the kernels multiply as stored (their GGML type ids): every quantized format the
# codecs read but Q5_0, which the kernels read as Q8_0 holding its values (quant/packed.py).
FUSED_TYPES = {
    "Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q6_K": 14, "Q2_K": 10, "Q5_1": 7, "Q3_K": 11,
    "Q5_K": 13, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20,
    "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "IQ1_M": 29, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39,
    "NVFP4": 40,
}  # fmt: skip
FLOAT_TYPES = {"F16": 1, "BF16": 30}
MAX_BATCH = 16  # rows of x per fused call; larger batches go to dequantize + BLAS

_lib: ctypes.CDLL | None = None
_backend = os.environ.get("CELLSWARM_KERNELS", "c")
_threads = 0
# Weights laid out for this CPU's fastest kernel at load (repack); CELLSWARM_REPACK=0 keeps
# the file's layout (benches compare the two; the results are the same bits either way).
_repack = os.environ.get("CELLSWARM_REPACK", "1") != "0"
_default_threads = 0  # sampled once (default_threads), again on set_threads(None)

# libgomp's threads spin this many times (a PAUSE each, ~25 ns here) waiting for the next
# parallel region or at a barrier before they sleep; its default, 300,000 (~7 ms), made
# --threads 2 beside a busy process 10-20x slower than one thread: the spinning thread holds
# a core the late one needs. Too few, and every region pays a sleeping thread's wake-up
# (tens of us on a VM), which the repacked kernels' shorter regions feel. Measured with
# bench/threads.py (2 threads / 1 thread, quiet and beside a hog): 300 gave 1.28 and 0.93,
# 2,000 (~50 us) 1.37-1.58 and 1.02-1.08, 5,000 1.34 and 1.01, 30,000 1.51 and 0.71.
SPIN_COUNT = "2000"
SAMPLE_S = 0.1  # how long default_threads watches /proc/stat


def cache_dir() -> Path:
    root = os.environ.get("CELLSWARM_CACHE") or Path.home() / ".cache" / "cellswarm"
    return Path(root) / "kernels"


def extra_flags() -> tuple[str, ...]:
    """CELLSWARM_CFLAGS: flags added to the build, e.g. "-mno-avx512f" for the AVX2 kernels on
    a CPU that has AVX-512 (tests build the other instruction-set paths this way)."""
    return tuple(os.environ.get("CELLSWARM_CFLAGS", "").split())


def library_path(extra: tuple[str, ...] | None = None) -> Path:
    """Where the compiled kernels for this source, compiler flags and machine live."""
    key = hashlib.sha256()
    for source in sorted(SOURCE.parent.glob("*.c")):
        key.update(source.read_bytes())
    key.update(" ".join((*CFLAGS, *(extra_flags() if extra is None else extra))).encode())
    key.update(f"{platform.machine()} {platform.processor()} {sys.platform}".encode())
    key.update(_cpu_signature().encode())
    return cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"


def build_id() -> str:
    """The kernels' sources: nodes that differ here run different arithmetic (doctor compares
    it across nodes). Not the flags or the CPU: every instruction set, -march and thread
    count computes the same bits from the same sources (exact.c), so a node built
    -mno-avx512f or on an ARM board is no odd one out."""
    key = hashlib.sha256()
    for source in sorted(SOURCE.parent.glob("*.c")):
        key.update(source.read_bytes())
    return key.hexdigest()[:12]


def _cpu_signature() -> str:
    """-march=native code must not run on another CPU that shares this cache directory."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "cpu\t")):
                return line
    except OSError:
        pass
    return ""


def build(path: Path | None = None, extra: tuple[str, ...] | None = None) -> Path:
    """Compile the kernels (once; later calls find the cached file)."""
    flags = extra_flags() if extra is None else extra
    target = path or library_path(flags)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [os.environ.get("CC", "gcc"), *_wrapper(), *LOW_MEMORY, *CFLAGS, *flags, "-o", tmp,
           str(SOURCE), "-lm"]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300,
                       preexec_fn=_die_with_parent)  # fmt: skip
        os.replace(tmp, target)  # atomic: concurrent builders never see half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _wrapper() -> tuple[str, ...]:
    """gcc's own children (cc1, as, ld) under util-linux's setpriv --pdeathsig: they die with
    the driver, as the driver dies with us (_die_with_parent); without setpriv, nothing."""
    return ("-wrapper", f"{_SETPRIV},--pdeathsig,KILL") if _SETPRIV else ()


_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the compiler's process: the kernel kills it when the process that started it dies
    (a worker stopped mid-build must not leave gcc running; Linux's PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


@dataclass(frozen=True)
class Built:
    """What `prebuild` did: the library, whether it compiled it now, and how long it took."""

    path: Path
    compiled: bool
    seconds: float

    def line(self) -> str:
        if self.compiled:
            return f"KERNELS built in {self.seconds:.1f} s ({self.path})"
        return f"KERNELS ready ({self.path})"


def prebuild() -> Built | None:
    """Build the kernels now, before any step needs them (a worker does so before it joins:
    a first step that compiles for seconds looks dead to its coordinator). None when the
    numpy path is asked for (CELLSWARM_KERNELS=numpy); KernelBuildError, saying why and
    what to do, when they cannot be built."""
    if _backend != "c":
        return None
    flags = extra_flags()
    target = library_path(flags)
    if target.exists():
        return Built(target, False, 0.0)
    t0 = time.perf_counter()
    try:
        path = build(target, flags)
    except FileNotFoundError:
        raise KernelBuildError(f"no C compiler {os.environ.get('CC', 'gcc')!r} on this "
                               "machine: install gcc (Debian: apt install gcc), or set "
                               "CELLSWARM_KERNELS=numpy for the slow reference path") from None
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise KernelBuildError(f"gcc could not build the kernels ({said[0][:200]}): check "
                               f"CELLSWARM_CFLAGS {' '.join(flags)!r} and the compiler, or set "
                               "CELLSWARM_KERNELS=numpy") from None  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"could not build the kernels into {target.parent}: {exc}; "
                               "give CELLSWARM_CACHE a writable folder") from None
    return Built(path, True, time.perf_counter() - t0)


class KernelBuildError(Exception):
    """The kernels could not be built (the message says why and what to do). Not a
    CellswarmError: kernels/ imports nothing of ours; the callers map it."""


def _load() -> ctypes.CDLL | None:
    global _lib
    if _lib is not None or _backend != "c":
        return _lib
    if not any(k in os.environ for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")):
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT  # read once, when libgomp loads (below)
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("fast kernels unavailable (%s); using the numpy path", exc)
        use("numpy")
        return None
    _declare(lib)
    _lib = lib
    lib.cs_set_threads(threads())
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.cs_quantize_act.argtypes = [p, i64, i64, p, p, p]
    lib.cs_matmul_q.argtypes = [i32, p, i64, i64, i64, p, p, p, i64, p]
    lib.cs_matmul_qx.argtypes = [i32, p, i64, i64, i64, p, i64, p]
    lib.cs_matmul_qx_shared.argtypes = [i32, p, p, p, p, i64, p, i64, p]
    lib.cs_matmul_f.argtypes = [i32, p, i64, i64, p, i64, p]
    lib.cs_dequantize.argtypes = [i32, p, i64, i64, i64, p]
    lib.cs_dequantize_rows.argtypes = [i32, p, i64, i64, i64, p, i64, p]
    lib.cs_dequantize_rows.restype = None
    lib.cs_set_threads.argtypes = [i32]
    lib.cs_outlier_count.argtypes = [i64]
    lib.cs_set_outliers.argtypes = [i32]
    lib.cs_set_outliers.restype = None
    lib.cs_outlier_dominance.restype = ctypes.c_float
    lib.cs_llama_decode_layers.argtypes = [p, i64, p, i64, p, p, p, p, i64, i32, p, p, p, p]
    lib.cs_llama_decode_layers.restype = None
    lib.cs_ds_decode_layers.argtypes = [p, i64, p, i64, p, p, p, p, i64, i32, p, p]
    lib.cs_llama_decode_many.argtypes = [p, i64, i64, p, p, p, p, p, p, p, i32, p, p]
    lib.cs_llama_decode_many.restype = None
    lib.cs_llama_scratch_floats.argtypes = [p, i64]
    lib.cs_llama_scratch_floats.restype = i64
    lib.cs_llama_scratch_qbytes.argtypes = [p, i64]
    lib.cs_llama_scratch_qbytes.restype = i64
    lib.cs_ds_decode_layers.restype = None
    lib.cs_swiglu1.argtypes = [p, p, p, p, i64, p]
    lib.cs_silu_mul_rows.argtypes = [p, p, i64, i64]
    f32 = ctypes.c_float
    lib.cs_attend.argtypes = [p, i64, p, i64, p, i64, i64, i64, i64, i64, i64, f32, p]
    lib.cs_rms_rows.argtypes = [p, i64, i64, p, f32, p]
    lib.cs_softmax_rows.argtypes = [p, i64, i64]
    lib.cs_sigmoid.argtypes = [p, i64, p]
    lib.cs_dot_rows.argtypes = [p, i64, i64, p, p]
    lib.cs_sincos.argtypes = [p, i64, p, p]
    lib.cs_pow.argtypes = [ctypes.c_double, p, i64, p]
    lib.cs_log.argtypes = [ctypes.c_double]
    lib.cs_log.restype = ctypes.c_double
    lib.cs_exp_d.argtypes = [p, i64, p]
    lib.cs_exp_d.restype = None
    lib.cs_sum_d.argtypes = [p, i64]
    lib.cs_sum_d.restype = ctypes.c_double
    lib.cs_mla_attend.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, f32, p]
    lib.cs_route_rows.argtypes = [p, p, i64, p, p]
    lib.cs_mla_attend.restype = lib.cs_route_rows.restype = None
    lib.cs_rope_rows.argtypes = [p, i64, i64, i64, i64, i32, p, p]
    lib.cs_ds_scratch_floats.argtypes = [p, i64, i64]
    lib.cs_ds_scratch_qbytes.argtypes = [p, i64]
    lib.cs_ds_decode_many.argtypes = [p, i64, p, p, p, p, p, p, i64, i32, p, p]
    lib.cs_ds_decode_many.restype = None
    lib.cs_ds_scratch_floats.restype = lib.cs_ds_scratch_qbytes.restype = i64
    lib.cs_ds_attention.argtypes = [p, p, i64, p, p, p, p, i64, i32, p, p]
    lib.cs_ds_decode.argtypes = [p, p, i64, p, p, p, p, i64, i32, p, p]
    lib.cs_kv_encode.argtypes = lib.cs_kv_decode.argtypes = [i32, p, i64, i64, p]
    lib.cs_kv_encode.restype = lib.cs_kv_decode.restype = None
    lib.cs_ds_route.argtypes = [p, p, p, p, p, p, p]
    for f in (lib.cs_swiglu1, lib.cs_ds_attention, lib.cs_ds_decode, lib.cs_ds_route,
              lib.cs_silu_mul_rows, lib.cs_rope_rows, lib.cs_attend, lib.cs_rms_rows,
              lib.cs_softmax_rows, lib.cs_sigmoid, lib.cs_dot_rows, lib.cs_sincos, lib.cs_pow):
        f.restype = None
    lib.cs_stream_read.argtypes = [p, i64]
    lib.cs_stream_read.restype = ctypes.c_uint64
    lib.cs_repacked.argtypes = [i32]
    lib.cs_repack.argtypes = [i32, p, i64, i64, p]
    lib.cs_repack.restype = None
    for f in (lib.cs_quantize_act, lib.cs_matmul_q, lib.cs_matmul_qx, lib.cs_matmul_qx_shared,
              lib.cs_matmul_f, lib.cs_dequantize):  # fmt: skip
        f.restype = None


def use(backend: str) -> None:
    """'c' (fused kernels, the default) or 'numpy' (the reference path)."""
    global _backend, _lib
    if backend not in ("c", "numpy"):
        raise ValueError(f"kernel backend {backend!r} is not 'c' or 'numpy'")
    _backend = backend
    if backend == "numpy":
        _lib = None


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Run a block on one backend ('numpy' for the reference path), then restore."""
    before = _backend
    use(name)
    try:
        yield
    finally:
        use(before)


def enabled() -> bool:
    """True when fused kernels run (cheap: called on every matmul)."""
    return _lib is not None or (_backend == "c" and _load() is not None)


def backend() -> str:
    return "c" if _load() is not None else "numpy"


def cpu_times(stat_text: str) -> dict[int, tuple[int, int]]:
    """/proc/stat's per-CPU lines -> {cpu: (busy, total)} in ticks; idle and iowait are not
    busy, steal is (a hypervisor's other guests had the core)."""
    out = {}
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            v = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            idle = v[3] + (v[4] if len(v) > 4 else 0)
            out[int(name[3:])] = (sum(v) - idle, sum(v))
    return out


def free_cores(before: str, after: str, cpus: Sequence[int], own_cores: float = 0.0) -> float:
    """Cores of `cpus` not used by other processes between two /proc/stat readings; own_cores:
    what this process used meanwhile (its own threads are not competition)."""
    a, b = cpu_times(before), cpu_times(after)
    seen = [c for c in cpus if c in a and c in b]
    total = sum(b[c][1] - a[c][1] for c in seen)
    if not seen or total <= 0:
        return float(len(cpus))
    busy = sum(b[c][0] - a[c][0] for c in seen) / total * len(seen)  # in cores
    return len(cpus) - min(float(len(seen)), max(0.0, busy - own_cores))


def threads_for(free: float, allowed: int) -> int:
    """A core counts if at least 60% of it is free; at least one thread."""
    return max(1, min(allowed, int(free + 0.4)))


def default_threads(sample_s: float | None = None) -> int:
    """Threads for the kernels when none are asked for: the cores this process may use (its
    affinity) that other processes left idle over `sample_s` (SAMPLE_S) seconds of
    /proc/stat; all of them where /proc/stat cannot be read. One thread per core another
    process keeps busy is not a loss: sharing that core, a second thread would run at its
    pace and every parallel step would wait for it."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return os.cpu_count() or 1
    try:
        stat = Path("/proc/stat")
        before, own0, t0 = stat.read_text(), _own_cpu_s(), time.monotonic()
        time.sleep(SAMPLE_S if sample_s is None else sample_s)
        after, own1, t1 = stat.read_text(), _own_cpu_s(), time.monotonic()
    except OSError:
        return len(cpus)
    own = (own1 - own0) / max(t1 - t0, 1e-9)
    return threads_for(free_cores(before, after, cpus, own), len(cpus))


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _sampled_default() -> int:
    global _default_threads
    if not _default_threads:
        _default_threads = default_threads()
    return _default_threads


def threads() -> int:
    """Threads the kernels and BLAS use (`set_threads`, else `default_threads`, sampled once)."""
    return _threads or _sampled_default()


def set_threads(n: int | None) -> int:
    """Threads for the kernels and for BLAS: n exactly, or None for `default_threads` (sampled
    anew: the cores free of other work now)."""
    global _threads, _default_threads
    if not n:
        _default_threads = 0
    _threads = n or _sampled_default()
    if _lib is not None:
        _lib.cs_set_threads(_threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(_threads, user_api="blas")
    except ImportError:  # BLAS keeps its own default
        pass
    return _threads


def can_fuse(type_name: str) -> bool:
    """Whether the kernels multiply this format as stored (F32 included)."""
    known = type_name in FUSED_TYPES or type_name in FLOAT_TYPES or type_name == "F32"
    return known and _load() is not None


def quantize_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (n, cols) float32, cols % 32 == 0 -> (int8 (n, cols), scales (n, cols/32), sums16)."""
    lib = _load()
    assert lib is not None
    n, cols = x.shape
    xq = np.empty((n, cols), np.int8)
    xd = np.empty((n, cols // 32), np.float32)
    xs = np.empty((n, cols // 16), np.int32)
    lib.cs_quantize_act(x.ctypes.data, n, cols, xq.ctypes.data, xd.ctypes.data, xs.ctypes.data)
    return xq, xd, xs


def outlier_rule(cols: int) -> tuple[int, float]:
    """Wherever a quantized matrix multiplies a vector of `cols` activations, its largest values
    are kept in float, out of the int8 blocks (kernels.c: take_outliers): at most this many,
    largest first, each while it is more than this many times the largest other value of its
    block of 32."""
    lib = _load()
    assert lib is not None
    return int(lib.cs_outlier_count(cols)), float(lib.cs_outlier_dominance())


def set_outliers(n: int) -> None:
    """At most this many outliers per vector (0..4, default 4); 0: int8 blocks alone, as
    llama.cpp quantizes activations (bench/quant_quality.py compares the two)."""
    lib = _load()
    assert lib is not None
    lib.cs_set_outliers(n)


def weight_args(type_name: str, w: np.ndarray, cols: int) -> tuple[int, int, int, int, int]:
    """What a fused call needs to know about a packed weight, computed once per weight:
    (kind, format code, data pointer, rows, row bytes); kind 0 = quantized, 1 = F16/BF16,
    2 = F32 (only inside the fused layers: a router or W_UK/W_UV kept in float)."""
    rows, row_bytes = w.shape[-2:]
    if type_name == "F32":
        return 2, 0, int(w.ctypes.data), rows, row_bytes
    kind = 1 if type_name in FLOAT_TYPES else 0
    code = FLOAT_TYPES.get(type_name) or FUSED_TYPES[type_name]
    return kind, code, int(w.ctypes.data), rows, row_bytes


def matmul_args(
    args: tuple[int, int, int, int, int], cols: int, x: np.ndarray, out: np.ndarray
) -> None:
    """out (n, rows) = x (n, cols) @ W.T, x float32 C-contiguous, any n (kernels/exact.c:
    each row of out the same bits whatever n)."""
    lib = _lib
    assert lib is not None
    kind, code, ptr, rows, row_bytes = args
    xp = ctypes.addressof(ctypes.c_char.from_buffer(x))  # type: ignore[arg-type]  # fast
    op = ctypes.addressof(ctypes.c_char.from_buffer(out))  # type: ignore[arg-type]
    if kind:
        lib.cs_matmul_f(code, ptr, rows, cols, xp, x.shape[0], op)
    else:
        lib.cs_matmul_qx(code, ptr, rows, row_bytes, cols, xp, x.shape[0], op)


def matmul_shared(
    args: Sequence[tuple[int, int, int, int, int]], cols: int, x: np.ndarray,
    outs: Sequence[np.ndarray],
) -> None:  # fmt: skip
    """outs[i] (n, rows_i) = x (n, cols) @ W_i.T for quantized weights (kind 0) that read the
    same x: x quantized once (kernels.c cs_matmul_qx_shared), each out the bits matmul_args
    gives it alone."""
    lib = _lib
    assert lib is not None and all(a[0] == 0 for a in args)
    m = len(args)
    codes = (ctypes.c_int * m)(*(a[1] for a in args))
    ptrs = (ctypes.c_void_p * m)(*(a[2] for a in args))
    rows = (ctypes.c_int64 * m)(*(a[3] for a in args))
    row_bytes = (ctypes.c_int64 * m)(*(a[4] for a in args))
    out_ptrs = (ctypes.c_void_p * m)(*(o.ctypes.data for o in outs))
    lib.cs_matmul_qx_shared(m, codes, ptrs, rows, row_bytes, cols, x.ctypes.data, x.shape[0],
                            out_ptrs)  # fmt: skip


def matmul(type_name: str, w: np.ndarray, cols: int, x: np.ndarray, out: np.ndarray) -> None:
    """out (n, rows) = x (n, cols) @ W.T; W packed (rows, row_bytes) C-contiguous."""
    _load()
    matmul_args(weight_args(type_name, w, cols), cols, np.ascontiguousarray(x, np.float32), out)


def _c32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float32 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, np.float32)


KEYS_ALIGN = 16  # the keys' cache layout: capacity rounded up to this (kernels.c keys_ld)


def keys_ld(capacity: int) -> int:
    """The keys' row length for a capacity: an odd number of KEYS_ALIGNs (kernels.c keys_ld:
    rows a power of two apart fall in the same L1 sets)."""
    return (-(-capacity // KEYS_ALIGN) | 1) * KEYS_ALIGN


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal grouped-query attention of T new queries: q (T, H, D); k (Hkv, S, D), v (Hkv, S,
    Dv), the T new tokens last -> (T, H, Dv). The keys are laid out as the cache keeps them
    (attend_keys) first."""
    n_kv, s, d = k.shape
    kt = np.zeros((n_kv, d, keys_ld(s)), np.float32)
    kt[:, :, :s] = k.transpose(0, 2, 1)
    return attend_keys(q, kt, v, scale)


def attend_keys(q: np.ndarray, kt: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """attend with the keys as the cache keeps them: kt (Hkv, D, ld) component-major, ld a
    multiple of KEYS_ALIGN at least S; v (Hkv, S, Dv) with each (S, Dv) slab contiguous (the
    slabs may sit `cap` rows apart, as in the cache). Each query as a decode step computes
    it (kernels.c attend_nq): the same bits."""
    lib = _lib
    assert lib is not None
    t, h, d = q.shape
    n_kv, s, dv = v.shape
    if kt.shape[:2] != (n_kv, d) or kt.shape[2] < s or kt.shape[2] % KEYS_ALIGN:
        raise ValueError(f"attend: keys {kt.shape} do not fit values {v.shape} and queries "
                         f"{q.shape}")
    ktc = _c32(kt)
    cap = _slab_rows(v, dv)
    if cap < 0:
        v, cap = np.ascontiguousarray(v, np.float32), s
    out = np.empty((t, h, dv), np.float32)
    qc = _c32(q)
    lib.cs_attend(qc.ctypes.data, t, ktc.ctypes.data, kt.shape[2], v.ctypes.data, cap, h, n_kv, s,
                  d, dv, scale, out.ctypes.data)  # fmt: skip
    return out


def _slab_rows(a: np.ndarray, width: int) -> int:
    """Rows between the starts of a (heads, S, width) float32 array's slabs, -1 when its rows
    are not contiguous (then the caller copies)."""
    item = 4
    if a.dtype != np.float32 or a.strides[2] != item or a.strides[1] != width * item:
        return -1
    return a.strides[0] // (width * item) if a.shape[0] > 1 else a.shape[1]


def rms_rows(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row of x (..., n) by weight (n,), as the fused layers compute it."""
    lib = _lib
    assert lib is not None
    xc, w = _c32(x), _c32(weight)
    n = xc.shape[-1]
    out = np.empty(xc.shape, np.float32)
    lib.cs_rms_rows(xc.ctypes.data, xc.size // max(n, 1), n, w.ctypes.data, eps, out.ctypes.data)
    return out


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """softmax over the last axis, in the kernels' one order (a new array)."""
    lib = _lib
    assert lib is not None
    out = np.array(x, dtype=np.float32, order="C")
    n = out.shape[-1]
    lib.cs_softmax_rows(out.ctypes.data, out.size // max(n, 1), n)
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    lib = _lib
    assert lib is not None
    xc = _c32(x)
    out = np.empty(xc.shape, np.float32)
    lib.cs_sigmoid(xc.ctypes.data, xc.size, out.ctypes.data)
    return out


def dot_rows(rows: np.ndarray, x: np.ndarray) -> np.ndarray:
    """rows (n, cols) . x (cols,) -> (n,), each in the kernels' one order."""
    lib = _lib
    assert lib is not None
    r, xc = _c32(rows), _c32(x)
    out = np.empty(r.shape[0], np.float32)
    lib.cs_dot_rows(r.ctypes.data, r.shape[0], r.shape[1], xc.ctypes.data, out.ctypes.data)
    return out


def mla_attend(
    q_lat: np.ndarray, q_rope: np.ndarray, latents: np.ndarray, k_ropes: np.ndarray, scale: float
) -> np.ndarray:
    """A prefill's latent attention, each (query, head) as a decode step computes it: q_lat
    (T, H, L), q_rope (T, H, R), the cache's latents (S, L) and RoPE keys (S, R), the T new
    tokens last -> (T, H, L)."""
    lib = _lib
    assert lib is not None
    t, h, n_lat = q_lat.shape
    ql, qr, lat, kr = (_c32(a) for a in (q_lat, q_rope, latents, k_ropes))
    out = np.empty((t, h, n_lat), np.float32)
    lib.cs_mla_attend(ql.ctypes.data, qr.ctypes.data, lat.ctypes.data, kr.ctypes.data, t, h,
                      lat.shape[0], n_lat, kr.shape[1], scale, out.ctypes.data)  # fmt: skip
    return out


class RouteRule(ctypes.Structure):
    """deepseek.c's route_rule: how a MoE layer picks its experts."""

    _fields_ = [
        ("n_experts", ctypes.c_int64), ("n_used", ctypes.c_int64), ("n_groups", ctypes.c_int64),
        ("topk_groups", ctypes.c_int64), ("sigmoid", ctypes.c_int64),
        ("norm_topk", ctypes.c_int64), ("routed_scale", ctypes.c_float),
        ("bias", ctypes.c_void_p),
    ]  # fmt: skip


def route_rows(
    logits: np.ndarray, rule: RouteRule, bias: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Router logits (T, E) -> expert ids (T, k), best first, and weights (T, k), as the fused
    layer routes a token (deepseek.c route_core)."""
    lib = _lib
    assert lib is not None
    lg = _c32(logits)
    b = None if bias is None else _c32(bias)
    rule.bias = None if b is None else b.ctypes.data
    t, k = lg.shape[0], rule.n_used
    ids, wts = np.empty((t, k), np.int64), np.empty((t, k), np.float32)
    lib.cs_route_rows(ctypes.byref(rule), lg.ctypes.data, t, ids.ctypes.data, wts.ctypes.data)
    return ids, wts


def sincos(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of float32 angles, computed in double by the kernels' own series and
    rounded once: the same bits on every CPU (numpy's float32 cos differs by SIMD path)."""
    lib = _load()
    assert lib is not None
    a = _c32(angles)
    c, s = np.empty(a.shape, np.float32), np.empty(a.shape, np.float32)
    lib.cs_sincos(a.ctypes.data, a.size, c.ctypes.data, s.ctypes.data)
    return c, s


def power(base: float, exponents: np.ndarray) -> np.ndarray:
    """base ** e for float32 exponents, in double by the kernels' own exp and log, rounded
    once to float32 (RoPE frequencies: the same bits on every CPU)."""
    lib = _load()
    assert lib is not None
    e = _c32(exponents)
    out = np.empty(e.shape, np.float32)
    lib.cs_pow(base, e.ctypes.data, e.size, out.ctypes.data)
    return out


def exp64(x: np.ndarray) -> np.ndarray:
    """exp of float64 values <= 0 by the kernels' own series (numpy's differs by SIMD path)."""
    lib = _load()
    assert lib is not None
    xc = np.ascontiguousarray(x, np.float64)
    out = np.empty(xc.shape, np.float64)
    lib.cs_exp_d(xc.ctypes.data, xc.size, out.ctypes.data)
    return out


def sum64(x: np.ndarray) -> float:
    """The sum of float64 values in order (numpy's pairwise order is its own)."""
    lib = _load()
    assert lib is not None
    xc = np.ascontiguousarray(x, np.float64)
    return float(lib.cs_sum_d(xc.ctypes.data, xc.size))


def natural_log(x: float) -> float:
    """log(x) in double by the kernels' own series (the same bits on every CPU)."""
    lib = _load()
    assert lib is not None
    return float(lib.cs_log(x))


def rope(x: np.ndarray, dim: int, neox: bool, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the first `dim` of each head of x (T, heads, D) float32 C-contiguous, in place:
    cos and sin (T, dim/2) float32 C-contiguous; the fused layers' rope (the same bits)."""
    lib = _lib
    assert lib is not None
    t, heads, d = x.shape
    if cos.shape != (t, dim // 2) or sin.shape != cos.shape or dim > d:
        raise ValueError(f"rope: x {x.shape}, dim {dim}, tables {cos.shape} and {sin.shape}")
    for a in (x, cos, sin):
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError("rope takes float32 C-contiguous arrays")
    lib.cs_rope_rows(x.ctypes.data, t, heads, d, dim, int(neox), cos.ctypes.data, sin.ctypes.data)
    return x


def stream_read(a: np.ndarray) -> int:
    """Sum a buffer's 64-bit words on all threads: a streaming-read bandwidth probe."""
    lib = _load()
    assert lib is not None
    return int(lib.cs_stream_read(a.ctypes.data, a.nbytes // 8))


def dequantize(type_name: str, w: np.ndarray, cols: int, out: np.ndarray, code: int = 0) -> None:
    """out (rows, cols) = W as float32; `code`: the format code of a repacked W (repack)."""
    lib = _load()
    assert lib is not None
    rows, row_bytes = w.shape
    lib.cs_dequantize(code or FUSED_TYPES[type_name], w.ctypes.data, rows, row_bytes, cols,
                      out.ctypes.data)  # fmt: skip


def dequantize_rows(code: int, w: np.ndarray, cols: int, ids: np.ndarray, out: np.ndarray) -> None:
    """out (n, cols) = rows `ids` (n,) of W (rows, row_bytes) as float32; `code`: W's format
    code, a repacked one (repack) included: a row is read from its group, not the file."""
    lib = _load()
    assert lib is not None
    rows, row_bytes = w.shape
    index = np.ascontiguousarray(ids, np.int64)
    assert w.flags.c_contiguous and out.shape == (len(index), cols) and out.flags.c_contiguous
    assert ((index >= 0) & (index < rows)).all(), "row ids outside the weight"
    lib.cs_dequantize_rows(code, w.ctypes.data, rows, row_bytes, cols, index.ctypes.data,
                           len(index), out.ctypes.data)  # fmt: skip


def set_repack(on: bool) -> bool:
    """Repack weights loaded from now on (True, the default) or not; returns the old value."""
    global _repack
    before, _repack = _repack, on
    return before


@contextlib.contextmanager
def repacking(on: bool) -> Iterator[None]:
    """Load weights in a block repacked or not (set_repack), then restore the setting."""
    before = set_repack(on)
    try:
        yield
    finally:
        set_repack(before)


def repack(
    type_name: str, w: np.ndarray, out: np.ndarray | None = None
) -> tuple[int, np.ndarray] | None:
    """W (rows, row_bytes) laid out for this CPU's fastest kernel, as (format code, bytes of
    the same shape: `out` if given), or None where there is no such layout (the format: all
    the fused ones but Q5_1 and NVFP4 have one; the CPU: AVX-512 VNNI or AVX2 with F16C;
    fewer than 16 rows; CELLSWARM_REPACK=0).
    The kernels read a repacked weight as the same numbers, to the bit."""
    packed_code = repacked_code(type_name, w.shape[0]) if w.ndim == 2 else None
    if packed_code is None:
        return None
    src = np.ascontiguousarray(w)
    dst = np.empty_like(src) if out is None else out
    assert dst.shape == src.shape and dst.flags.c_contiguous and dst.dtype == np.uint8
    lib = _load()
    assert lib is not None
    lib.cs_repack(FUSED_TYPES[type_name], src.ctypes.data, src.shape[0], src.shape[1],
                  dst.ctypes.data)  # fmt: skip
    return packed_code, dst


def repacked_code(type_name: str, rows: int) -> int | None:
    """The format code a weight of `rows` rows gets from repack, or None where it gets none."""
    lib = _load()
    code = FUSED_TYPES.get(type_name, -1)
    if lib is None or not _repack or rows < 16 or code < 0:
        return None
    packed_code = int(lib.cs_repacked(code))
    return packed_code if packed_code >= 0 else None


class Mat(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64), ("fmt", ctypes.c_int64), ("w", ctypes.c_void_p),
        ("rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
    ]  # fmt: skip


class LlamaLayer(ctypes.Structure):
    """Mirrors `llama_layer` in kernels.c: one layer's weights and shapes for cs_llama_decode."""

    _fields_ = [
        *[(n, Mat) for n in ("q", "k", "v", "o", "gate", "up", "down")],
        *[(n, ctypes.c_void_p) for n in ("attn_norm", "ffn_norm", "q_bias", "k_bias", "v_bias",
                                         "q_norm", "k_norm")],
        *[(n, ctypes.c_int64) for n in ("d", "n_heads", "n_kv", "head_dim", "ffn", "rope_dim",
                                        "rope_neox")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
    ]  # fmt: skip


def mat(args: tuple[int, int, int, int, int]) -> Mat:
    return Mat(*args)


def ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else int(a.ctypes.data)


def pointers(arrays: Sequence[np.ndarray | ctypes.Structure]) -> ctypes.Array[ctypes.c_void_p]:
    """A C array of the addresses of `arrays` (numpy arrays, or ctypes structures)."""
    return (ctypes.c_void_p * len(arrays))(*(
        a.ctypes.data if isinstance(a, np.ndarray) else ctypes.addressof(a) for a in arrays
    ))  # fmt: skip


def llama_decode_layers(
    layers: ctypes.Array[ctypes.c_void_p], x: np.ndarray, pos: int, cos: np.ndarray,
    sin: np.ndarray, k_stores: ctypes.Array[ctypes.c_void_p],
    v_stores: ctypes.Array[ctypes.c_void_p], capacity: int, scratch: tuple[np.ndarray, ...],
    kind: int = 0,
) -> None:  # fmt: skip
    """llama_decode through every layer of `layers` (pointers to LlamaLayer) in one call;
    k_stores / v_stores: each layer's cache storage (pointers), all of `capacity` tokens and
    of the cache type `kind` (KVCache.kind: kv.c)."""
    lib = _lib
    assert lib is not None
    f, xq, xd, xs = scratch
    lib.cs_llama_decode_layers(
        layers, len(layers), x.ctypes.data, pos, cos.ctypes.data, sin.ctypes.data, k_stores,
        v_stores, capacity, kind, f.ctypes.data, xq.ctypes.data, xd.ctypes.data,
        xs.ctypes.data,
    )  # fmt: skip


def llama_scratch_many(layers: Sequence[LlamaLayer], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Float and int8 scratch for cs_llama_decode_many: n tokens, the widest of `layers`."""
    lib = _load()
    assert lib is not None
    floats = max(lib.cs_llama_scratch_floats(ctypes.addressof(x), n) for x in layers)
    qbytes = max(lib.cs_llama_scratch_qbytes(ctypes.addressof(x), n) for x in layers)
    return np.empty(floats, np.float32), np.empty(qbytes, np.int8)


def llama_decode_many(
    layers: ctypes.Array[ctypes.c_void_p], x: np.ndarray, pos: np.ndarray, cos: np.ndarray,
    sin: np.ndarray, k_stores: Sequence[np.ndarray], v_stores: Sequence[np.ndarray],
    capacities: np.ndarray, scratch: tuple[np.ndarray, np.ndarray], kind: int = 0,
) -> None:  # fmt: skip
    """One token of each of n sequences through `layers`, in place on x (n, d): pos (n,)
    int64, cos/sin (n, rope_dim / 2), k_stores / v_stores layer-major (layer i, sequence s
    at i * n + s), capacities (n,) int64 of each sequence's cache, all of type `kind`."""
    lib = _lib
    assert lib is not None
    n = x.shape[0]
    ks, vs = pointers(list(k_stores)), pointers(list(v_stores))
    f, q = scratch
    lib.cs_llama_decode_many(
        layers, len(layers), n, x.ctypes.data, pos.ctypes.data, cos.ctypes.data,
        sin.ctypes.data, ks, vs, capacities.ctypes.data, kind, f.ctypes.data, q.ctypes.data,
    )  # fmt: skip


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u for two (rows, width) arrays (in place in g when it is a writeable float32
    C array): each value as the fused layers compute it (deepseek.c silu_mul), the rows
    shared among the threads."""
    lib = _lib
    assert lib is not None
    if g.shape != u.shape or g.ndim != 2:
        raise ValueError(f"silu_mul takes two (rows, width) arrays, got {g.shape} and {u.shape}")
    g = np.require(g, np.float32, ["C", "W"])
    u = np.ascontiguousarray(u, np.float32)
    lib.cs_silu_mul_rows(g.ctypes.data, u.ctypes.data, g.shape[0], g.shape[1])
    return g


def swiglu1(
    gate: tuple[int, int, int, int, int], up: tuple[int, int, int, int, int],
    down: tuple[int, int, int, int, int], x: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """down(silu(gate x) * up x) for one row x (d,), in the arithmetic the fused DeepSeek layer
    uses for an expert (kernels/deepseek.c), so an expert is the same bits wherever it runs."""
    lib = _lib
    assert lib is not None
    xc = np.ascontiguousarray(x, np.float32)
    out = np.empty(down[3], np.float32)
    g, u, dn = Mat(*gate), Mat(*up), Mat(*down)
    lib.cs_swiglu1(ctypes.addressof(g), ctypes.addressof(u), ctypes.addressof(dn), xc.ctypes.data,
                   xc.shape[-1], out.ctypes.data)  # fmt: skip
    return out


class DsLayer(ctypes.Structure):
    """Mirrors `ds_layer` in deepseek.c: one DeepSeek layer's weights and shapes."""

    _fields_ = [
        *[(n, Mat) for n in ("q_a", "q_b", "q", "kv_a", "k_b", "v_b", "o", "gate", "up", "down",
                             "router", "gate_exps", "up_exps", "down_exps")],
        *[(n, ctypes.c_int64) for n in ("gate_stride", "up_stride", "down_stride")],
        *[(n, ctypes.c_void_p) for n in ("held", "attn_norm", "ffn_norm", "q_a_norm",
                                         "kv_a_norm", "router_bias")],
        *[(n, ctypes.c_int64) for n in ("d", "n_heads", "q_lora", "kv_lora", "nope", "rope_dim",
                                        "v_dim", "ffn", "moe_ffn", "n_experts", "n_used",
                                        "n_groups", "topk_groups", "sigmoid", "norm_topk",
                                        "moe")],
        *[(n, ctypes.c_float) for n in ("eps", "latent_eps", "scale", "routed_scale")],
    ]  # fmt: skip


def ds_scratch(layer: DsLayer, capacity: int, n: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Float and int8 scratch for the fused DeepSeek calls: n sequences, caches of up to
    `capacity` tokens."""
    lib = _load()
    assert lib is not None
    ref = ctypes.addressof(layer)
    floats = lib.cs_ds_scratch_floats(ref, capacity, n)
    return np.empty(floats, np.float32), np.empty(lib.cs_ds_scratch_qbytes(ref, n), np.int8)


def ds_decode_many(
    layer: DsLayer, x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray,
    latents: list[np.ndarray], k_ropes: list[np.ndarray], scratch: tuple[np.ndarray, np.ndarray],
    kind: int = 0,
) -> None:  # fmt: skip
    """One layer for one token of each of n sequences, in place on x (n, d): pos (n,) int64,
    cos/sin (n, R/2), each sequence's latent (cap, L) and RoPE key (cap, R) stores."""
    lib = _lib
    assert lib is not None
    n = x.shape[0]
    lat = (ctypes.c_void_p * n)(*[a.ctypes.data for a in latents])
    kr = (ctypes.c_void_p * n)(*[a.ctypes.data for a in k_ropes])
    cap = max(a.shape[0] for a in latents)
    f, q = scratch
    lib.cs_ds_decode_many(ctypes.addressof(layer), n, x.ctypes.data, pos.ctypes.data,
                          cos.ctypes.data, sin.ctypes.data, lat, kr, cap, kind, f.ctypes.data,
                          q.ctypes.data)  # fmt: skip


def ds_layer_call(
    name: str, layer: DsLayer, x: np.ndarray, pos: int, cos: np.ndarray, sin: np.ndarray,
    latent: np.ndarray, k_rope: np.ndarray, scratch: tuple[np.ndarray, np.ndarray],
    kind: int = 0,
) -> None:  # fmt: skip
    """cs_ds_decode ('decode': the whole layer) or cs_ds_attention ('attention'), in place on
    x (d,), writing the latent cache (cap, L) and RoPE key cache (cap, R) at `pos`."""
    lib = _lib
    assert lib is not None
    fn = lib.cs_ds_decode if name == "decode" else lib.cs_ds_attention
    f, q = scratch
    fn(ctypes.addressof(layer), x.ctypes.data, pos, cos.ctypes.data, sin.ctypes.data,
       latent.ctypes.data, k_rope.ctypes.data, latent.shape[0], kind, f.ctypes.data,
       q.ctypes.data)  # fmt: skip


def ds_decode_layers(
    layers: ctypes.Array[ctypes.c_void_p], x: np.ndarray, pos: int, cos: np.ndarray,
    sin: np.ndarray, latents: ctypes.Array[ctypes.c_void_p],
    k_ropes: ctypes.Array[ctypes.c_void_p], capacity: int,
    scratch: tuple[np.ndarray, np.ndarray], kind: int = 0,
) -> None:  # fmt: skip
    """cs_ds_decode through every layer of `layers` (pointers to DsLayer) in one call, in
    place on x (d,); latents / k_ropes: each layer's caches (pointers), of `capacity` tokens
    and of the cache type `kind`."""
    lib = _lib
    assert lib is not None
    f, q = scratch
    lib.cs_ds_decode_layers(layers, len(layers), x.ctypes.data, pos, cos.ctypes.data,
                            sin.ctypes.data, latents, k_ropes, capacity, kind, f.ctypes.data,
                            q.ctypes.data)  # fmt: skip


def ds_route(
    layer: DsLayer, x: np.ndarray, scratch: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """h = rms(x) and the routing of a MoE layer: (h (d,), expert ids (k,), weights (k,))."""
    lib = _lib
    assert lib is not None
    h = np.empty(layer.d, np.float32)
    ids = np.zeros(max(1, layer.n_used), np.int64)
    wts = np.zeros(max(1, layer.n_used), np.float32)
    f, q = scratch
    lib.cs_ds_route(ctypes.addressof(layer), x.ctypes.data, h.ctypes.data, ids.ctypes.data,
                    wts.ctypes.data, f.ctypes.data, q.ctypes.data)  # fmt: skip
    return h, ids, wts


KV_WIDTHS = {0: (4, 1), 1: (2, 1), 8: (34, 32)}  # a cache kind's bytes per `n` values (kv.c)


def kv_encode(x: np.ndarray, kind: int) -> np.ndarray:
    """float32 rows (rows, width) to a cache kind's bytes (rows, width * bytes / values), as
    the fused layers write them (kv.c kv_put): for tests and the same-bits harness."""
    lib = _load()
    assert lib is not None
    xc = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    num, den = KV_WIDTHS[kind]
    out = np.empty((xc.shape[0], xc.shape[1] * num // den), np.uint8)
    lib.cs_kv_encode(kind, xc.ctypes.data, xc.shape[0], xc.shape[1], out.ctypes.data)
    return out


def kv_decode(stored: np.ndarray, kind: int) -> np.ndarray:
    """kv_encode's bytes (rows, b) back to float32 rows, as attention reads them (kv.c)."""
    lib = _load()
    assert lib is not None
    sc = np.ascontiguousarray(stored, np.uint8)
    num, den = KV_WIDTHS[kind]
    out = np.empty((sc.shape[0], sc.shape[1] * den // num), np.float32)
    lib.cs_kv_decode(kind, sc.ctypes.data, sc.shape[0], out.shape[1], out.ctypes.data)
    return out
