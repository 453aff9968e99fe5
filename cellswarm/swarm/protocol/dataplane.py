"""The data plane's messages: what a frame's header carries (ring/frames.py), as frozen, typed
values (msgspec Structs), from a client or a head to stage 0, from stage to stage around the
ring, from stage 0 back to its client, and to and from part servers (ring/parts.py).

A frame on the wire is unchanged: a msgpack map of a "type" and its fields, and maybe an
array. `fields(message)` is the map a message is sent as (its type is `message.kind`);
`read(Kind, frame_fields)` turns what arrived into the message before any handler reads it,
or raises ProtocolError naming the field — the sender's fault, told apart from the node's.
So a handler reads attributes of known types, never `.get` of a raw dict.

The keys and their values are what the dicts before them held, so no PROTOCOL bump: a
message whose every key was always sent (`First`, `Token`, `Done`, ...) is sent whole
(omit_defaults=False); the others leave out a field at its default (a key that was sent only
when set). Checks of values a type cannot say (a
prompt's ids within the vocabulary, a cached row count within the prompt) stay with the
stage, which knows its model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal, TypeVar

import msgspec

from cellswarm.errors import ProtocolError

MAX_LIST = 4096  # completions of a scoring sequence, log-probabilities in a score (at most)
MAX_DRAFT = 8  # drafted tokens a step verifies (engine/speculative.py MAX_DRAFT)
MAX_LINKS = 4096  # callers of one part server a reset may name (the stages of its ring)
Speculative = Literal["auto", "off", "lookup", "draft"]  # engine/speculative.py MODES


class DataMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                  omit_defaults=True, gc=False):  # fmt: skip
    """Every data-plane message: immutable, keyword-built, strict about its fields; `kind`
    is the frame type it travels as."""

    kind: ClassVar[str] = ""


# -- what a client (the head, a local pipeline) asks of stage 0 -------------------------------


class Sampling(DataMessage, frozen=True):
    """A sequence's sampling settings (engine/sampling.py's SamplingParams): only those set
    travel; their ranges are checked where the sampler is made (the last stage), whose
    refusal is the job's fault."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: list[tuple[int, float]] | None = None  # (token id, bias) pairs


class Generate(DataMessage, frozen=True):
    """A request into stage 0 (its prompt is the frame's i64 array): a generation of up to
    max_tokens, replaying the tokens a resumed one already made; or, with `completions`,
    a scoring sequence (the prompt's first score_from ids, then each completion's)."""

    kind: ClassVar[str] = "generate"
    req: str
    max_tokens: int
    sampling: Sampling = Sampling()
    stop_ids: list[int] = msgspec.field(default_factory=list)
    replay: list[int] = msgspec.field(default_factory=list)
    score_from: int | None = None
    completions: Annotated[list[int], msgspec.Meta(max_length=MAX_LIST)] | None = None
    top: int | None = None  # each scored token's top-k too (0..scoring.MAX_TOP)
    speculative: Speculative = "auto"  # stage 0 drafts, the last stage verifies


class Stats(DataMessage, frozen=True):
    """Asks a stage or a part server for its counters (answered by a `stats` frame)."""

    kind: ClassVar[str] = "stats"


# -- around the ring ----------------------------------------------------------------------------


class First(DataMessage, frozen=True, omit_defaults=False):
    """What a sequence's first step carries around the ring (every stage makes its cache by
    it, the last its sampler or its scoring): sent whole, every key."""

    capacity: int  # the tokens its KV cache holds
    req: str
    prompt: list[int]
    sampling: Sampling = Sampling()
    score_from: int | None = None
    completions: list[int] = msgspec.field(default_factory=list)
    top: int | None = None


class Hidden(DataMessage, frozen=True):
    """A step's hidden state (the frame's f32 (T, d) array) for the next stage: rows at
    positions pos.. of sequence seq; a first step's `first`, and the rows at its start it
    was sent without (`cached`: the next stage restores them from its prefix cache)."""

    kind: ClassVar[str] = "hidden"
    seq: int
    pos: int
    ep: int
    first: First | None = None
    cached: int | None = None
    # speculative decoding: the rows are the last token and these drafts after it, which
    # the last stage verifies (engine/speculative.py accept)
    drafts: Annotated[list[int], msgspec.Meta(max_length=MAX_DRAFT)] | None = None
    # a speculative round's first row's token (rounds.py Expect): with drafts, or alone
    token: int | None = None


class Need(DataMessage, frozen=True, omit_defaults=False):
    """The next stage lacks a first step's `cached` rows: send them (`prefix`); `cache`
    False: it keeps no prefix cache, send every row from now."""

    kind: ClassVar[str] = "need"
    seq: int
    ep: int
    cache: bool = True


class Prefix(DataMessage, frozen=True):
    """The rows a first step was sent without (the frame's array), as its `need` asked."""

    kind: ClassVar[str] = "prefix"
    seq: int
    ep: int


class Token(DataMessage, frozen=True, omit_defaults=False):
    """The last stage's sampled token of `seq`, to stage 0; `bits`: its logits' digest.
    `more`: after a step with drafts, the tokens after `token` that step gave (the drafts
    kept, then the model's own), each with its logits' digest."""

    kind: ClassVar[str] = "token"
    seq: int
    token: int
    ep: int
    # the text position `token` takes: required, so every answer can be checked against
    # where stage 0's text stands (Stage.on_token)
    at: int
    bits: str = ""
    more: Annotated[list[tuple[int, str]], msgspec.Meta(max_length=MAX_DRAFT)] = \
        msgspec.field(default_factory=list)
    # whose answer it is, besides `at`: the token the step's first row ran (a speculative
    # round's or a prompt's; None after a plain decode step, whose rows carry no token).
    # Stage 0 takes it only where its text stands (Stage.on_token).
    follows: int | None = None


# A scored token: its log-probability, whether it was the row's argmax, the row's likeliest
# as (id, log-probability) pairs (engine/scoring.py's token_detail)
TokenDetail = tuple[float, bool, list[tuple[int, float]]]


class Score(DataMessage, frozen=True):
    """A scoring sequence's log-likelihood of each completion, and with `top` each token's
    detail (one list per completion)."""

    logprobs: Annotated[list[float], msgspec.Meta(max_length=MAX_LIST)]
    detail: list[list[TokenDetail]] | None = None


class Scored(Score, frozen=True, kw_only=True):
    """A score from the last stage to stage 0."""

    kind: ClassVar[str] = "scored"
    seq: int
    ep: int


class End(DataMessage, frozen=True):
    """Let a sequence go (every stage frees its cache)."""

    kind: ClassVar[str] = "end"
    seq: int
    ep: int


class Failed(DataMessage, frozen=True, omit_defaults=False):
    """A later stage found the job's data at fault: free the sequence, stage 0 tells why."""

    kind: ClassVar[str] = "failed"
    seq: int
    ep: int
    message: str = ""


class PartAddress(DataMessage, frozen=True):
    """Where a part server listens and what it holds (ring/parts.py's PartSpec on the wire):
    routed experts by layer (keys: the layer, in decimal), or vocabulary rows [a, b). In a
    coordinator's reset, `key`: the link key the stage proves to it, sealed to the stage
    (label "{epoch}|{part's node id}")."""

    node_id: str
    port: int
    host: str = ""
    experts: dict[str, list[int]] = msgspec.field(default_factory=dict)
    vocab_rows: tuple[int, int] | None = None
    key: str | None = None


class Reset(DataMessage, frozen=True):
    """A new layout epoch: forget every sequence; a coordinator also sends the ring's new
    wiring: the next stage's address and the key this stage proves to it (`next_key`), the
    one stage that may send it frames (`prev`) and the key that stage proves (`prev_key`),
    the part servers. Keys are sealed to this node (swarm/auth.py seal_key; labels
    "{epoch}|next" and "{epoch}|prev"). A local pipeline's (`peers`): names that prove the
    cluster token."""

    kind: ClassVar[str] = "reset"
    epoch: int
    next_host: str | None = None
    next_port: int | None = None
    peers: list[str] | None = None
    parts: list[PartAddress] | None = None
    prev: str | None = None
    prev_key: str | None = None
    next_key: str | None = None


class ResetDone(DataMessage, frozen=True):
    kind: ClassVar[str] = "reset_done"


# -- stage 0 to its client ----------------------------------------------------------------------


class TokenOut(DataMessage, frozen=True):
    kind: ClassVar[str] = "token"
    req: str
    token: int


class Done(DataMessage, frozen=True, omit_defaults=False):
    """A generation ended: `reason` stop_token or max_tokens; `bits` the last logits' digest;
    `drafted`, `accepted`: speculative decoding's drafts verified, and kept."""

    kind: ClassVar[str] = "done"
    req: str
    reason: str
    bits: str = ""
    drafted: int = 0
    accepted: int = 0


class ErrorOut(DataMessage, frozen=True, omit_defaults=False):
    """A request failed: `fault` "job" (its own data), "room" (the stage was full: it waits)."""

    kind: ClassVar[str] = "error"
    req: str
    message: str
    fault: str = "job"


class ScoreOut(Score, frozen=True, kw_only=True):
    kind: ClassVar[str] = "score"
    req: str


# -- part servers (ring/parts.py) ---------------------------------------------------------------


class ExpertsAsk(DataMessage, frozen=True):
    """Routed experts of `layer` over the frame's packed rows (parts.pack_routes, k routes)."""

    kind: ClassVar[str] = "experts"
    layer: int
    k: int


class LogitsAsk(DataMessage, frozen=True):
    """Partial logits of the frame's normed rows; `rows`: the whole head's (its row blocks)."""

    kind: ClassVar[str] = "logits"
    rows: int | None = None


class RowsAsk(DataMessage, frozen=True):
    """Dequantized rows of the frame's global ids: of the embedding, or of the head."""

    kind: ClassVar[str] = "rows"
    tensor: str = "head"


class PartReset(DataMessage, frozen=True):
    """A part server's reset: maybe new callers (it holds no sequence to forget). From a
    coordinator: `keys`, each calling stage's link key sealed to this node (swarm/auth.py
    seal_key, label "{epoch}|{stage id}"), which replace every caller before them."""

    kind: ClassVar[str] = "reset"
    epoch: int | None = None
    peers: list[str] | None = None
    keys: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_LINKS)] | None = None


class PartStats(DataMessage, frozen=True):
    """A part server's counters: requests answered, weight bytes (by kind), peak RSS."""

    node: str
    requests: int
    weights_by_kind: dict[str, int]
    weight_bytes: int
    peak_rss_bytes: int


M = TypeVar("M", bound=DataMessage)


def fields(message: DataMessage) -> dict[str, object]:
    """A message as the frame header's fields (msgpack-ready builtins), defaults left out."""
    out: dict[str, object] = msgspec.to_builtins(message)
    return out


def read(kind: type[M], data: Mapping[str, object], frame: str | None = None) -> M:
    """A frame's fields as a `kind`, or a ProtocolError naming the frame and the field."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"a {frame or kind.kind or kind.__name__!r} frame: {exc}") from None
