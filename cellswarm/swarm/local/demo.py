"""`cellswarm demo`: the demo model split over a local swarm — a coordinator and worker
processes under memory budgets — a worker killed mid-generation, and the plan for the
seed's 100,000 PS3s."""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from cellswarm.engine.model import Model
from cellswarm.units import format_bytes

if TYPE_CHECKING:
    from cellswarm.io.tokenizer import Tokenizer
    from cellswarm.swarm.api.client import Status
    from cellswarm.swarm.local.up import LocalSwarm

STAGES, SPARES = 3, 1
BUDGET = "128M"  # per worker: below what the whole demo model needs in one process
CONTEXT, SEQUENCES = 256, 4
KILL_AFTER = 8
QUESTION = "Name five famous landmarks in Paris."


def run(max_tokens: int = 48) -> int:
    from cellswarm.demo import demo_model_path
    from cellswarm.loader import load_tokenizer
    from cellswarm.swarm.api import client
    from cellswarm.swarm.local.up import LocalSwarm

    con = Console()
    path = demo_model_path()
    tok = load_tokenizer(path)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]), False)
    request = {"prompt": prompt, "max_tokens": max_tokens, "stop_ids": sorted(tok.stop_ids)}
    state = Path(tempfile.mkdtemp(prefix="cellswarm-demo-"))
    con.print(f"[bold]{path.name}[/] on {STAGES} local workers + {SPARES} spare, {BUDGET} each "
              f"(one process would need {_whole_model_need(path)}); state in {state}")  # fmt: skip
    swarm = LocalSwarm(str(path), STAGES + SPARES, BUDGET, state, stages=STAGES,
                       context=CONTEXT, max_sequences=SEQUENCES)  # fmt: skip
    with swarm:
        swarm.wait_ready()
        con.print(f"[dim]user:[/] {QUESTION}")
        t0 = time.perf_counter()
        first = client.wait(swarm.url, client.submit(swarm.url, request), _streamer(tok))
        elapsed = time.perf_counter() - t0
        print()
        time.sleep(3 * swarm.heartbeat_s)  # the workers' step timings come with heartbeats
        con.print(_node_table(swarm.status(), len(first["tokens"]), elapsed))
        victim = _stage_holder(swarm.status(), 1)
        con.print(f"\nAgain, killing {victim} (stage 1) with SIGKILL after {KILL_AFTER} tokens:")
        rid = client.submit(swarm.url, request)
        second = client.wait(swarm.url, rid, _killer(tok, swarm, victim, after=KILL_AFTER))
        print()
        same = second["tokens"] == first["tokens"]
        verdict = "[green]same text[/]" if same else "[red]different text[/]"
        status = swarm.status()
        con.print(f"{verdict}: {victim} is {_state_of(status, victim)}, its layers went to "
                  f"{_stage_holder(status, 1)}; the ring replayed the tokens it had")
        con.print(f"[dim]its timeline across nodes: cellswarm logs {rid} --dir {swarm.log_dir}[/]")
    _plan_summary(con)
    return 0 if same else 1


def _whole_model_need(path: Path) -> str:
    from cellswarm.loader import load
    from cellswarm.swarm.ring.stage import StageConfig, shard_need_bytes

    model: Model = load(path, tokenizer=False)
    cfg = StageConfig(str(path), (0, 30), True, True, context=CONTEXT, max_sequences=SEQUENCES)
    return format_bytes(sum(shard_need_bytes(model, cfg).values()))


def _stage_holder(status: Status, stage: int) -> str:
    return next(n["node_id"] for n in status["nodes"] if n["stage"] == stage)


def _state_of(status: Status, node_id: str) -> str:
    return next(n["state"] for n in status["nodes"] if n["node_id"] == node_id)


def _streamer(tok: Tokenizer) -> Callable[[list[int]], None]:
    tokens: list[int] = []
    shown = [0]

    def show(new: list[int]) -> None:
        tokens.extend(new)
        text = tok.decode(tokens)
        safe = len(text.rstrip("\ufffd"))
        sys.stdout.write(text[shown[0] : safe])
        sys.stdout.flush()
        shown[0] = max(shown[0], safe)

    return show


def _killer(tok: Tokenizer, swarm: LocalSwarm, victim: str,
            after: int) -> Callable[[list[int]], None]:  # fmt: skip
    show, seen = _streamer(tok), [0]

    def step(new: list[int]) -> None:
        show(new)
        before = seen[0]
        seen[0] += len(new)
        if before < after <= seen[0]:
            swarm.kill(victim)

    return step


def _node_table(status: Status, tokens: int, elapsed: float) -> Table:
    from cellswarm.swarm.control.rebalance import seconds_of

    title = f"{tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tokens/s)"
    t = Table("worker", "state", "holds", "memory (peak of budget)", "ms / decode step",
              title=title)  # fmt: skip
    for n in status["nodes"]:
        s = n.get("stats") or {}
        ms = (1000 * seconds_of(s, "decode_s") / max(seconds_of(s, "decode_steps"), 1)
              if s else None)  # fmt: skip
        t.add_row(
            n["node_id"], n["state"], n["holds"],
            f"{format_bytes(n['peak_rss_bytes'])} of {format_bytes(n['memory_bytes'])}",
            "-" if ms is None else f"{ms:.2f}",
        )  # fmt: skip
    return t


def _plan_summary(con: Console) -> None:
    from cellswarm.planner.api import plan

    r = plan("kimi-k3", node="ps3", count=100_000)
    con.print(
        "\n[bold]And the seed's question[/] — Kimi K3 (2.8T, IQ1_M mix: 1.75 bits a routed "
        "expert weight) on 100,000 PS3s:"
    )
    if not r.fits:
        con.print(f"does not fit: {r.problem}")
        return
    con.print(
        f"fits: {r.min_nodes:,} PS3s per replica, {r.replicas} replicas; "
        f"{r.decode_tokens_per_s:.2f} tokens/s per stream, {r.throughput_tokens_per_s:.1f} "
        f"for the swarm; bound: {r.bound}; {r.node_power_w / 1e6:.1f} MW at the nodes "
        f"({r.power_w / 1e6:.1f} MW with PUE).\nDetails: cellswarm plan kimi-k3 --node ps3 "
        "--count 100000"
    )
