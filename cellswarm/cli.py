"""The `cellswarm` command line. Errors from the library become one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from cellswarm.errors import CellswarmError, RequestError

EXIT_USAGE = 2
TIERED_CONTEXT = 512  # a tiered box's KV reservation without --context (its cache is sized once)


def main(argv: Sequence[str] | None = None) -> int:
    from cellswarm.lifecycle import die_with_parent

    die_with_parent()
    parser = build_parser()
    try:  # a flag's own parser may say what is wrong with its value (RequestError)
        args = parser.parse_args(argv)
        return int(args.func(args))
    except CellswarmError as exc:
        print(f"cellswarm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a file it was given cannot be opened: one line, not a traceback
        print(f"cellswarm: error: {os_error(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("cellswarm: interrupted", file=sys.stderr)
        return 130


def os_error(exc: OSError) -> str:
    """What an OSError says, with the file and what to do about it."""
    where = f" {exc.filename}" if exc.filename else ""
    what = f"{exc.strerror or exc}{':' if where else ''}{where}"
    if isinstance(exc, PermissionError):
        return f"{what}: this user may not read it; check its owner and mode (ls -l)"
    if isinstance(exc, FileNotFoundError):
        return f"{what}: check the path"
    return what


class Parser(argparse.ArgumentParser):
    """argparse's, but a mistake is one line naming it and where the help is (not the
    whole usage: `generate`'s is 15 lines), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="cellswarm", description=__doc__)
    sub: Any = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_plan(sub)
    from cellswarm.swarm.commands import add_commands

    add_commands(sub)
    from cellswarm.swarm.certs_cli import add_certs_commands

    add_certs_commands(sub)
    from cellswarm.swarm.nats_cli import add_nats_commands

    add_nats_commands(sub)
    from cellswarm.sim.cli import add_simulate_command

    add_simulate_command(sub)
    from cellswarm.lab.cli import add_lab_command

    add_lab_command(sub)
    from cellswarm.evaluate import add_eval_command

    add_eval_command(sub)
    from cellswarm.doctor import add_doctor_command

    add_doctor_command(sub)
    lg = sub.add_parser("logs", help="one request's timeline, merged across every node's log")
    lg.add_argument("request_id")
    lg.add_argument("--dir", default="cellswarm-logs", help="folder of the nodes' .jsonl logs")
    lg.add_argument("--coordinator", help="read the events every node shipped to this "
                    "coordinator instead (URL; nodes need not share a disk)")
    lg.add_argument("--token-file", help="with --coordinator: prove the cluster token")
    lg.add_argument("--api-key-file", help="with --coordinator: send its first key")
    lg.add_argument("--tls", metavar="DIR", help="with --coordinator: mutual TLS (certs folder)")
    lg.set_defaults(func=_cmd_logs)
    v = sub.add_parser("verify", help="check a GGUF file without loading it: header, tensors, "
                       "and every block's scales finite (a corrupt download shows here)")
    v.add_argument("file", help="the .gguf file")
    v.set_defaults(func=_cmd_verify)
    k = sub.add_parser("kernels", help="the C kernels: `kernels build` compiles them for this "
                       "machine now (a worker's unit runs it as ExecStartPre)")  # fmt: skip
    k.add_argument("action", choices=["build"])
    k.set_defaults(func=_cmd_kernels)
    d = sub.add_parser("demo", help="the demo model on a local swarm, a worker killed mid-way")
    d.add_argument("--max-tokens", type=int, default=48)
    d.set_defaults(
        func=lambda a: __import__("cellswarm.swarm.local.demo", fromlist=["run"]).run(a.max_tokens)
    )
    return parser


def _cmd_kernels(args: argparse.Namespace) -> int:
    """Compile the kernels into this machine's cache (CELLSWARM_CACHE), or say why not."""
    from cellswarm.kernels import KernelBuildError, prebuild

    try:
        built = prebuild()
    except KernelBuildError as exc:
        raise RequestError(str(exc)) from None
    print(built.line() if built else "KERNELS off (CELLSWARM_KERNELS=numpy)", flush=True)
    return 0


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from cellswarm.swarm.settings import parse_count

    p = sub.add_parser("generate", help="generate text with a model in this process")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", help="a .gguf file or Hugging Face folder (default: demo model)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x best")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="1: off")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--quant", help="re-pack weights at load, e.g. q8_0, q4_0, f32")
    p.add_argument("--kv-budget", help="byte budget for the KV cache, e.g. 64M")
    add_cache_type_option(p)
    p.add_argument("--context", type=lambda t: parse_count(t, "--context", "4096"),
                   help="tokens of KV cache a generation may take, prompt + --max-tokens: "
                   "more is refused before any is taken (default: what the generation needs; "
                   "a tiered box reserves 512); with --coordinator, checked against the "
                   "context the swarm serves")  # fmt: skip
    p.add_argument("--threads", type=int, help="threads for kernels and BLAS (default: all cores)")
    p.add_argument("--speculative", default="auto", metavar="MODE",
                   help="speculative decoding, the same text either way: auto (default: drafts "
                   "when they pay), off, lookup (drafts from the text so far), draft (from "
                   "--draft)")  # fmt: skip
    p.add_argument("--draft", metavar="MODEL", help="a small draft model with the same "
                   "tokenizer (a .gguf file or Hugging Face folder)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--ids", action="store_true", help="the prompt is comma-separated token ids")
    p.add_argument("--coordinator", help="run on this swarm (its URL) instead of in-process")
    p.add_argument("--tls", metavar="DIR", help="with --coordinator: mutual TLS (certs folder)")
    p.add_argument("--api-key-file", help="with --coordinator: send its first key")
    t = p.add_argument_group("tiered box (MoE models): weights split between DRAM and a slow tier")
    t.add_argument("--dram-budget", help="anonymous memory for this process in all, e.g. 8G")
    t.add_argument(
        "--slow-tier",
        help="where the GGUF lives (a DAX-mounted PMem namespace, an SSD): a folder holding "
        "the --model file's name, or the file itself (default: --model as given)",
    )
    t.add_argument("--slow-bandwidth", help="pace slow-tier reads to this many bytes/s, e.g. 2G")
    t.add_argument("--routing-stats", type=Path, help="JSON routing counts: read, then saved")
    t.add_argument("--numa", type=int, help="pin threads and allocations to this NUMA node")
    t.add_argument("--plan-node", default="xeon-optane", help="profile for the prediction")
    p.set_defaults(func=_cmd_generate)


def add_cache_type_option(p: argparse.ArgumentParser) -> None:
    """--cache-type: a bad value is one line naming it and the choices (check_cache_type
    raises RequestError, which main prints), not argparse's usage."""
    from cellswarm.cache_types import CACHE_TYPES, DEFAULT_CACHE_TYPE, check_cache_type

    p.add_argument("--cache-type", type=check_cache_type, default=DEFAULT_CACHE_TYPE,
                   help=f"what the KV cache stores values as: {', '.join(CACHE_TYPES)} (default "
                   "%(default)s: half f32's bytes; q8_0 about a quarter; their quality: "
                   "docs/design.md 'KV cache types')")  # fmt: skip


def _cmd_generate(args: argparse.Namespace) -> int:
    from cellswarm import kernels
    from cellswarm.demo import demo_model_path
    from cellswarm.engine.model import GenerateOptions
    from cellswarm.engine.sampling import SamplingParams
    from cellswarm.loader import load
    from cellswarm.units import format_bytes, parse_bytes

    if args.coordinator:
        from cellswarm.swarm.commands import generate_remote

        return generate_remote(args)
    if args.threads is not None and args.threads < 1:
        raise RequestError(f"--threads {args.threads} must be at least 1")
    kernels.set_threads(args.threads)
    budget = parse_bytes(args.kv_budget) if args.kv_budget else None
    tiered = None
    if args.dram_budget:
        tiered = _load_tiered(args)
        model = tiered.model
    else:
        model = load(args.model or demo_model_path(), quant=args.quant, kv_budget_bytes=budget,
                     cache_type=args.cache_type)  # fmt: skip
        model.prepare()  # repacked before the prompt's clock starts, as llama.cpp's load does
    if args.draft:
        try:
            draft = load(args.draft, cache_type=args.cache_type)
        except CellswarmError as exc:
            raise RequestError(f"--draft: {exc}") from None
        model.use_draft(draft)
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    # unchecked without --context, as before: the cache takes prompt + max_tokens, and a
    # tiny test model's 64 tokens would refuse the default 64 of --max-tokens
    opts = GenerateOptions(max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop),
                           context=args.context, speculative=args.speculative)  # fmt: skip
    stream = None if args.json else _print_piece
    from cellswarm.swarm.commands import ids_prompt

    gen = model.generate(ids_prompt(args), opts, on_text=stream, chat=args.chat)
    s = gen.stats
    tier_stats = _tier_stats(tiered, args, s.decode_tokens_per_s) if tiered else None
    if args.json:
        out = {"text": gen.text, "token_ids": gen.token_ids, "stats": s.as_dict()}
        if tier_stats is not None:
            out["tiered"] = tier_stats
        print(json.dumps(out))
        return 0
    print(flush=True)
    if tier_stats is not None:
        print(_tier_line(tier_stats, s.decode_tokens_per_s), file=sys.stderr)
    print(
        f"[prompt {s.prompt_tokens} tokens | prefill {s.prefill_tokens_per_s:.1f} tok/s | "
        f"decode {s.decode_tokens_per_s:.1f} tok/s | {s.generated_tokens} generated "
        f"({s.stop_reason}){_drafted(s.drafted_tokens, s.accepted_tokens)} | "
        f"peak RSS {format_bytes(s.peak_rss_bytes)}]",
        file=sys.stderr,
    )
    return 0


def _drafted(drafted: int, accepted: int) -> str:
    """The stats line's word on speculative decoding: how many drafts the model kept."""
    if drafted == 0:
        return ""
    return f" | drafts {accepted}/{drafted} kept ({100 * accepted / drafted:.0f}%)"


def _load_tiered(args: argparse.Namespace) -> Any:
    from cellswarm.engine import tiered
    from cellswarm.units import parse_bytes

    if args.quant or args.kv_budget:
        raise RequestError("--dram-budget keeps the file's own weights: drop --quant/--kv-budget")
    if not args.model:
        raise RequestError("--dram-budget needs --model, a MoE .gguf file")
    path = Path(args.model)
    if args.slow_tier:
        slow = Path(args.slow_tier)
        path = slow / path.name if slow.is_dir() else slow
    note = tiered.pin_numa(args.numa) if args.numa is not None else None
    if note and not args.json:
        print(note, file=sys.stderr)
    bandwidth = parse_bytes(args.slow_bandwidth) if args.slow_bandwidth else None
    tm = tiered.load_tiered(
        path, parse_bytes(args.dram_budget), slow_bandwidth=bandwidth,
        context=args.context or TIERED_CONTEXT,
        routing_stats=args.routing_stats, cache_type=args.cache_type,
    )  # fmt: skip
    if not args.json:
        print(tm.placement.describe(), file=sys.stderr)
    tm.numa_note = note
    return tm


def _tier_stats(tm: Any, args: argparse.Namespace, measured: float) -> dict[str, Any]:
    from cellswarm.engine import tiered
    from cellswarm.planner.api import predict_tiered_tokens_per_s

    stats = tm.stats()
    stats["placement"] = tm.placement.as_dict()
    stats["numa"] = tm.numa_note
    dram_bw = tiered.dram_bandwidth()
    stats["dram_bandwidth"] = dram_bw
    stats["predicted_tokens_per_s"] = predict_tiered_tokens_per_s(
        tm.slow.path, stats, dram_bw, node=args.plan_node
    )
    stats["measured_tokens_per_s"] = measured
    if args.routing_stats:
        tm.experts.save_counts(args.routing_stats)
    return stats


def _tier_line(t: dict[str, Any], measured: float) -> str:
    from cellswarm.units import format_bytes as fb

    tot = t["total"]
    slow_bw = t["slow_bytes_read"] / t["slow_read_s"] if t["slow_read_s"] else 0.0
    return (
        f"[tiered | expert cache hit rate {t['hit_rate']:.1%} ({tot['hits']} hits + "
        f"{tot['misses']} misses = {tot['uses']} expert uses; decode {t['decode_hit_rate']:.1%})"
        f" | per decode token: DRAM {fb(t['dram_bytes_per_token'])}, slow tier "
        f"{fb(t['slow_bytes_per_token'])} | page faults major {t['majflt']} minor "
        f"{t['minflt']} | peak RssAnon {fb(t['peak_rss_anon'])} of "
        f"{fb(t['placement']['dram_budget'])}, peak RssFile {fb(t['peak_rss_file'])}, model "
        f"in page cache {fb(max(t['page_cache_bytes'], 0))} | decode {measured:.2f} tok/s "
        f"measured, {t['predicted_tokens_per_s']:.2f} predicted (planner, measured tiers: DRAM "
        f"{fb(t['dram_bandwidth'])}/s, slow {fb(slow_bw)}/s)]"
    )


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="will a model run on N nodes of a kind, how fast, what power")
    p.add_argument("model", help="a preset (kimi-k3, ...), a .gguf file or a Hugging Face folder")
    p.add_argument("--node", default="ps3", help="node profile (ps3, rpi4, xeon-optane, ...)")
    p.add_argument("--count", type=int, help="how many nodes (default 1, or the --topology "
                   "file's hosts)")  # fmt: skip
    p.add_argument("--quant", help="GGUF type (q4_0, q8_0, ...) or bits per weight (1.74)")
    p.add_argument("--context", type=int, default=4096, help="tokens of context per sequence")
    p.add_argument("--concurrency", type=int, default=1, help="sequences in flight per replica")
    p.add_argument("--parallel", choices=["pipeline", "tensor", "expert"], default="pipeline")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens for the prefill time")
    p.add_argument("--activations", choices=["f32", "f16", "q8_0"], default="f32")
    p.add_argument("--profiles", type=Path, help="TOML file adding or overriding node profiles")
    p.add_argument("--dram-budget", help="tiered boxes: DRAM for weights, e.g. 64G (0: none)")
    p.add_argument("--hit-rate", type=float, help="tiered boxes: expert-cache hit rate 0..1")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", type=Path, help="write charts to this PNG file")
    p.add_argument("--measure-overhead", action="store_true", help="measure an idle worker")
    p.add_argument("--vs", metavar="NODE", help="and beside it the same model on this profile "
                   "(e.g. plan kimi-k3 --node ps3 --count 100000 --vs xeon-optane)")
    p.add_argument("--vs-count", type=int, default=1, help="how many --vs nodes (default 1)")
    p.add_argument("--stages", type=int, help="exactly this many pipeline stages, as "
                   "`cellswarm up --stages` places them (default: the fewest that fit)")
    p.add_argument("--draft", help="a draft model for speculative decoding (a preset, .gguf "
                   "or HF folder), held by the first node of each replica beside its share "
                   "(`worker --draft`)")  # fmt: skip
    p.add_argument("--topology", type=Path, help="the network of a `cellswarm lab` topology "
                   "file (racks, host rate, oversubscription): what the lab would measure")
    add_cache_type_option(p)
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from cellswarm.planner import api, render
    from cellswarm.planner.overhead import measure_idle_worker_rss_bytes
    from cellswarm.units import format_bytes

    if args.plot:
        from cellswarm.evaluate import need_matplotlib

        need_matplotlib()
    overhead = measure_idle_worker_rss_bytes() if args.measure_overhead else None
    if overhead is not None:
        print(f"idle worker RSS, measured now: {overhead:,} bytes ({format_bytes(overhead)})")
    network, hosts = _topology_network(args.topology)
    args.network = network
    result = _plan_of(args, api, args.node, args.count or hosts or 1, overhead)
    fallback = _smaller_context(result, api)
    if args.vs:
        return _plan_vs(args, api, fallback or result, overhead)
    if args.json:
        out = render.as_dict(result)
        if fallback is not None:
            out["fits_at_context"] = render.as_dict(fallback)
        print(json.dumps(out))
    else:
        render.render(result)
        if fallback is not None:
            print(f"\nWith --context {fallback.request.context} it fits:")
            render.render(fallback)
    if args.plot:
        from cellswarm.planner.plot import plot

        plot(fallback or result, args.plot)
    return 0


def _plan_of(args: argparse.Namespace, api: Any, node: str, count: int,
             overhead: int | None) -> Any:  # fmt: skip
    """The plan `plan`'s flags ask for, on `count` nodes of `node`."""
    from cellswarm.units import parse_bytes

    return api.plan(
        args.model, node=node, count=count, quant=args.quant, context=args.context,
        concurrency=args.concurrency, parallel=args.parallel, prompt_tokens=args.prompt,
        profiles_file=args.profiles, activations=args.activations, runtime_overhead=overhead,
        dram_bytes=parse_bytes(args.dram_budget) if args.dram_budget else None,
        expert_hit_rate=args.hit_rate, stages=args.stages, network=args.network,
        draft=args.draft, cache_type=args.cache_type,
    )  # fmt: skip


def _topology_network(path: Path | None) -> tuple[Any, int | None]:
    """The planner's NetworkSpec of a lab topology file and its worker hosts (None, None
    without one): the lab builds that file's racks and links, `plan` predicts them."""
    if path is None:
        return None, None
    from cellswarm.lab.cli import spec_of_file
    from cellswarm.lab.topology import build

    spec = spec_of_file(path)
    return build(spec).network_spec(), int(spec.hosts)


def _plan_vs(args: argparse.Namespace, api: Any, first: Any, overhead: int | None) -> int:
    """`plan --vs NODE`: the same model and settings on a second setup, side by side."""
    from cellswarm.planner import render

    if args.vs_count < 1:
        raise RequestError(f"--vs-count {args.vs_count} must be at least 1")
    second = _plan_of(args, api, args.vs, args.vs_count, overhead)
    second = _smaller_context(second, api) or second
    if args.json:
        print(json.dumps({"plans": [render.as_dict(first), render.as_dict(second)]}))
        return 0
    from rich.console import Console

    console = Console(width=min(Console().width, 100))
    console.print(render.side_by_side([first, second]))
    for p in (first, second):
        if p.request.node.thermal is not None:
            console.print(f"{p.request.node.name} thermal: {p.request.node.thermal.line()}")
    return 0


def _smaller_context(result: Any, api: Any) -> Any:
    """When only the KV cache is in the way, the plan at the longest context that fits."""
    if result.fits or "KV cache" not in result.problem:
        return None
    context = api.largest_context_that_fits(result)
    if not context:
        return None
    import dataclasses

    from cellswarm.planner.plan import plan

    smaller = plan(result.model, dataclasses.replace(result.request, context=context))
    return smaller if smaller.fits else None


def _cmd_logs(args: argparse.Namespace) -> int:
    from cellswarm.swarm.logs import format_timeline, timeline

    if args.coordinator:
        from cellswarm.swarm.api.access import first_key
        from cellswarm.swarm.api.client import fetch_timeline
        from cellswarm.swarm.auth import load_token

        key = first_key(args.api_key_file) if args.api_key_file else None
        token = load_token(args.token_file) if args.token_file else None
        events, clocks = fetch_timeline(args.coordinator, args.request_id, token, key, args.tls)
        print(format_timeline(events, clocks))
        return 0
    if not Path(args.dir).is_dir():
        raise RequestError(f"log folder {args.dir} does not exist; pass --dir")
    print(format_timeline(timeline(args.dir, args.request_id)))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from cellswarm.swarm.node.net import Progress
    from cellswarm.verify import verify

    # bytes and ETA on a terminal (a big file reads for minutes); stdout keeps the one line
    progress = Progress(Path(args.file).name, sys.stderr, verb="VERIFYING") \
        if sys.stderr.isatty() else None  # fmt: skip
    print(verify(args.file, progress=progress).line())
    return 0


def _print_piece(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
