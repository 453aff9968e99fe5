"""A swarm's settings, written once: the config dataclasses, and their command-line flags
derived from them.

Each field that a command line sets carries its flag and help in the field's metadata
(`setting`); `add_flags` builds the argparse options from them, `from_args` the config back
from parsed options, and `to_flags` the options that recreate a config (how `cellswarm up`
and the tests start a coordinator process). So a default lives in one place: here, or in
policy.py for the failure policy. Pure: no sockets, no database.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TypeVar

from cellswarm.cache_types import CACHE_TYPES, DEFAULT_CACHE_TYPE, check_cache_type
from cellswarm.errors import RequestError
from cellswarm.swarm.policy import (
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    LEASE_S,
    MAX_BEATS_PER_S,
    OFFLINE_AFTER,
)
from cellswarm.units import parse_bytes

_PARSERS = {"int": int, "float": float, "str": str}

T = TypeVar("T")


def setting(
    default: T, flag: str, help: str, *, size: bool = False, required: bool = False,
    parse: Callable[[str], object] | None = None,
) -> T:  # fmt: skip
    """A field a command-line flag sets (its help says the default itself). `size`: bytes,
    given as "256M" and the like; `required`: the flag must be given (the field has no
    default: `default` only gives the field's type); `parse`: the value's own parser (one
    that raises RequestError says what is wrong in one line); a help of argparse.SUPPRESS
    hides a test hook. Typed as the field's value, as dataclasses' `field` is."""
    meta = {"flag": flag, "help": help, "size": size, "required": required, "parse": parse}
    return field(metadata=meta) if required else field(default=default, metadata=meta)


@dataclass(frozen=True)
class CoordinatorConfig:
    model: str
    db: str = "cellswarm.db"  # a SQLite path, or postgresql://... to share with others
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8470
    token_file: str | None = setting(
        None, "--token-file", "cluster token file; workers must prove they hold it")
    api_key_file: str | None = setting(
        None, "--api-key-file", "client keys, one per line ('admin KEY' for one that sees every "
        "job): every client route then asks for 'Authorization: Bearer KEY', and a job is its "
        "key's (without a file: no auth)")
    max_body_bytes: int = 4 * 2**20  # a longer request body is refused unread (413)
    heartbeat_s: float = setting(HEARTBEAT_S, "--heartbeat", "seconds between heartbeats")
    heartbeat_timeout_s: float = setting(HEARTBEAT_TIMEOUT_S, "--heartbeat-timeout",
                                         "seconds to 'lost'")  # fmt: skip
    control: str | None = setting(
        None, "--control", "nats://HOST:PORT (tls:// with --tls): also take heartbeats from "
        "this NATS server, configured by `cellswarm nats config` (coordinators sharing it "
        "split them in one queue group; workers given the same --control beat through it, "
        "over HTTP when it does not answer)")
    max_beats_per_s: float = setting(
        MAX_BEATS_PER_S, "--max-beats", "heartbeats a second this coordinator takes: a "
        "bigger swarm beats less often (the interval and the timeout grow together)")  # fmt: skip
    offline_after: int = setting(OFFLINE_AFTER, "--offline-after", "failures in a row: offline")
    probe_every_s: float = 2.0
    stages: int | None = setting(None, "--stages", "pipeline stages (default: fewest that fit)")
    expert_nodes: int = setting(
        0, "--expert-nodes", "nodes holding the MoE layers' routed experts, apart from attention")
    vocab_nodes: int = setting(
        0, "--vocab-nodes", "nodes holding the embedding and output head, split by rows")
    # None: the model's own (GGUF context_length). Fixed for the coordinator's life, so a
    # request is checked against one number; the placement fits the workers to it (more
    # stages, fewer sequences in flight) or says in `status` what does fit.
    context: int | None = setting(
        None, "--context", "tokens a sequence may hold, prompt + completion: every stage "
        "reserves KV cache for them (default: the model's own context; with too little "
        "memory fewer sequences run at once, down to 1, and status says what fits)",
        parse=lambda text: parse_count(text, "--context", "4096"))
    cache_type: str = setting(
        DEFAULT_CACHE_TYPE, "--cache-type", f"what every stage's KV cache stores values as: "
        f"{', '.join(CACHE_TYPES)} (f16 half the bytes of f32, q8_0 about a quarter; "
        "their quality: docs/design.md 'KV cache types'); one for the whole swarm, told to "
        "each worker with its shard, so a sequence's bits do not depend on who holds it",
        parse=check_cache_type)
    max_sequences: int = setting(
        8, "--max-sequences", "sequences in flight per stage, at most (fewer when the context "
        "leaves no room)", parse=lambda text: parse_count(text, "--max-sequences", "8"))
    log_dir: str | None = setting(None, "--log-dir", "folder for JSON-line event logs")
    draft: str | None = setting(
        None, "--draft", "the draft model its workers were started with (worker --draft): "
        "each ring's first stage is placed with room for it, its weights and its cache")
    replicas: int = setting(1, "--replicas", "independent rings sharing the queue")
    lease_s: float = setting(LEASE_S, "--lease", "seconds a job lease lasts unrenewed")
    evict_after_disagreements: int = setting(
        1, "--evict-after", "verification: a node outvoted this many times is taken out (at "
        "the first by default: correct nodes compute the same bits on any CPU)")
    leader_ttl_s: float = setting(
        5.0, "--leader-ttl", "several coordinators: seconds a leader's term lasts unrenewed")
    rebalance: bool = setting(
        True, "--rebalance", "move layers off a stage measured much slower than the others "
        "(default on; off for measuring one fixed placement)")
    tls_dir: str | None = None  # mutual TLS: its HTTPS and its resets to stages (tls.py)
    # tests: once a job is leased, the core thread stalls this long (a slow fsync or
    # placement pass): heartbeats must still be answered and no node lost for it
    stall_core_s: float = setting(0.0, "--stall-core", argparse.SUPPRESS)

    def __post_init__(self) -> None:
        if self.context is not None:
            check_count(self.context, "--context", "4096")
        check_count(self.max_sequences, "--max-sequences", "8")
        check_cache_type(self.cache_type)
        if self.draft is not None and not os.path.isfile(self.draft):
            raise RequestError(f"--draft {self.draft}: no such file; give the GGUF its "
                               "workers draft with (worker --draft)")  # fmt: skip
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise RequestError(
                f"heartbeat timeout {self.heartbeat_timeout_s} s must exceed the heartbeat "
                f"interval {self.heartbeat_s} s"
            )


@dataclass(frozen=True)
class WorkerConfig:
    join: str = setting("", "--join", "the coordinator's URL, or URL1,URL2,... (fails over "
                        "in order)", required=True)  # fmt: skip
    memory_bytes: int = setting(0, "--memory", "hard memory budget, e.g. 256M", size=True,
                                required=True)  # fmt: skip
    node_id: str = setting("", "--node-id", "a stable name (default: host + random)")
    rack: str | None = setting(None, "--rack", "the rack (access switch) it sits in: the "
                               "dashboard's map groups by it (default: by host)")  # fmt: skip
    profile: str | None = setting(
        None, "--profile", "behave like a node of this planner profile (ps3, ...)")
    token_file: str | None = setting(
        None, "--token-file", "cluster token file (never pass the token itself)")
    # A local copy of the model; without one the shard's bytes are fetched from the
    # coordinator (hosts share no disk), only the chunks the shard needs.
    model: str | None = setting(None, "--model", "a local copy of the model file (default: "
                                "fetch the shard's bytes from the coordinator, with progress)")
    listen: str | None = setting(None, "--listen", "HOST[:PORT] for the data port (default: "
                                 "this host's address on the route to the coordinator, any "
                                 "free port)")  # fmt: skip
    advertise: str | None = setting(None, "--advertise", "HOST[:PORT] peers should dial (NAT, "
                                    "containers; default: the --listen address)")  # fmt: skip
    threads: int | None = setting(None, "--threads", "compute threads")
    cache_type: str | None = setting(
        None, "--cache-type", f"the KV cache type this worker serves ({', '.join(CACHE_TYPES)}; "
        "default: the coordinator's --cache-type, which comes with the shard); given, a shard "
        "of another type is refused", parse=check_cache_type)
    log_dir: str | None = setting(None, "--log-dir", "folder for JSON-line event logs")
    control: str | None = setting(
        None, "--control", "nats://HOST:PORT (tls:// with --tls): send heartbeats through "
        "this NATS server (as the coordinator's --control; over HTTP when it does not "
        "answer)")
    stop_after_s: float = setting(
        5.0, "--stop-after", "stop serving after this many seconds without the coordinator")
    fail_forward: bool = setting(False, "--fail-forward", argparse.SUPPRESS)  # tests: all fail
    fetch: bool = setting(
        False, "--fetch", "fetch the shard from the coordinator even with --model")
    perturb: float = setting(0.0, "--perturb", argparse.SUPPRESS)  # tests: wrong outputs
    flip_bit: bool = setting(False, "--flip-bit", argparse.SUPPRESS)  # tests: a bad weight
    metrics: str = setting("", "--metrics", "[HOST:]PORT for GET /metrics (Prometheus; "
                           "default: any free port on the data port's host, told to the "
                           "coordinator's /v1/metrics/targets; 'off': none)")  # fmt: skip
    dram_budget_bytes: int | None = setting(
        None, "--dram-budget", "tier the shard's MoE experts: this much DRAM, the rest read "
        "from the file", size=True)
    cache_dir: str | None = setting(None, "--cache-dir", "where fetched shards are kept")
    draft: str | None = setting(
        None, "--draft", "a draft model for speculative decoding (a local GGUF of the "
        "model's tokenizer): when this worker runs the ring's first stage it drafts with it, "
        "within --memory")
    tls_dir: str | None = None  # mutual TLS to the coordinator and on the data plane (tls.py)
    # Serve the data port beyond loopback without a cluster token: anyone who reaches it
    # can drive the stage (stage 0: bypass the queue). Refused unless asked for by name.
    insecure: bool = setting(False, "--insecure", "without --token-file, listen beyond "
                             "loopback anyway (anyone who can reach the data port can drive "
                             "this node's stage)")  # fmt: skip
    fail_token: int | None = setting(None, "--fail-token", argparse.SUPPRESS)  # tests
    stall_step_s: float = setting(0.0, "--stall-step", argparse.SUPPRESS)  # tests: one long step
    keep_awake: bool = setting(
        True, "--keep-awake", "while steps arrive, keep this machine's idle CPUs out of deep "
        "sleep (PM QoS, /dev/cpu_dma_latency; needs root): a stage that waits for its "
        "neighbours wakes at once and computes on warm caches; let go 2 s after the last step "
        "(default on; off to save power between tokens)")

    def __post_init__(self) -> None:
        if not self.node_id:
            object.__setattr__(self, "node_id", f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
        if self.cache_type is not None:
            check_cache_type(self.cache_type)
        if self.draft is not None and not os.path.isfile(self.draft):
            raise RequestError(f"--draft {self.draft}: no such file; give a local GGUF of the "
                               "model's tokenizer")  # fmt: skip


def parse_count(text: str, flag: str, example: str) -> int:
    """A flag's whole number >= 1 (tokens, sequences), or RequestError naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise RequestError(f"{flag} {text!r} is not a whole number: give one of at least 1, "
                           f"e.g. {flag} {example}") from None  # fmt: skip
    return check_count(value, flag, example)


def check_count(value: int, flag: str, example: str) -> int:
    if value < 1:
        raise RequestError(f"{flag} {value} must be at least 1, e.g. {flag} {example}")
    return value


def _flagged(cls: type) -> list[Field[object]]:
    return [f for f in fields(cls) if "flag" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per flagged field of `cls`, typed and defaulted from the field."""
    for f in _flagged(cls):
        meta = f.metadata
        flag, help_text = meta["flag"], meta["help"]
        if f.type == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help_text)  # fmt: skip
            continue
        kind = meta["parse"] or (parse_bytes if meta["size"] else
                                 _PARSERS[str(f.type).removesuffix(" | None")])  # fmt: skip
        default = None if f.default is MISSING else f.default
        if default not in (None, "") and help_text != argparse.SUPPRESS:
            help_text += f" (default {default})"
        parser.add_argument(flag, dest=f.name, type=kind, default=default,
                            required=meta["required"], help=help_text,
                            metavar=flag.removeprefix("--").upper().replace("-", "_"))  # fmt: skip


def from_args(cls: type[T], args: argparse.Namespace, **rest: object) -> T:
    """`cls` from the options add_flags made; the fields given as `rest` win."""
    return cls(**{**{f.name: getattr(args, f.name) for f in _flagged(cls)}, **rest})


def to_flags(config: object) -> list[str]:
    """The options that give `config`'s flagged fields to another process's add_flags
    (a None field is left to its default, which is None)."""
    out: list[str] = []
    for f in _flagged(type(config)):
        value = getattr(config, f.name)
        if f.type == "bool" and value == f.default:
            continue  # the other process's default is the same field's
        if f.type == "bool":
            out.append(f.metadata["flag"] if value else "--no-" + f.metadata["flag"][2:])
        elif value is not None:
            out += [f.metadata["flag"], str(value)]
    return out
