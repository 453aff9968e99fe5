"""`cellswarm simulate MODEL --node P --count N [...]` or `cellswarm simulate --workload F`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cellswarm.errors import RequestError


def add_simulate_command(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a planned swarm for hours: failures, spares, queue, network, energy",
    )
    p.add_argument("model", nargs="?", help="a preset, .gguf or HF folder (or in --workload)")
    p.add_argument("--workload", type=Path, help="scenario TOML file (examples/*.toml)")
    p.add_argument("--node", help="node profile (default ps3)")
    p.add_argument("--count", type=int, help="nodes in the swarm")
    p.add_argument("--quant", help="GGUF type or bits per weight, e.g. 1.74")
    p.add_argument("--context", type=int, help="tokens of context per sequence")
    p.add_argument("--concurrency", type=int, help="sequences in flight per replica")
    p.add_argument("--duration", help="simulated time: 1h (default), 30m, 2d, seconds")
    p.add_argument("--rate", type=float, help="jobs/s arriving (Poisson); else a batch")
    p.add_argument("--jobs", type=int, help="batch size queued at t=0 (default 1000)")
    p.add_argument("--prompt", dest="prompt_tokens", type=int, help="prompt tokens per job")
    p.add_argument("--output", dest="output_tokens", type=int, help="tokens generated per job")
    p.add_argument("--mtbf", help="per-node mean time between failures, e.g. 10000h (off)")
    p.add_argument("--mttr", help="per-node mean time to repair (default 1h)")
    p.add_argument("--rack-mtbf", help="per access switch (rack) MTBF: all its nodes at once")
    p.add_argument("--rack-mttr", help="rack mean time to repair (default 1h)")
    p.add_argument("--slow-fraction", type=float, help="fraction of nodes running slow")
    p.add_argument("--slow-speed", type=float, help="their speed, a fraction (default 0.5)")
    p.add_argument("--poison-fraction", type=float, help="fraction of jobs failing every try")
    p.add_argument("--acceptance", type=float,
                   help="speculative drafts kept, 0..1 (default 0): a lone sequence's gain")
    p.add_argument("--topology", help="network overrides: core_bandwidth=100G,access_uplinks=1")
    p.add_argument("--seed", type=int, help="random seed (default 0)")
    p.add_argument("--max-beats", type=float,
                   help="the coordinator's --max-beats (heartbeats/s it takes; default 4000)")
    p.add_argument("--coordinator-cores", type=float,
                   help="cores the control plane has (default 1: one coordinator process)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", type=Path, help="charts over time to this PNG file")
    p.add_argument("--calibrate", action="store_true",
                   help="run real local swarms of emulated workers (4, 8, 16; with and without "
                        "a kill), fit the simulator's overheads, print predicted vs measured")
    p.add_argument("--strict", action="store_true",
                   help="with --calibrate: exit 1 when a prediction is beyond ±15%%")
    p.add_argument("--calibrate-profile", default="ps3",
                   help="the profile the calibration's workers emulate (default ps3)")
    p.set_defaults(func=cmd_simulate)


def scenario_from_args(args: argparse.Namespace) -> Any:
    from cellswarm.sim.network import parse_topology
    from cellswarm.sim.scenario import make_scenario, read_scenario_file

    values: dict[str, Any] = read_scenario_file(args.workload) if args.workload else {}
    cli = {
        "model": args.model, "node": args.node, "count": args.count, "quant": args.quant,
        "context": args.context, "concurrency": args.concurrency, "duration": args.duration,
        "rate": args.rate, "jobs": args.jobs, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "mtbf": args.mtbf, "mttr": args.mttr,
        "rack_mtbf": args.rack_mtbf, "rack_mttr": args.rack_mttr,
        "slow_fraction": args.slow_fraction, "slow_speed": args.slow_speed,
        "poison_fraction": args.poison_fraction, "acceptance": args.acceptance,
        "seed": args.seed,
    }  # fmt: skip
    values |= {k: v for k, v in cli.items() if v is not None}
    if args.rate is not None:
        values.pop("jobs", None)
    control = {"max_beats_per_s": args.max_beats, "cores": args.coordinator_cores}
    if any(v is not None for v in control.values()):
        values["control"] = {**values.get("control", {}),
                             **{k: v for k, v in control.items() if v is not None}}  # fmt: skip
    if args.topology:
        values["network"] = {**values.get("network", {}), **dict(parse_topology(args.topology))}
    return make_scenario(values)


def cmd_simulate(args: argparse.Namespace) -> int:
    from cellswarm.sim import report
    from cellswarm.sim.run import timed_simulate

    if args.calibrate:
        from cellswarm.sim.calibrate import calibrate, render

        cal = calibrate(profile=args.calibrate_profile,
                        progress=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
        if args.json:
            print(json.dumps(cal.as_dict(), sort_keys=True))
        else:
            render(cal)
        # a report, not a gate: it ran and says how far off each prediction is (--strict:
        # exit 1 when one is beyond the tolerance, for a CI that wants the gate)
        return 1 if args.strict and not cal.ok else 0
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise RequestError(f"--plot {args.plot}: give a .png file name")
    out, wall, events = timed_simulate(scenario_from_args(args))
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        report.render(out)
        print(f"{events:,} events in {wall:.2f} s wall ({events / wall:,.0f} events/s)",
              file=sys.stderr)  # fmt: skip
    if args.plot:
        report.plot(out, args.plot)
    return 0
