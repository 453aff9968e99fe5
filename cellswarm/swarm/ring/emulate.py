"""Make a local stage behave like a node of a planner profile (a PS3, a Raspberry Pi).

Compute: after each real step (the layers, and on the last stage the head and the sampler),
wait out the time the profile would have taken for the same step — its weight bytes at the
profile's effective memory bandwidth, or its FLOPs at the profile's effective FLOP/s,
whichever is longer (the planner's roofline). The wait is an asyncio sleep, so an emulated
node costs the host no CPU while it "computes". A stage can be slowed to a profile, never
sped up: if the host is slower, the real time stands (a PS3 runs 7-8 demo layers in
~1.3-1.5 ms, 15 in ~2.8 ms; this host's Python takes ~1.5-2.6 and ~3.4 ms).

Link: a token bucket at the profile's TCP goodput, plus half its round trip per frame. Like a
real NIC the link sends while the node computes: `depart` only books the frame's slot on the
wire and says when it arrives; the stage hands the frame to a writer that delivers it then
(stage.py), and goes on with its next step at once.

Timers: asyncio's default (epoll) loop waits in whole milliseconds, rounded up, so every
emulated wait overshot by ~0.5-1 ms — 10-20 % of a 5 ms step, paid at every stage and every
hop. An emulated node runs on `precise_loop`, whose select() waits in microseconds.

What emulation cannot remove: the host's own CPU. Every stage's real compute, its frame
encoding and loopback sockets, and the client share the host's cores; when several stages
compute at once on fewer cores they slow each other, and no padding hides that.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from dataclasses import dataclass

from cellswarm.engine.model import Model
from cellswarm.planner.profiles import NodeProfile, get_profile


def precise_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose timers fire within microseconds, not milliseconds: select() takes
    its timeout in microseconds where epoll_wait() takes whole milliseconds. select() is
    limited to 1024 descriptors, far more than a stage's few connections."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


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

    def depart(self, nbytes: int) -> float:
        """Book a frame of `nbytes` on the link; the perf_counter time it reaches the next
        node. Queued frames leave one after another at the link's rate, in order."""
        start = max(time.perf_counter(), self._link_free_at)
        self._link_free_at = start + nbytes / self.profile.link_bytes_per_s
        return self._link_free_at + self.profile.link_rtt_s / 2
