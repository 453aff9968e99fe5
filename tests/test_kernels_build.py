"""The kernels are built before a worker joins (issue 30): `cellswarm kernels build` says so
and how long it took; a machine that cannot build them gets one line saying why (a worker
there does not join); a build stopped half way leaves no compiler running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.waiting import wait_until


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cellswarm.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def cold_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """An empty home and cache: nothing compiled before."""
    return {**os.environ, "HOME": str(tmp_path), "CELLSWARM_CACHE": str(tmp_path / "cache"),
            **extra}  # fmt: skip


def test_kernels_build_compiles_once_and_says_how_long(tmp_path: Path) -> None:
    env = cold_env(tmp_path)
    first = cli("kernels", "build", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("KERNELS built in ") and " s (" in first.stdout
    assert list((tmp_path / "cache" / "kernels").glob("kernels-*.so"))
    again = cli("kernels", "build", env=env)
    assert again.returncode == 0 and again.stdout.startswith("KERNELS ready")


def test_no_compiler_is_one_line_and_a_worker_does_not_join(tmp_path: Path) -> None:
    env = cold_env(tmp_path, CC=str(tmp_path / "no-such-gcc"))
    out = cli("kernels", "build", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    [line] = out.stderr.splitlines()
    assert "no-such-gcc" in line and "install gcc" in line and "CELLSWARM_KERNELS=numpy" in line
    # a worker on that machine says the same and never joins (no coordinator is needed)
    (tmp_path / "t").write_text("x" * 64)
    w = cli("worker", "--join", "http://127.0.0.1:9", "--memory", "128M", "--token-file",
            str(tmp_path / "t"), "--metrics", "off", env=env)  # fmt: skip
    assert w.returncode == 2 and "JOINED" not in w.stdout, (w.stdout, w.stderr)
    assert "cannot build the kernels" in w.stderr and "Traceback" not in w.stderr


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out.update(int(k) for k in kids)
        todo.extend(int(k) for k in kids)
    return out


def test_a_build_killed_half_way_leaves_no_compiler_running(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-m", "cellswarm.cli", "kernels", "build"],
                         env=cold_env(tmp_path), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # fmt: skip
    compiler: set[int] = set()

    def compiling() -> bool:  # the driver and the compiler proper under it
        compiler.update(descendants(p.pid))
        return any(Path(f"/proc/{c}/comm").exists() and
                   "cc1" in Path(f"/proc/{c}/comm").read_text() for c in descendants(p.pid))
    try:
        wait_until(compiling, timeout_s=60)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    time.sleep(0.2)
    wait_until(lambda: not any(Path(f"/proc/{c}").exists() and
                               Path(f"/proc/{c}/stat").read_text().split()[2] != "Z"
                               for c in compiler), timeout_s=3)  # fmt: skip
