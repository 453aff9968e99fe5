"""`cellswarm doctor --model`: the seed's order (input, environment, a first request), each
check found failing by breaking that thing on purpose."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from cellswarm import doctor
from cellswarm.quant import PackedMatrix


def statuses(results: list[doctor.Result]) -> dict[str, str]:
    return {r.name: r.status for r in results}


def test_the_demo_model_on_this_machine_passes_every_check(demo_path: Path) -> None:
    results = doctor.Doctor(demo_path).run()
    assert set(statuses(results).values()) == {"PASS"}, [r.line() for r in results]
    assert [r.step for r in results] == ["input"] * 2 + ["environment"] * 3 + ["request"] * 2
    assert "Paris" in next(r.detail for r in results if r.name == "short prompt")


def test_a_truncated_file_fails_first_and_the_rest_that_need_it_skip(
    demo_path: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(demo_path.read_bytes()[: 3 << 20])
    got = statuses(doctor.Doctor(bad).run())
    assert got["model file"] == "FAIL"
    assert got["tokenizer"] == got["memory"] == got["short prompt"] == "SKIP"
    assert got["disk"] == got["kernels"] == "PASS"  # the environment is still looked at


def test_kernels_that_give_wrong_numbers_are_found(
    demo_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = PackedMatrix.matmul

    def wrong(self: PackedMatrix, x: np.ndarray, **kw: object) -> np.ndarray:
        return np.asarray(real(self, x, **kw)) * 1.1  # type: ignore[arg-type]

    monkeypatch.setattr(PackedMatrix, "matmul", wrong)
    [r] = [r for r in doctor.Doctor(demo_path).run() if r.name == "kernels"]
    assert r.status == "FAIL" and "wrong numbers" in r.fix


def test_a_full_disk_is_found(demo_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 << 30, 10 << 30, 5 << 20))
    [r] = [r for r in doctor.Doctor(demo_path).run() if r.name == "disk"]
    assert r.status == "FAIL" and "free space" in r.fix and "5.0 MiB" in r.detail


@pytest.mark.slow
def test_the_command_says_one_line_per_check_and_fails_in_its_exit_status(
    demo_path: Path, tmp_path: Path
) -> None:
    ok = subprocess.run([sys.executable, "-m", "cellswarm", "doctor", "--model", str(demo_path)],
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ok.returncode == 0 and "7 of 7 checks passed" in ok.stdout, ok.stdout + ok.stderr
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(demo_path.read_bytes()[:1000])
    run = subprocess.run([sys.executable, "-m", "cellswarm", "doctor", "--model", str(bad)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr
    first = run.stdout.splitlines()[0]
    assert first.startswith("FAIL input") and "truncated" in first and "fix:" in first
