"""Instructions a weight of one matrix-vector product, ours against llama.cpp's, per format.

    python -m bench.instructions [--types Q4_K,Q6_K,...]

Timings on a shared 2-core machine wander by ±30% from one run to the next; instruction
counts do not. Both sides run under `valgrind --tool=callgrind`, counting only the product
(CALLGRIND_START/STOP_INSTRUMENTATION): a 2048 x 2048 matrix, one thread, the activations
quantized inside the measured part as a decode step does. Ours: kernels.c built as the
engine builds it (bench/instructions/ours_matvec.c), row by row and, for the formats this CPU
repacks at load (16-row groups: AVX-512 VNNI or AVX2), as a loaded model reads them.
llama.cpp's: the peers' build (bench.peers.install_llama_cpp), ggml's own quantization and
its CPU `vec_dot` row by row, and for Q4_0, Q4_K and IQ4_NL also the repacked 8-row AVX2
kernel it lays those out for (bench/instructions/ggml_matvec.c). Where decode is
compute-bound (small models on slow cores) the ratio of the two counts is the speed ratio
to expect.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from bench.peers import install_llama_cpp
from cellswarm.kernels import CFLAGS, FUSED_TYPES, SOURCE

HERE = Path(__file__).resolve().parent / "instructions"
WEIGHTS = 2048 * 2048
REPACKED = {"Q4_0", "Q4_K", "IQ4_NL"}  # llama.cpp's AVX2 8-row layouts (ggml-cpu repack)
DEFAULT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q2_K", "Q3_K", "Q5_1", "Q5_K",
                 "TQ2_0", "TQ1_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                 "IQ1_M", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4"]  # fmt: skip


def build(out: Path) -> tuple[Path, Path]:
    """The two harnesses, compiled: ours against kernels.c, llama.cpp's against its libs."""
    ours, theirs = out / "ours_matvec", out / "ggml_matvec"
    flags = [f for f in CFLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run(["gcc", *flags, f'-DKERNELS="{SOURCE}"', str(HERE / "ours_matvec.c"), "-lm",
                    "-o", str(ours)], check=True, capture_output=True)  # fmt: skip
    llama = install_llama_cpp().bin.parent.parent  # build/bin -> the llama.cpp tree
    libs = [str(llama / "build" / "ggml" / "src" / f"libggml{s}.a")
            for s in ("-cpu", "-base", "", "-cpu", "-base")]  # fmt: skip
    subprocess.run(["g++", "-O2", "-x", "c", str(HERE / "ggml_matvec.c"), "-x", "none",
                    f"-I{llama / 'ggml' / 'include'}", *libs, "-fopenmp", "-lpthread", "-lm",
                    "-o", str(theirs)], check=True, capture_output=True)  # fmt: skip
    return ours, theirs


def per_weight(argv: list[str], out: Path) -> float | None:
    """Instructions a weight of the instrumented part of `argv` under callgrind; None when
    the harness says the layout asked for does not exist on this CPU (exit 3)."""
    log = out / "callgrind.out"
    run = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                          f"--callgrind-out-file={log}", *argv], capture_output=True)  # fmt: skip
    if run.returncode == 3:
        return None
    run.check_returncode()
    totals = next(line for line in log.read_text().splitlines() if line.startswith("totals:"))
    return int(totals.split()[1]) / WEIGHTS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default=",".join(DEFAULT_TYPES))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        ours, theirs = build(out)
        print("type      ours  ours 16-row  llama.cpp row  llama.cpp 8-row  "
              "ours / llama.cpp (best of each)")
        for name in args.types.split(","):
            t = str(FUSED_TYPES[name])
            a = per_weight([str(ours), t], out)
            a16 = per_weight([str(ours), t, "r16"], out)
            b = per_weight([str(theirs), t], out)
            c = per_weight([str(theirs), t, "gemv"], out) if name in REPACKED else None
            assert a is not None and b is not None
            ours_best = min(x for x in (a, a16) if x is not None)
            best = min(x for x in (b, c) if x is not None)
            print(f"{name:8} {a:5.2f}  {_cell(a16):>11}  {b:13.2f}  {_cell(c):>15}  "
                  f"{ours_best / best:8.2f}", flush=True)  # fmt: skip


def _cell(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    main()
