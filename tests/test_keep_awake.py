"""A worker holds a CPU wake-latency bound (PM QoS) while steps arrive, and lets it go after.

The unit tests give KeepAwake a plain file for the device; the swarm test watches a real
worker's open files for the real /dev/cpu_dma_latency (root only)."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import cellswarm
from cellswarm import kernels
from cellswarm.kernels import awake as awake_module
from cellswarm.kernels.awake import WakeBound
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.node.awake import DEVICE, KeepAwake
from cellswarm.swarm.node.metrics import Power


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_touch_writes_the_bound_and_holds_it_until_release(tmp_path: Path) -> None:
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    awake = KeepAwake(device, latency_us=0)
    assert not awake.held
    awake.touch()
    awake.touch()  # held already: not opened (or written) twice
    assert awake.held
    assert device.read_bytes() == struct.pack("<i", 0)  # the kernel's format: a 32-bit int
    awake.release()
    assert not awake.held
    awake.release()  # twice is harmless


def test_held_seconds_add_up_and_count_at_busy_power(tmp_path: Path) -> None:
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    clock = Clock()
    awake = KeepAwake(device, clock=clock)
    awake.touch()
    clock.now += 3.0
    awake.release()
    clock.now += 10.0  # let go: not counted
    awake.touch()
    clock.now += 1.5
    assert awake.held_s() == pytest.approx(4.5)  # the span still held counts so far
    power = Power()
    power.set(busy_w=80.0, idle_w=5.0, source="test")
    power.started_s -= 100.0  # up for 100 s
    # busy 2 s inside 4.5 s held: 4.5 s at 80 W, 95.5 s at 5 W
    assert power.joules(2.0, awake.held_s()) == pytest.approx(4.5 * 80 + 95.5 * 5, rel=1e-3)
    assert power.joules(2.0) == pytest.approx(2 * 80 + 98 * 5, rel=1e-3)


def test_the_bound_lingers_after_the_last_step_then_goes(tmp_path: Path) -> None:
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    clock = Clock()

    async def run() -> list[bool]:
        awake = KeepAwake(device, linger_s=0.2, clock=clock)
        seen = []
        awake.touch()
        await asyncio.sleep(0.1)
        clock.now += 0.15
        awake.touch()  # a step within the linger: the bound stays past the first deadline
        clock.now += 0.1
        await asyncio.sleep(0.2)  # the first deadline: 0.1 s since the last step
        seen.append(awake.held)
        clock.now += 0.5
        await asyncio.sleep(0.3)  # the re-armed one: idle long enough
        seen.append(awake.held)
        return seen

    assert asyncio.run(run()) == [True, False]


def test_without_the_device_the_node_runs_on_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    awake = KeepAwake(tmp_path / "absent")
    awake.touch()
    awake.touch()
    assert not awake.held
    assert "absent" in awake.unavailable
    assert sum("keep-awake" in r.getMessage() for r in caplog.records) == 1


def held_by(pid: int) -> bool:
    """Whether process pid has the PM QoS device open."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == str(DEVICE):
                return True
        except OSError:  # closed meanwhile
            continue
    return False


@pytest.mark.skipif(not os.access(DEVICE, os.W_OK), reason="needs write access to " + str(DEVICE))
@pytest.mark.parametrize("keep_awake", [True, False])
def test_a_worker_holds_the_bound_while_it_decodes_and_lets_go_after(
    demo_path: Path, tmp_path: Path, keep_awake: bool
) -> None:
    with LocalSwarm(str(demo_path), 2, "200M", tmp_path, stages=2,
                    keep_awake=keep_awake) as swarm:  # fmt: skip
        swarm.wait_ready()
        workers = [p.pid for name, p in swarm.procs.items() if name.startswith("worker")]
        assert not any(held_by(pid) for pid in workers)  # loaded and idle: nothing held
        rid = client.submit(swarm.url, {"prompt": [1, 2, 3], "max_tokens": 200})
        seen: set[int] = set()
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(client.wait, swarm.url, rid)
            while not done.done():
                seen |= {pid for pid in workers if held_by(pid)}
                time.sleep(0.01)
        assert done.result()["state"] == "done"
        # both stages held it while steps came (and for LINGER_S after the last)
        assert seen == (set(workers) if keep_awake else set())
        deadline = time.monotonic() + 30
        while any(held_by(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(held_by(pid) for pid in workers)


@pytest.fixture
def shared_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WakeBound:
    """The engine's process-wide bound, on a plain file."""
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    bound = WakeBound(device)
    monkeypatch.setattr(awake_module, "_shared", bound)
    monkeypatch.delenv("CELLSWARM_KEEP_AWAKE", raising=False)
    return bound


def test_nested_blocks_share_one_bound_and_the_last_lets_go(shared_bound: WakeBound) -> None:
    with awake_module.awake():
        with awake_module.awake():
            assert shared_bound.held
        assert shared_bound.held  # the outer block still runs
    assert not shared_bound.held
    with awake_module.awake(wanted=False):
        assert not shared_bound.held


def test_the_environment_turns_it_off(
    shared_bound: WakeBound, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELLSWARM_KEEP_AWAKE", "0")
    with awake_module.awake():
        assert not shared_bound.held


@pytest.mark.parametrize("threads", [1, 2])
def test_a_generation_holds_the_bound_above_one_thread(
    demo_path: Path, shared_bound: WakeBound, threads: int
) -> None:
    model = cellswarm.load(demo_path)
    seen: list[bool] = []
    before = kernels.threads()
    kernels.set_threads(threads)
    try:
        gen = model.generate("Once upon a time", max_tokens=6,
                             on_text=lambda piece: seen.append(shared_bound.held))  # fmt: skip
    finally:
        kernels.set_threads(before)
    assert gen.token_ids and seen
    assert all(seen) == (threads > 1) and any(seen) == (threads > 1)
    assert not shared_bound.held  # let go when the generation ends
