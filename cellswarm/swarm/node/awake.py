"""A worker keeps the CPUs out of deep idle states while steps arrive (kernels/awake.py).

A pipeline stage waits for its neighbours for much of every token: on two stages, about
half of it. Left to sleep, its core costs each hop a wakeup and each step cold caches. On a
2-core VM whose idle cores halt at once, in alternating `bench.hop` runs (254M model), the
swarm ran at 0.82-0.88 of one process with the bound held and at 0.80-0.87 without it.
The bound is held from a step until `linger_s` after the last one (back-to-back tokens and
jobs keep it), so a swarm between jobs sleeps as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from cellswarm.kernels.awake import DEVICE, WakeBound

LINGER_S = 2.0  # after the last step


class KeepAwake:
    """`touch()` at every step holds the bound; `linger_s` without one lets it go (or
    `release()`). Event-loop thread only."""

    def __init__(self, device: Path = DEVICE, latency_us: int = 0, linger_s: float = LINGER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.bound = WakeBound(device, latency_us, clock)
        self.linger_s, self.clock = linger_s, clock
        self._last_s = 0.0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def held(self) -> bool:
        return self.bound.held

    @property
    def unavailable(self) -> str:
        return self.bound.unavailable

    def held_s(self) -> float:
        return self.bound.held_s()

    def touch(self) -> None:
        """A step arrived: hold the bound (if not already), and keep holding it."""
        self._last_s = self.clock()
        if not self.bound.held and self.bound.hold():
            self._arm(self.linger_s)

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.bound.release()

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
