"""The same bits on every CPU path (issue 32): every family (llama, qwen2, qwen3, DeepSeek-V3
MLA + MoE) in every format the kernels read (F32, Q8_0, Q4_0, Q4_K, Q6_K, llama-quantize's
Q4_K_M mix), a prefill and 32 greedy decode steps, alone, among 16 sequences and over 1, 2
and 4 stages: the logits' digests must be equal, bit for bit, across

- kernel builds: native (AVX-512 with VNNI, VBMI, GFNI here), AVX-512 without them, AVX2
  (-mno-avx512f), and the portable path (-march=x86-64: no intrinsics, SSE2 only), each
  compiled cold into its own empty cache and home;
- OpenBLAS core types (Haswell, SkylakeX, Zen, Prescott): nothing in the token path uses BLAS;
- 1 and 2 threads.

Each configuration is a process of its own running tests/bits_probe.py. The cross-ISA proof
for ARM and PowerPC is tests/test_bits_cross.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cellswarm import kernels
from tests.bits_models import MODELS, write_model
from tests.conftest import _cpu_flags

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(kernels.backend() != "c", reason="no C compiler on this machine"),
]

ROOT = Path(__file__).resolve().parents[1]
AVX512 = "avx512f" in _cpu_flags()
BUILDS = {
    "native": "",
    **({"avx512-plain": "-mno-avx512vnni -mno-avx512vbmi -mno-gfni"} if AVX512 else {}),
    "avx2": "-mno-avx512f",
    "x86-64": "-march=x86-64",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("bits-models")
    return [write_model(folder / f"{f}-{q}.gguf", f, q) for f, q in MODELS]


def probe(paths: list[Path], home: Path, *, cflags: str = "", coretype: str | None = None,
          threads: int = 1) -> dict[str, dict[str, str]]:  # fmt: skip
    """tests/bits_probe.py in a process of its own: a cold home and kernel cache."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELLSWARM_", "OPENBLAS"))}
    env |= {"HOME": str(home), "CELLSWARM_CACHE": str(home / "cache"), "CELLSWARM_CFLAGS": cflags,
            "BITS_THREADS": str(threads), "PYTHONPATH": str(ROOT)}  # fmt: skip
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    run = subprocess.run([sys.executable, "-m", "tests.bits_probe", *map(str, paths)], env=env,
                         capture_output=True, text=True, timeout=1200, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def same_within(result: dict[str, dict[str, str]]) -> None:
    """Alone, in a batch of 16, over 2 and 4 stages, replayed as one prefill, and verified in
    speculative rounds of a few rows (in one process and over 4 stages): the same logits."""
    for model, r in result.items():
        checks = ("alone", "batch16", "stages2", "stages4", "replayed", "rounds",
                  "stages4_rounds")
        assert len({r[c] for c in checks}) == 1, (model, r)
        assert r["alone_q8_0"] == r["replayed_q8_0"], (model, r)  # C writes = numpy writes


def differences(a: dict[str, dict[str, str]], b: dict[str, dict[str, str]]) -> list[str]:
    return [f"{m}: {a[m]} vs {b[m]}" for m in a if a[m] != b[m]]


@pytest.fixture(scope="module")
def builds(
    models: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, dict[str, str]]]:
    """Every build's digests, two builds at a time (two cores), each cold."""
    home = tmp_path_factory.mktemp("homes")
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(lambda kv: probe(models, home / kv[0], cflags=kv[1]), BUILDS.items())
        return dict(zip(BUILDS, runs, strict=True))


def test_every_kernel_build_gives_the_same_bits(
    builds: dict[str, dict[str, dict[str, str]]],
) -> None:
    for result in builds.values():
        same_within(result)
    bad = {name: differences(r, builds["native"]) for name, r in builds.items()}
    assert bad == {name: [] for name in BUILDS}


@pytest.mark.parametrize("coretype", ["Haswell", "SkylakeX", "Zen", "Prescott"])
def test_blas_core_types_and_threads_change_no_bit(
    models: list[Path], builds: dict[str, dict[str, dict[str, str]]], tmp_path: Path,
    coretype: str,
) -> None:  # fmt: skip
    """One model of each family in the mix users download, per core type; on 2 threads."""
    mixed = [p for p in models if p.stem.endswith("Q4_K_M")]
    result = probe(mixed, tmp_path / "home", coretype=coretype, threads=2)
    assert differences(result, {p.name: builds["native"][p.name] for p in mixed}) == []
