"""Keep this machine's CPUs out of deep idle states while the node has work in flight.

A pipeline stage waits for its neighbours for most of every token: on two stages, about half
of it. An idle core halts (a virtual machine's gives its physical core back to the host),
and a halted core costs twice: the frame that ends the wait finds it asleep (each hop pays
the wakeup), and the step that follows runs on cold caches. Measured with `bench.hop` on a
2-core VM: the stages' own compute was 5-15% slower than the same layers in one process,
and the hops ~30% longer, until the cores were kept awake.

Linux's PM QoS interface says how long the CPUs may take to wake: a process writes a
latency bound in microseconds (a 32-bit int) to /dev/cpu_dma_latency, and the bound holds
for as long as it keeps that file open. 0 leaves only the polling idle state: an idle core
spins in the kernel, so it wakes at once, and it still yields to any runnable task (a busy
core is never taken from other work, unlike a spin in user space). The cost is power while
the request is held, which is why a node holds it only while steps arrive, and lets go
`linger_s` after the last one (a swarm between jobs halts as before).

Opening the device needs root (or write access to it); without it, or on a system without
the device, the node runs as it would without --keep-awake, and says so once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

DEVICE = Path("/dev/cpu_dma_latency")
LINGER_S = 2.0  # after the last step: back-to-back tokens and jobs keep it held


class KeepAwake:
    """Hold a wake-latency bound of `latency_us` while `touch()` is called often; let it go
    `linger_s` after the last call (or at `release()`). Event-loop thread only."""

    def __init__(self, device: Path = DEVICE, latency_us: int = 0, linger_s: float = LINGER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.device, self.latency_us, self.linger_s = device, latency_us, linger_s
        self.clock = clock
        self._fd: int | None = None
        self._last_s = 0.0
        self._held_since_s = 0.0
        self._held_before_s = 0.0  # the spans already let go
        self._timer: asyncio.TimerHandle | None = None
        self.unavailable = ""  # why the bound could not be held (said once), if so

    @property
    def held(self) -> bool:
        return self._fd is not None

    def held_s(self) -> float:
        """Seconds the bound has been held, in all (the energy estimate counts them)."""
        now = self.clock() - self._held_since_s if self._fd is not None else 0.0
        return self._held_before_s + now

    def touch(self) -> None:
        """A step arrived: hold the bound (if not already), and keep holding it."""
        self._last_s = self.clock()
        if self._fd is not None or self.unavailable:
            return
        try:
            fd = os.open(self.device, os.O_WRONLY)
            try:
                os.write(fd, struct.pack("<i", self.latency_us))
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            self.unavailable = f"{self.device}: {exc.strerror or exc}"
            log.warning("keep-awake: cannot hold a CPU wake-latency bound (%s); idle cores "
                        "will halt between steps", self.unavailable)  # fmt: skip
            return
        self._fd, self._held_since_s = fd, self._last_s
        self._arm(self.linger_s)

    def release(self) -> None:
        """Let the CPUs halt again (closing the device drops the bound)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            self._held_before_s += self.clock() - self._held_since_s

    def _arm(self, after_s: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): held until release()
            return
        self._timer = loop.call_later(max(after_s, 0.0), self._expire)

    def _expire(self) -> None:
        self._timer = None
        idle_s = self.clock() - self._last_s
        if idle_s >= self.linger_s:
            self.release()
        else:
            self._arm(self.linger_s - idle_s)
