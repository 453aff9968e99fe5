"""The simulator against a real local swarm of emulated nodes (issue 7's calibration)."""

from __future__ import annotations

from pathlib import Path

from cellswarm.sim.calibrate import TOLERANCE, calibrate, fit, predict
from cellswarm.sim.params import SimParams


def test_calibrated_predictions_are_within_15_percent(demo_path: Path) -> None:
    """4, 8 and 16 emulated ps3 workers, each with and without one worker SIGKILLed
    mid-batch: after fitting the overheads, decode tokens/s and p50 latency are predicted
    within ±15% (real processes, real sockets; ~60 s)."""
    cal = calibrate()
    for _ in range(2):  # timings on a shared 2-core box: a noisy run is measured again
        if cal.ok:
            break
        cal = calibrate()
    for c in cal.checks:
        assert abs(c.tokens_error) <= TOLERANCE, c
        assert abs(c.latency_error) <= TOLERANCE, c
    assert cal.params.hop_overhead_s > 0 and cal.params.replace_overhead_s >= 0
    # the fit matters: the planner's numbers alone miss the software overheads
    raw = [predict(c.run, SimParams()) for c in cal.checks if not c.run.killed]
    measured = [c.run for c in cal.checks if not c.run.killed]
    assert max(p.tokens_per_s / r.tokens_per_s for p, r in zip(raw, measured, strict=True)) > 1
    assert fit([c.run for c in cal.checks], host_floor=True) == cal.params  # deterministic
