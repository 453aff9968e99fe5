"""A stage's step times as a histogram (fixed buckets, as Prometheus histograms are): a few
ints per node, carried in its heartbeat stats and served on its /metrics."""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import msgspec

from cellswarm.swarm.protocol.messages import StepHistogram

# upper bounds (s): 0.5 ms (a demo decode step on one fast core) .. 30 s (a PS3's long
# prefill); each about 2.5x the last, so a decode step and a prefill land in buckets apart
BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
             10.0, 30.0)  # fmt: skip


class StepTimes:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)  # the last: beyond the largest bound
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    def histogram(self) -> StepHistogram:
        return StepHistogram(le=list(BUCKETS_S), counts=list(self.counts),
                             sum_s=round(self.sum_s, 6))  # fmt: skip

    def as_dict(self) -> dict[str, object]:
        """The histogram as a heartbeat's JSON carries it (le, counts, sum_s)."""
        out: dict[str, object] = msgspec.to_builtins(self.histogram())
        return out


def cumulative(
    hist: StepHistogram | Mapping[str, object],
) -> tuple[list[tuple[str, float]], float]:
    """A heartbeat's histogram (typed, or as its JSON carried it) as Prometheus' cumulative
    buckets ("+Inf" last) and its sum."""
    h = hist if isinstance(hist, StepHistogram) else msgspec.convert(hist, StepHistogram)
    total, out = 0, []
    for le, n in zip([*h.le, float("inf")], h.counts, strict=True):
        total += int(n)
        out.append(("+Inf" if le == float("inf") else repr(float(le)), float(total)))
    return out, float(h.sum_s)
