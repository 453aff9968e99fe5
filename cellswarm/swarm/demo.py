"""`cellswarm demo`: the demo model split over a local swarm of stage processes, a stage
killed mid-generation, and the plan for the seed's 100,000 PS3s."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from cellswarm.engine.model import Model
from cellswarm.units import format_bytes

STAGES = 3
BUDGET_BYTES = 128 << 20  # per worker: below what the whole demo model needs in one process
CONTEXT, SEQUENCES = 256, 4
QUESTION = "What is the capital of France?"


def run(max_tokens: int = 32) -> int:
    from cellswarm.demo import demo_model_path
    from cellswarm.io.gguf_file import GGUFFile
    from cellswarm.io.tokenizer import Tokenizer
    from cellswarm.swarm.local import LocalPipeline, budget_split

    con = Console()
    path = demo_model_path()
    tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]), False)
    request = {"prompt": prompt, "max_tokens": max_tokens, "stop_ids": sorted(tok.stop_ids)}
    con.print(f"[bold]{path.name}[/] on {STAGES} local workers, {format_bytes(BUDGET_BYTES)} each "
              f"(one process would need {_whole_model_need(path)})")  # fmt: skip
    splits = budget_split(str(path), STAGES, BUDGET_BYTES, CONTEXT, SEQUENCES)
    with LocalPipeline(str(path), splits, memory_bytes=BUDGET_BYTES,
                       context=CONTEXT, max_sequences=SEQUENCES) as pipe:  # fmt: skip
        con.print(f"[dim]user:[/] {QUESTION}")
        t0 = time.perf_counter()
        [first] = pipe.generate([request], on_token=_streamer(tok))
        elapsed = time.perf_counter() - t0
        print()
        con.print(_node_table(pipe.stats(), len(first.tokens), elapsed))
        victim = 1
        con.print(f"\nAgain, killing worker {victim} (layers {pipe.configs[victim].layers}) "
                  "with SIGKILL after 5 tokens:")  # fmt: skip
        [second] = pipe.generate([request], on_token=_killer(tok, pipe, victim, after=5))
        print()
        same = second.tokens == first.tokens
        verdict = "[green]same text[/]" if same else "[red]different text[/]"
        con.print(f"{verdict} after {pipe.restarts} worker replacement(s) and a replay")
    _plan_summary(con)
    return 0 if same else 1


def _whole_model_need(path: Any) -> str:
    import cellswarm
    from cellswarm.swarm.stage import StageConfig, shard_need_bytes

    model: Model = cellswarm.load(path, tokenizer=False)
    cfg = StageConfig(str(path), (0, 30), True, True, context=CONTEXT, max_sequences=SEQUENCES)
    return format_bytes(sum(shard_need_bytes(model, cfg).values()))


def _streamer(tok: Any) -> Any:
    tokens: list[int] = []
    shown = [0]

    def show(_i: int, token: int) -> None:
        tokens.append(token)
        text = tok.decode(tokens)
        safe = len(text.rstrip("\ufffd"))
        sys.stdout.write(text[shown[0] : safe])
        sys.stdout.flush()
        shown[0] = max(shown[0], safe)

    return show


def _killer(tok: Any, pipe: Any, victim: int, after: int) -> Any:
    show, seen = _streamer(tok), [0]

    def step(i: int, token: int) -> None:
        show(i, token)
        seen[0] += 1
        if seen[0] == after:
            os.kill(pipe.procs[victim].pid, signal.SIGKILL)

    return step


def _node_table(stats: list[dict[str, Any]], tokens: int, elapsed: float) -> Table:
    title = f"{tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tokens/s)"
    t = Table(
        "worker", "layers", "memory (peak of budget)", "steps", "ms / decode step", title=title
    )
    for i, s in enumerate(stats):
        lo, hi = s["layers"]
        t.add_row(
            str(i), f"{lo}..{hi - 1}",
            f"{format_bytes(s['peak_rss_bytes'])} of {format_bytes(s['memory_bytes'])}",
            str(s["steps"]), f"{1000 * s['decode_s'] / max(s['decode_steps'], 1):.2f}",
        )  # fmt: skip
    return t


def _plan_summary(con: Console) -> None:
    from cellswarm.planner.api import plan

    r = plan("kimi-k3", node="ps3", count=100_000)
    con.print(
        "\n[bold]And the seed's question[/] — Kimi K3 (2.8T, 1.74 bits/weight) on 100,000 PS3s:"
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
