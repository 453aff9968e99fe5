"""A full disk under the coordinator: a clear 507, nodes keep their places, nothing
acknowledged is lost, and it carries on by itself once space returns.

The coordinator's database and every node's log live on a 24 MiB tmpfs that the test fills
with a file; needs root (mount), skipped with the reason otherwise."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cellswarm.errors import RequestError
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.conftest import greedy_reference

PROMPT = "The capital of France is"


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A small tmpfs at `mnt` (made), unmounted after; the test skips without root."""
    if os.geteuid() != 0:
        pytest.skip("needs root: it mounts a small tmpfs to fill on purpose")
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "24m") as mnt:
        yield mnt


def fill(disk: Path) -> Path:
    """Fill the disk to the last byte. Unbuffered: a buffered file that met ENOSPC in a
    flush still holds the bytes, and its close raised ENOSPC again (a red CI run)."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_a_full_disk_is_a_507_costs_no_node_and_loses_nothing(
    demo_path: Path, small_disk: Path
) -> None:
    [(prompt, expected)] = greedy_reference(demo_path, [PROMPT], 8).items()
    body = {"prompt": list(prompt), "max_tokens": 8}
    with LocalSwarm(str(demo_path), workers=2, memory="256M", state_dir=small_disk,
                    stages=2) as swarm:  # fmt: skip
        swarm.wait_ready()
        before = client.submit(swarm.url, body)  # acknowledged before the disk fills
        filler = fill(small_disk)
        with pytest.raises(RequestError, match="disk is full"):
            for _ in range(50):  # the first writes may still fit in a page the file has
                client.submit(swarm.url, body)
        time.sleep(3 * swarm.heartbeat_timeout_s)  # long enough to lose every node, were
        status = client.call(swarm.url, "/v1/status")  # heartbeats written to the database
        assert [n["state"] for n in status["nodes"]] == ["assigned", "assigned"]
        filler.unlink()  # space returns: no restart, no operator
        after = client.submit(swarm.url, body)
        for rid in (before, after):
            result = client.wait(swarm.url, rid, timeout_s=120)
            assert result["state"] == "done"
            assert result["tokens"] == expected
        ledger = client.call(swarm.url, "/v1/ledger")
        assert ledger["done"] == 2 and ledger["duplicates"] == 0, ledger
        assert ledger["done_without_commit"] == 0, ledger


def test_a_process_s_kept_output_stops_on_a_full_disk_not_its_pump() -> None:
    """LocalSwarm copies each process's output to a file as it pumps the pipe: with the
    disk full (/dev/full: every write is ENOSPC) the copy stops and the pump goes on — a
    pump that died would leave the process blocked on a full pipe."""
    from cellswarm.swarm.local.up import Kept

    kept = Kept(Path("/dev/full"))
    for _ in range(3):
        kept.write("a line the disk has no room for\n")  # no exception
    assert kept.file is None
    kept.close()
