"""The same bytes on other CPUs (issue 32): tests/bits_harness.c (the kernels on fixed inputs
read from a file: every quantized and float matmul, attention, the elementwise functions, one
llama-family and one DeepSeek-V3 layer) built for x86-64 here (native, and the portable
-march=x86-64 path) and by Debian's cross compilers for aarch64 (NEON), 32-bit ARM (armhf,
NEON) and the PS3's big-endian PowerPC (-mcpu=cell -maltivec), the last three run under
qemu-user. Every output must be the x86 build's bytes. Where a cross compiler or qemu is
missing the test skips, saying which (CI installs them: .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

HARNESS = Path(__file__).with_name("bits_harness.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"]
# name: (compiler, its flags, how to run the binary)
TARGETS = {
    "x86-64-native": ("gcc", ["-march=native"], []),
    "x86-64-portable": ("gcc", ["-march=x86-64"], []),
    "aarch64-neon": ("aarch64-linux-gnu-gcc", ["-static"], ["qemu-aarch64"]),
    "armhf-neon": ("arm-linux-gnueabihf-gcc", ["-static", "-mfpu=neon"], ["qemu-arm"]),
    "ppc64be-cell-altivec": ("powerpc64-linux-gnu-gcc", ["-static", "-mcpu=cell", "-maltivec"],
                             ["qemu-ppc64"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("harness") / "input.bin"
    path.write_bytes(np.random.default_rng(32).integers(0, 256, 1 << 20, np.uint8).tobytes())
    return path


def run(target: str, inputs: Path, folder: Path) -> bytes:
    cc, flags, runner = TARGETS[target]
    missing = [tool for tool in (cc, *runner) if shutil.which(tool) is None]
    if missing and os.environ.get("CELLSWARM_REQUIRE_CROSS"):  # CI installed them: a failure
        pytest.fail(f"{target}: {' and '.join(missing)} not found")
    if missing:
        pytest.skip(f"{target}: {' and '.join(missing)} not installed (Debian: gcc-*-linux-gnu*, "
                    "qemu-user)")  # fmt: skip
    binary, out = folder / target, folder / f"{target}.out"
    build = subprocess.run([cc, *FLAGS, *flags, "-o", str(binary), str(HARNESS), "-lm"],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    done = subprocess.run([*runner, str(binary), str(inputs), str(out)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return out.read_bytes()


@pytest.fixture(scope="module")
def x86(inputs: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = run("x86-64-native", inputs, tmp_path_factory.mktemp("x86"))
    values = np.frombuffer(out, "<f4")
    assert values.size > 6000 and np.isfinite(values).all()  # every part wrote its results
    return out


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "x86-64-native"])
def test_the_kernels_give_the_same_bytes_on(
    target: str, inputs: Path, x86: bytes, tmp_path: Path
) -> None:
    out = run(target, inputs, tmp_path)
    if out != x86:
        a, b = np.frombuffer(x86, "<f4"), np.frombuffer(out, "<f4")
        first = int(np.flatnonzero(a != b)[0]) if a.size == b.size else -1
        pytest.fail(f"{target}: {int((a != b).sum()) if first >= 0 else 'other'} values differ "
                    f"from x86's, the first at float {first}")  # fmt: skip
