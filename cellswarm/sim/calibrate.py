"""`cellswarm simulate --calibrate`: fit the simulator to a real local swarm, then check it.

    measure_local (real processes, emulated nodes)  ->  tokens/s, p50 latency per setup
    predict_local (the simulator, same split)       ->  the same two numbers
    fit SimParams (per-hop, per-step, replacement overheads) on them, print side by side

The planner's cost model knows bandwidth, FLOPs and wire time; it does not know what our
software adds per message and per step (framing, syscalls, event loops, Python around the
kernels), nor how long a dead node takes to be noticed and replaced. Those are the
simulator's `SimParams`; this fits them by least squares over the relative errors of
tokens/s and p50 latency, on runs without a kill (hop and step overheads) and then with one
(replacement overhead) — on the smallest swarm's runs only (`FIT_ON`) — and reports the
error of every other setup: out of sample, what a prediction for an unbuilt swarm is worth.
Emulated `ps3` nodes by default.
An emulated node can be made slower than this host, never faster: a PS3's roofline for a
slice of the demo model is faster than our 2-core box's Python step, so the fit also finds
the host's effective streaming rate (`host_bytes_per_s`, the emulation floor: a step takes
at least its shard's bytes at that rate); for a slower profile (rpi4) the floor does not
bind. Real nodes have no such floor: the fitted value is used for local predictions only.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cellswarm.sim.local import LocalPrediction, predict_local
from cellswarm.sim.params import SimParams
from cellswarm.swarm.local.measure import LocalRun, measure_local

SIZES = (4, 8, 16)
FIT_ON = (4,)  # the sizes whose runs the overheads are fitted on; the others are predicted
TOLERANCE = 0.15


@dataclass(frozen=True)
class Check:
    run: LocalRun
    predicted: LocalPrediction
    fitted: bool = False  # the overheads were fitted on this run (in sample)

    @property
    def tokens_error(self) -> float:
        return self.predicted.tokens_per_s / self.run.tokens_per_s - 1

    @property
    def latency_error(self) -> float:
        return self.predicted.latency_p50_s / self.run.p50_latency_s - 1

    @property
    def ok(self) -> bool:
        return abs(self.tokens_error) <= TOLERANCE and abs(self.latency_error) <= TOLERANCE


@dataclass(frozen=True)
class Calibration:
    params: SimParams
    checks: tuple[Check, ...]

    @property
    def predicted(self) -> tuple[Check, ...]:
        """The runs the fit did not see (every run, when it saw none of them)."""
        return tuple(c for c in self.checks if not c.fitted)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.predicted)

    def as_dict(self) -> dict[str, Any]:
        return {
            "params": dataclasses.asdict(self.params), "ok": self.ok,
            "rows": [{"workers": c.run.workers, "killed": c.run.killed, "fitted": c.fitted,
                      "measured_tokens_per_s": c.run.tokens_per_s,
                      "predicted_tokens_per_s": round(c.predicted.tokens_per_s, 3),
                      "tokens_error": round(c.tokens_error, 4),
                      "measured_p50_s": c.run.p50_latency_s,
                      "predicted_p50_s": round(c.predicted.latency_p50_s, 4),
                      "latency_error": round(c.latency_error, 4)} for c in self.checks],
        }  # fmt: skip


def predict(run: LocalRun, params: SimParams) -> LocalPrediction:
    """The simulator's view of one measured run: the same split, load and kill."""
    kill_stage = len(run.split) // 2  # measure_local kills the middle stage's worker
    return predict_local(
        list(run.split), node=run.profile, in_flight=run.in_flight, jobs=run.jobs,
        tokens=run.max_tokens, prompt_tokens=round(sum(run.prompt_tokens) / len(run.prompt_tokens)),
        kill_at_s=run.kill_at_s if run.killed else None, kill_stage=kill_stage, params=params,
    )  # fmt: skip


def _loss(runs: Sequence[LocalRun], params: SimParams) -> float:
    total = 0.0
    for run in runs:
        p = predict(run, params)
        total += (p.tokens_per_s / run.tokens_per_s - 1) ** 2
        total += (p.latency_p50_s / run.p50_latency_s - 1) ** 2
    return total


def fit(runs: Sequence[LocalRun], host_floor: bool = False) -> SimParams:
    """Least squares on a coarse grid, refined around the best point twice. With
    `host_floor`, also the host's streaming rate below which an emulated node cannot go."""
    plain = [r for r in runs if not r.killed]
    hosts = [0.0] + ([x * 1e9 for x in (2, 3, 4, 6, 8, 12, 16, 24)] if host_floor else [])
    fits = [(b, *_grid2(plain, (0.0, 0.004), (0.0, 0.004), b)) for b in hosts]
    best = min((_loss(plain, SimParams(hop_overhead_s=h, step_overhead_s=s,
                                      host_bytes_per_s=b)), h, s, b)
               for b, h, s in fits)  # fmt: skip
    _, hop, step, host = best
    params = SimParams(hop_overhead_s=hop, step_overhead_s=step, host_bytes_per_s=host)
    killed = [r for r in runs if r.killed]
    if killed:
        _, replace = min((_loss(killed, dataclasses.replace(params, replace_overhead_s=x)), x)
                         for x in [i * 0.1 for i in range(31)])  # fmt: skip
        params = dataclasses.replace(params, replace_overhead_s=replace)
    return params


def _grid2(
    runs: Sequence[LocalRun], hop_range: tuple[float, float], step_range: tuple[float, float],
    host_bytes_per_s: float = 0.0,
) -> tuple[float, float]:
    (h0, h1), (s0, s1) = hop_range, step_range
    best = (float("inf"), 0.0, 0.0)
    for _ in range(3):
        hs = [h0 + (h1 - h0) * i / 4 for i in range(5)]
        ss = [s0 + (s1 - s0) * i / 4 for i in range(5)]
        for h, s in itertools.product(hs, ss):
            loss = _loss(runs, SimParams(hop_overhead_s=h, step_overhead_s=s,
                                         host_bytes_per_s=host_bytes_per_s))
            best = min(best, (loss, h, s))
        _, h, s = best
        dh, ds = (h1 - h0) / 4, (s1 - s0) / 4
        h0, h1, s0, s1 = max(0.0, h - dh), h + dh, max(0.0, s - ds), s + ds
    return best[1], best[2]


def calibrate(
    sizes: Sequence[int] = SIZES, profile: str = "ps3", jobs: int = 8, tokens: int = 16,
    in_flight: int = 4, progress: Any = None, fit_on: Sequence[int] = FIT_ON,
) -> Calibration:  # fmt: skip
    runs = []
    for n, kill in itertools.product(sizes, (False, True)):
        if progress is not None:
            progress(f"measuring {n} emulated {profile} workers{' with a kill' if kill else ''}")
        runs.append(measure_local(n, profile, jobs, tokens, in_flight, kill, memory="128M"))
    # a node faster than this host (a PS3, for slices of a small model) is floored by it;
    # for a slower one (an rpi4) the fit finds the floor does not bind
    params = fit([r for r in runs if r.workers in fit_on], host_floor=True)
    return Calibration(params, tuple(Check(r, predict(r, params), r.workers in fit_on)
                                     for r in runs))  # fmt: skip


def render(cal: Calibration) -> None:
    from rich.console import Console
    from rich.table import Table

    p = cal.params
    title = (f"calibrated: hop {1000 * p.hop_overhead_s:.2f} ms, step "
             f"{1000 * p.step_overhead_s:.2f} ms, "
             f"replacement {p.replace_overhead_s:.1f} s")  # fmt: skip
    # headers short enough for 80 columns (a terminal's default): nothing is cut
    t = Table("workers", "kill", "tok/s", "simulated", "error", "p50 s", "simulated", "error",
              title=title)  # fmt: skip
    for c in cal.checks:
        t.add_row(f"{c.run.workers}{' fit' if c.fitted else ''}", "yes" if c.run.killed else "no",
                  f"{c.run.tokens_per_s:.1f}", f"{c.predicted.tokens_per_s:.1f}",
                  f"{100 * c.tokens_error:+.1f}%", f"{c.run.p50_latency_s:.2f}",
                  f"{c.predicted.latency_p50_s:.2f}",
                  f"{100 * c.latency_error:+.1f}%")  # fmt: skip
    Console().print(t)
    import textwrap

    print(textwrap.fill(verdict(cal), width=80))


def verdict(cal: Calibration) -> str:
    """One line: how many predictions are within the tolerance, and which are not."""
    test = cal.predicted
    off = [f"{c.run.workers} workers{' with a kill' if c.run.killed else ''}"
           for c in test if not c.ok]  # fmt: skip
    fitted = sorted({c.run.workers for c in cal.checks if c.fitted})
    head = (f"{len(test) - len(off)} of {len(test)} runs predicted within "
            f"±{100 * TOLERANCE:.0f}% (tokens/s and p50)")
    if fitted:
        head += f", out of sample (fitted on the {', '.join(map(str, fitted))}-worker runs)"
    return head if not off else f"{head}; beyond it: {', '.join(off)}"
