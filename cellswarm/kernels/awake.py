"""Keep the CPUs out of deep idle states while work is in flight (Linux PM QoS).

Idle moments inside a token are many and short: a second thread waits at every barrier
for the first, a pipeline stage waits half of every token for its neighbours. An idle core
halts (a virtual machine's gives its physical core back to the host), and a halted core
costs twice: whatever ends the wait finds it asleep, and the work that follows runs on
cold caches. libgomp's threads spin only briefly before they sleep (SPIN_COUNT in
__init__.py: longer spins take a core from other work on a busy machine).

Linux's PM QoS interface says how long the CPUs may take to wake: a process writes a
latency bound in microseconds (a 32-bit int) to /dev/cpu_dma_latency, and the bound holds
for as long as that file stays open. 0 leaves only the polling idle state: an idle core
spins in the kernel, so it wakes at once, and it still yields to any runnable task (unlike
a spin in user space, it never takes a core from other work). The cost is power, on every
core, for as long as the bound is held: so it is held only while work runs (a generation
with more than one thread, a worker while steps arrive) and let go after.

Opening the device needs root (or write access to it); without it, or on a system without
the device, everything runs as before, and a warning says so once.
CELLSWARM_KEEP_AWAKE=0 turns it off for the engine (`cellswarm generate`, Model.generate).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

DEVICE = Path("/dev/cpu_dma_latency")


class WakeBound:
    """One PM QoS request: `hold()` opens the device and writes the bound, `release()`
    closes it. Counts the seconds held (an energy estimate counts them as busy)."""

    def __init__(self, device: Path = DEVICE, latency_us: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.device, self.latency_us, self.clock = device, latency_us, clock
        self.unavailable = ""  # why the bound could not be held, once tried (said once)
        self._fd: int | None = None
        self._since_s = 0.0
        self._before_s = 0.0  # the spans already let go

    @property
    def held(self) -> bool:
        return self._fd is not None

    def hold(self) -> bool:
        """Hold the bound (if not already); False where it cannot be held."""
        if self._fd is not None:
            return True
        if self.unavailable:
            return False
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
                        "will sleep between steps", self.unavailable)  # fmt: skip
            return False
        self._fd, self._since_s = fd, self.clock()
        return True

    def release(self) -> None:
        """Let the CPUs sleep again (closing the device drops the bound)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            self._before_s += self.clock() - self._since_s

    def held_s(self) -> float:
        """Seconds held, in all (the span still held counts so far)."""
        return self._before_s + (self.clock() - self._since_s if self._fd is not None else 0.0)


_shared = WakeBound()
_users = 0
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("CELLSWARM_KEEP_AWAKE", "1") != "0"


@contextmanager
def awake(wanted: bool = True) -> Iterator[None]:
    """Hold the process's bound inside the block (nested and concurrent blocks share one);
    a no-op unless `wanted` and enabled()."""
    global _users
    if not (wanted and enabled()):
        yield
        return
    with _lock:
        _users += 1
        _shared.hold()
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _shared.release()
