"""The simulator's calibration, without a stopwatch: `fit` finds known overheads again.

Runs are made by the simulator itself with known overheads (the split, load and kill a real
`measure_local` run has), then `fit` must recover them. That the calibrated simulator is
within ±15% of a real swarm is a measurement, not a test: `python -m bench.calibrate`
(real processes, real sockets) reports it against the goal.
"""

from __future__ import annotations

import dataclasses

import pytest

from cellswarm.sim.calibrate import fit, predict
from cellswarm.sim.params import SimParams
from cellswarm.swarm.local.measure import LocalRun

SPLITS = {4: ((0, 8), (8, 16), (16, 24), (24, 30)),
          8: tuple((k * 4, min(k * 4 + 4, 30)) for k in range(8))}  # fmt: skip


def _runs(truth: SimParams) -> list[LocalRun]:
    """What the simulator with `truth` says runs of 4 and 8 stages, with and without a
    kill, measure."""
    runs = []
    for workers, killed in [(4, False), (4, True), (8, False), (8, True)]:
        template = LocalRun(workers, "ps3", 8, 16, 4, killed, SPLITS[workers], (6,) * 8, 128,
                            0.0, 1.0, 1.0, 2.0 if killed else None)  # fmt: skip
        p = predict(template, truth)
        runs.append(dataclasses.replace(template, tokens_per_s=p.tokens_per_s,
                                        p50_latency_s=p.latency_p50_s))  # fmt: skip
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("hop_s, step_s, replace_s", [(0.001, 0.002, 1.0), (0.0, 0.003, 0.5)])
def test_fit_recovers_known_overheads(hop_s: float, step_s: float, replace_s: float) -> None:
    truth = SimParams(hop_overhead_s=hop_s, step_overhead_s=step_s, replace_overhead_s=replace_s)
    runs = _runs(truth)
    params = fit(runs)
    for run in runs:  # the fitted simulator reproduces the runs it was fitted on
        p = predict(run, params)
        assert p.tokens_per_s == pytest.approx(run.tokens_per_s, rel=0.02)
        assert p.latency_p50_s == pytest.approx(run.p50_latency_s, rel=0.02)
    assert params.step_overhead_s == pytest.approx(step_s, abs=2.5e-4)
    assert fit(runs) == params  # deterministic


def test_the_bare_planner_is_optimistic_without_the_overheads() -> None:
    runs = _runs(SimParams(hop_overhead_s=0.001, step_overhead_s=0.002))
    raw = [predict(r, SimParams()) for r in runs if not r.killed]
    assert all(p.tokens_per_s > r.tokens_per_s for p, r in zip(raw, runs[::2], strict=True))
