"""The swarm on loopback: per-hop overhead, decode speed by worker count, pipelining.

    python -m bench.swarm [--quick]

1. Per-hop overhead: a ring of stages that hold no layers but pass frames along.
2. Decode tokens/s of one sequence over 1, 2, 4 and 8 stage processes, against the
   single-process engine in this process (one thread everywhere, so the 2-core machine
   is not oversubscribed by the stages themselves).
3. Pipelining: S stages with S sequences in flight, against S x one sequence's rate — on
   real stages (which share this machine's 2 cores), then on stages emulating a Raspberry
   Pi 4 and a PS3 (swarm/ring/emulate.py: compute padded by sleeping, links that send while the
   node computes). Emulated stages get the layers that even out their emulated step times
   (planner/cost.py `emulated_split`): the demo model's tied 49152-row head weighs ~8
   layers, so an even split by layer count leaves the last stage the bottleneck (0.60 of
   S x one at 4 stages by construction). The planner's figure is for its own placement, by memory.

What remains between a measurement and the planner's figure:
* per-hop software overhead: ~0.3 ms on loopback between real stages, ~0.6 ms beside an
  emulated link (frame encode/decode, asyncio, the delivery timer; bench/hop.py takes a hop
  apart, through the coordinator as users run it); the planner charges a
  hop only half an RTT plus the bytes (0.1 ms on rpi4/ps3 gigabit), so one sequence over
  4 stages is ~2 ms per token slower than it predicts;
* the host's CPU: every stage's real compute, the frames and the client share 2 cores. A
  rpi4 stage's real compute (~2 ms) hides under its emulated step (~7 ms), but with S
  sequences in flight the stages compute at once and jitter into each other's waits. A
  PS3 stage is faster than this host's Python (a 15-layer step: 2.8 ms on a PS3, 3.4 ms
  here): ps3 rows measure the host, not the PS3, and S in flight cannot beat 2 cores;
* the planner's node_busy_s leaves out the output head (cost._head_step adds it to the
  latency only), so it calls a last stage holding the head as free as the others.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from cellswarm import kernels
from cellswarm.demo import demo_model_path
from cellswarm.loader import load
from cellswarm.planner.cost import emulated_split
from cellswarm.planner.placement import even_split
from cellswarm.swarm.local.pipeline import LocalPipeline

PROMPT = list(range(100, 108))
CONTEXT = 512


def single_process_tokens_per_s(path: str, tokens: int) -> float:
    kernels.set_threads(1)
    model = load(path, tokenizer=False)
    cache = model.new_cache(len(PROMPT) + tokens + 1)
    model.step(np.asarray(PROMPT), cache)
    t0 = time.perf_counter()
    for i in range(tokens):
        model.step(np.asarray([PROMPT[i % len(PROMPT)]]), cache)
    return tokens / (time.perf_counter() - t0)


def swarm_decode(
    path: str, stages: int, sequences: int, tokens: int, profile: str | None = None
) -> float:
    """Tokens/s over all sequences, from the first token to the last (prefill excluded)."""
    split = emulated_split(path, stages, profile) if profile else even_split(30, stages)
    with LocalPipeline(path, split, profile=profile) as pipe:
        pipe.generate([{"prompt": PROMPT, "max_tokens": 2}])  # warm: pages, kernels
        stamps: list[float] = []
        requests = [{"prompt": PROMPT, "max_tokens": tokens} for _ in range(sequences)]
        pipe.generate(requests, on_token=lambda _i, _t: stamps.append(time.perf_counter()))
    first_round = sequences  # the first token of each sequence comes out of prefill
    return (len(stamps) - first_round) / (stamps[-1] - stamps[first_round - 1])


def per_hop_overhead_s(path: str, tokens: int) -> float:
    """Same model, 1 stage vs 8 stages: the extra time per token over 7 more hops."""
    one = 1 / swarm_decode(path, 1, 1, tokens)
    eight = 1 / swarm_decode(path, 8, 1, tokens)
    return (eight - one) / 7


def planner_prediction(path: str, profile: str, stages: int, concurrency: int) -> float:
    """The planner's tokens/s (all sequences) for the same setup: `stages` nodes of the
    profile, `concurrency` sequences in flight (exact_plan)."""
    result = exact_plan(path, profile, stages, concurrency)
    if result is None:
        return float("nan")
    return float(result.throughput_tokens_per_s if concurrency > 1 else
                 result.decode_tokens_per_s)  # fmt: skip


def exact_plan(path: str, profile: str, stages: int, concurrency: int = 1,
               context: int = CONTEXT) -> Any:  # fmt: skip
    """The planner's PlanResult for `stages` nodes of the profile, each given just enough
    memory that the model needs all of them (found by bisection, since the planner fills
    nodes by memory); None when no memory makes it exactly `stages`."""
    from dataclasses import replace

    from cellswarm.planner.api import plan, resolve_model
    from cellswarm.planner.plan import plan as plan_inventory
    from cellswarm.planner.profiles import get_profile

    inv = resolve_model(path)
    base = plan(inv, node=profile, count=stages, context=context, concurrency=concurrency)
    lo, hi = 1 << 20, 1 << 34
    result = base
    while lo < hi:  # the smallest memory for which the model still fits on `stages` nodes
        mid = (lo + hi) // 2
        req = replace(base.request, node=replace(get_profile(profile), memory_bytes=mid))
        trial = plan_inventory(inv, req)
        if trial.fits and trial.min_nodes <= stages:
            hi, result = mid, trial
        else:
            lo = mid + 1
    return result if result.fits and result.min_nodes == stages else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    path = str(demo_model_path())
    tokens = 16 if args.quick else 48
    base = single_process_tokens_per_s(path, tokens)
    print(f"single process, 1 thread: {base:.1f} tokens/s (demo model)")
    print(f"per-hop overhead on loopback: {1000 * per_hop_overhead_s(path, tokens):.2f} ms")
    print(f"{'stages':>6} {'1 sequence tok/s':>17} {'/ single':>9} {'S in flight tok/s':>18} "
          f"{'/ (S x one)':>12}")  # fmt: skip
    for stages in (1, 2, 4, 8):
        one = swarm_decode(path, stages, 1, tokens)
        many = swarm_decode(path, stages, stages, tokens)
        print(f"{stages:>6} {one:>17.1f} {one / base:>9.2f} {many:>18.1f} "
              f"{many / (stages * one):>12.2f}")  # fmt: skip
    for profile in ("rpi4", "ps3"):
        print(f"emulated {profile} stages (planner's prediction for the same setup in brackets):")
        for stages in (2, 4):
            one = swarm_decode(path, stages, 1, tokens, profile)
            many = swarm_decode(path, stages, stages, tokens, profile)
            p_one = planner_prediction(path, profile, stages, 1)
            p_many = planner_prediction(path, profile, stages, stages)
            print(f"{stages:>6} {one:>9.1f} [{p_one:>5.1f}] {'':>9} {many:>10.1f} [{p_many:>5.1f}]"
                  f" {many / (stages * one):>12.2f} [{p_many / (stages * p_one):.2f}]"
                  f"  layers {emulated_split(path, stages, profile)}")  # fmt: skip


if __name__ == "__main__":
    main()
