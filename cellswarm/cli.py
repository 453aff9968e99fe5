"""The `cellswarm` command line. Errors from the library become one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cellswarm.errors import CellswarmError

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CellswarmError as exc:
        print(f"cellswarm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("cellswarm: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cellswarm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    return parser


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from cellswarm.demo import demo_model_path
    from cellswarm.engine.model import GenerateOptions
    from cellswarm.engine.sampling import SamplingParams
    from cellswarm.loader import load
    from cellswarm.units import format_bytes, parse_bytes

    budget = parse_bytes(args.kv_budget) if args.kv_budget else None
    model = load(args.model or demo_model_path(), quant=args.quant, kv_budget_bytes=budget)
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    opts = GenerateOptions(max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop))
    stream = None if args.json else _print_piece
    gen = model.generate(args.prompt, opts, on_text=stream, chat=args.chat)
    s = gen.stats
    if args.json:
        print(json.dumps({"text": gen.text, "token_ids": gen.token_ids, "stats": s.as_dict()}))
        return 0
    print(flush=True)
    print(
        f"[prompt {s.prompt_tokens} tokens | prefill {s.prefill_tokens_per_s:.1f} tok/s | "
        f"decode {s.decode_tokens_per_s:.1f} tok/s | {s.generated_tokens} generated "
        f"({s.stop_reason}) | peak RSS {format_bytes(s.peak_rss_bytes)}]",
        file=sys.stderr,
    )
    return 0


def _print_piece(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
