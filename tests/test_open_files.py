"""The coordinator's open files (issue 31): every connection takes one, and systemd's default
soft limit of 1024 let 1,100 idle connections make a coordinator unreachable. At start it
raises its soft limit to the hard one, and says so when even the hard one is low."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cellswarm.swarm.local.pipeline import free_port
from tests.waiting import wait_until


def limited(soft: int, hard: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return apply


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files line")


@pytest.mark.parametrize(("hard", "warned"), [(8192, False), (1000, True)])
def test_the_coordinator_raises_its_open_file_limit_and_warns_when_low(
    demo_path: Path, tmp_path: Path, hard: int, warned: bool
) -> None:
    out = tmp_path / "coordinator.out"
    with out.open("w") as sink:
        p = subprocess.Popen(
            [sys.executable, "-m", "cellswarm", "coordinator", "--model", str(demo_path),
             "--listen", f"127.0.0.1:{free_port()}", "--db", f"sqlite:///{tmp_path / 'c.db'}"],
            stdout=sink, stderr=subprocess.STDOUT, preexec_fn=limited(256, hard),
            env=dict(os.environ, CELLSWARM_CACHE=str(tmp_path / "cache")),
        )  # fmt: skip
    try:
        wait_until(lambda: "READY" in out.read_text(), timeout_s=120)
        assert open_files_limit(p.pid) == (hard, hard)
        said = out.read_text()
        assert (f"at most {hard} open files" in said) == warned, said
    finally:
        p.kill()
        p.wait()
