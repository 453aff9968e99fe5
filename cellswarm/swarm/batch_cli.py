"""`cellswarm batch submit | watch | results | cancel | retry-failed`."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from cellswarm.errors import RequestError
from cellswarm.swarm.api.client import api_key

if TYPE_CHECKING:
    from cellswarm.swarm.api.client import Status
    from cellswarm.swarm.protocol.jsonvalue import JsonObject

DEFAULT_URL = "http://127.0.0.1:8470"


def add_batch_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("batch", help="batch jobs: submit a JSONL file, watch it, get results")
    bsub = b.add_subparsers(dest="batch_command", required=True)
    s = bsub.add_parser("submit", help="submit FILE.jsonl; prints the batch's job id")
    s.add_argument("file", type=Path, help="one JSON object per line: id, prompt|messages, ...")
    s.add_argument("--verify", type=float, default=0.0,
                   help="fraction of jobs rerun on another replica, compared (0..1)")
    s.add_argument("--name", help="a name for the batch (default: the file's)")
    s.set_defaults(func=cmd_submit)
    w = bsub.add_parser("watch", help="a live progress bar until the batch is finished")
    w.add_argument("job")
    w.set_defaults(func=cmd_watch)
    r = bsub.add_parser("results", help="one line per input, in input order")
    r.add_argument("job")
    r.add_argument("-o", "--output", type=Path, help="write JSONL here (default: stdout)")
    r.set_defaults(func=cmd_results)
    c = bsub.add_parser("cancel", help="cancel the batch's unfinished jobs")
    c.add_argument("job")
    c.set_defaults(func=lambda a: _post(a, f"/v1/batches/{a.job}/cancel"))
    t = bsub.add_parser("retry-failed", help="requeue the batch's dead-lettered jobs")
    t.add_argument("job")
    t.set_defaults(func=lambda a: _post(a, f"/v1/batches/{a.job}/retry-failed"))
    for p in (s, w, r, c, t):
        p.add_argument("--coordinator", default=DEFAULT_URL, help="the coordinator's URL")
        p.add_argument("--tls", metavar="DIR", help="mutual TLS: this node's certs folder")
        p.add_argument("--api-key-file", help="a coordinator with keys: send this file's first key")


class BatchProgress(TypedDict):
    """The fields of GET /v1/batches/ID (api/batch_api.py `progress`) that `watch` reads."""

    name: str
    total: int
    finished: int
    tokens: int
    counts: dict[str, int]  # jobs by state: queued, leased, done, dead, cancelled


def read_items(path: Path) -> list[JsonObject]:
    """The batch file's objects, one a line (blank lines skipped). A line that is not UTF-8,
    not JSON or not an object, or that repeats an earlier line's id, is refused naming its
    line number — every such line, not only the first."""
    if not path.is_file():
        raise RequestError(f"batch file {path} does not exist")
    items: list[JsonObject] = []
    bad: list[str] = []
    ids: dict[str, int] = {}
    for n, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.append(f"line {n}: byte 0x{raw[exc.start]:02x} at column {exc.start + 1} is not "
                       "UTF-8")  # fmt: skip
            continue
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as exc:
            bad.append(f"line {n} is not JSON ({getattr(exc, 'msg', exc)})")
            continue
        if not isinstance(item, dict):
            bad.append(f"line {n} is not a JSON object")
            continue
        if item.get("id") is not None:
            key = str(item["id"])
            if key in ids:
                bad.append(f"line {n} repeats the id {key!r} of line {ids[key]}")
            ids.setdefault(key, n)
        items.append(item)
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise RequestError(f"{path}: {'; '.join(bad[:3])}{more}: one JSON object per line, "
                           "UTF-8, each with its own id")  # fmt: skip
    if not items:
        raise RequestError(f"{path} has no lines")
    return items


def cmd_submit(args: argparse.Namespace) -> int:
    from cellswarm.swarm.api import client

    items = read_items(args.file)
    # the same file submitted twice is the same batch: the key is its content
    key = hashlib.sha256(args.file.read_bytes()).hexdigest() + f":{args.verify}"
    answer = client.call(args.coordinator, "/v1/batches", {
        "name": args.name or args.file.name, "items": items,
        "verify_fraction": args.verify, "idempotency_key": key,
    }, tls=args.tls, api_key=api_key(args))  # fmt: skip
    print(answer["batch_id"])
    print(f"{answer['total']} jobs; watch: cellswarm batch watch {answer['batch_id']}",
          file=sys.stderr)  # fmt: skip
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from cellswarm.swarm.api import client

    key = api_key(args)

    def get(path: str) -> BatchProgress:
        info: BatchProgress = client.call(args.coordinator, path, tls=args.tls, api_key=key)
        return info

    def status() -> Status:
        answer: Status = client.call(args.coordinator, "/v1/status", tls=args.tls, api_key=key)
        return answer

    info = get(f"/v1/batches/{args.job}")
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}")]  # fmt: skip
    samples: list[tuple[float, int, int]] = []  # (time, finished, tokens), the last minute
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(info["name"], total=info["total"], detail="")
        while True:
            info = get(f"/v1/batches/{args.job}")
            now = time.monotonic()
            samples = [x for x in samples if now - x[0] <= RATE_WINDOW_S]
            samples.append((now, int(info["finished"]), int(info.get("tokens") or 0)))
            stall = status() if stalled_s(samples) >= STALL_S else None
            bar.update(task, completed=info["finished"],
                       detail=watch_detail(info, samples, stall))  # fmt: skip
            if info["finished"] >= info["total"]:
                break
            time.sleep(0.5)
    return 0 if info["counts"]["dead"] == 0 else 1


RATE_WINDOW_S = 60.0  # the rate and ETA are over the last minute, not since the start
STALL_S = 15.0  # no job finished for this long: say why


def stalled_s(samples: list[tuple[float, int, int]]) -> float:
    """How long the finished count has not moved, within the samples kept."""
    last = samples[-1]
    moved = [t for t, done, _ in samples if done != last[1]]
    since = max(moved) if moved else samples[0][0]
    return last[0] - since


def watch_detail(info: BatchProgress, samples: list[tuple[float, int, int]],
                 status: Mapping[str, object] | None) -> str:  # fmt: skip
    """`batch watch`'s line: counts, the rate over the last minute and the ETA it gives —
    or, when nothing has finished for STALL_S, "stalled" and why (the swarm's status)."""
    c = info["counts"]
    head = f"done {c['done']} failed {c['dead']} cancelled {c['cancelled']}"
    (t0, f0, k0), (t1, f1, k1) = samples[0], samples[-1]
    span = t1 - t0
    if status is not None and info["finished"] < info["total"]:
        return f"{head} | stalled {stalled_s(samples):.0f} s: {stall_reason(status, c)}"
    if info["finished"] >= info["total"]:
        return f"{head} | finished"
    if span < 1.0:
        return f"{head} | measuring the rate"
    rate, tok_s = (f1 - f0) / span, (k1 - k0) / span
    left = info["total"] - info["finished"]
    eta = f"ETA {left / rate:.0f} s" if rate > 0 else "ETA -"
    return f"{head} | {rate:.2f} jobs/s, {tok_s:.1f} tok/s over {span:.0f} s | {eta}"


def stall_reason(status: Mapping[str, object], counts: Mapping[str, int]) -> str:
    if status.get("problem"):
        return f"the swarm cannot place the model ({status['problem']})"
    if not status.get("wired"):
        return "the ring is being rewired (a node was lost or joined); jobs wait, none is spent"
    if counts.get("leased", 0) == 0 and counts.get("queued", 0) > 0:
        return "jobs are queued but none is leased: interactive requests go first"
    return "jobs are running but none has finished (a long prompt or generation)"


def cmd_results(args: argparse.Namespace) -> int:
    from cellswarm.swarm.api import client

    path = f"/v1/batches/{args.job}/results"
    rows = client.call(args.coordinator, path, tls=args.tls, api_key=api_key(args))["results"]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if args.output:
        args.output.write_text(lines)
        done = sum(r["state"] == "done" for r in rows)
        print(f"{len(rows)} results ({done} done) written to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(lines)
    return 0


def _post(args: argparse.Namespace, path: str) -> int:
    from cellswarm.swarm.api import client

    print(json.dumps(client.call(args.coordinator, path, {}, tls=args.tls, api_key=api_key(args))))
    return 0
