"""The swarm's command line: `coordinator`, `worker`, `status`, `up`, `generate --coordinator`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cellswarm.cache_types import CACHE_TYPES, DEFAULT_CACHE_TYPE, check_cache_type
from cellswarm.errors import RequestError, SwarmError
from cellswarm.swarm.api.client import api_key
from cellswarm.swarm.settings import (
    CoordinatorConfig,
    WorkerConfig,
    add_flags,
    from_args,
    parse_count,
)
from cellswarm.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from cellswarm.swarm.api.client import ModelCard, NodeRow, Status
    from cellswarm.swarm.protocol.jsonvalue import JsonObject, JsonValue

DEFAULT_URL = "http://127.0.0.1:8470"


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from cellswarm.swarm.batch_cli import add_batch_commands

    add_batch_commands(sub)
    c = sub.add_parser("coordinator", help="run a swarm's coordinator (HTTP, state in SQLite)")
    c.add_argument("--model", help="the .gguf file to place (default: the demo model)")
    c.add_argument("--listen", default="127.0.0.1:8470", help="HOST:PORT (default loopback)")
    c.add_argument("--db", default="sqlite:///cellswarm.db",
                   help="sqlite:///PATH, or postgresql://... shared by several coordinators")
    c.add_argument("--max-body", default="4M",
                   help="refuse longer request bodies unread, with a 413 (default 4M)")
    add_flags(c, CoordinatorConfig)  # the rest: one flag per setting (settings.py)
    c.set_defaults(func=cmd_coordinator)

    w = sub.add_parser("worker", help="join a coordinator and serve the shard it assigns")
    add_flags(w, WorkerConfig)  # one flag per setting (settings.py)
    w.add_argument("--slow-tier", help="the model file on the slow tier (PMem, SSD): as --model")
    w.set_defaults(func=cmd_worker)

    s = sub.add_parser("status", help="every node of a swarm: state, shard, memory, failures")
    s.add_argument("--coordinator", default=DEFAULT_URL, help="the coordinator's URL")
    s.add_argument("--api-key-file", help="a coordinator with keys: send this file's first key")
    s.set_defaults(func=cmd_status)
    for p in (c, w, s):
        add_tls_option(p)

    u = sub.add_parser("up", help="a coordinator and N local workers, as separate processes")
    u.add_argument("--workers", type=int, default=3)
    u.add_argument("--memory", default="256M", help="budget per worker")
    u.add_argument("--profile", help="emulate this planner profile on every worker")
    u.add_argument("--model", help="the .gguf file (default: the demo model)")
    u.add_argument("--stages", type=int, help="pipeline stages (default: fewest that fit)")
    u.add_argument("--context", type=lambda t: parse_count(t, "--context", "4096"),
                   help="tokens a sequence may hold, prompt + completion (default: the "
                   "model's own, capped by what the workers' memory holds, one worker left "
                   "spare: up to 4096 first, then --max-sequences in flight, then the rest "
                   "of the model's)")  # fmt: skip
    u.add_argument("--max-sequences", type=lambda t: parse_count(t, "--max-sequences", "8"),
                   default=CoordinatorConfig.max_sequences,
                   help="sequences in flight per stage, at most (default %(default)s)")
    u.add_argument("--cache-type", type=check_cache_type, default=DEFAULT_CACHE_TYPE,
                   help=f"what the KV cache stores values as: {', '.join(CACHE_TYPES)} "
                   "(default %(default)s; coordinator --cache-type)")  # fmt: skip
    u.add_argument("--draft", help="a draft model (GGUF of the model's tokenizer) every "
                   "worker drafts with when it runs a ring's first stage (worker --draft)")
    u.add_argument("--state-dir", default="cellswarm-state", help="database, token, logs")
    u.add_argument("--port", type=int, default=8470)
    u.add_argument("--keep-awake", action=argparse.BooleanOptionalAction, default=True,
                   help="workers keep idle CPUs out of deep sleep while steps arrive (worker "
                   "--keep-awake; default on)")  # fmt: skip
    u.set_defaults(func=cmd_up)
    add_tls_option(u)


def add_tls_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", metavar="DIR",
                   help="mutual TLS with this node's certificate folder (ca.pem, node.pem, "
                   "node.key from `cellswarm certs node`); URLs become https://")  # fmt: skip


def _model(path: str | None) -> str:
    from cellswarm.demo import demo_model_path

    p = path or str(demo_model_path())
    if not Path(p).exists():
        raise RequestError(f"model {p} does not exist: give a .gguf file or a model folder")
    return p


def check_model(path: str) -> None:
    """Refuse a bad model before serving (ModelFileError: one line, exit 2), not at the first
    worker that loads it: a GGUF file is verified as `cellswarm verify` does (header, tensors,
    every block's scales; remembered by path, size and mtime), a folder's config is read."""
    if Path(path).is_dir():
        from cellswarm.loader import read_config

        read_config(path)
        return
    from cellswarm.swarm.node.net import Progress
    from cellswarm.verify import verify_cached

    done = verify_cached(path, progress=Progress("model", verb="VERIFYING"))
    if done is not None:
        print(done.line(), flush=True)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise RequestError(f"--listen {text!r} is not HOST:PORT")
    return host, int(port)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from cellswarm.swarm.api.server import serve

    shared = args.db.startswith(("postgresql://", "postgres://"))
    if not shared and not args.db.startswith("sqlite:///"):
        raise RequestError(f"--db {args.db!r}: give sqlite:///PATH or postgresql://...")
    host, port = _host_port(args.listen)
    model = _model(args.model)
    check_model(model)
    serve(from_args(
        CoordinatorConfig, args, model=model, host=host, port=port,
        db=args.db if shared else args.db.removeprefix("sqlite:///"),
        max_body_bytes=_max_body(args.max_body), tls_dir=args.tls,
    ))  # fmt: skip
    return 0


def _max_body(text: str) -> int:
    size = parse_bytes(text)
    if size < 4096:
        raise RequestError(f"--max-body {text} is under 4K: the workers' own calls need more")
    return size


def cmd_worker(args: argparse.Namespace) -> int:
    from cellswarm.swarm.node.worker import main

    main(from_args(WorkerConfig, args, model=args.slow_tier or args.model, tls_dir=args.tls))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cellswarm.swarm.api import client

    print_status(client.call(args.coordinator, "/v1/status", tls=args.tls, api_key=api_key(args)))
    return 0


def print_status(status: Status) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    wired = "wired" if status["wired"] else "not wired"
    title = f"{status['model']} · epoch {status['epoch']} · ring {wired}"
    narrow = console.width < 140  # a terminal's 80 columns: each cell two lines, none cut
    cols = (("node", "holds / address", "memory / heartbeat", "work / clock") if narrow else
            ("node", "address", "state", "holds", "memory (peak of budget)", "heartbeat",
             "clock", "served", "failures", "note"))  # fmt: skip
    t = Table(*cols, title=title, box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD)
    for n in status["nodes"]:
        layers = n.get("holds") or "-"
        mem = f"{format_bytes(n['peak_rss_bytes'])} of {format_bytes(n['memory_bytes'])}"
        state = n["state"]
        if n.get("busy_s", 0) >= 1.0:  # beating from its own thread through a long step
            state += f" (busy: a step for {n['busy_s']:.0f} s)"
        beat = f"{n['last_seen_s_ago']:.1f} s ago"
        if narrow:
            peak, _, unit = format_bytes(n["peak_rss_bytes"]).partition(" ")
            budget, _, unit2 = format_bytes(n["memory_bytes"]).partition(" ")
            short = f"{peak} of {budget} {unit}" if unit == unit2 else mem
            t.add_row(f"{n['node_id']}\n{state}", f"{layers}\n{n.get('address', '')}",
                      f"{short}\n{beat}", f"served {n['served']}, failed {n['failures']}\n"
                      f"{_clock(n)}")  # fmt: skip
        else:
            t.add_row(n["node_id"], n.get("address", ""), state, layers, mem, beat, _clock(n),
                      str(n["served"]), str(n["failures"]), n["message"][:60])  # fmt: skip
    console.print(t)
    if narrow:  # notes below the table, whole
        for n in status["nodes"]:
            if n["message"]:
                print(f"{n['node_id']}: {n['message'][:200]}")
    if status.get("context"):  # below the table: a title that wraps splits its words
        print(f"context {status['context']:,} tokens a sequence, {status['sequences']} in flight")
    for b in status.get("bottlenecks", []):
        print(f"pipeline bottleneck: {b['node_id']} (stage {b['stage']}, {b['step_ms']:.1f} ms "
              f"a decode step, {b['times_median']:.1f}x the median stage)")  # fmt: skip
    spec = status.get("speculative")
    if spec and spec["drafted"]:
        print(f"speculative decoding: {spec['accepted']:,} of {spec['drafted']:,} drafts kept "
              f"({100 * spec['accepted'] / spec['drafted']:.0f}%)")  # fmt: skip
    if status.get("problem"):
        print(f"cannot place the model: {status['problem']}")


def _clock(node: NodeRow) -> str:
    """The node's clock against the coordinator's, e.g. '+1.2 ms ±0.3'."""
    offset, error = node.get("clock_offset_s"), node.get("clock_error_s")
    if offset is None:
        return "-"
    return f"{-1000 * offset:+.1f} ms ±{1000 * (error or 0):.1f}"


def cmd_up(args: argparse.Namespace) -> int:
    from cellswarm.swarm.local.up import (
        LocalSwarm,
        Stopped,
        ignore_stop_signals,
        kill_strays,
        stop_on_signals,
    )

    if args.workers < 1:
        raise RequestError(f"--workers {args.workers}: a swarm needs at least 1 worker "
                           "(3 by default: two stages and a spare)")  # fmt: skip
    swarm = LocalSwarm(model=_model(args.model), workers=args.workers, memory=args.memory,
                       state_dir=Path(args.state_dir), profile=args.profile,
                       stages=args.stages, port=args.port, tls_dir=args.tls,
                       keep_awake=args.keep_awake, context=args.context,
                       max_sequences=args.max_sequences, draft=args.draft,
                       cache_type=args.cache_type)  # fmt: skip
    fit = swarm.fit_to_workers()  # a context they cannot hold: one line, before any process

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        with stop_on_signals():  # from the start: loading takes a while, orphans last
            try:
                say(f"context {fit.context_tokens:,} tokens a sequence, up to {fit.sequences} "
                    f"in flight, {args.cache_type} KV cache (--context, --max-sequences, "
                    f"--memory {args.memory}, --cache-type)")
                swarm.start(say)
                print_status(swarm.wait_ready(on_change=say))
                say(f"coordinator: {swarm.url} (token in {swarm.token_file}); Ctrl-C stops "
                    "the swarm")  # fmt: skip
                say(f"dashboard: {swarm.url}/ · metrics: {swarm.url}/metrics · doctor: "
                    f"cellswarm doctor --coordinator {swarm.url} --token-file "
                    f"{swarm.token_file}")  # fmt: skip
                tls = f" --tls {args.tls}" if args.tls else ""
                say(f"try: cellswarm generate 'Hello' --coordinator {swarm.url}{tls}")
                return swarm.watch(say)
            finally:
                try:
                    ignore_stop_signals()
                finally:
                    swarm.close(grace_s=5.0)  # every child, whatever ended the watch
                    kill_strays()
    except Stopped as exc:
        print(f"cellswarm up: {signal.Signals(exc.signum).name}: the swarm is stopped",
              file=sys.stderr)  # fmt: skip
        return 128 + exc.signum


# local `generate` flags that shape this process, not the swarm: with --coordinator, each
# says in one line where the swarm's own setting lives
LOCAL_ONLY = {
    "quant": "a swarm serves its model file's weights as stored: make a file of that type "
             "(llama.cpp's llama-quantize) and start the coordinator with --model on it, or "
             "drop --quant",
    "kv_budget": "each worker's --memory bounds its KV cache: drop --kv-budget",
    "threads": "each worker sets its own --threads: drop --threads",
    "dram_budget": "a tiered box runs in one process: drop --coordinator",
    "slow_tier": "a tiered box runs in one process: drop --coordinator",
    "slow_bandwidth": "a tiered box runs in one process: drop --coordinator",
    "routing_stats": "a tiered box runs in one process: drop --coordinator",
    "numa": "a tiered box runs in one process: drop --coordinator",
    "draft": "a swarm drafts with the draft model its first stage's worker was started "
             "with (cellswarm worker --draft): drop --draft",
}


def generate_remote(args: argparse.Namespace) -> int:
    """`cellswarm generate --coordinator URL`: the same flags and output as local `generate`,
    over the swarm's OpenAI routes (chat template, stop strings and token ids included);
    text streams as it comes, or one JSON object with --json."""
    from cellswarm.swarm.api import client

    for name, why in LOCAL_ONLY.items():
        if getattr(args, name, None) is not None:
            flag = "--" + name.replace("_", "-")
            raise RequestError(f"{flag} {getattr(args, name)} with --coordinator: {why}")
    key = api_key(args)
    card: ModelCard = client.call(args.coordinator, "/v1/models", tls=args.tls,
                                  api_key=key)["data"][0]  # fmt: skip
    if args.model and Path(args.model).name not in (card["id"], Path(card["id"]).stem):
        raise RequestError(f"--model {args.model}: the swarm at {args.coordinator} serves "
                           f"{card['id']}; drop --model or point at its coordinator")  # fmt: skip
    if args.context:
        check_served_context(args.coordinator, args.context, args.tls, key, card)
    body, route = _openai_body(args, card["id"])
    t0 = time.perf_counter()
    wait_placeable(args.coordinator, args.tls, key)
    text: list[str] = []
    ids: list[int] = []
    finish: JsonObject | None = None
    rid, usage = "", _object(None)
    def waiting(line: str) -> None:  # the coordinator's word while no token comes
        print(f"[{line}]", file=sys.stderr, flush=True)

    for chunk in client.events(args.coordinator, route, body, tls=args.tls, api_key=key,
                               on_comment=waiting):
        rid = rid or str(chunk["id"]).split("-", 1)[-1]
        usage = _object(chunk.get("usage")) or usage
        for c in _objects(chunk["choices"]):
            piece = _object(c.get("delta")).get("content") if args.chat else c.get("text")
            if piece:
                text.append(str(piece))
                if not args.json:
                    sys.stdout.write(str(piece))
                    sys.stdout.flush()
            if c.get("finish_reason"):
                finish, ids = c, _ints(c.get("token_ids") or [])
    took_s = time.perf_counter() - t0
    reason = _stop_reason(finish)
    if args.json:
        predicted = _object(usage.get("completion_tokens_details"))
        kept = int(str(predicted.get("accepted_prediction_tokens") or 0))
        stats = {"prompt_tokens": usage.get("prompt_tokens"), "generated_tokens": len(ids),
                 "seconds": round(took_s, 4), "stop_reason": reason, "request_id": rid,
                 "drafted_tokens": kept + int(str(predicted.get("rejected_prediction_tokens")
                                                  or 0)),
                 "accepted_tokens": kept}  # fmt: skip
        print(json.dumps({"text": "".join(text), "token_ids": ids, "stats": stats}))
        return 0
    print(flush=True)
    print(f"[request {rid} | prompt {usage.get('prompt_tokens')} tokens | {len(ids)} generated "
          f"({reason}) in {took_s:.2f} s]", file=sys.stderr)  # fmt: skip
    return 0


def wait_placeable(url: str, tls: str | None, key: str | None, timeout_s: float = 120.0) -> None:
    """Until the coordinator can place the model (a swarm just started: its workers are
    still joining), saying why it waits, once per reason; then the request is queued and
    waits for the ring like any other. A SwarmError with the last reason after `timeout_s`."""
    from cellswarm.swarm.api import client

    deadline, said = time.monotonic() + timeout_s, ""
    while True:
        problem = str(client.call(url, "/v1/status", tls=tls, api_key=key).get("problem") or "")
        if not problem:
            return
        if time.monotonic() > deadline:
            raise SwarmError(f"the swarm at {url} cannot place the model after "
                             f"{timeout_s:.0f} s: {problem}")  # fmt: skip
        if problem != said:
            print(f"[waiting for the swarm: {problem}]", file=sys.stderr, flush=True)
            said = problem
        time.sleep(0.5)


def _object(value: JsonValue | None) -> JsonObject:
    """An object of a streamed chunk; {} for one that is null or absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _objects(value: JsonValue) -> list[JsonObject]:
    """A chunk's list of objects (its choices)."""
    if not isinstance(value, list):
        raise TypeError(f"expected a JSON list, got {type(value).__name__}")
    return [_object(v) for v in value]


def _ints(value: JsonValue) -> list[int]:
    """A chunk's token ids."""
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise TypeError(f"expected a list of token ids, got {value!r}")
    return [v for v in value if isinstance(v, int)]


def _openai_body(args: argparse.Namespace, model: str) -> tuple[dict[str, object], str]:
    """The OpenAI request local `generate`'s flags make, and its route."""
    prompt = ids_prompt(args)
    if args.ids and args.chat:
        raise RequestError("--ids with --chat: token ids are not a message; drop one")
    body: dict[str, object] = {
        "model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "repetition_penalty": args.repeat_penalty, "stream": True, "return_token_ids": True,
        "skip_special_tokens": False,
        "stream_options": {"include_usage": True}, "speculative": args.speculative,
    }  # fmt: skip
    if args.seed is not None:
        body["seed"] = args.seed
    if args.stop:
        body["stop"] = list(args.stop)
    if args.chat:
        return body | {"messages": [{"role": "user", "content": prompt}]}, "/v1/chat/completions"
    return body | {"prompt": prompt}, "/v1/completions"


def ids_prompt(args: argparse.Namespace) -> str | list[int]:
    """`generate`'s prompt: the text, or with --ids its comma-separated token ids."""
    if not args.ids:
        return args.prompt
    try:
        return [int(i) for i in args.prompt.split(",")]
    except ValueError:
        raise RequestError(f"--ids: {args.prompt!r} is not comma-separated integers") from None


def _stop_reason(choice: JsonObject | None) -> str:
    """Local generate's names for an OpenAI finish: a stop string, an end token, the limit."""
    if choice is None or choice.get("finish_reason") == "length":
        return "max_tokens"
    return "stop_string" if isinstance(choice.get("stop_reason"), str) else "stop_token"


def check_served_context(url: str, context: int, tls: str | None, key: str | None,
                         card: ModelCard | None = None) -> None:  # fmt: skip
    """`generate --coordinator URL --context N`: the swarm must serve at least N tokens a
    sequence (its /v1/models' max_model_len); the request itself is checked there too."""
    from cellswarm.swarm.api import client

    if not card:
        card = client.call(url, "/v1/models", tls=tls, api_key=key)["data"][0]
    served = card.get("max_model_len")
    if served is not None and context > int(served):
        raise RequestError(f"--context {context}: the swarm at {url} serves {served} tokens a "
                           f"sequence; start it with a larger --context (cellswarm up --context "
                           f"{context}) or ask for {served} or less")  # fmt: skip
