"""The swarm's own overhead per hop: one stream through the coordinator vs one process.

    python -m bench.hop [--rounds N] [--tokens N] [--model demo|llama254m|PATH ...]
                        [--no-keep-awake]

What users run (`cellswarm up`): a coordinator and 2 workers (LocalSwarm, 1 thread each,
loopback, --keep-awake as by default), one request at a time of `--tokens` tokens submitted
over HTTP, leased by the head, run around the ring. Its decode rate is stage 0's token
period (from its first decode step to its last: the "decode" event each stage logs per
sequence). Against it, in the same process as this script and in between the swarm's
requests, the single-process engine at the same thread count generating the same tokens
(`Model.generate`, no tokenizer). The two alternate, `--rounds` times: the machine may be
shared, so the table gives each round, the median ratio and the ratio of the best rates (the
runs least disturbed by other work).

Per hop, from the stages' own tallies (stage.py HOP_PARTS; microseconds per token, median
over rounds): the sender's encode and the CPU time of its write, the receiver's read
(decode and checks) and dispatch (stage 0: the token to the head, the next step started).
What the period holds beyond every stage's compute and those parts is the rest: the
kernel's loopback, the receiver's wakeup and its event loop, shown per hop as half of it.
Below, the control plane's CPU per token during a request: the coordinator process, and
each worker's threads besides the one that runs its stage (heartbeats, the head's
checkpoints every 0.1 s, the log shipper).

"llama254m" is a random-weight llama (bench/engine.py's `random_llama`: d_model 1024,
18 layers, FFN 2560, vocabulary 32000, 254M parameters, Q8_0), written once to a GGUF
under ~/.cache/cellswarm/bench.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cellswarm import kernels
from cellswarm.engine.model import GenerateOptions, Model
from cellswarm.loader import load
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.ring.stage import HOP_PARTS

PROMPT = list(range(100, 108))
LLAMA_254M = {"d_model": 1024, "n_layers": 18, "ffn": 2560, "vocab": 32000}
CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def model_path(name: str) -> str:
    if name == "demo":
        from cellswarm.demo import demo_model_path

        return str(demo_model_path())
    if name == "llama254m":
        return str(random_llama_file())
    return name


def random_llama_file() -> Path:
    """The 254M random llama as a GGUF (written once; ~270 MB)."""
    from bench.engine import model_file, random_llama

    return model_file("random-llama-254m-q8_0", lambda: random_llama("q8_0", **LLAMA_254M))


def single_run(model: Model, tokens: int) -> tuple[float, float]:
    """Decode tokens/s, and CPU seconds per token (prefill included: as the stages' CPU)."""
    cpu = time.thread_time()
    gen = model.generate(PROMPT, GenerateOptions(max_tokens=tokens, stop_ids=frozenset()))
    assert len(gen.token_ids) == tokens
    return gen.stats.decode_tokens_per_s, (time.thread_time() - cpu) / tokens


def cpu_s(pid: int) -> tuple[float, float]:
    """A process's CPU seconds: (its main thread, all its other threads)."""
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # a thread that just ended
            continue
        f = stat.rpartition(")")[2].split()
        used = (int(f[11]) + int(f[12])) * CLOCK_TICK_S  # utime + stime
        if int(tid) == pid:
            main += used
        else:
            other += used
    return main, other


def decode_event(log_dir: Path, node: str, request_id: str) -> dict[str, Any] | None:
    """The last "decode" event a node logged for the request: its whole tally there."""
    found = None
    path = log_dir / f"{node}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        e = json.loads(line)
        if e.get("request_id") == request_id and e["event"] == "decode":
            found = e
    return found


@dataclass
class Round:
    single: float  # tokens/s
    swarm: float
    single_cpu_us: float  # per token, the one process
    stages_cpu_us: float  # per token, the stages' main threads together
    stages: list[dict[str, Any]]  # each stage's decode event
    control_us: dict[str, float]  # CPU per token outside the stages' main threads

    @property
    def ratio(self) -> float:
        return self.swarm / self.single


@dataclass
class Result:
    name: str
    split: list[tuple[int, int]]
    rounds: list[Round] = field(default_factory=list)


def measure(name: str, rounds: int, tokens: int, keep_awake: bool = True) -> Result:
    path = model_path(name)
    kernels.set_threads(1)
    model = load(path, tokenizer=False)
    with tempfile.TemporaryDirectory() as tmp:
        swarm = LocalSwarm(path, 2, "2G", Path(tmp), stages=2, threads=1, rebalance=False,
                           context=len(PROMPT) + tokens + 8, max_sequences=2,
                           keep_awake=keep_awake)  # fmt: skip
        with swarm:
            status = swarm.wait_ready(300)
            stages = sorted((n for n in status["nodes"] if n["stage"] is not None),
                            key=lambda n: n["stage"])  # fmt: skip
            result = Result(name, [(int(n["layers"][0]), int(n["layers"][1])) for n in stages])
            nodes = [str(n["node_id"]) for n in stages]
            warm = client.submit(swarm.url, {"prompt": PROMPT, "max_tokens": 8})
            client.wait(swarm.url, warm)  # pages touched, kernels loaded: not measured
            single_run(model, 8)
            for _ in range(rounds):
                single = single_run(model, tokens)
                result.rounds.append(swarm_round(swarm, nodes, tokens, single))
    return result


def swarm_round(
    swarm: LocalSwarm, nodes: list[str], tokens: int, single: tuple[float, float]
) -> Round:
    pids = {name: p.pid for name, p in swarm.procs.items()}
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    rid = client.submit(swarm.url, {"prompt": PROMPT, "max_tokens": tokens})
    done = client.wait(swarm.url, rid)
    after = {name: cpu_s(pid) for name, pid in pids.items()}
    assert done["state"] == "done" and len(done["tokens"]) == tokens, done
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the last stage logs its tally as it lets go
        events = [e for n in nodes if (e := decode_event(swarm.log_dir, n, rid)) is not None]
        if len(events) == len(nodes) and all(e["steps"] == tokens - 1 for e in events):
            break
        time.sleep(0.1)
    head = events[0]
    period_s = head["span_ms"] / 1000 / (head["steps"] - 1)
    control = {"coordinator": sum(after["coordinator"]) - sum(before["coordinator"])}
    stages_cpu = 0.0
    for name in pids:
        if name.startswith("worker"):
            control[f"{name} threads"] = after[name][1] - before[name][1]
            stages_cpu += after[name][0] - before[name][0]
    return Round(single[0], 1 / period_s, 1e6 * single[1], 1e6 * stages_cpu / tokens, events,
                 {k: 1e6 * v / tokens for k, v in control.items()})


def med(values: list[float]) -> float:
    return statistics.median(values)


def render(res: Result, tokens: int) -> None:
    rs = res.rounds
    print(f"\n{res.name}: 2 stages {res.split}, 1 thread each, {tokens} tokens a request, "
          f"{len(rs)} rounds (single process, then the swarm)")  # fmt: skip
    print(f"{'round':>6} {'single tok/s':>13} {'swarm tok/s':>12} {'ratio':>6}"
          f" {'CPU us/token: single':>21} {'stages':>7}")  # fmt: skip
    for i, r in enumerate(rs):
        print(f"{i:>6} {r.single:>13.1f} {r.swarm:>12.1f} {r.ratio:>6.3f}"
              f" {r.single_cpu_us:>21.0f} {r.stages_cpu_us:>7.0f}")  # fmt: skip
    best = max(r.swarm for r in rs) / max(r.single for r in rs)
    cpu = med([r.single_cpu_us / r.stages_cpu_us for r in rs])
    print(f"median ratio {med([r.ratio for r in rs]):.3f}; best swarm / best single {best:.3f}; "
          f"CPU per token, single / stages: {cpu:.3f}")  # fmt: skip
    n = len(rs[0].stages)
    part = {k: [[r.stages[s][f"{k}_us"] for r in rs] for s in range(n)] for k in HOP_PARTS}
    period = [1e6 / r.swarm for r in rs]
    single = [1e6 / r.single for r in rs]
    known = [sum(r.stages[s][f"{k}_us"] for s in range(n) for k in HOP_PARTS) for r in rs]
    rest = [p - k for p, k in zip(period, known, strict=True)]
    print("per token, us (median over rounds):")
    hops = [f"hop {s}->{(s + 1) % n}" for s in range(n)]
    print(f"  {'':<34}" + "".join(f"{h:>11}" for h in hops) + f"{'ring':>11}")

    def row(label: str, per_hop: list[float]) -> None:
        print(f"  {label:<34}" + "".join(f"{v:>11.0f}" for v in per_hop)
              + f"{sum(per_hop):>11.0f}")  # fmt: skip

    # hop s -> s+1: stage s encodes and writes, stage s+1 reads and dispatches
    row("encode (sender)", [med(part["encode"][s]) for s in range(n)])
    row("write, CPU (sender)", [med(part["send"][s]) for s in range(n)])
    row("wire, wakeup, event loop (rest/2)", [med(rest) / n] * n)
    row("read: decode + checks (receiver)", [med(part["read"][(s + 1) % n]) for s in range(n)])
    row("dispatch (receiver)", [med(part["dispatch"][(s + 1) % n]) for s in range(n)])
    hop_total = [med(part["encode"][s]) + med(part["send"][s]) + med(rest) / n
                 + med(part["read"][(s + 1) % n]) + med(part["dispatch"][(s + 1) % n])
                 for s in range(n)]  # fmt: skip
    row("hop", hop_total)
    computes = [med(part["compute"][s]) for s in range(n)]
    print(f"  compute per stage {' + '.join(f'{c:.0f}' for c in computes)} = "
          f"{sum(computes):.0f}; token period {med(period):.0f} (single process "
          f"{med(single):.0f}); period - compute {med(period) - sum(computes):.0f}")
    control = {k: med([r.control_us[k] for r in rs]) for k in rs[0].control_us}
    print("  control plane CPU per token: "
          + ", ".join(f"{k} {v:.0f}" for k, v in control.items()))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", action="append", help="demo, llama254m or a GGUF path")
    ap.add_argument("--keep-awake", action=argparse.BooleanOptionalAction, default=True,
                    help="the workers' --keep-awake (default on, as `cellswarm up`)")
    args = ap.parse_args()
    for name in args.model or ["demo", "llama254m"]:
        render(measure(name, args.rounds, args.tokens, args.keep_awake), args.tokens)


if __name__ == "__main__":
    main()
