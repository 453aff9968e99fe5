"""The messages between a node and the coordinator, as frozen, typed values (msgspec Structs).

Both ends import this module: the worker builds a value and sends `encode(value)` (JSON-ready
builtins, defaults left out so a beat stays small); the coordinator's routes turn what
arrived into the value with `decode(Type, data)` before any handler reads it, so a handler
reads attributes of known types and never `.get` of a raw dict. A field a message does not
have, or a value of the wrong type, is refused at the door in one line naming the field (a
RequestError: HTTP 400). Bounds on numbers (no port of 70,000, no byte count of 1e30) are
checked before, by transport/wire.py.

Why msgspec and not pydantic (the client edge's): at a 100,000-node swarm's one heartbeat
interval, encoding and decoding every beat costs msgspec a fraction of pydantic's time
(`python -m bench.protocol`; the figures are in docs/design.md). A change of shape or meaning
here bumps PROTOCOL (protocol/__init__.py): a node of another version is refused at its join.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal, TypeVar

import msgspec

from cellswarm.errors import RequestError
from cellswarm.swarm.protocol.dataplane import PartAddress, Sampling, Speculative, TokenDetail


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
              omit_defaults=True, gc=False):  # fmt: skip
    """Every message: immutable, keyword-built, strict about its fields; untracked by the
    garbage collector (a message holds no cycle), which halves a beat's decode at 100,000."""


class StepHistogram(Message, frozen=True):
    """A stage's step times as Prometheus buckets (ring/step_times.py): upper bounds (s),
    the count in each (one more than the bounds: +Inf), and the sum."""

    le: list[float]
    counts: list[int]
    sum_s: float


class NodeStats(Message, frozen=True):
    """What a node's stage counted since it started, and the worker's own readings; every
    field optional (a node without a shard has none of the stage's)."""

    layers: list[int] | None = None
    memory_bytes: int | None = None
    peak_rss_bytes: int | None = None
    steps: int | None = None
    busy_s: float | None = None
    sequences: int | None = None
    decode_steps: int | None = None
    decode_s: float | None = None
    hop_s: dict[str, float] | None = None  # read, dispatch, compute, encode, send
    step_s: StepHistogram | None = None
    running_s: float | None = None
    batches: int | None = None
    widest_batch: int | None = None
    rows_unsent: int | None = None
    rows_resent: int | None = None
    prefix_hits: int | None = None  # the prefix cache (engine/prefix_cache.py)
    prefix_misses: int | None = None
    prefix_evictions: int | None = None
    prefix_bytes: int | None = None
    prefix_blocks: int | None = None
    energy_j: float | None = None  # the worker's: energy so far, temperature, shard fetch
    temp_c: float | None = None
    fetch_done_bytes: int | None = None
    fetch_total_bytes: int | None = None
    drafted_tokens: int | None = None  # speculative decoding at stage 0: drafts verified,
    accepted_tokens: int | None = None  # and kept; rounds sent behind others (pipelined),
    rounds_pipelined: int | None = None
    rounds_void: int | None = None  # and, at the last stage, rounds dropped as void
    tokens_stray: int | None = None  # stage 0: answers dropped, their step no longer its text's


class CheckAsk(Message, frozen=True):
    """A doctor round asked of a node in a heartbeat's answer (control/checkup.py)."""

    round: str
    seed: int


class HostFacts(Message, frozen=True, omit_defaults=False):
    """The facts of a node's host that make nodes differ (ring/checks.py: environment):
    versions, CPU, free memory and disk, OOM kills; its worker adds its RSS. Sent whole,
    every key (null where unreadable)."""

    cellswarm: str = ""
    python: str = ""
    numpy: str = ""
    kernels: str = ""  # "c" or "numpy"
    kernel_build: str = ""
    machine: str = ""
    os: str = ""
    cpu_flags: list[str] = msgspec.field(default_factory=list)
    memory_available_bytes: int | None = None
    disk_free_bytes: dict[str, int] = msgspec.field(default_factory=dict)  # folder -> free
    oom_kills_cgroup: int = 0  # in its own memory cgroup
    cgroup_limit_bytes: int | None = None
    oom_kills: int = 0  # anyone's on its host, as the kernel log says
    pid: int = 0
    rss_bytes: int | None = None


class ForwardDigest(Message, frozen=True):
    """One forward step's output (1, n) as its bits' sha256 (16 hex digits), its norm and
    its projections onto fixed +-1 vectors (ring/checks.py: digest)."""

    n: int
    bits: str
    norm: float
    proj: list[float]


class CheckResult(Message, frozen=True):
    """A node's answer to a round, in its next beat (ring/checks.py runs it): the facts of
    its host, its matmul and forward step on the round's input, or the error it hit; its
    echo to the coordinator and the layers it holds."""

    round: str | None = None
    env: HostFacts = HostFacts()
    matmul: list[float] | None = None
    forward: ForwardDigest | None = None  # a digest of one step (checks.forward_digest)
    error: str | None = None
    echo_s: float | None = None
    layers: list[int] | None = None


class Heartbeat(Message, frozen=True):
    """A node's beat: alive, what it holds and serves, where its peers reach it, its clock,
    and the answers to what the last beat's answer asked (a probe, a doctor round)."""

    node_id: str
    session: str = ""  # over HTTP; a sealed NATS beat is proved by its seal instead
    seq: int | None = None  # a sealed NATS beat's number (replays are refused)
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    data_port: int | None = None
    data_host: str | None = None  # advertised; else the address the beat came from
    ready: str | None = None  # the shard_id it serves, once loaded
    sent_s: float | None = None  # its clock when sent (the answer's now_s sets its offset)
    clock_offset_s: float | None = None  # its estimate of coordinator - node
    clock_error_s: float | None = None
    refused: str | None = None  # why it could not hold the shard it was given
    max_sequences: int | None = None  # what its KV cache was sized for
    stats: NodeStats | None = None
    metrics_port: int | None = None
    probe_ok: bool | None = None  # an offline node's probe, when it ran one
    probe_error: str | None = None
    check: CheckResult | None = None  # a doctor round's result (ring/checks.py)


class PartHolding(Message, frozen=True):
    """What a part server holds (ring/parts.py's PartSpec, less where it listens): routed
    experts by layer (keys: the layer, in decimal, as dataplane.PartAddress has them), or
    vocabulary rows [a, b)."""

    experts: dict[str, list[int]] = msgspec.field(default_factory=dict)
    vocab_rows: tuple[int, int] | None = None

    def at(self, node_id: str, host: str, port: int) -> PartAddress:
        """This holding at an address: what a stage is told of its part server."""
        return PartAddress(node_id=node_id, host=host, port=port, experts=self.experts,
                           vocab_rows=self.vocab_rows)  # fmt: skip


class Shard(Message, frozen=True):
    """One slot of a layout (control/membership.py): a stage of a replica's pipeline (its
    layer range, whether it is the ring's first or last), or a part server (`spec`: routed
    experts of some layers, or vocabulary rows)."""

    slot: int
    n: int  # slots in the layout
    role: Literal["stage", "part"]
    replica: int = 0
    stage: int | None = None
    layers: tuple[int, int] | None = None  # [lo, hi) of the model's blocks
    first: bool = False
    last: bool = False
    spec: PartHolding | None = None  # a part server's

    @property
    def content_id(self) -> str:
        """What identifies what it holds (not which ring): a worker reports it once loaded."""
        return json.dumps({"slot": self.slot, "role": self.role, "first": self.first,
                           "last": self.last, "spec": msgspec.to_builtins(self.spec),
                           "layers": list(self.layers) if self.layers else None},
                          sort_keys=True)  # fmt: skip


class Assignment(Message, frozen=True):
    """What a node is told to hold: its shard, and what running it needs to know."""

    shard: Shard
    model: str
    context: int
    max_sequences: int
    cache_type: str  # what its KV cache stores values as (the coordinator's --cache-type)
    # a stage's part servers: what each holds (their addresses come with the wiring's reset)
    parts: list[PartAddress] = msgspec.field(default_factory=list)


class HeartbeatAnswer(Message, frozen=True, omit_defaults=False):
    """The coordinator's answer to a beat: the shard the node should hold (None: none, a
    spare), the wiring's epoch and whether the whole layout is wired in it, whether to run a
    probe or a doctor round, the lease, its clock and how often to beat, and why nothing can
    be placed when nothing can. `held`: heard while its core was busy, nothing new (only
    `now_s` and `heartbeat_s` are said). Every field is sent, defaults too."""

    held: bool = False
    shard: Assignment | None = None
    epoch: int = -1
    wired: bool = False
    probe: bool = False
    check: CheckAsk | None = None  # a doctor round's ask (control/checkup.py)
    lease_s: float | None = None
    now_s: float | None = None
    heartbeat_s: float | None = None
    problem: str = ""


# -- a pipeline head and the job queue (api/server.py's head routes, node/head.py) -------------


class JobRef(Message, frozen=True):
    """A job under the fence of one lease of it (every holder's call names both)."""

    job_id: str
    fence: int


class RunState(Message, frozen=True):
    """A held job's tokens so far; `frontier`: its ring is about to run a step it never
    completed (from then on a failure there may be the job's doing: jobs.strike_replica)."""

    job_id: str
    fence: int
    tokens: list[int]
    frontier: bool = False


class JobOutput(Message, frozen=True):
    """What a run of a job made, as the queue keeps it for the client (api/server.py,
    openai_api.py read it): a generation's tokens, their reason to stop and the last
    logits' digest; a scoring job's log-likelihood of each completion, and with `top` each
    token's detail (one list per completion). Only what was set travels."""

    tokens: list[int] | None = None
    reason: str | None = None  # stop_token, max_tokens; "scored"
    bits: str | None = None
    scores: list[float] | None = None
    detail: list[list[TokenDetail]] | None = None
    drafted: int | None = None  # speculative decoding: drafts verified, and kept
    accepted: int | None = None


class JobResult(Message, frozen=True):
    """What a run of a job made, under the fence of the lease it ran by."""

    job_id: str
    fence: int
    result: JobOutput


class LeaseAsk(Message, frozen=True):
    n: int = 1  # free sequences of the ring
    wait_s: float = 0.0  # a long poll: answer at once with jobs, or after this with none


class JobWork(Message, frozen=True):
    """What a head runs of a job: its prompt and, for a generation (kind "generate"), its
    length, sampling and stop ids; for a scoring job (kind "score"), the completions to
    score and how many alternatives to tell of each token. The queue keeps the client's
    whole payload (its id, extra fields, whether to answer with text); a lease carries only
    this. Which fields a kind needs is the head's check (node/head.py), per job."""

    prompt: list[int]
    max_tokens: int | None = None
    sampling: Sampling | None = None
    stop_ids: list[int] = msgspec.field(default_factory=list)
    completions: list[list[int]] | None = None
    top: int | None = None
    speculative: Speculative = "auto"

    @classmethod
    def of(cls, payload: Mapping[str, object]) -> JobWork:
        """The work in a stored payload (its other fields stay with the queue), or a
        RequestError naming the field at fault."""
        return decode(cls, {k: payload[k] for k in cls.__struct_fields__ if k in payload})


class JobLease(Message, frozen=True):
    """A leased job: the work, its fence, and the tokens to resume from."""

    job_id: str
    kind: str
    payload: JobWork
    fence: int
    tokens: list[int] = msgspec.field(default_factory=list)
    attempt: int = 1


class LeaseAnswer(Message, frozen=True):
    jobs: list[JobLease] = msgspec.field(default_factory=list)
    ring_sequences: int | None = None  # what the ring holds at once (the fewest KV slots)


class _Leased(msgspec.Struct, frozen=True):
    """What any leased job has, whatever else is wrong with it: whose it is."""

    job_id: str
    fence: int


def decode_leases(data: object) -> tuple[LeaseAnswer, list[tuple[JobRef, str]]]:
    """A lease answer, job by job: one job whose work does not decode (a field of the
    wrong type, an unknown one) is given back as its ref and why, to fail alone, while
    the others run. A RequestError only when the answer itself is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("jobs", []), list):
        raise RequestError("a lease answer is an object with a list of jobs")
    jobs: list[object] = data.get("jobs", [])
    good: list[JobLease] = []
    bad: list[tuple[JobRef, str]] = []
    for raw in jobs:
        try:
            good.append(decode(JobLease, raw))
        except RequestError as exc:
            try:  # no job id or fence: the whole answer is at fault
                who = msgspec.convert(raw, _Leased)
            except msgspec.ValidationError as whose:
                raise RequestError(f"a leased job: {whose}") from None
            bad.append((JobRef(job_id=who.job_id, fence=who.fence), str(exc)))
    rest = decode(LeaseAnswer, {**data, "jobs": []})
    return msgspec.structs.replace(rest, jobs=good), bad


class Report(Message, frozen=True):
    """A head's one post: results (committed first), then the checkpoints due."""

    runs: list[RunState] = msgspec.field(default_factory=list)
    results: list[JobResult] = msgspec.field(default_factory=list)


class FailReport(Message, frozen=True):
    job_id: str
    fence: int
    reason: str
    fault: str = "job"  # "job": its own data failed a stage; else a node's (no attempt spent)


class ReleaseAsk(Message, frozen=True):
    runs: list[JobRef] = msgspec.field(default_factory=list)


LogValue = str | int | float | bool | None


class LogEvent(Message, frozen=True):
    """One shipped log line (swarm/logs.py writes it flat, one JSON object a line): what
    every line has, typed, and the event's own fields (timings in ms, counts, names)."""

    seq: int  # per run of the node's shipper: a resent line is stored once
    ts: float  # the node's clock (unix seconds)
    event: str
    request_id: str | None = None
    node: str | None = None
    fields: dict[str, LogValue] = msgspec.field(default_factory=dict)

    @classmethod
    def of(cls, line: Mapping[str, object]) -> LogEvent:
        """A flat log line as an event; a field's list or object travels as its JSON text.
        A RequestError when a line lacks an integer seq, a number ts or an event name."""
        head = {k: line[k] for k in ("seq", "ts", "event", "request_id", "node") if k in line}
        fields = {k: v if v is None or isinstance(v, str | int | float | bool)
                  else json.dumps(v, separators=(",", ":"), default=str)
                  for k, v in line.items() if k not in head}  # fmt: skip
        return decode(cls, {**head, "fields": fields})


class LogBatch(Message, frozen=True):
    """A node's shipped events (transport/logship.py), with the process run they came from
    and its clock's offset."""

    run: str
    events: list[LogEvent]
    clock_offset_s: float | None = None
    clock_error_s: float | None = None


class Capabilities(Message, frozen=True):
    """What a node joins with: its budget (what placement packs against), what it measured
    of itself, its rack, and its protocol version — read from the raw join first, so that a
    node of another version hears that, not a complaint about a field it has and we lack."""

    memory_bytes: int = 0
    protocol: int | None = None
    profile: str | None = None  # a planner profile it runs as (planner/profiles)
    rack: str | None = None
    bandwidth_bytes_per_s: int | None = None
    flops: int | None = None
    link_bytes_per_s: int | None = None
    oom_kills: int | None = None  # its memory cgroup's, at start (a supervisor restarted it)
    cgroup_limit_bytes: int | None = None
    max_sequences: int | None = None  # set by the coordinator from its beats
    draft: bool = False  # started with --draft: as a ring's first stage it drafts with it
    # auth.node_binding: the id's first join keeps its hash; a later join under the id must
    # bring the same (stored hashed, so the database gives it to nobody)
    binding: str | None = None


class Fault(Message, frozen=True):
    """A stage's failed step, told at once (the job's attempt is judged by it)."""

    node_id: str
    session: str
    kind: str = "forward"  # forward, next, part, sender (Coordinator.fault)
    detail: str = ""
    epoch: int | None = None  # the wiring's epoch it struck in; a fault of an older one is moot
    job: str | None = None


M = TypeVar("M", bound=Message)


def decode(kind: type[M], data: object) -> M:
    """`data` (parsed JSON) as a `kind`, or a RequestError naming the field."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise RequestError(f"a {kind.__name__.lower()}: {exc}") from None


def decode_body(kind: type[M], data: dict[str, object]) -> M:
    """A node's request body as its message, the proof of who sent it (node_id, session,
    read by the route's authentication) left aside."""
    return decode(kind, {k: v for k, v in data.items() if k not in ("node_id", "session")})


def encode(message: Message) -> dict[str, object]:
    """A message as JSON-ready builtins, fields at their default left out."""
    out: dict[str, object] = msgspec.to_builtins(message)
    return out
