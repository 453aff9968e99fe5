"""The OpenAI-compatible API, served by the coordinator next to its own routes.

    GET  /v1/models                the one model: its file name as id, owned_by "cellswarm"
    GET  /v1/models/{id}
    POST /v1/completions           prompt: a string or token ids (one prompt per request)
    POST /v1/chat/completions      messages -> the model's chat template (generation prompt on)

Both completion routes submit one job to the coordinator's queue (the same job `/v1/requests`
makes), then follow its checkpointed tokens: `stream: true` answers with server-sent events
(`data: {chunk}` lines, then `data: [DONE]`; a chat stream's first delta carries the role,
and `stream_options.include_usage` adds a last chunk with the usage), otherwise one JSON
object with `usage` and `finish_reason` ("stop": an end token of the model or a stop string;
"length": max_tokens). Text is decoded from all tokens so far and handed out only up to the
last whole character, so a streamed answer's deltas add up to the non-streamed text.

Options: max_tokens (chat: also max_completion_tokens; default 16 for completions, the rest
of the context for chat), temperature (default 1, as OpenAI's; 0 is greedy), top_p, seed,
stop, stream, stream_options, n (1 only). Extensions in the body: top_k, min_p,
repetition_penalty, and return_token_ids (each choice gets `token_ids`, its tokens). Not
supported, refused with a 400 naming the parameter: n > 1, best_of > 1, echo, suffix,
logprobs, tools, non-zero presence/frequency penalties, a response_format other than text,
content parts other than text.

Stop strings: the ring stops on token ids only (the tokenizer's end-of-turn tokens, as
`stop_ids`), so stop strings are applied here: the text is cut before the first occurrence of
any of them and the answer finishes at once (`finish_reason` "stop", `completion_tokens` the
fewest tokens whose text holds the stop string). A stream holds back text that could be the
start of a stop string. The job is then cancelled (as it is when a streaming client goes
away): its head's next checkpoint is refused and the head drops the sequence from its ring.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400
invalid_request_error (bad parameters; malformed JSON; FastAPI's validation errors on these
routes; a prompt longer than the context: code context_length_exceeded), 401 invalid_api_key,
404 model_not_found (and unknown paths under these routes), 500 server_error when the swarm
gave up on the job (its attempts spent), 503 server_error (code no_ring) when the coordinator
cannot place the model at all (no live workers, budgets too small). A ring that is merely not
wired yet (workers loading, a rewiring after a failure) is not an error: the job waits in the
durable queue and runs once the ring is up.

Every response of the coordinator carries `x-request-id`; for a completion it is the job id
the coordinator and workers log under (`cellswarm logs ID --dir LOGS` shows its timeline),
also the suffix of the response's id (`chatcmpl-ID`, `cmpl-ID`).

API keys (`--api-key-file`, one key per line, `#` comments): when given, `Authorization:
Bearer KEY` must name one of them on the routes above (checked before the body is read);
the workers' routes have their own auth (the cluster token and sessions).
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cellswarm.engine.sampling import SamplingParams
from cellswarm.errors import CellswarmError, RequestError
from cellswarm.swarm.coordinator import Coordinator

API_PREFIXES = ("/v1/models", "/v1/completions", "/v1/chat/completions")
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_POLL_S = 30.0


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)  # fmt: skip

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def load_api_keys(path: str | None) -> frozenset[str]:
    """The keys in `path`, one per line (blank lines and `#` comments skipped); none: no auth."""
    if path is None:
        return frozenset()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise RequestError(f"--api-key-file {path}: {exc.strerror or exc}") from None
    keys = frozenset(s for line in lines if (s := line.strip()) and not s.startswith("#"))
    if not keys:
        raise RequestError(f"--api-key-file {path} holds no keys: one key per line")
    return keys


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]  # as long as a job id


def _is_api_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in API_PREFIXES)


class RequestIdAndKeys:
    """ASGI middleware: an `x-request-id` header on every response (the job id when a route
    set `request.state.request_id`, else a fresh id), and the API key check on the OpenAI
    routes, before anything reads the body."""

    def __init__(self, app: ASGIApp, keys: frozenset[str] = frozenset()) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["request_id"] = new_request_id()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = str(state["request_id"])
            await send(message)

        if self.keys and _is_api_path(scope["path"]):
            denied = self._denied(Headers(scope=scope).get("authorization", ""))
            if denied is not None:
                return await denied.response()(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)

    def _denied(self, authorization: str) -> OpenAIError | None:
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return OpenAIError(401, "You didn't provide an API key: send 'Authorization: Bearer "
                               "KEY' with a key from the coordinator's --api-key-file",
                               code="invalid_api_key")  # fmt: skip
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.keys):
            shown = key[:3] + "*" * min(max(len(key) - 7, 0), 20) + key[-4:]
            return OpenAIError(401, f"Incorrect API key provided: {shown}",
                               code="invalid_api_key")  # fmt: skip
        return None


# -- requests --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # parameters we do not know are ignored

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # extensions (vLLM spells them the same)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    return_token_ids: bool = False


class CompletionRequest(_Common):
    prompt: Any
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: handed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def _unsupported(req: _Common) -> None:
    def refuse(param: str, why: str) -> None:
        raise OpenAIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")

    if req.n not in (None, 1):
        refuse("n", f"{req.n} choices asked; this server makes one choice per request (n=1)")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            refuse(name, "not supported (use the repetition_penalty extension)")
    if isinstance(req, CompletionRequest):
        if req.echo:
            refuse("echo", "echoing the prompt is not supported")
        if req.best_of not in (None, 1):
            refuse("best_of", "only 1 is supported")
        if req.suffix:
            refuse("suffix", "insertion (a suffix) is not supported")
        if req.logprobs is not None:
            refuse("logprobs", "log probabilities are not supported")
    if isinstance(req, ChatRequest):
        if req.logprobs:
            refuse("logprobs", "log probabilities are not supported")
        if req.tools:
            refuse("tools", "tool calls are not supported")
        if req.response_format and req.response_format.get("type", "text") != "text":
            refuse("response_format", "only {'type': 'text'} is supported")


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise OpenAIError(400, "stop: stop strings must not be empty", param="stop")
    return stops


def _sampling(req: _Common) -> dict[str, Any]:
    fields: dict[str, Any] = {"temperature": 1.0 if req.temperature is None else req.temperature,
              "top_p": req.top_p, "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p,
              "repetition_penalty": req.repetition_penalty}  # fmt: skip
    sampling = {k: v for k, v in fields.items() if v is not None}
    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError, CellswarmError) as exc:
        raise OpenAIError(400, str(exc)) from None
    return sampling


def _prompt_ids(prompt: Any, tok: Any) -> list[int]:
    """A completion prompt: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise OpenAIError(400, f"prompt: {len(prompt)} prompts given; send one per request",
                          param="prompt")  # fmt: skip
    if isinstance(prompt, str):
        ids = list(tok.encode(prompt))
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise OpenAIError(400, f"prompt: token id {bad[0]} is not in 0..{tok.vocab_size - 1}",
                              param="prompt")  # fmt: skip
    else:
        raise OpenAIError(400, "prompt must be a string or a list of token ids", param="prompt")
    if not ids:
        raise OpenAIError(400, "prompt: the prompt is empty", param="prompt")
    return ids


def _chat_ids(messages: list[ChatMessage], tok: Any) -> list[int]:
    turns = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            kinds = {str(p.get("type")) for p in content} - {"text"}
            if kinds:
                raise OpenAIError(400, f"messages[{i}].content: only text parts are supported, "
                                  f"not {sorted(kinds)}", param="messages")  # fmt: skip
            content = "".join(str(p.get("text", "")) for p in content)
        extra = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
        role = "system" if m.role == "developer" else m.role
        turns.append({**extra, "role": role, "content": content or ""})
    text = tok.apply_chat_template(turns, add_generation_prompt=True)
    return list(tok.encode(text, add_special=False))  # the template wrote BOS if it wants one


# -- following a job -------------------------------------------------------------------------


class TextStream:
    """A completion's text as its tokens come: each `feed` gets every token so far and gives
    the new text, never the half of a UTF-8 character (a trailing U+FFFD waits) nor what could
    be the start of a stop string; the text is cut before the first stop string."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Iterable[str] = ()) -> None:
        self.decode, self.stops = decode, [s for s in stops if s]
        self.shown = ""
        self.stopped = False  # a stop string ended it
        self.used = 0  # tokens the answer took
        self.tokens: list[int] = []  # every token so far
        self.finish: str | None = None  # set by _follow: "stop" or "length"

    def feed(self, tokens: Sequence[int], last: bool) -> str:
        if self.stopped:
            return ""
        text = self.decode(tokens)
        self.tokens, self.used = list(tokens), len(tokens)
        cut = min((i for s in self.stops if (i := text.find(s)) >= 0), default=None)
        if cut is not None:
            self.stopped = True
            self.used = self._fewest(tokens)
            return self._advance(text[:cut])
        if not last:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._partial_stop(text)]
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.shown):  # more tokens changed earlier text: keep what went
            return ""
        delta, self.shown = text[len(self.shown) :], text
        return delta

    def _partial_stop(self, text: str) -> int:
        return max((m for s in self.stops for m in range(1, len(s)) if text.endswith(s[:m])),
                   default=0)  # fmt: skip

    def _fewest(self, tokens: Sequence[int]) -> int:
        k = len(tokens)
        while k > 1 and any(s in self.decode(tokens[: k - 1]) for s in self.stops):
            k -= 1
        return k


async def _follow(coord: Coordinator, job_id: str, stream: TextStream) -> AsyncIterator[str]:
    """The job's text deltas until it ends or a stop string does; then `stream.finish` is set
    ("stop"/"length"). A job the swarm gave up on raises
    a server_error."""
    from cellswarm.swarm.server import wait_for_job

    seen = 0
    while True:
        job = await wait_for_job(coord, job_id, seen, MAX_POLL_S)
        tokens = list(job.result.get("tokens", [])) if job.result else list(job.tokens)
        if job.terminal and job.state != "done":
            why = job.error or job.state
            raise OpenAIError(500, f"the swarm could not finish request {job_id}: {why}",
                              type="server_error", code="request_failed")  # fmt: skip
        if len(tokens) > seen or job.terminal:
            seen = len(tokens)
            delta = stream.feed(tokens, job.terminal)
            if delta:
                yield delta
            if stream.stopped and not job.terminal:  # the ring stops on ids only: tell it
                coord.queue.cancel_job(job_id, "a stop string ended the answer")
                coord.log.event("cancelled", job_id, why="stop string")
            if stream.stopped or job.terminal:
                reason = str((job.result or {}).get("reason", ""))
                length = reason == "max_tokens" and not stream.stopped
                stream.finish = "length" if length else "stop"
                return


# -- the routes ------------------------------------------------------------------------------


def add_openai_routes(app: FastAPI, coord: Coordinator, api_keys: Iterable[str] = ()) -> None:
    """OpenAI's routes on the coordinator's app, the request-id middleware (every route), and
    OpenAI-shaped errors for these routes (other routes keep the app's own)."""
    keys = frozenset(api_keys)
    app.add_middleware(RequestIdAndKeys, keys=keys)
    path = Path(coord.config.model)
    model_id = path.name
    try:
        created = int(path.stat().st_mtime)
    except OSError:
        created = 0
    model_card = {"id": model_id, "object": "model", "created": created, "owned_by": "cellswarm"}

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        if not _is_api_path(request.url.path):
            return await request_validation_exception_handler(request, exc)
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if not _is_api_path(request.url.path):
            return await http_exception_handler(request, exc)
        kind = "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                           kind, code=code).response()  # fmt: skip

    def check_model(name: str) -> None:
        if name not in (model_id, path.stem):
            raise OpenAIError(404, f"The model `{name}` does not exist; this swarm serves "
                              f"`{model_id}`", param="model", code="model_not_found")  # fmt: skip

    def tokenizer() -> Any:
        try:
            return coord.tokenizer
        except CellswarmError as exc:
            raise OpenAIError(400, str(exc)) from None

    def submit(request: Request, prompt: list[int], max_tokens: int | None, req: _Common,
               route: str) -> tuple[str, int]:  # fmt: skip
        """The job's id and its max_tokens, after checking the ring can be had at all."""
        context = coord.config.context
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_TOKENS if route == "completions" else context - len(
                prompt)  # fmt: skip
        if len(prompt) + max(max_tokens, 1) > context:
            raise OpenAIError(400, f"This model's maximum context length is {context} tokens. "
                              f"However, you requested {len(prompt) + max_tokens} tokens "
                              f"({len(prompt)} in the prompt, {max_tokens} in the completion). "
                              "Please reduce the prompt or the completion length.",
                              param="messages" if route == "chat" else "prompt",
                              code="context_length_exceeded")  # fmt: skip
        if coord.problem:
            raise OpenAIError(503, f"the swarm cannot serve the model: {coord.problem}",
                              type="server_error", code="no_ring")  # fmt: skip
        payload = {"prompt": prompt, "max_tokens": max_tokens, "sampling": _sampling(req),
                   "stop_ids": sorted(tokenizer().stop_ids), "text": False}  # fmt: skip
        job = coord.submit(payload)
        request.state.request_id = job.job_id
        coord.log.event("openai", job.job_id, route=route, stream=bool(req.stream),
                        prompt_tokens=len(prompt), max_tokens=max_tokens)  # fmt: skip
        return job.job_id, max_tokens

    def usage(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card

    async def run(request: Request, req: _Common, prompt: list[int], max_tokens: int | None,
                  route: Literal["chat", "completions"]) -> Response:  # fmt: skip
        _unsupported(req)
        stops = _stops(req.stop)
        tok = tokenizer()
        job_id, _ = submit(request, prompt, max_tokens, req, route)
        chat = route == "chat"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job_id}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model_id}  # fmt: skip
        stream = TextStream(lambda ids: tok.decode(ids, skip_special=True), stops)
        t0 = time.perf_counter()

        def choice(text: str | None, finish: str | None, streaming: bool) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0}
            if chat:
                message: dict[str, Any] = {} if text is None else {"content": text}
                if not streaming:
                    message = {"role": "assistant", "content": text}
                c["delta" if streaming else "message"] = message
            else:
                c["text"] = text or ""
            c |= {"logprobs": None, "finish_reason": finish}
            if finish is not None and req.return_token_ids:
                c["token_ids"] = stream.tokens[: stream.used]
            return c

        def done() -> tuple[str, dict[str, int]]:
            finish = str(stream.finish)
            coord.log.event("answered", job_id, route=route, finish_reason=finish,
                            completion_tokens=stream.used,
                            ms=round(1000 * (time.perf_counter() - t0), 1))  # fmt: skip
            return finish, usage(len(prompt), stream.used)

        if not req.stream:
            text = "".join([d async for d in _follow(coord, job_id, stream)])
            finish, used = done()
            return JSONResponse({**head, "choices": [choice(text, finish, False)], "usage": used})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(choices: list[dict[str, Any]], used: dict[str, int] | None = None) -> str:
            chunk: dict[str, Any] = {**chunk_head, "choices": choices}
            if include_usage:
                chunk["usage"] = used
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            if chat:
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])  # fmt: skip
            try:
                async for delta in _follow(coord, job_id, stream):
                    yield event([choice(delta, None, True)])
            except OpenAIError as exc:
                yield f"data: {json.dumps(exc.body())}\n\n"
                return
            except BaseException:  # the client went away mid-stream: stop the job too
                if coord.queue.cancel_job(job_id, "the client disconnected"):
                    coord.log.event("cancelled", job_id, why="client disconnected")
                raise
            finish, used = done()
            yield event([choice(None if chat else "", finish, True)])
            if include_usage:
                yield event([], used)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Response:
        check_model(req.model)
        return await run(request, req, _prompt_ids(req.prompt, tokenizer()), req.max_tokens,
                         "completions")  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest) -> Response:
        check_model(req.model)
        try:
            prompt = _chat_ids(req.messages, tokenizer())
        except CellswarmError as exc:  # the template refused the conversation
            raise OpenAIError(400, str(exc), param="messages") from None
        return await run(request, req, prompt, req.max_completion_tokens or req.max_tokens,
                         "chat")  # fmt: skip


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors: list[dict[str, Any]] = [dict(e) for e in exc.errors()]
    first: dict[str, Any] = errors[0] if errors else {"type": "", "loc": (), "msg": "?"}
    if first["type"] == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "")
        return OpenAIError(400, f"The request body is not valid JSON ({why}); send a JSON object")
    loc = [str(x) for x in first["loc"] if x != "body"]
    if not loc:
        if first["type"] == "missing":
            return OpenAIError(400, "The request body is missing; send a JSON object")
        return OpenAIError(400, f"The request body must be a JSON object ({first['msg']})")
    where = loc[0] + "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in loc[1:])
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    value = "" if first["type"] == "missing" else f" (got {first.get('input')!r})"
    return OpenAIError(400, f"{where}: {first['msg']}{value}{more}", param=loc[0])
