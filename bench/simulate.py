"""The simulator's speed: events per second, and the seed scenario's wall time.

    python -m bench.simulate

1. The seed's scenario (examples/kimi-k3-ps3-100k.toml): 100,000 PS3s, one simulated hour
   (the goal: <= 60 s wall on a 2-core machine).
2. The same scenario for its full day.
3. An event-heavy swarm: Mixtral 8x7B on 100,000 Raspberry Pi 4s (25,000 replicas of 4
   nodes), short jobs arriving at 60/s, node failures every ~36 s and a rack a day — the
   events/s figure of the loop itself.
"""

from __future__ import annotations

from pathlib import Path

from cellswarm.sim.params import Scenario
from cellswarm.sim.run import timed_simulate
from cellswarm.sim.scenario import make_scenario, read_scenario_file

SEED = Path(__file__).resolve().parents[1] / "examples" / "kimi-k3-ps3-100k.toml"


def _line(name: str, out: dict, wall: float, events: int) -> None:
    print(
        f"{name:<44} wall {wall:7.2f} s  events {events:>9,}  {events / wall:>10,.0f} events/s  "
        f"tokens/s {out['tokens_per_s']:>10,.1f}  failures/h "
        f"{out['failures']['failures_per_hour']:6.1f}  lost {out['jobs']['lost']}"
    )


def main() -> None:
    values = read_scenario_file(SEED)
    for duration in ("1h", "24h"):
        out, wall, events = timed_simulate(make_scenario({**values, "duration": duration}))
        _line(f"seed: kimi-k3 on 100,000 ps3, {duration} simulated", out, wall, events)
    heavy = Scenario(
        "mixtral-8x7b", node="rpi4", count=100_000, context=1024, concurrency=4,
        duration_s=3600, rate=60.0, prompt_tokens=32, output_tokens=64, mtbf_s=1000 * 3600,
        mttr_s=3600, rack_mtbf_s=50_000 * 3600, rack_mttr_s=3600, slow_fraction=0.02, seed=1,
    )  # fmt: skip
    out, wall, events = timed_simulate(heavy)
    _line("mixtral-8x7b on 100,000 rpi4, 1h, 60 jobs/s", out, wall, events)


if __name__ == "__main__":
    main()
