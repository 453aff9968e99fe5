"""Faults a test plants in a stage, behind one seam: the stage asks `Faults` at three points
(before a step, while computing, after sampling) and is otherwise unaware of them. A stage
built without test flags holds `NO_FAULTS`, whose answers are all "nothing": production code
paths run no injection logic of their own.

- `crash_after_steps`: the process dies like a SIGKILL (no cleanup, no goodbye) once it has
  run this many steps — what a power cut looks like to the other stages;
- `fail_forward`: every forward pass raises (a broken node);
- `fail_token`: the first step of a sequence whose prompt holds this token raises, as a
  query of death would (a fault the stage cannot tell from its own);
- `perturb`: this fraction of sequences get wrong tokens (bad RAM; --verify's quorum sees it);
- `stall_once_s`: the next step blocks the event loop this long (a stuck node).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Faults:
    crash_after_steps: int | None = None
    fail_forward: bool = False
    fail_token: int | None = None
    perturb: float = 0.0
    stall_once_s: float = 0.0
    corrupted: set[int] = field(default_factory=set)  # sequences whose outputs go bad
    _rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def before_step(self, steps: int, prompt: Sequence[int] | None = None) -> None:
        """Before a step (a sequence's first one carries its `prompt`): die, or raise."""
        if self.crash_after_steps is not None and steps >= self.crash_after_steps:
            os._exit(1)  # no cleanup, no goodbye: what a power cut looks like to the others
        if self.fail_forward:
            raise RuntimeError("injected fault: this node's forward pass always fails")
        if self.fail_token is not None and prompt is not None and self.fail_token in prompt:
            raise RuntimeError("injected fault: this request's first step always fails")

    def stall(self) -> None:
        """While a step computes: block once, if asked."""
        if self.stall_once_s:
            stall_s, self.stall_once_s = self.stall_once_s, 0.0
            time.sleep(stall_s)

    def token(self, seq: int, token: int, first: bool, vocab_size: int) -> int:
        """A sampled token, or a wrong one for a sequence picked to go bad (at its first)."""
        if self.perturb and first and self._rng.random() < self.perturb:
            self.corrupted.add(seq)
        if seq in self.corrupted:
            return (token + 1 + int(self._rng.integers(1000))) % vocab_size
        return token

    def forget(self, seq: int) -> None:
        self.corrupted.discard(seq)


NO_FAULTS = Faults()  # a production stage's: every answer is "nothing"
