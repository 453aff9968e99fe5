"""One request schema at every edge: what a client may send the coordinator, checked at submit.

    POST /v1/requests            SubmitRequest   prompt (text or ids), max_tokens, sampling, ...
    POST /v1/batches             BatchRequest    items: BatchItem (one line of a JSONL file)
    POST /v1/completions         CompletionRequest   (OpenAI's fields; unknown ones refused)
    POST /v1/chat/completions    ChatRequest

The models are frozen and strict (no "5" for 5, no true for 1, no NaN): a value the ring
could choke on is refused here, as a 4xx naming the field, never as a job that dies later on
a worker. The sampling fields and their ranges are one definition (`SamplingFields`) shared by
all four: temperature 0..2, top_k 0..2^31-1, top_p (0, 1], min_p [0, 1), repetition_penalty
(0, 100], seed 0..2^64-1. What needs the model — token ids below its vocabulary, prompt +
max_tokens within the context the ring reserves, a scoring job's sequences within the ring's
sequences — is checked by `Limits` (the coordinator's model facts) once the text is tokens.
The body itself is capped before it is read (access.py, `--max-body`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeAlias, TypeVar

from fastapi import Depends, Request, params
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from cellswarm.errors import RequestError
from cellswarm.swarm.protocol.dataplane import Speculative

if TYPE_CHECKING:
    from cellswarm.swarm.control.coordinator import Coordinator

U64_MAX = 2**64 - 1
MAX_TOKEN_ID = 2**31 - 1  # a vocabulary is far smaller; the model's own size is checked later
MAX_KEY_CHARS = 256  # request ids, idempotency keys, batch names and line ids
MAX_ITEMS = 100_000  # lines of one batch
MAX_STOP_IDS = 1024
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
                 "presence_penalty", "frequency_penalty", "logit_bias")
MAX_BIASES = 1024  # logit_bias entries (OpenAI allows 300)
# Text is refused untokenized beyond this many bytes per token of context: no token covers
# more input bytes than its longest text (x4 for normalization), so such a prompt is over the
# context for sure, and tokenizing megabytes (seconds, gigabytes) is never needed to say so.
TEXT_SLACK = 4

# What a route hands FastAPI to send as a JSON object. Not jsonvalue's `JsonObject`: FastAPI
# makes a route's return annotation its response model, and pydantic cannot build one from
# that recursive alias (the route would answer 500). A mapping of objects is validated and
# serialized as `dict[str, Any]` was (the same bytes on the wire), and takes a JsonObject,
# a TypedDict or a coordinator's dict alike.
Reply: TypeAlias = Mapping[str, object]


class BadRequest(RequestError):
    """A client's input is wrong: `status` (400 unless said), a one-line message naming the
    field (`param`) and the fix; `code` is OpenAI's error code when there is one."""

    status = 400

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class NotFound(BadRequest):
    """No such job or batch — or one another API key submitted (never said which)."""

    status = 404


# -- field types ------------------------------------------------------------------------------


def _unicode(text: str) -> str:
    """Text the tokenizer can take: no lone surrogates (JSON can spell them, UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode text (a lone surrogate at character "
                         f"{exc.start}); send UTF-8 text") from None  # fmt: skip
    return text


Text = Annotated[str, AfterValidator(_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]
Key = Annotated[str, Field(min_length=1, max_length=MAX_KEY_CHARS), AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKEN_ID)]
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=U64_MAX)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]


def _bias_ids(bias: dict[str, float]) -> dict[str, float]:
    for key in bias:
        if not (key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise ValueError(f"key {key[:20]!r} is not a token id (OpenAI's shape: "
                             '{"123": -100})')  # fmt: skip
    return bias


LogitBias = Annotated[dict[str, Bias], Field(max_length=MAX_BIASES), AfterValidator(_bias_ids)]

STRICT = ConfigDict(strict=True, frozen=True, extra="forbid")


class SamplingFields(BaseModel):
    """The sampling options, the same names and ranges at every edge (engine/sampling.py's
    `SamplingParams`); unset fields keep the engine's defaults (greedy)."""

    model_config = STRICT

    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None  # {"token id": bias}

    def sampling(self) -> dict[str, Any]:
        """The set fields, as the ring takes them (`SamplingParams(**sampling)`); logit_bias
        as [id, bias] pairs in id order."""
        out = {k: v for k in SAMPLING_KEYS if (v := getattr(self, k)) is not None}
        if self.logit_bias is not None:
            out["logit_bias"] = sorted([int(t), b] for t, b in self.logit_bias.items())
        return out

    def bias_ids(self) -> list[int]:
        """The token ids logit_bias names (checked against the vocabulary by `Limits`)."""
        return [int(t) for t in self.logit_bias or {}]


class Sampling(SamplingFields):
    """`/v1/requests`' "sampling" object."""


def _prompt(value: object) -> str | list[int]:
    """A prompt is text or a non-empty list of token ids; say which item is wrong."""
    if isinstance(value, str):
        if not value:
            raise ValueError("the prompt is empty; send text or token ids")
        return _unicode(value)
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty string or list of token ids")
    for i, t in enumerate(value):
        if type(t) is not int:
            raise ValueError(f"item {i} ({_shown(t)}) is not a token id (an integer)")
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"token id {t} (item {i}) is not in 0..{MAX_TOKEN_ID}")
    return value


class SubmitRequest(BaseModel):
    """POST /v1/requests: one generation job."""

    model_config = STRICT

    prompt: str | list[int]  # checked by `check_prompt` first, for a message naming the item
    max_tokens: MaxTokens = 32
    sampling: Sampling | None = None
    stop_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_IDS)
    request_id: Key | None = None  # its idempotency key: the same id twice is the same job
    speculative: Speculative | None = None  # speculative decoding (None: auto)

    check_prompt = field_validator("prompt", mode="before")(_prompt)


# -- OpenAI's requests (openai_api.py) ----------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    include_usage: bool = False


MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound (ring/stage.py MAX_TOP)
MAX_CHOICES = 64  # choices of one request: prompts x n (each is a job of the queue)
MAX_DETOKENIZE = 65_536  # token ids one /detokenize decodes


class OpenAICommon(SamplingFields):
    # A field we do not know is refused by name, as OpenAI's own server does ("Unrecognized
    # request argument supplied"): never silently ignored (openai_api._unsupported).
    model_config = ConfigDict(strict=True, frozen=True, extra="allow")

    model: str
    max_tokens: MaxTokens | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    user: Annotated[str, Field(max_length=MAX_KEY_CHARS)] | None = None  # logged with the job
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(
        max_length=512)]] | None = Field(None, max_length=16)  # logged, OpenAI's 16 pairs
    # OpenAI's, for tool-calling models: refused by name unless they ask for nothing
    tool_choice: object = None
    parallel_tool_calls: object = None
    reasoning_effort: object = None
    return_token_ids: bool = False  # an extension (vLLM's name): each choice gets its ids
    # an extension: speculative decoding, the same tokens either way (None: auto)
    speculative: Speculative | None = None
    skip_special_tokens: bool = True  # vLLM's too: False shows <|im_end|> and the like


class CompletionRequest(OpenAICommon):
    prompt: object  # text, token ids, or a list of either (openai_api._prompts)
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)] | None = None  # 0: echo only
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


class ChatMessage(BaseModel):
    # name, tool_calls, ...: handed to the chat template
    model_config = ConfigDict(strict=True, frozen=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[dict[str, object]] | None = None


class ChatRequest(OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[object] | None = None
    response_format: dict[str, object] | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): text, or a conversation through the chat template."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE)
    model: str | None = None


# -- batches (batch_api.py) -----------------------------------------------------------------------


class BatchItem(SamplingFields):
    """One line of a batch file: generate from `prompt` or `messages`, or score `completions`
    (log-likelihoods given the prompt, each token's too) or `labels` (the most likely one).
    Other fields (a gold label, a source) are the user's: carried to the line's result as
    `extra`, unless the name looks like a misspelt field of ours (then refused, saying which)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="allow")

    id: Key | int | None = None
    prompt: NonEmptyText | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: MaxTokens = 64
    completions: list[NonEmptyText] | None = Field(None, min_length=1)
    labels: list[NonEmptyText] | None = Field(None, min_length=1)
    speculative: Speculative | None = None  # a generation's (None: auto)

    @model_validator(mode="after")
    def _one_of_each(self) -> BatchItem:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("needs a 'prompt' string or 'messages', not both")
        if self.completions is not None and self.labels is not None:
            raise ValueError("give 'completions' or 'labels', not both")
        import difflib

        for name in self.model_extra or {}:
            near = difflib.get_close_matches(name, type(self).model_fields, n=1, cutoff=0.8)
            if near:
                raise ValueError(f"{name[:40]!r} is not a field; did you mean {near[0]!r}? "
                                 "(other fields are carried to the result as 'extra')")
        return self

    def extra(self) -> dict[str, object]:
        return dict(self.model_extra or {})


class BatchRequest(BaseModel):
    """POST /v1/batches. `items` stay plain objects here: each is checked as a `BatchItem` by
    itself, so an error names its line (and its id), not a path into the list."""

    model_config = STRICT

    items: list[object] = Field(min_length=1, max_length=MAX_ITEMS)
    name: Key | None = None
    verify_fraction: Fraction | None = None
    idempotency_key: Key | None = None


def chat_turns(messages: Sequence[ChatMessage]) -> list[dict[str, object]]:
    """Messages as a chat template takes them: text parts joined, "developer" as "system"."""
    turns = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            kinds = {str(p.get("type")) for p in content} - {"text"}
            if kinds:
                raise BadRequest(f"messages[{i}].content: only text parts are supported, not "
                                 f"{sorted(kinds)}", param="messages")  # fmt: skip
            content = "".join(str(p.get("text", "")) for p in content)
            _unicode_or_bad(content, f"messages[{i}].content")
        extra = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
        role = "system" if m.role == "developer" else m.role
        turns.append({**extra, "role": role, "content": content or ""})
    return turns


def _unicode_or_bad(text: str, field: str) -> None:
    try:
        _unicode(text)
    except ValueError as exc:
        raise BadRequest(f"{field}: {exc}", param=field.split("[")[0].split(".")[0]) from None


# -- parsing and messages --------------------------------------------------------------------


M = TypeVar("M", bound=BaseModel)


def body(model: type[M]) -> params.Depends:
    """A route's JSON body as `model` (a FastAPI dependency: `Annotated[Model, body(Model)]`).
    Read and checked here rather than by FastAPI, so that every edge answers bad bytes, bad
    JSON and bad fields with the same one-line 400, whatever the Content-Type said."""

    async def read(request: Request) -> M:
        return parse(model, load_json(await request.body()))

    return Depends(read)


def parse(model: type[M], data: object, where: str = "") -> M:
    """`data` (decoded JSON) as `model`, or BadRequest naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc.errors(), where) from None


def load_json(raw: bytes) -> object:
    """A request body as JSON (whatever value it holds: the caller narrows it); BadRequest
    (never a traceback) for anything else: bytes that are not UTF-8, NaN and Infinity (not
    JSON), nesting deeper than Python recurses."""
    if not raw.strip():
        raise BadRequest("The request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"The request body is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                         f"{exc.start}); send UTF-8 JSON") from None  # fmt: skip
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON ({exc.msg} at line {exc.lineno} "
                         f"column {exc.colno}); send a JSON object") from None  # fmt: skip
    except RecursionError:
        raise BadRequest("The request body nests too deeply to read; send a flat JSON "
                         "object") from None  # fmt: skip
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise BadRequest(f"The request body is not valid JSON ({exc})") from None


def _no_constant(name: str) -> NoReturn:
    raise BadRequest(f"The request body holds {name}, which is not a JSON number; send a "
                     "finite number")  # fmt: skip


def invalid(errors: Sequence[ErrorDetails], where: str = "") -> BadRequest:
    """Pydantic's (or FastAPI's) validation errors as one line: the first error's field, what
    is wrong with it and the value sent, and how many more there are."""
    found = [(_loc(e["loc"]), e) for e in errors]  # (its field's path, the error)
    none: ErrorDetails = {"type": "", "loc": (), "msg": "?", "input": None}
    first_loc, first = found[0] if found else ([], none)
    if first["type"] == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "")
        return BadRequest(f"The request body is not valid JSON ({why}); send a JSON object")
    # a value no branch of a union took fails in each: the deepest error says the most
    loc, first = max((f for f in found if f[0][:1] == first_loc[:1]),
                     key=lambda f: len(f[0]), default=(first_loc, first))  # fmt: skip
    if not loc and not where and first["type"] != "value_error":
        if first["type"] == "missing":
            return BadRequest("The request body is missing; send a JSON object")
        return BadRequest(f"The request body must be a JSON object ({first['msg']})")
    field = loc[0] + "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in loc[1:]) if loc else ""
    msg = str(first["msg"]).removeprefix("Value error, ")
    shown = first["type"] not in ("missing", "value_error")
    value = f" (got {_shown(first.get('input'))})" if shown else ""
    others = len({tuple(x[:1]) for x, _ in found}) - 1  # other fields (not union branches)
    more = f" (and {others} more problems)" if others > 0 else ""
    head = ": ".join(x for x in (where, field) if x)
    return BadRequest(f"{head}: {msg}{value}{more}" if head else f"{msg}{more}",
                      param=loc[0] if loc else None)  # fmt: skip


def _loc(loc: Iterable[int | str]) -> list[str]:
    """A field's path without FastAPI's "body" and pydantic's union branch tags
    ("str", "list[int]", "function-after[...]")."""
    return [str(x) for x in loc if not (isinstance(x, str) and (x in _TAGS or "[" in x))]


_TAGS = frozenset({"body", "query", "path",  # FastAPI's
                   "str", "int", "float", "bool", "dict", "list", "none"})  # fmt: skip


def _shown(value: object, limit: int = 60) -> str:
    """A value in a message, cut short: an error must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- what the model allows -------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The coordinator's model facts a request is checked against: the model's vocabulary
    (embedding rows), the context each ring reserves per sequence (`--context`), the
    sequences it runs at once (`--max-sequences`), and the most text a token covers."""

    vocab_size: int
    context: int
    max_sequences: int
    token_bytes: int  # the longest token's text, in UTF-8 bytes (0: no tokenizer known)

    @property
    def max_text_bytes(self) -> int:
        return TEXT_SLACK * max(self.token_bytes, 1) * (self.context + 1)

    def ids(self, ids: Sequence[int], field: str) -> list[int]:
        """Token ids the model has."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"{field}: token id {bad} is not in the model's vocabulary "
                             f"0..{self.vocab_size - 1}", param=field.split("[")[0])  # fmt: skip
        return list(ids)

    def encode(self, encode: Callable[[str], list[int]], text: str, field: str) -> list[int]:
        """Text as token ids — refused untokenized when it cannot fit the context anyway."""
        self.text(text, field)
        return encode(text)

    def text(self, text: str, field: str) -> None:
        """Text that could fit the context: checked before any tokenizing, which costs
        ~1 s a megabyte (issue 56: a 3 MB label was tokenized before it was refused)."""
        size = len(text.encode("utf-8"))
        if self.token_bytes and size > self.max_text_bytes:
            raise BadRequest(f"{field}: {size:,} bytes of text cannot fit the context of "
                             f"{self.context} tokens; send a shorter {field} (or start the "
                             "coordinator with a larger --context)", param=field.split("[")[0],
                             code="context_length_exceeded")  # fmt: skip

    def options(self, options: Sequence[str], field: str) -> None:
        """A scoring line's options, counted and sized before they are tokenized."""
        if len(options) > MAX_OPTIONS:  # the frame and its one step stay bounded
            raise BadRequest(f"{field}: {len(options)} options, but a line takes at most "
                             f"{MAX_OPTIONS}; split it into several lines",
                             param=field)  # fmt: skip
        for i, option in enumerate(options):
            self.text(option, f"{field}[{i}]")

    def turns(self, messages: Sequence[object], field: str = "messages") -> None:
        """A conversation whose turns alone overflow the context (each takes at least a
        token), refused before its template runs over them."""
        if len(messages) > self.context:
            raise BadRequest(f"{field}: {len(messages):,} messages cannot fit the context of "
                             f"{self.context} tokens; send fewer", param=field,
                             code="context_length_exceeded")  # fmt: skip

    def generate(self, prompt: Sequence[int], max_tokens: int, field: str = "prompt") -> None:
        """prompt + max_tokens within the context a ring reserves for a sequence."""
        if len(prompt) + max_tokens > self.context:
            raise BadRequest(
                f"This model's maximum context length is {self.context} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the {field}, "
                f"{max_tokens} in the completion). Please reduce the {field} or max_tokens.",
                param=field, code="context_length_exceeded")  # fmt: skip

    def score(self, prompt: Sequence[int], completions: Sequence[Sequence[int]],
              field: str) -> None:  # fmt: skip
        """Scoring: one sequence, the prompt and then each option after it (+ the step that
        scores them); its cache holds the prompt and the longest option."""
        if len(completions) > MAX_OPTIONS:  # the frame and its one step stay bounded
            raise BadRequest(f"{field}: {len(completions)} options, but a line takes at most "
                             f"{MAX_OPTIONS}; split it into several lines",
                             param=field)  # fmt: skip
        longest = max(len(c) for c in completions)
        if len(prompt) + longest + 1 > self.context:
            raise BadRequest(f"{field}: the prompt ({len(prompt)} tokens) and its longest option "
                             f"({longest}) do not fit the context of {self.context} tokens",
                             param=field, code="context_length_exceeded")  # fmt: skip


# Options of one `labels` / `completions` line: they go through the ring after the prompt in
# one sequence (ring/stage.py layers_first), so the bound is the job's size only.
MAX_OPTIONS = 64


def check_speculative(coord: Coordinator, mode: str | None, field: str = "speculative") -> None:
    """`speculative: "draft"` only where every ring placed drafts at its first stage (a
    worker started with --draft): refused at submit, not failed three times by stage 0. With
    no ring placed yet, which nodes will head one is not known: the job waits, and a first
    stage without a draft refuses it then."""
    if mode != "draft":
        return
    placed, drafting = coord.drafting_heads()
    if placed and drafting < placed:
        raise BadRequest(f"{field} 'draft': {placed - drafting} of the swarm's {placed} rings "
                         "have no draft model at their first stage; use auto or lookup, or "
                         "start the workers with --draft MODEL.gguf (cellswarm up --draft)",
                         param=field)  # fmt: skip


def limits_of(coord: Coordinator) -> Limits:
    """What a request to this coordinator is checked against now (its context may change
    with a re-placement; the model's facts are read once)."""
    vocab_size, token_bytes = coord.model_facts
    return Limits(vocab_size, coord.context, coord.config.max_sequences, token_bytes)
