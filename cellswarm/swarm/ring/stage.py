"""A pipeline stage: one process holding a layer range of the model, in a ring of stages.

    client --generate--> stage 0 (embedding, layers 0..a) --hidden--> stage 1 --> ...
    ... --> stage N-1 (layers ..L, head: samples) --token--> stage 0 --token--> client

Stage 0 owns each sequence (its prompt, its tokens, when it stops); the last stage owns
sampling (seeded, so a sequence's tokens do not depend on the layout). Every stage keeps a
KV cache per sequence for its own layers. Many sequences are in flight at once: while stage
k computes one, stage k+1 computes another — that is the pipelining.

Run as `python -m cellswarm.swarm.ring.stage CONFIG_JSON`; prints `READY <port>` when listening.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import TypeVar

import msgspec
import numpy as np

from cellswarm.cache_types import DEFAULT_CACHE_TYPE
from cellswarm.engine.memory import peak_rss_bytes
from cellswarm.engine.model import Model
from cellswarm.engine.prefix_cache import BLOCK_TOKENS, PrefixCache
from cellswarm.engine.sampling import SamplingParams, sample
from cellswarm.engine.scoring import MAX_TOP, log_norms, sum_log_probs, token_detail
from cellswarm.engine.speculative import MAX_DRAFT, DraftModel, Speculator
from cellswarm.engine.speculative import accept as accept_drafts
from cellswarm.errors import BudgetError, CellswarmError, JobError, ProtocolError, RequestError
from cellswarm.io.weights import Selection
from cellswarm.models.base import ExpertArchitecture
from cellswarm.models.deepseek2_config import DeepseekConfig
from cellswarm.models.kv_cache import KVCache
from cellswarm.swarm.auth import COORDINATOR, RESERVED_IDS, load_token, open_key
from cellswarm.swarm.logs import JsonLog
from cellswarm.swarm.protocol.dataplane import (
    Done,
    End,
    ErrorOut,
    Failed,
    First,
    Generate,
    Hidden,
    Need,
    Prefix,
    Reset,
    ResetDone,
    Sampling,
    Score,
    Scored,
    ScoreOut,
    Stats,
    Token,
    TokenDetail,
    TokenOut,
    fields,
    read,
)
from cellswarm.swarm.protocol.messages import NodeStats
from cellswarm.swarm.protocol.messages import encode as encode_message
from cellswarm.swarm.ring.costs import first_step_bytes, prefill_rows
from cellswarm.swarm.ring.emulate import Emulation, precise_loop
from cellswarm.swarm.ring.faults import NO_FAULTS, Faults
from cellswarm.swarm.ring.frames import (
    Frame,
    accept,
    connect,
    decode,
    encode_parts,
    listen_tls,
    no_delay,
    read_frame,
    read_raw,
    write_frame,
)
from cellswarm.swarm.ring.parts import ExpertParts, PartLost, PartSpec, VocabParts
from cellswarm.swarm.ring.rounds import Expect, Round, continues, kept_whole, next_round
from cellswarm.swarm.ring.step import Rows, step
from cellswarm.swarm.ring.step_times import StepTimes
from cellswarm.swarm.tls import client_context, lean_tls_buffers, server_context

log = logging.getLogger("cellswarm.stage")
T = TypeVar("T")


@dataclass(frozen=True)
class StageConfig:
    model: str
    layers: tuple[int, int]
    first: bool
    last: bool
    next_host: str = "127.0.0.1"
    next_port: int = 0  # the next stage; the last stage's next is the first stage (ring)
    listen_port: int = 0
    threads: int | None = None
    memory_bytes: int | None = None  # the budget: the shard must fit, with its KV cache
    # With a budget, KV cache for `context` tokens x `max_sequences` is reserved in it, and
    # requests beyond that are refused; without one, neither is limited.
    context: int = 512
    cache_type: str = DEFAULT_CACHE_TYPE  # what the KV cache stores (cache_types.py)
    max_sequences: int = 8
    log_dir: str | None = None  # JSON lines per event, see swarm/logs.py
    node_id: str = "stage"
    profile: str | None = None  # behave like a node of this planner profile (emulate.py)
    crash_after_steps: int | None = None  # fault injection for tests: die like a SIGKILL
    token_file: str | None = None  # cluster token: every connection must prove it (auth.py)
    peers: tuple[str, ...] = ()  # who may connect: the previous stage and the client
    # Part servers (swarm/ring/parts.py) holding what this stage does not: routed experts of its
    # layers (it keeps the rest of each MoE layer), or the vocabulary rows of the embedding
    # (first stage) and output head (last stage; it keeps the final norm).
    parts: tuple[PartSpec, ...] = ()
    # A big box as one stage: routed experts tiered between this much DRAM and the model
    # file (engine/tiered/) instead of held whole.
    dram_budget_bytes: int | None = None
    tls_dir: str | None = None  # mutual TLS on every data-plane connection (swarm/tls.py)
    # Decode steps of this many ready sequences at most run as one pass over the layers
    # (continuous batching: Stage.run_ready); 1 runs each alone (bench/batch.py's baseline).
    max_batch: int = 32
    # KV of prompt blocks kept for later sequences that start the same way (engine/
    # prefix_cache.py); None: 64 MiB, or with a budget half of what it leaves after the
    # shard, up to that (never more than --memory: prefix_budget); 0: off.
    prefix_cache_bytes: int | None = None
    # The first stage's draft model (a GGUF of the same tokenizer; speculative 'draft', and
    # 'auto' drafts with it): held whole beside the shard, in the same budget, with a cache
    # of its own per sequence (engine/speculative.py DraftModel)
    draft: str | None = None

    def to_json(self) -> str:
        d = asdict(self)
        d["parts"] = [p.to_dict() for p in self.parts]
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> StageConfig:
        raw = json.loads(text)
        raw["layers"] = tuple(raw["layers"])
        raw["peers"] = tuple(raw.get("peers", ()))
        raw["parts"] = tuple(PartSpec.from_dict(p) for p in raw.get("parts", ()))
        return cls(**raw)

    @property
    def vocab_remote(self) -> bool:
        return any(p.vocab_rows is not None for p in self.parts)


Emit = Callable[[Frame], Awaitable[None]]
# (request id) -> awaited before stage 0 runs a step its request never completed before
Frontier = Callable[[str], Awaitable[None]]
# (kind, detail, epoch, request id or None) -> maybe something to await: the report sent
Fault = Callable[[str, str, int, str | None], Awaitable[object] | None]

# What a peer may send a stage, by frame type (protocol/dataplane.py): a frame that does not
# read as its message is the sender's fault (ProtocolError), as is an array of the wrong
# kind: neither may make this node fail a step. Another type is ignored.
Incoming = Generate | Hidden | Prefix | Token | Scored | End | Failed | Stats | Reset
INCOMING: dict[str, type[Incoming]] = {
    m.kind: m for m in (Generate, Hidden, Prefix, Token, Scored, End, Failed, Stats, Reset)
}


def sends(peer: str, message: Incoming) -> bool:
    """Whether the peer at the other end of a link (the name frames.accept proved) sends
    such a frame: the coordinator resets and asks for counters; a local pipeline's client
    also starts requests; any other name is the ring's previous stage, whose frames go
    round the ring. A token holder posing as either is refused at the handshake; this keeps
    a member on the ring from acting as the coordinator."""
    if peer == COORDINATOR:
        return isinstance(message, Reset | Stats)
    if peer == "client":
        return isinstance(message, Generate | Reset | Stats)
    return isinstance(message, Hidden | Prefix | Token | Scored | End | Failed)


# What a stage sends the next one (all of one epoch: `ep`)
Onward = Hidden | Prefix | Token | Scored | End | Failed


# A decode step's time at a stage, in parts: its frame read (decoded and checked), handed on
# to the step (stage 0: the token given to the head, the next step started), the step itself
# (embedding, layers, head and sampler: what one process does too), the frame out encoded
# and written (the CPU time of the write: on loopback it delivers to the next stage, whose
# wakeup may take this process's core at once). What a token's period holds beyond the sum
# of these over the ring is the wire and the waking (bench/hop.py).
HOP_PARTS = ("read", "dispatch", "compute", "encode", "send")
DECODE_LOG_EVERY = 64  # a sequence's decode steps go to the log summed, every this many


@dataclass
class DecodeTally:
    """One sequence's decode steps at this stage, summed: a "decode" log event every
    DECODE_LOG_EVERY steps and when the stage lets the sequence go, not a line per token."""

    steps: int = 0
    logged: int = 0  # steps in the last event
    first_s: float = 0.0  # perf_counter when its first decode step started ...
    last_s: float = 0.0  # ... and its latest
    max_s: float = 0.0  # the longest step (compute)
    parts: list[float] = field(default_factory=lambda: [0.0] * len(HOP_PARTS))

    def event(self) -> dict[str, float]:
        n = self.steps
        out: dict[str, float] = {
            "steps": n, "span_ms": round(1000 * (self.last_s - self.first_s), 3),
            "max_ms": round(1000 * self.max_s, 3),
        }  # fmt: skip
        for name, total in zip(HOP_PARTS, self.parts, strict=True):
            out[f"{name}_us"] = round(1e6 * total / n, 1)
        return out


class NextStageLost(ConnectionError):
    """The next stage in the ring stopped answering: its fault, not ours."""

    def __init__(self, address: str, epoch: int) -> None:
        super().__init__(address)
        self.epoch = epoch


@dataclass
class Ready:
    """A decode step waiting for the stage's next batch: one token's hidden state (1, d) of
    sequence `seq` at position `pos`, when its frame was read and decoded, the embedding's
    time (stage 0)."""

    seq: int
    h: np.ndarray
    pos: int
    frame_s: tuple[float, float] | None
    embed_s: float


@dataclass
class Sequence:
    """Stage 0's view of one request."""

    req: str
    emit: Emit  # where its tokens go: a client connection, or the head in this process
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    # Tokens a resumed request already produced: fed back one decode step at a time, exactly
    # as they were first computed, so the cache and the sampler end up as they were.
    replay: list[int] = field(default_factory=list)
    active_s: float = field(default_factory=time.monotonic)  # its last step came back then
    # The sha256 of the logits its last token was chosen from (16 hex digits): the same bits
    # on every correct node, so --verify compares it with another replica's (jobs.same_result)
    bits: str = ""
    # speculative decoding (engine/speculative.py): its drafting, and its steps in flight,
    # oldest first (rounds.py: pipelined)
    spec: Speculator | None = None
    rounds: list[Round] = field(default_factory=list)


class Stage:
    def __init__(self, config: StageConfig, model: Model) -> None:
        self.config, self.model = config, model
        self.caches: dict[int, KVCache] = {}
        # a sequence's sampling: its parameters, generator, prompt + tokens, prompt's length
        self.samplers: dict[int, tuple[SamplingParams, np.random.Generator, list[int], int]] = {}
        self.sequences: dict[int, Sequence] = {}
        self.logit_bits: dict[int, str] = {}  # the last stage: per sequence, its last logits' sha
        self._next: asyncio.StreamWriter | None = None
        self._next_lock = asyncio.Lock()
        # Emulated link: frames booked on the wire, delivered at their arrival time by a
        # writer task, so the stage computes while they are "in flight" (emulate.py).
        self._wire: asyncio.Queue[tuple[float, Onward, np.ndarray | None]] = asyncio.Queue()
        self._wire_task: asyncio.Task[None] | None = None
        # ... and computes on a thread of its own, one step at a time, so that the loop is
        # free to deliver those frames while a step runs, as a NIC does beside a CPU.
        self._cpu = (
            concurrent.futures.ThreadPoolExecutor(1, "compute") if config.profile else None
        )
        self._seq_ids = 0
        # Decode steps that arrived while a step ran, stepped together next (run_ready)
        self._ready: list[Ready] = []
        self._batcher: asyncio.Task[None] | None = None
        self.batches, self.widest_batch = 0, 0  # passes of more than one sequence (stats)
        room = prefix_budget(model, config)
        self.prefix = PrefixCache(room) if room > 0 else None
        # A first step's rows whose blocks this stage restored go on without them ("cached":
        # the next stage restores them from its own cache), kept here (the blocks' output
        # rows, shared with the cache) in case it asks for them ("need"). And the other way:
        # a first step whose cached rows this stage lacks waits for them ("prefix").
        self._unsent: dict[int, list[np.ndarray]] = {}
        self._awaiting: dict[int, tuple[Hidden, np.ndarray]] = {}
        self._next_caches = True  # the next stage said nothing yet of having no prefix cache
        self._back: asyncio.Task[None] | None = None
        self.rows_unsent = self.rows_resent = 0  # (stats)
        # speculative decoding: drafts verified and kept, rounds pipelined (stage 0); rounds
        # dropped as void (the last stage)
        self.drafted = [0, 0, 0, 0]
        self.tokens_stray = 0  # stage 0: answers to steps its text no longer has (dropped)
        self.expect: dict[int, Expect] = {}  # the last stage: where each sequence goes on
        self._tasks: set[asyncio.Future[None]] = set()  # a ring of one's rounds (spawn)
        self.epoch = 0  # the layout generation; frames from an older one are stale
        self.log = JsonLog(config.log_dir, config.node_id)
        self.token = load_token(config.token_file) if config.token_file else None
        # Who may dial this stage and the key each proves (frames.accept), and the key it
        # proves to the next stage. A local pipeline's links all prove the cluster token; a
        # swarm worker's stage admits the coordinator under this node's own key (trust, at
        # join) and, once wired, only its previous stage under the key the wiring dealt that
        # link (reset): a member holding the token is nobody here.
        self.keys: dict[str, bytes] = {p: self.token for p in config.peers} if self.token else {}
        self.next_key: bytes | None = self.token
        self.node_key: bytes | None = None
        self.tls = client_context(config.tls_dir) if config.tls_dir else None  # to dial peers
        self.emulation = Emulation.for_stage(model, config.profile) if config.profile else None
        self.requests: dict[int, str] = {}  # seq -> request id, for the logs
        self.steps, self.busy_s = 0, 0.0
        self.decode_steps, self.decode_s = 0, 0.0
        self.tallies: dict[int, DecodeTally] = {}  # seq -> its decode steps here, summed
        self.hop_s = [0.0] * len(HOP_PARTS)  # every decode step's parts, summed (stats)
        # The frame that started the step running now: when it was read and when decoded;
        # the embedding's time (stage 0, before the step); the last frame out's encode and
        # write. Set and taken between two awaits that do not suspend (no I/O waits there).
        self._frame_s: tuple[float, float] | None = None
        self._embed_s = 0.0
        self._sent_s = (0.0, 0.0)
        # A worker tells its coordinator: ("forward", why, epoch, request) when this node
        # failed a step of that request, ("next", address, ...) when the next stage stopped
        # answering, ("sender", peer id, ...) when a peer sent a malformed frame. A job's own
        # fault (JobError) is no node's: it goes back to stage 0 as that job's error.
        self.on_fault: Fault | None = None
        self.on_step: Callable[[], None] | None = None  # a step arrived (node/awake.py)
        # Stage 0's head is told (and has told its coordinator) before a sequence runs a step
        # its job never completed: its first, or the first after the tokens it replays. Only
        # such a step can be the one that kills a node (a replayed one made the same bits
        # before), so only then is the job exposed to a crash of its ring (head.py).
        self.on_frontier: Frontier | None = None
        # what a test plants (faults.py); a production stage holds none
        self.faults = Faults(config.crash_after_steps) if config.crash_after_steps else NO_FAULTS
        self.step_since: float | None = None  # when the step running now began (monotonic)
        self.step_times = StepTimes()  # every step's compute time (stats, /metrics)
        self.connections: set[asyncio.StreamWriter] = set()
        self.vocab: VocabParts | None = None
        self.experts = ExpertParts((), self.token, config.node_id)
        self.connect_parts()

    def connect_parts(self) -> None:
        """Clients for the part servers in the config (connected on first use)."""
        c = self.config
        self.experts.close()
        if self.vocab is not None:
            self.vocab.close()
        tls = self.tls
        self.vocab = VocabParts(c.parts, self.token, c.node_id, tls) if c.vocab_remote else None
        self.experts = ExpertParts(c.parts, self.token, c.node_id, tls)
        if self.experts.clients:
            check_expert_cover(self.model, self.experts)
            assert isinstance(self.model.arch, ExpertArchitecture)  # check_expert_cover's
            self.model.arch.remote_experts = self.experts

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """(T,) ids -> (T, d), from the vocab parts when the rows live there."""
        if self.vocab is not None:
            return self.vocab.embed(token_ids)
        return self.model.arch.embed(token_ids)

    def head(self, h: np.ndarray) -> np.ndarray:
        """(T, d) -> (T, vocab): the final norm here, the head's rows on the vocab parts."""
        if self.vocab is None:
            return self.model.arch.head(h)
        from cellswarm.models.ops import lm_head

        c = self.model.config
        return lm_head(self.model.weights, h, c.d_model, c.rms_eps, head=self.vocab)

    # -- connections ---------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        no_delay(writer)
        self.connections.add(writer)
        peer: str | None = None  # who is on the other end, when a token makes them say
        if self.token is not None or self.node_key is not None:
            # the handshake before any body: a peer that has not proved the token gets no
            # more than a header's worth of our memory (frames.accept)
            try:
                peer = await accept(reader, writer, self.keys)
            except (OSError, ProtocolError):  # it hung up (or reset) mid-handshake
                peer = None
            if peer is None:
                self.log.event("denied", None, stage=self.span)
                self.connections.discard(writer)
                writer.close()
                return
        try:
            while True:
                try:
                    raw = await read_raw(reader)
                    if raw is None:
                        break
                    got_s = time.perf_counter()
                    frame = decode(*raw)
                    message = self.check_frame(frame)
                    if message is not None and peer is not None and not sends(peer, message):
                        raise ProtocolError(f"a {frame.type!r} frame from {peer}, whose role on "
                                            "this link does not send it")  # fmt: skip
                except ProtocolError as exc:
                    return await self.bad_frame(peer, exc)
                self._frame_s = (got_s, time.perf_counter())
                if message is not None:
                    await self.handle(message, frame.array, writer, peer)
        except Exception as exc:  # a bug of ours: log it, drop this connection, serve on
            self.unexpected(exc, "connection dropped")
        finally:
            self.connections.discard(writer)
            writer.close()

    def fault(
        self, kind: str, detail: str, epoch: int, req: str | None = None
    ) -> Awaitable[object] | None:
        return None if self.on_fault is None else self.on_fault(kind, detail, epoch, req)

    def unexpected(self, exc: Exception, what: str) -> None:
        """An exception no handler expected (a bug of ours, or the next stage gone while a
        step's result went out): logged, and told as the node's fault or the link's."""
        log.error("stage %s: %s", self.config.layers, what, exc_info=exc)
        if isinstance(exc, NextStageLost):
            self.fault("next", f"{type(exc).__name__}: {exc}", exc.epoch)
        else:
            self.fault("forward", f"{type(exc).__name__}: {exc}", self.epoch)

    def check_frame(self, frame: Frame) -> Incoming | None:
        """The frame as its typed message (None: a type a stage does not take); ProtocolError
        unless it reads as one and carries an array of the right kind: what a peer sends
        wrong is the peer's fault, found before a step."""
        kind = INCOMING.get(frame.type)
        if kind is None:
            return None
        a = frame.array
        if kind is Generate and (a is None or a.dtype != np.int64 or a.ndim != 1):
            raise ProtocolError("a 'generate' frame's prompt must be a 1-D array of i64 ids")
        message = read(kind, frame.fields, frame.type)
        if isinstance(message, Scored) and message.detail is not None and not detail_ok(
            message.detail, len(message.logprobs)
        ):
            raise ProtocolError("a 'scored' frame's detail is not one list of [logprob, greedy, "
                                "top] a token for each completion")  # fmt: skip
        top = message.top if isinstance(message, Generate) else None
        if top is not None and not 0 <= top <= MAX_TOP:
            raise ProtocolError(f"a 'generate' frame's top {str(top)[:20]} is not in 0..{MAX_TOP}")
        d = int(self.model.config.d_model)
        if isinstance(message, Hidden | Prefix) and (
            a is None or a.dtype != np.float32 or a.ndim != 2 or a.shape[1] != d
        ):
            shape = None if a is None else (a.dtype.name, list(a.shape))
            raise ProtocolError(f"a {frame.type!r} frame's array {shape} is not float32 (T, {d})")
        first = message.first if isinstance(message, Hidden) else None
        if first is not None and first.completions and first.score_from is None:
            raise ProtocolError("a 'hidden' frame's first step has completions but no "
                                "score_from")  # fmt: skip
        if isinstance(message, Hidden) and message.cached is not None:
            check_cached(message)
            if len(self._awaiting) >= max(1, self.config.max_sequences):  # bounded memory
                raise ProtocolError("more first steps wait for their rows than the stage "
                                    "holds sequences")  # fmt: skip
        waiting = self._awaiting.get(message.seq) if isinstance(message, Prefix) else None
        if waiting is not None and a is not None and a.shape[0] != waiting[0].cached:
            raise ProtocolError(f"a 'prefix' frame of {a.shape[0]} rows for a step sent without "
                                f"{waiting[0].cached}")  # fmt: skip
        return message

    async def bad_frame(self, peer: str | None, exc: ProtocolError) -> None:
        """A malformed frame is its sender's fault, never ours: the connection goes (its
        stream cannot be framed any more) and a node that sent it is named to the
        coordinator — before we hang up, so the sender's complaint that we went away comes
        second, of an older epoch, and counts for nothing."""
        who = peer or "an unauthenticated peer"
        log.warning("stage %s: malformed frame from %s: %s", self.config.layers, who, exc)
        self.log.event("bad_frame", None, stage=self.span, peer=peer, why=str(exc)[:200])
        if peer is None or peer in ("client", "coordinator"):
            return  # not a node: nobody to charge (and certainly not this node)
        told = self.fault("sender", peer, self.epoch)
        if told is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(told, 5.0)

    def close_connections(self) -> None:
        """Stop serving: every peer connection, and the link to the next stage."""
        for w in [*self.connections, *([self._next] if self._next else [])]:
            w.close()
        self.connections.clear()
        self._next = None

    def forget_sequences(self) -> None:
        """Drop every sequence (a reset, or the stage stops): caches, samplers, and stage
        0's own records, whose emitters lead back to this stage through its head."""
        for seq in list(self.tallies):
            self.log_decode(seq, pop=True)
        self.caches.clear()
        self.samplers.clear()
        self.sequences.clear()
        self.expect.clear()
        self._ready.clear()
        self._unsent.clear()
        self._awaiting.clear()

    async def send_next(self, message: Onward, array: np.ndarray | None = None) -> None:
        if self.emulation is None:
            return await self.write_next(message, array)
        arrives = self.emulation.depart(0 if array is None else array.nbytes)
        self._wire.put_nowait((arrives, message, array))
        if self._wire_task is None or self._wire_task.done():
            self._wire_task = asyncio.get_running_loop().create_task(self._deliver())

    async def _deliver(self) -> None:
        """The emulated link: each frame to the next stage at its arrival time, in order."""
        while True:
            arrives, message, array = await self._wire.get()
            if (wait := arrives - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            try:
                await self.write_next(message, array)
            except NextStageLost as exc:  # what serve() does when a send fails in a step
                log.exception("stage %s: next stage lost", self.config.layers)
                self.fault("next", f"{type(exc).__name__}: {exc}", exc.epoch)

    async def write_next(self, message: Onward, array: np.ndarray | None = None) -> None:
        """Send to the next stage. A frame of an older epoch is dropped (its layout is gone);
        a failure names the address and epoch it was for, so a reset that rewired the ring
        meanwhile never gets a healthy new neighbour blamed."""
        async with self._next_lock:
            if message.ep != self.epoch:
                return
            host, port, epoch = self.config.next_host, self.config.next_port, self.epoch
            try:
                if self._next is None:
                    back, link = await _connect(
                        host, port, self.next_key, self.config.node_id,
                        still=lambda: self.epoch == epoch, tls=self.tls,
                    )  # fmt: skip
                    if self.epoch != epoch:  # a reset came while we connected: stale link
                        link.close()
                        return
                    self._next, self._next_caches = link, True
                    self._back = asyncio.get_running_loop().create_task(self.read_back(back))
                t0 = time.perf_counter()
                head, payload = encode_parts(Frame.of(message, array))
                t1, cpu = time.perf_counter(), time.thread_time()
                self._next.write(head)
                if payload is not None:  # the rows' own buffer: the transport keeps only
                    self._next.write(payload)  # what the socket had no room for
                del payload
                await self._next.drain()
                self._sent_s = (t1 - t0, time.thread_time() - cpu)
            except (OSError, ConnectionError) as exc:
                self._next = None
                if self.epoch != epoch:
                    return  # rewired while we tried: that address is history
                raise NextStageLost(f"{host}:{port}", epoch) from exc

    # -- the protocol ----------------------------------------------------------------------

    async def handle(
        self, message: Incoming, array: np.ndarray | None, writer: asyncio.StreamWriter,
        peer: str | None = None,
    ) -> None:  # fmt: skip
        if isinstance(message, Hidden | Token | End | Scored | Failed | Prefix) and (
            message.ep != self.epoch
        ):
            return  # sent before the last reset, by or for a layout that no longer exists
        if isinstance(message, Generate):
            assert array is not None  # (check_frame)
            await self.start(message, array, lambda out: write_frame(writer, out))
        elif isinstance(message, Hidden):
            assert array is not None  # (check_frame)
            await self.on_hidden(message, array, writer)
        elif isinstance(message, Prefix):
            await self.on_prefix(message, array)
        elif isinstance(message, Token):
            await self.on_token(message.seq, [(message.token, message.bits), *message.more],
                                message.at, message.follows)  # fmt: skip
        elif isinstance(message, Scored):
            await self.on_scored(message.seq, Score(logprobs=message.logprobs,
                                                    detail=message.detail))  # fmt: skip
        elif isinstance(message, End):
            self.release(message.seq)
        elif isinstance(message, Failed):  # a later stage found the job's data at fault
            await self.fail_request(message.seq, message.message)
        elif isinstance(message, Stats):
            await write_frame(writer, Frame(Stats.kind, encode_message(self.stats())))
        elif isinstance(message, Reset):  # the layout changed under us: forget every sequence
            await self.reset(message, writer, peer)

    def trust(self, node_key: bytes) -> None:
        """The key this node shares with the coordinator (swarm/auth.py node_key), set at
        each join: the coordinator proves it, and seals this node's link keys with it."""
        self.node_key = node_key
        self.keys = {**self.keys, COORDINATOR: node_key}

    def opened(self, r: Reset) -> tuple[dict[str, bytes], bytes | None, list[PartSpec]]:
        """A coordinator's reset's keys, opened with this node's key: who may dial this
        stage then (the coordinator, and the previous stage only), the key to prove to the
        next stage, and the part servers with the key to prove to each. ProtocolError for a
        reset whose keys are missing or do not open."""
        nk, ep = self.node_key, r.epoch
        if nk is None or r.prev is None or r.prev_key is None or r.next_key is None:
            raise ProtocolError("a coordinator's 'reset' without its links' keys (or before "
                                "this node joined)")  # fmt: skip
        if r.prev in RESERVED_IDS or any(p.key is None for p in r.parts or ()):
            raise ProtocolError(f"a 'reset' naming {r.prev[:60]!r} as the previous stage, or "
                                "a part server without a key")  # fmt: skip
        try:
            keys = {COORDINATOR: nk, r.prev: open_key(nk, f"{ep}|prev", r.prev_key)}
            parts = [PartSpec.from_wire(p, open_key(nk, f"{ep}|{p.node_id}", str(p.key)))
                     for p in r.parts or ()]  # fmt: skip
            return keys, open_key(nk, f"{ep}|next", r.next_key), parts
        except RequestError as exc:
            raise ProtocolError(str(exc)) from None

    async def reset(self, r: Reset, writer: asyncio.StreamWriter, peer: str | None = None) -> None:
        """A new layout epoch: forget every sequence; a coordinator also sends the ring's new
        wiring (the next stage's address and link, who may connect; sealed keys only it can
        have made, opened here with this node's own key) with it."""
        epoch = r.epoch
        wired = peer == COORDINATOR
        if wired:
            keys, next_key, parts = self.opened(r)
            if r.next_port is None or r.next_host is None:
                raise ProtocolError("a coordinator's 'reset' names no next stage")
            self.keys, self.next_key = keys, next_key
        for req in {*self.requests.values(), *(s.req for s in self.sequences.values())}:
            self.log.event("reset", req, stage=self.span, epoch=epoch)
        if r.next_port is not None:
            if r.next_host is None:
                raise ProtocolError("a 'reset' frame with a next_port names no next_host")
            self.config = replace(
                self.config, next_host=r.next_host, next_port=r.next_port,
                peers=tuple(self.config.peers if r.peers is None else r.peers),
            )  # fmt: skip
            if not wired and r.peers is not None and self.token is not None:
                self.keys = {name: self.token for name in r.peers}
        if wired or r.parts:  # the part servers' addresses (and links) in this layout
            if not wired:
                parts = [PartSpec.from_wire(p) for p in r.parts or ()]
            self.config = replace(self.config, parts=tuple(parts))
            self.connect_parts()
        self.epoch = epoch
        self.forget_sequences()
        while not self._wire.empty():  # frames of the old epoch still "on the wire"
            self._wire.get_nowait()
        # reconnect: the next stage may be a new process. Not under the send lock: a send
        # still connecting to the old neighbour (alive but busy, no challenge yet) holds it
        # and gives up on its own once it sees the new epoch; what it then holds it drops.
        if self._next is not None:
            self._next.close()
        self._next = None
        self.experts.close()  # and so may a part server
        if self.vocab is not None:
            self.vocab.close()
        await write_frame(writer, Frame.of(ResetDone()))

    def stats(self) -> NodeStats:
        c = self.config
        stats = NodeStats(
            layers=list(c.layers), memory_bytes=c.memory_bytes,
            peak_rss_bytes=peak_rss_bytes(), steps=self.steps,
            busy_s=round(self.busy_s, 4), sequences=len(self.caches),
            decode_steps=self.decode_steps, decode_s=round(self.decode_s, 4),
            hop_s={k: round(v, 6) for k, v in zip(HOP_PARTS, self.hop_s, strict=True)},
            step_s=self.step_times.histogram(), running_s=round(self.running_s(), 2),
            batches=self.batches, widest_batch=self.widest_batch,
            rows_unsent=self.rows_unsent, rows_resent=self.rows_resent,
            drafted_tokens=self.drafted[0], accepted_tokens=self.drafted[1],
            rounds_pipelined=self.drafted[2], rounds_void=self.drafted[3],
            tokens_stray=self.tokens_stray,
        )  # fmt: skip
        if self.prefix is None:
            return stats
        return msgspec.structs.replace(stats, **self.prefix.stats())

    async def on_generate(self, frame: Frame, emit: Emit) -> None:
        """A `generate` frame from a client in this process (the head): its request starts."""
        assert frame.array is not None
        await self.start(read(Generate, frame.fields, frame.type), frame.array, emit)

    async def start(self, f: Generate, prompt: np.ndarray, emit: Emit) -> None:
        """A request's first step (stage 0): its sequence made, its prompt embedded."""
        c, vocab = self.config, int(self.model.config.vocab_size)
        bad = None
        if len(prompt) == 0 or int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            bad = "the prompt has " + ("an empty prompt" if len(prompt) == 0
                                       else f"token ids outside 0..{vocab - 1}")  # fmt: skip
        lengths = list(f.completions or ())
        # scoring in one pass: the prompt, then each completion after it (Stage.layers_first)
        if lengths and (min(lengths) < 1 or f.score_from is None
                        or f.score_from + sum(lengths) != len(prompt)
                        or f.score_from < 1):  # fmt: skip
            bad = f"completions {lengths} do not follow a prompt in {len(prompt)} ids"
        if f.speculative == "draft" and not lengths and self.model.draft is None:
            bad = ("speculative 'draft': this ring's first stage has no draft model (start "
                   "its worker with --draft MODEL.gguf): use auto or lookup")  # fmt: skip
        if bad is not None:
            await emit(Frame.of(ErrorOut(req=f.req, message=bad, fault="job")))
            return
        need = (f.score_from + max(lengths) + 1 if lengths and f.score_from is not None
                else len(prompt) + f.max_tokens)  # fmt: skip
        # KV for `context` x `max_sequences` tokens is what the budget was checked for: a
        # request longer than the context is the job's fault; a full stage is nobody's (the
        # head keeps the sequence waiting: "room")
        if c.memory_bytes is not None and need > c.context:
            why = f"request needs {need} tokens of context but the stage reserves {c.context}"
            await emit(Frame.of(ErrorOut(req=f.req, message=why, fault="job")))
            return
        if c.memory_bytes is not None and len(self.sequences) >= c.max_sequences:
            why = f"{len(self.sequences)} of {c.max_sequences} sequences in flight"
            await emit(Frame.of(ErrorOut(req=f.req, message=why, fault="room")))
            return
        self._seq_ids += 1
        seq = self._seq_ids
        self.sequences[seq] = Sequence(
            f.req, emit, [int(t) for t in prompt], f.max_tokens, frozenset(f.stop_ids),
            replay=list(f.replay),
            spec=None if lengths else Speculator.of(f.speculative, [int(t) for t in prompt],
                                                    self.drafter(f.speculative, need)),
        )  # fmt: skip
        rows = scoring_rows(f.score_from, lengths) if lengths and f.score_from is not None \
            else slice(None)  # fmt: skip
        h = self.embed(np.asarray(prompt, dtype=np.int64)[rows])
        tokens = self.sequences[seq].prompt
        first = First(capacity=need, sampling=f.sampling, prompt=tokens, req=f.req,
                      score_from=f.score_from, completions=lengths, top=f.top)  # fmt: skip
        self.log.event("generate", f.req, stage=self.span, prompt_tokens=len(tokens),
                       replay=len(self.sequences[seq].replay))  # fmt: skip
        if not self.sequences[seq].replay and not await self.at_frontier(seq):
            return
        await self.run_layers(seq, h, 0, first)

    def drafter(self, mode: str, capacity: int) -> DraftModel | None:
        """A sequence's own draft model cache, when this stage has a draft model and the
        mode drafts with one ('draft', 'auto')."""
        if self.model.draft is None or mode not in ("draft", "auto"):
            return None
        return DraftModel(self.model.draft, capacity)

    async def at_frontier(self, seq: int) -> bool:
        """Tell the head (on_frontier) that `seq` is about to run a step its job never
        completed; False if the sequence was let go meanwhile (a reset, a cancel)."""
        s = self.sequences.get(seq)
        if s is not None and self.on_frontier is not None:
            await self.on_frontier(s.req)
        return s is not None and self.sequences.get(seq) is s

    async def on_hidden(self, f: Hidden, h: np.ndarray, writer: asyncio.StreamWriter) -> None:
        if h.shape[0] == 1 and f.first is None and f.token is None:  # a decode step: batched
            return self.queue_step(f.seq, h, f.pos)
        cached = f.cached or 0
        if cached and not (self.prefix and f.first is not None
                           and self.prefix.outputs(f.first.prompt, cached)):  # fmt: skip
            # sent without rows this stage does not hold (evicted, or no cache here): the
            # step waits for them, asked of the sender on its own link
            self._awaiting[f.seq] = (f, h)
            need = Need(seq=f.seq, ep=self.epoch, cache=self.prefix is not None)
            return await write_frame(writer, Frame.of(need))
        await self.run_layers(f.seq, h, f.pos, f.first, cached, f.drafts, f.token)

    async def on_prefix(self, f: Prefix, rows: np.ndarray | None) -> None:
        """The rows a first step was sent without, which this stage asked for: the step runs."""
        waiting = self._awaiting.pop(f.seq, None)
        if waiting is None or rows is None:
            return  # let go meanwhile (an end, a reset)
        hidden, h = waiting
        await self.run_layers(hidden.seq, np.concatenate([rows, h]), hidden.pos, hidden.first)

    async def read_back(self, reader: asyncio.StreamReader) -> None:
        """What the next stage says on our link to it: only "need" (a first step's rows that
        were not sent), at most once a sequence; anything else ends the reading."""
        while True:
            try:
                frame = await read_frame(reader, 0)  # a "need" carries no array
            except (OSError, ProtocolError):
                return
            if frame is None or frame.type != Need.kind:
                return
            try:
                need = read(Need, frame.fields, frame.type)
            except ProtocolError:
                return
            if need.ep != self.epoch:
                continue
            if not need.cache:  # it keeps no prefix: send it all from now
                self._next_caches = False
            rows = self._unsent.pop(need.seq, None)
            if rows is not None:
                self.rows_resent += sum(r.shape[0] for r in rows)
                await self.send_next(Prefix(seq=need.seq, ep=self.epoch), np.concatenate(rows))

    # -- continuous batching -----------------------------------------------------------------
    # A decode step does not run when its frame arrives: it joins the stage's ready steps,
    # and one task steps all that are ready as one pass over the layers (Model.forward_many:
    # each weight read once for the batch, each sequence's bits those of a step alone). Steps
    # that arrive while a batch runs form the next: a sequence joins or leaves at any step.

    def queue_step(self, seq: int, h: np.ndarray, pos: int) -> None:
        frame_s, self._frame_s = self._frame_s, None
        embed_s, self._embed_s = self._embed_s, 0.0
        self._ready.append(Ready(seq, h, pos, frame_s, embed_s))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.get_running_loop().create_task(self.run_ready())

    async def run_ready(self) -> None:
        """Step the ready sequences, max_batch at a time, until none is ready."""
        while self._ready:
            await asyncio.sleep(0)  # frames that came with this one join its batch
            n = max(1, self.config.max_batch)
            batch, self._ready = self._ready[:n], self._ready[n:]
            try:
                await self.run_batch(batch)
            except Exception as exc:  # as serve() does with a frame's: the loop serves on
                self.unexpected(exc, "decode steps dropped")

    async def run_batch(self, batch: list[Ready]) -> None:
        """One decode step of each sequence of `batch` still held, as one pass over the
        layers (and the head, at the last stage). Anything wrong in a shared pass runs each
        sequence alone instead, where a fault is told apart from a job's and attributed: the
        shared pass has no side effect that a step alone does not redo (its cache entries
        are rewritten; sampling comes after it)."""
        batch = [r for r in batch if r.seq in self.caches]  # not let go meanwhile
        if not batch:
            return
        t0 = self.step_starts()
        try:
            self.faults.before_step(self.steps)
            rows = [Rows(r.h, self.caches[r.seq], r.pos) for r in batch]
            head = self.head if self.config.last else None
            done = await step(self.model, rows, self.compute, head)
        except Exception as exc:
            if len(batch) == 1:
                return await self.step_failed(batch[0].seq, exc)
            log.info("stage %s: a batch of %d failed; each alone", self.config.layers,
                     len(batch), exc_info=True)  # fmt: skip
            for r in batch:
                await self.run_batch([r])
            return
        assert done is not None  # (only a prompt's chunks wait, and see a sequence go)
        h, logits = done
        outs: list[int | Exception | None] = [None] * len(batch)
        if logits is not None:  # the sampler is part of the step; its failure, its sequence's
            for i, r in enumerate(batch):
                try:
                    outs[i] = self.pick(r.seq, logits[i], None)
                except Exception as exc:
                    outs[i] = exc
        t1 = await self.step_done(t0, len(batch), steps=len(batch), decode=True)
        for i, (r, out) in enumerate(zip(batch, outs, strict=True)):
            if isinstance(out, Exception):
                await self.step_failed(r.seq, out)
            else:
                await self.decode_out(r, h[i : i + 1], out, t0, t1)

    async def run_layers(
        self, seq: int, h: np.ndarray, pos: int, first: First | None, cached: int = 0,
        drafts: list[int] | None = None, token: int | None = None,
    ) -> None:  # fmt: skip
        """A step of `seq` other than a decode step: h (T, d) at positions pos.. (a first
        step's: after `cached` rows it was sent without, which this stage holds in its
        prefix cache; a speculative step's: the last token and its `drafts`), logged as it
        is. The rows of drafts the last stage refuses need no undoing here: the next step
        starts at the position after the last one kept, and writes over them. The last
        stage drops a round sent behind one whose drafts it did not all keep (rounds.py)."""
        if first is not None:
            self.caches[seq] = self.model.new_cache(first.capacity)
            self.requests[seq] = first.req
        cache = self.caches.get(seq)
        if cache is None:  # dropped by a reset while this frame was on the wire
            return
        expect = self.expect.get(seq) if token is not None and self.config.last else None
        if expect is not None and not expect.takes(pos, token):
            self.drafted[3] += 1
            return  # void: built on drafts the round before it did not keep
        self._frame_s, self._embed_s = None, 0.0  # a decode step's (queue_step), not this one's
        scoring = first is not None and first.score_from is not None
        one_row = h.shape[0] == 1  # (a one-token prompt's counts as a decode step)
        t0 = self.step_starts()
        try:
            self.faults.before_step(self.steps, first.prompt if first else None)
            rows = 1 + len(drafts or ())  # the last stage's logits: of these last rows
            done = await self.layers_first(seq, h, pos, cache, first, cached, rows)
            if done is None:  # dropped by a reset between two chunks
                return
            h, made, kept = done  # the last stage's: logits to sample, or a score
            out = self.verify(seq, made, drafts) if drafts and isinstance(made, np.ndarray) \
                else self.pick(seq, made[-1], first) if isinstance(made, np.ndarray) \
                else made  # fmt: skip
        except Exception as exc:
            return await self.step_failed(seq, exc)
        t1 = await self.step_done(t0, h.shape[0], decode=one_row)
        if token is None:  # a speculative round is a decode step's kind: counted, not logged
            self.log.event("step", self.requests.get(seq), stage=self.span, pos=pos,
                           tokens=h.shape[0], ms=round(1000 * (t1 - t0), 3))  # fmt: skip
        await self.step_out(seq, h, pos, first, scoring, out, kept, drafts, token)

    def step_starts(self) -> float:
        """A step begins (node/awake.py hears of it): when."""
        if self.on_step is not None:
            self.on_step()
        return time.perf_counter()

    async def step_done(self, t0: float, rows: int, steps: int = 1, decode: bool = False) -> float:
        """A step (a batch: `steps` of them) that started at t0 has computed its `rows`: padded
        to the emulated node's time, counted (decode: as decode steps); when it ended. The
        last stage's step includes the head and the sampler: the emulated step time counts
        the head's bytes, so its real time belongs inside the padded window."""
        if self.emulation is not None:
            await self.emulation.pad(t0, rows)
        t1 = time.perf_counter()
        self.steps += steps
        self.busy_s += t1 - t0
        self.step_times.observe(t1 - t0)
        if decode:
            self.decode_s, self.decode_steps = self.decode_s + t1 - t0, self.decode_steps + steps
        if steps > 1:
            self.batches, self.widest_batch = self.batches + 1, max(self.widest_batch, steps)
        return t1

    async def decode_out(self, r: Ready, h: np.ndarray, out: int | None, t0: float,
                         t1: float) -> None:  # fmt: skip
        """A decode step's result on its way (step_out); its time tallied by part, not logged
        (a line per token per stage cost more than the frames), and after its result went
        on: the next stage need not wait for it."""
        read_s = dispatch_s = 0.0
        if r.frame_s is not None:  # started by a frame (not by this process's own last step)
            read_s, dispatch_s = r.frame_s[1] - r.frame_s[0], t0 - r.frame_s[1] - r.embed_s
        parts = [read_s, dispatch_s, t1 - t0 + r.embed_s, 0.0, 0.0]
        if self.config.first and self.config.last:  # nothing goes out; the token may end it
            self.tally(r.seq, t0 - r.embed_s, parts)
            return await self.step_out(r.seq, h, r.pos, None, False, out)
        self._sent_s = (0.0, 0.0)
        await self.step_out(r.seq, h, r.pos, None, False, out)
        parts[3], parts[4] = self._sent_s
        self.tally(r.seq, t0 - r.embed_s, parts)

    async def step_failed(self, seq: int, exc: Exception) -> None:
        """A step of `seq` raised: the job's data (JobError) fails that job and the stage
        serves on; anything else is this node's fault (or a part server's), told to the
        coordinator, which resets the ring and replays."""
        if seq not in self.caches:
            # let go while the step ran (a reset forgot it between two sequences of a batch,
            # or it was cancelled): it failed for that (a KeyError for its sampler), neither
            # the job's fault nor this node's. Reported, it struck the job and charged the node
            # in the new epoch (the churn test of tests/test_jobs_swarm.py on a slow machine:
            # 6 such faults after one reset, and an innocent job's third strike).
            return
        if isinstance(exc, JobError):
            log.warning("stage %s: request %s failed: %s", self.config.layers,
                        self.requests.get(seq), exc)  # fmt: skip
            self.log.event("job_error", self.requests.get(seq), stage=self.span,
                           why=str(exc)[:200])  # fmt: skip
            return await self.fail_request(seq, str(exc))
        if self.on_fault is None:
            raise exc
        # Keep the connections: the coordinator resets the ring and replays; dropping them
        # would make the neighbours report this node as gone rather than faulty.
        log.error("stage %s: step failed", self.config.layers, exc_info=exc)
        if isinstance(exc, PartLost):  # a part server's fault, not this node's
            self.fault("part", exc.node_id, self.epoch)
        else:  # this node's, as far as it can tell; the request is named (poison)
            self.fault("forward", f"{type(exc).__name__}: {exc}", self.epoch,
                       self.requests.get(seq))  # fmt: skip

    async def layers_first(
        self, seq: int, h: np.ndarray, pos: int, cache: KVCache, first: First | None,
        cached: int = 0, logit_rows: int = 1,
    ) -> tuple[np.ndarray, np.ndarray | Score | None, int] | None:
        """The compute (`step`) of a step other than a decode step, over its rows h (T, d) at
        positions pos..: the output rows, the last stage's logits of the last row (or a
        scoring sequence's Score), and how many rows at the start the prefix cache gave;
        None if a reset dropped the sequence meanwhile. A scoring sequence's first step with
        several completions (first["completions"]: their lengths, after a prompt of
        first["score_from"] ids) runs the prompt once and then each completion at the
        positions after it: every completion sees the prompt's keys and its own, and every
        row is the bits it gets when that completion is scored alone (each row computed
        alone: the prefill's kernels). h holds `scoring_rows`: a completion's last token is
        not run (it predicts nothing scored), so a one-token label costs no pass at all. h
        lacks its first `cached` rows when the previous stage sent it without them
        (on_hidden saw this stage's prefix cache hold them)."""
        groups, kept, shared, prompt = [Rows(h, cache, pos)], None, None, []
        if first is not None:
            lengths = first.completions
            n = first.score_from if lengths and first.score_from is not None \
                else cached + h.shape[0]  # the prompt's rows  # fmt: skip
            prompt = list(first.prompt)[:n]
            shared = self.prefix if pos == 0 and len(prompt) == n else None
            kept = shared.restore(prompt, cache, n - 1) if shared is not None else None
            skip = 0 if kept is None else kept.shape[0]
            if skip < cached:  # on_hidden found them, and nothing ran between
                raise RuntimeError(f"the prefix cache gave {skip} rows of the {cached} not sent")
            # the prompt's rows after those, then each completion's at the positions after
            # the prompt (the cache cut back to it: Rows.pos)
            groups, start = [], skip - cached
            for at, rows in ((skip, n - skip), *((n, length - 1) for length in lengths)):
                if rows:
                    groups.append(Rows(h[start : start + rows], cache, pos + at))
                start += rows
        head: Callable[[np.ndarray], np.ndarray | Score] | None = None
        if self.config.last and first is not None and first.score_from is not None:
            head = partial(self.score, first=first)
        elif self.config.last:  # the sampler comes after (Stage.pick, Stage.verify)
            head = lambda out: self.head(out[-logit_rows:])  # noqa: E731
        done = await step(self.model, groups, self.compute, head, kept,
                          alive=lambda: self.caches.get(seq) is cache)  # fmt: skip
        if done is None:
            return None
        if shared is not None:  # the prompt's blocks, for later sequences
            shared.remember(prompt, cache, done[0][: len(prompt)])
        return done[0], done[1], 0 if kept is None else kept.shape[0]

    def tally(self, seq: int, start_s: float, parts: list[float]) -> None:
        """Add a decode step to its sequence's tally (and log it every DECODE_LOG_EVERY)."""
        t = self.tallies.get(seq)
        if t is None:
            if seq not in self.caches:  # let go meanwhile (its last token was this step's)
                return
            t = self.tallies[seq] = DecodeTally(first_s=start_s)
        t.steps += 1
        t.last_s = start_s
        t.max_s = max(t.max_s, parts[2])
        for i, x in enumerate(parts):
            t.parts[i] += x
            self.hop_s[i] += x
        if t.steps - t.logged >= DECODE_LOG_EVERY:
            self.log_decode(seq)

    def log_decode(self, seq: int, pop: bool = False) -> None:
        """The sequence's decode steps here so far, as one "decode" event (if any since the
        last); pop: and forget them (the stage lets the sequence go)."""
        t = self.tallies.pop(seq, None) if pop else self.tallies.get(seq)
        if t is not None and t.steps > t.logged:
            t.logged = t.steps
            self.log.event("decode", self.requests.get(seq), stage=self.span, **t.event())

    async def step_out(
        self, seq: int, h: np.ndarray, pos: int, first: First | None, scoring: bool,
        out: int | Score | list[tuple[int, str]] | None, kept: int = 0,
        drafts: list[int] | None = None, token: int | None = None,
    ) -> None:  # fmt: skip
        """A step's result to where it goes: the hidden state to the next stage (a first
        step's without the `kept` rows this stage's prefix cache gave, which the next
        restores from its own); the last stage's token or score around the ring to stage 0
        (or to itself, when it is both)."""
        if not self.config.last:
            cached = None
            if first is not None:
                rows = self.prefix.outputs(first.prompt, kept) if kept and self.prefix else None
                if rows is not None and self._next_caches:
                    self._unsent[seq], cached, h = rows, kept, h[kept:]
                    self.rows_unsent += kept
            hidden = Hidden(seq=seq, pos=pos, ep=self.epoch, first=first, cached=cached,
                            drafts=drafts or None, token=token)  # fmt: skip
            await self.send_next(hidden, h)
            return
        if isinstance(out, Score):
            if self.config.first:
                return await self.on_scored(seq, out)
            return await self.send_next(Scored(seq=seq, ep=self.epoch, logprobs=out.logprobs,
                                               detail=out.detail))  # fmt: skip
        assert out is not None  # the last stage's step made a token (or a score: above)
        picked = out if isinstance(out, list) else [(int(out), self.logit_bits.pop(seq, ""))]
        # where the sequence goes on, after every step (rounds.py Expect): a round sent ahead
        # may come behind one that ran as a plain decode step, and must still be checked
        after = len(first.prompt) if first is not None else pos + len(picked)
        self.expect[seq] = Expect(after, picked[-1][0])
        at = after - len(picked) + 1  # the position of the first token picked
        follows = first.prompt[-1] if first is not None else token
        if self.config.first:
            await self.on_token(seq, picked, at, follows)
        else:
            (out_token, bits), *more = picked
            await self.send_next(Token(seq=seq, token=out_token, ep=self.epoch, bits=bits,
                                       more=more, at=at, follows=follows))  # fmt: skip

    def score(self, h: np.ndarray, first: First) -> Score:
        """Log-likelihood of each completion's tokens given the prompt (the tokens from
        `score_from` on, or each of first["completions"] after it): the head over the
        positions that predict them — the prompt's last, then the completion's own but its
        last — in one call for all (the offline-classification path). With first["top"]
        (k, 0..MAX_TOP): each token's too, as `detail` (see `token_detail`)."""
        ids = np.asarray(first.prompt, np.int64)
        assert first.score_from is not None  # a scoring sequence's (run_layers)
        n = first.score_from
        lengths = first.completions or [len(ids) - n]
        top = first.top
        # the prompt's last row once (it predicts every completion's first token: a labels
        # line's one-token labels need no other row), then each completion's own rows; each
        # row's logits are its bits in any batch
        rows, start = [h[n - 1 : n]], n  # h: scoring_rows, each completion without its last
        for length in lengths:
            rows.append(h[start : start + length - 1])
            start += length - 1
        logits = self.head(np.concatenate(rows)).astype(np.float64)  # (1 + own rows, vocab)
        norms = log_norms(logits)  # each row's once: a labels line's labels share row 0's
        out: list[float] = []
        detail: list[list[TokenDetail]] = []
        at, start = 1, n
        for length in lengths:
            own = np.array([0, *range(at, at + length - 1)])  # the rows that predict its tokens
            picked = logits[own, ids[start : start + length]]
            out.append(sum_log_probs(picked, norms[own]))
            if top is not None:
                each = token_detail(logits[own], norms[own], ids[start:start + length], top)
                detail.append([(float(lp), bool(greedy), [(int(i), float(x)) for i, x in alts])
                               for lp, greedy, alts in each])  # fmt: skip
            at, start = at + length - 1, start + length
        return Score(logprobs=out, detail=None if top is None else detail)

    async def on_scored(self, seq: int, score: Score) -> None:
        s = self.sequences.pop(seq, None)
        if s is None:  # dropped by a reset while the score was on the wire
            return
        self.log.event("scored", s.req, stage=self.span,
                       logprobs=[round(x, 4) for x in score.logprobs])  # fmt: skip
        await s.emit(Frame.of(ScoreOut(req=s.req, logprobs=score.logprobs, detail=score.detail)))
        self.release(seq)
        if not self.config.last:
            await self.send_next(End(seq=seq, ep=self.epoch))

    async def compute(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) here, or on the compute thread of an emulated node. While it runs, the
        heartbeat (a thread of its own, worker.py) reports the node busy since `step_since`."""
        self.step_since = time.monotonic()
        try:
            self.faults.stall()  # a test's stuck node (faults.py)
            if self._cpu is None:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)
        finally:
            self.step_since = None

    def running_s(self) -> float:
        """How long the step running now has run (0 between steps)."""
        since = self.step_since
        return time.monotonic() - since if since is not None else 0.0


    def pick(self, seq: int, logits: np.ndarray, first: First | None) -> int:
        """The next token of `seq` from its last position's logits (vocab,): the sampler,
        the logits' digest for --verify, and the test hook that corrupts outputs."""
        digest = hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest()
        self.logit_bits[seq] = digest[:16]
        token = self.sample(seq, logits, first)
        return self.faults.token(seq, token, first is not None, int(self.model.config.vocab_size))

    def verify(self, seq: int, logits: np.ndarray, drafts: list[int]) -> list[tuple[int, str]]:
        """A speculative step's tokens, each with its logits' digest: the sampler at each
        of the rows (k+1, vocab) in turn while it agrees with the drafts, then its own
        (engine/speculative.py accept: the tokens decoding without drafts makes)."""
        digests: list[str] = []

        def pick(row: np.ndarray, _kept: list[int]) -> int:  # the sampler keeps its history
            token = self.pick(seq, row, None)
            digests.append(self.logit_bits.pop(seq, ""))
            return token

        tokens = accept_drafts(logits, drafts, pick)
        return list(zip(tokens, digests, strict=True))

    def sample(self, seq: int, logits: np.ndarray, first: First | None) -> int:
        if first is not None:
            self.samplers[seq] = new_sampler(first.sampling, first.prompt)
        params, rng, history, n_prompt = self.samplers[seq]  # present: created with the cache
        try:
            token = sample(logits, params, rng, history, n_prompt)
        except ValueError as exc:  # the draw refused its probabilities: whose fault?
            if not np.isfinite(logits).all():
                raise RuntimeError("the head's logits are not finite") from exc  # this node's
            raise JobError(f"sampling {asdict(params)} cannot draw from this request's "
                           f"logits ({exc}); use a temperature nearer 1") from None  # fmt: skip
        history.append(token)
        return token

    async def on_token(self, seq: int, tokens: list[tuple[int, str]], at: int | None = None,
                       follows: int | None = None) -> None:  # fmt: skip
        """A step's tokens came back (one; after a step with drafts, the drafts kept and the
        model's own), each with its logits' digest: out to the client, then the next step.
        `at`, `follows`: whose answer they are (the position of the first, the token its
        step ran first); one that does not continue the text where it stands is dropped."""
        s = self.sequences.get(seq)
        if s is None:  # dropped by a reset while this token was on the wire
            return
        length, last = len(s.prompt) + len(s.tokens), (s.tokens or s.prompt)[-1]
        if not continues(length, last, at, follows):  # for a step the text no longer has
            self.tokens_stray += 1
            self.log.event("stray", s.req, stage=self.span, at=at, text=length)
            return
        s.active_s = time.monotonic()
        if s.rounds:  # the oldest step in flight came back (rounds.py)
            self.came_back(s, s.rounds.pop(0), [t for t, _ in tokens])
        elif s.spec is not None:  # the prompt's step: its token, for the lookup
            s.spec.took([], [t for t, _ in tokens])
        replaying = bool(s.replay)
        for token, bits in tokens:
            replaying = bool(s.replay)
            s.bits = bits[:16]
            if replaying:
                token = s.replay.pop(0)  # the client has it already
            elif token in s.stop_ids:
                return await self.finish(seq, "stop_token")
            s.tokens.append(token)
            if not replaying:
                await s.emit(Frame.of(TokenOut(req=s.req, token=token)))
            if len(s.tokens) >= s.max_tokens:
                return await self.finish(seq, "max_tokens")
        if replaying and not s.replay and self.on_frontier is not None:  # replayed up to
            if not await self.at_frontier(seq):  # where its job had come: new ground next
                return
            self._frame_s = None  # (the step waited for the head: no frame's timing is its)
        await self.next_steps(seq, s)

    def came_back(self, s: Sequence, done: Round, got: list[int]) -> None:
        """A step's tokens tune k (what its drafts came to, its time); if it did not keep all
        its drafts and the guess after them, the rounds sent behind it are void (the last
        stage drops them) and the next step starts from what was kept."""
        assert s.spec is not None  # rounds are kept only for a sequence that drafts
        drafts = list(done.rows[1:])
        guess = s.rounds[0].rows[0] if s.rounds else None  # of its own token, sent behind it
        s.spec.took(drafts, got, guess)
        if done.lead:  # (a round sent behind others waited for them at every stage too)
            s.spec.k.timed(len(done.rows), s.active_s - done.sent_s)
        self.drafted[0] += len(drafts)
        self.drafted[1] += len(got) - 1
        if guess is not None and len(got) > len(drafts):  # all kept: the guess was judged
            self.drafted[0] += 1
            self.drafted[1] += int(got[-1] == guess)
        if not kept_whole(done, got, s.rounds):
            s.rounds.clear()

    async def next_steps(self, seq: int, s: Sequence) -> None:
        """The step after the sequence's last token, unless one is in flight: that token
        alone, with the others ready (one pass: run_ready); or, when it drafts, the token and
        its drafts as rows of a step of its own, which the last stage verifies. Then, while
        the drafts are likely kept, more rounds behind it (rounds.py)."""
        if not s.rounds:
            pos = len(s.prompt) + len(s.tokens) - 1
            await self.send_round(seq, s, Round(pos, (s.tokens[-1], *self.drafts(s)),
                                                time.monotonic()))  # fmt: skip
        while self.pipelines(s) and self.sequences.get(seq) is s:
            assert s.spec is not None
            last_pos = len(s.prompt) + s.max_tokens - 2
            look = s.spec.lookup.draft(8 * MAX_DRAFT)
            r = next_round(s.rounds, look, s.spec.k.acceptance, last_pos, time.monotonic())
            if r is None:
                return
            self.drafted[2] += 1
            await self.send_round(seq, s, r)

    def pipelines(self, s: Sequence) -> bool:
        """Whether rounds of `s` go behind others in flight: it drafts, the ring has more
        than one stage, it does not replay, and in `auto` it is the ring's lone sequence (as
        drafts() says)."""
        if s.spec is None or self.config.last or s.replay:
            return False
        return not (s.spec.mode == "auto" and len(self.sequences) > 1)

    async def send_round(self, seq: int, s: Sequence, r: Round) -> None:
        """A round to the next stage: a decode step with the others ready, unless it has
        drafts or may have rounds behind it, which then must keep its order and be told
        from a void one at the last stage (its first row's `token`)."""
        t0 = time.perf_counter()
        h = self.embed(np.asarray(r.rows))
        if s.spec is not None:
            s.rounds.append(r)
        if len(r.rows) > 1 or self.pipelines(s):
            drafts = list(r.rows[1:])
            if self.config.last:  # a ring of one: the answer comes back inside this call,
                # and the next round from it: a task each, not a recursion each
                self.spawn(self.run_layers(seq, h, r.pos, None, drafts=drafts, token=r.rows[0]))
                return
            return await self.run_layers(seq, h, r.pos, None, drafts=drafts, token=r.rows[0])
        self._embed_s = time.perf_counter() - t0  # the step's, as in one process
        self.queue_step(seq, h, r.pos)  # with the others ready: one pass (run_ready)

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def drafts(self, s: Sequence) -> list[int]:
        """Drafts for the sequence's next step: none while it replays, none in `auto` while
        other sequences share this ring (their steps fill its passes already: drafting
        would only take their turn), at most what max_tokens leaves room for."""
        if s.spec is None or s.replay:
            return []
        if s.spec.mode == "auto" and len(self.sequences) > 1:
            return []
        return s.spec.draft(s.prompt + s.tokens, s.max_tokens - len(s.tokens) - 1)

    async def finish(self, seq: int, reason: str) -> None:
        self.log_decode(seq, pop=True)
        s = self.sequences.pop(seq)
        self.log.event("done", s.req, stage=self.span, reason=reason, tokens=len(s.tokens))
        k = s.spec.k if s.spec is not None else None
        await s.emit(Frame.of(Done(req=s.req, reason=reason, bits=s.bits,
                                   drafted=k.drafted if k else 0,
                                   accepted=k.accepted if k else 0)))  # fmt: skip
        self.release(seq)
        if not self.config.last:
            await self.send_next(End(seq=seq, ep=self.epoch))

    async def fail_request(self, seq: int, message: str) -> None:
        """The job's own data failed a step (here, or at a later stage that said so with a
        `failed` frame): every stage frees the sequence, and stage 0, which owns it, tells
        its client (the head: that job's attempt failed). No node is at fault."""
        if not self.config.first:
            self._drop(seq)
            return await self.send_next(Failed(seq=seq, ep=self.epoch, message=message))
        s = self.sequences.pop(seq, None)
        if s is None:  # dropped by a reset or cancelled meanwhile
            return
        self.log.event("failed", s.req, stage=self.span, why=message[:200])
        await s.emit(Frame.of(ErrorOut(req=s.req, message=message, fault="job")))
        self.release(seq)
        if not self.config.last:  # the stages before the one that failed hold it too
            await self.send_next(End(seq=seq, ep=self.epoch))

    def activity(self, req: str | None = None) -> float | None:
        """When a step of the request (or of a scoring job's `req#i`; without one, of any
        request) last came back to stage 0 (monotonic s); None when stage 0 holds none of
        its sequences."""
        times = [s.active_s for s in self.sequences.values()
                 if req is None or s.req == req or s.req.startswith(req + "#")]  # fmt: skip
        return max(times) if times else None

    def in_flight(self) -> int:
        """Sequences stage 0 holds (the head admits more only while the ring has room)."""
        return len(self.sequences)

    async def cancel_request(self, req: str) -> int:
        """Stage 0 drops a request's sequences (a scoring job's too: `req#i`) and tells the
        ring to free their caches; how many it dropped."""
        seqs = [q for q, s in self.sequences.items() if s.req == req or s.req.startswith(req + "#")]
        for seq in seqs:
            s = self.sequences.pop(seq)
            self.log.event("cancelled", s.req, stage=self.span)
            self.release(seq)
            if not self.config.last:
                await self.send_next(End(seq=seq, ep=self.epoch))
        return len(seqs)

    @property
    def span(self) -> str:
        return f"{self.config.layers[0]}..{self.config.layers[1] - 1}"

    def _drop(self, seq: int) -> None:
        self.log_decode(seq, pop=True)
        self._unsent.pop(seq, None)
        self._awaiting.pop(seq, None)
        self.faults.forget(seq)
        self.requests.pop(seq, None)
        self.caches.pop(seq, None)
        self.samplers.pop(seq, None)
        self.logit_bits.pop(seq, None)
        self.expect.pop(seq, None)

    def release(self, seq: int) -> None:
        self._drop(seq)
        if not self.config.last and not self.config.first:
            asyncio.get_running_loop().create_task(self.send_next(End(seq=seq, ep=self.epoch)))


def new_sampler(
    sampling: Sampling, prompt: list[int]
) -> tuple[SamplingParams, np.random.Generator, list[int], int]:
    """A sequence's sampler: its parameters, its seeded generator and the tokens it has seen;
    JobError (the request's fault, named) when the parameters cannot be used."""
    try:
        params = sampling_params(sampling)
    except (TypeError, ValueError, RequestError) as exc:
        raise JobError(f"sampling {fields(sampling)}: {exc}") from None
    try:
        rng = np.random.default_rng(params.seed)
    except (TypeError, ValueError) as exc:
        raise JobError(f"sampling seed {params.seed!r}: {exc}; a seed is an integer >= 0"
                       ) from None  # fmt: skip
    return params, rng, list(prompt), len(prompt)


async def _connect(
    host: str, port: int, token: bytes | None, peer: str, attempts: int = 20,
    still: Callable[[], bool] = lambda: True, tls: ssl.SSLContext | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect, retrying for about a second (a replacement may be starting), while `still`."""
    for _ in range(attempts):
        if not still():
            break
        try:
            return await _while(still, connect(host, port, token, peer, tls))
        except ssl.SSLError:
            raise  # a refused certificate: retrying will not change it
        except OSError:
            await asyncio.sleep(0.05)
    raise ConnectionError(f"stage at {host}:{port} did not answer")


async def _while(still: Callable[[], bool], work: Awaitable[T]) -> T:
    """`work`, given up (ConnectionError) as soon as `still()` turns false: a peer that
    accepted but is too busy to send its challenge must not hold a reset's rewiring up."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait([task], timeout=0.1)
        if done:
            return task.result()
        if not still():
            task.cancel()
            raise ConnectionError("rewired while connecting")


def load_stage_model(config: StageConfig) -> Model:
    from cellswarm import kernels
    from cellswarm.loader import load

    kernels.set_threads(config.threads)
    if config.dram_budget_bytes:
        from cellswarm.engine.tiered import load_tiered

        tiered = load_tiered(config.model, config.dram_budget_bytes, context=config.context,
                             selection=stage_selection(config), tokenizer=False,
                             cache_type=config.cache_type)  # fmt: skip
        print(tiered.placement.describe(), file=sys.stderr, flush=True)
        return tiered.model
    model = load(config.model, selection=stage_selection(config), tokenizer=False,
                 cache_type=config.cache_type)
    if config.draft and config.first:
        model.draft = load_draft(config.draft, config.model)
        model.draft.set_cache_type(config.cache_type)
    if config.memory_bytes is not None:
        check_budget(model, config)
    return model


def load_draft(path: str, model_path: str) -> Model:
    """The first stage's draft model, whole; it must share the model's tokenizer token for
    token, or its guesses would be other tokens (as Model.use_draft checks in one process)."""
    from cellswarm.loader import load, load_tokenizer

    def vocabulary(file: str) -> object:
        try:
            return load_tokenizer(file).vocabulary()
        except CellswarmError:  # none in the file: nothing to share
            return None

    draft = load(path, tokenizer=False)
    theirs = vocabulary(path)
    if theirs is None or theirs != vocabulary(model_path):
        raise RequestError(f"--draft {path} has another tokenizer than {model_path}: draft "
                           "with a model of the same family and vocabulary")  # fmt: skip
    return draft


def check_cached(hidden: Hidden) -> None:
    """ProtocolError unless a 'hidden' frame's "cached" (the rows it was sent without) is a
    whole number of prefix blocks within its first step's prompt."""
    cached, first = hidden.cached, hidden.first
    if not (cached is not None and first is not None and 0 < cached < len(first.prompt)
            and cached % BLOCK_TOKENS == 0):  # fmt: skip
        raise ProtocolError(f"a 'hidden' frame's cached {str(cached)[:20]} is not a whole "
                            "number of prefix blocks of its first step's prompt")  # fmt: skip


def scoring_rows(n: int, lengths: list[int]) -> np.ndarray:
    """The rows of a one-pass scoring sequence (a prompt of n ids, then completions of
    `lengths`) that the layers run: the prompt's, then each completion's but its last — the
    positions whose outputs predict a scored token."""
    keep, start = [np.arange(n)], n
    for length in lengths:
        keep.append(np.arange(start, start + length - 1))
        start += length
    return np.concatenate(keep)


def detail_ok(detail: list[list[TokenDetail]], completions: int) -> bool:
    """A peer's `detail` (its types read: protocol/dataplane.TokenDetail) is one list per
    completion, each token's top at most MAX_TOP long, as token_detail makes it."""
    return len(detail) == completions and all(len(e[2]) <= MAX_TOP for c in detail for e in c)


def sampling_params(s: Sampling) -> SamplingParams:
    """The sampler's parameters: those set, over the engine's defaults (greedy)."""
    d = SamplingParams  # its fields' defaults (class attributes of the dataclass)
    return SamplingParams(
        temperature=d.temperature if s.temperature is None else s.temperature,
        top_k=d.top_k if s.top_k is None else s.top_k,
        top_p=d.top_p if s.top_p is None else s.top_p,
        min_p=d.min_p if s.min_p is None else s.min_p,
        repetition_penalty=_or(s.repetition_penalty, d.repetition_penalty),
        seed=s.seed,
        presence_penalty=_or(s.presence_penalty, d.presence_penalty),
        frequency_penalty=_or(s.frequency_penalty, d.frequency_penalty),
        logit_bias=d.logit_bias if s.logit_bias is None else tuple(s.logit_bias),
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def stage_selection(config: StageConfig) -> Selection:
    """The stage's layers, less what its part servers hold: routed experts held elsewhere,
    and every vocabulary row when vocab parts hold them (it keeps the final norm)."""
    lo, hi = config.layers
    vocab = (0, 0) if config.vocab_remote else None
    remote: dict[int, set[int]] = {}
    for p in config.parts:
        for layer, ids in p.experts.items():
            remote.setdefault(layer, set()).update(ids)
    experts = None
    if any(lo <= layer < hi for layer in remote):
        from cellswarm.loader import read_config

        n = int(read_config(config.model).n_experts)
        experts = {
            layer: tuple(e for e in range(n) if e not in ids)
            for layer, ids in remote.items() if lo <= layer < hi
        }  # fmt: skip
    return Selection(layers=(lo, hi), vocab_rows=vocab, experts=experts, embed=config.first,
                     head=config.last)  # fmt: skip


def check_expert_cover(model: Model, remote: ExpertParts) -> None:
    """Every routed expert of every MoE layer held here or on a part server: one held
    nowhere would silently add nothing for the tokens routed to it."""
    c = model.config
    if not isinstance(model.arch, ExpertArchitecture) or not isinstance(c, DeepseekConfig):
        raise RequestError(f"{c.arch} has no routed experts to place on part servers")
    for layer in model.layers:
        if not c.is_moe(layer):
            continue
        local = model.weights.experts(f"blk.{layer}.ffn_up_exps.weight").held
        missing = set(range(c.n_experts)) - set(local) - remote.held(layer)
        if missing:
            raise RequestError(
                f"layer {layer}: routed experts {sorted(missing)[:8]} are held by no node; "
                "give them to this stage or to a part server"
            )


def shard_need_bytes(model: Model, config: StageConfig) -> dict[str, int]:
    """What this stage will hold at most: the engine's own accounting plus the measured
    runtime of an idle worker (the planner's figure). Scratch is a prefill chunk's
    (PREFILL_CHUNK positions against the whole context), not a decode step's: a long
    prompt's step is the peak, and the budget (peak RSS <= --memory) must hold it."""
    from cellswarm.planner.overhead import runtime_overhead_bytes

    mem = model.memory(batch=prefill_rows(config.context), context=config.context)
    need = {
        "weights": mem.weight_bytes,
        "kv": model.kv_sequence_bytes(config.context) * config.max_sequences,
        "scratch": mem.scratch_bytes + model.kv_read_bytes(config.context),
        "rows": first_step_bytes(model.config.d_model, config.context),
        "runtime": runtime_overhead_bytes(),
    }
    if model.draft is not None:  # its weights, its cache per sequence, a draft step's scratch
        draft = model.draft.memory(batch=1, context=config.context)
        need["draft"] = (draft.weight_bytes + draft.scratch_bytes
                         + model.draft.kv_sequence_bytes(config.context) * config.max_sequences)
    return need


DEFAULT_PREFIX_CACHE_BYTES = 64 << 20


def prefix_budget(model: Model, config: StageConfig) -> int:
    """Bytes the stage's prefix cache may hold: as configured; else 64 MiB, or under a budget
    half of what it leaves after the shard's own need (weights, scratch, KV for
    max_sequences x context, runtime), up to 64 MiB: the cache never takes memory the shard
    was given, and half the slack stays for what the runtime figure does not foresee."""
    if config.prefix_cache_bytes is not None:
        return max(0, int(config.prefix_cache_bytes))
    if config.memory_bytes is None:
        return DEFAULT_PREFIX_CACHE_BYTES
    slack = int(config.memory_bytes) - sum(shard_need_bytes(model, config).values())
    return max(0, min(slack // 2, DEFAULT_PREFIX_CACHE_BYTES))


def check_budget(model: Model, config: StageConfig) -> None:
    need = shard_need_bytes(model, config)
    total, budget = sum(need.values()), int(config.memory_bytes or 0)
    if total > budget:
        parts = ", ".join(f"{k} {v:,}" for k, v in need.items())
        raise BudgetError(
            f"layers {config.layers[0]}..{config.layers[1] - 1} need {total:,} bytes ({parts}) "
            f"but --memory is {budget:,}: {total - budget:,} bytes short; give this node fewer "
            "layers, a shorter context or fewer sequences in flight"
        )


async def main(config: StageConfig) -> None:
    lean_tls_buffers()  # a stranger's TLS connection costs 16 KiB until it proves a key
    try:
        stage = Stage(config, load_stage_model(config))
    except CellswarmError as exc:
        print(f"REFUSED {exc}", flush=True)
        return
    tls = server_context(config.tls_dir) if config.tls_dir else None
    server = await asyncio.start_server(stage.serve, "127.0.0.1", config.listen_port,
                                        **listen_tls(tls))  # fmt: skip
    port = server.sockets[0].getsockname()[1]
    print(f"READY {port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    stage_config = StageConfig.from_json(sys.argv[1])
    # an emulated node's waits must be precise to well under its step time (emulate.py)
    with asyncio.Runner(loop_factory=precise_loop if stage_config.profile else None) as runner:
        runner.run(main(stage_config))
