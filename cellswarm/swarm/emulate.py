"""Make a local stage behave like a node of a planner profile (a PS3, a Raspberry Pi).

Compute: after each real step, wait out the time the profile would have taken for the same
step — its weight bytes at the profile's effective memory bandwidth, or its FLOPs at the
profile's effective FLOP/s, whichever is longer (the planner's roofline). The wait is an
asyncio sleep, so an emulated node costs the host no CPU while it "computes". A stage can be
slowed to a profile, never sped up: if the host is slower, the real time stands.
Link: a token bucket at the profile's TCP goodput, plus half its round trip per frame.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from cellswarm.engine.model import Model
from cellswarm.planner.profiles import NodeProfile, get_profile


@dataclass
class Emulation:
    profile: NodeProfile
    weight_bytes: int  # what one step streams
    params: int  # what one token multiplies
    _link_free_at: float = 0.0

    @classmethod
    def for_stage(cls, model: Model, profile_name: str) -> Emulation:
        # The engine's own accounting: the bytes a step streams and the parameters it
        # multiplies. An embedding is a row lookup, not a stream — unless it is also the
        # (tied) output head of the last stage, which reads all of it, as the planner counts.
        weights = model.weights
        tied_head = "output.weight" not in weights and "output_norm.weight" in weights
        read = {k: t for k, t in weights.items() if k != "token_embd.weight" or tied_head}
        nbytes = sum(int(t.nbytes) for t in read.values())
        params = sum(math.prod(t.shape) for t in read.values() if len(t.shape) >= 2)
        return cls(get_profile(profile_name), nbytes, params)

    def step_s(self, tokens: int) -> float:
        p = self.profile
        return max(self.weight_bytes / p.effective_bandwidth_bytes_per_s,
                   2 * self.params * tokens / p.effective_flops)  # fmt: skip

    async def pad(self, started: float, tokens: int) -> None:
        remaining = self.step_s(tokens) - (time.perf_counter() - started)
        if remaining > 0:
            await asyncio.sleep(remaining)

    async def send(self, nbytes: int) -> None:
        """Wait for the link: queued frames leave one after another at the link's rate."""
        now = time.perf_counter()
        start = max(now, self._link_free_at)
        self._link_free_at = start + nbytes / self.profile.link_bytes_per_s
        await asyncio.sleep(self._link_free_at - now + self.profile.link_rtt_s / 2)
