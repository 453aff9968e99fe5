"""The OpenAI-compatible API, served by the coordinator next to its own routes.

    GET  /v1/models                the one model: its file name as id, owned_by "cellswarm",
                                   its served context as max_model_len (vLLM's name)
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
repetition_penalty, return_token_ids (each choice gets `token_ids`, its tokens) and
skip_special_tokens (default true: false shows special tokens' text), vLLM's names. Not
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
invalid_request_error (bad parameters, checked by schema.py's models at submit: a seed
outside 0..2^64-1, a token id outside the vocabulary, malformed JSON; a prompt longer than the
context: code context_length_exceeded), 401 invalid_api_key, 413 body_too_large (--max-body),
404 model_not_found (and unknown paths under these routes), 500 server_error when the swarm
gave up on the job (its attempts spent), 503 server_error (code no_ring) when the coordinator
cannot place the model at all (no live workers, budgets too small). A ring that is merely not
wired yet (workers loading, a rewiring after a failure) is not an error: the job waits in the
durable queue and runs once the ring is up.

Every response of the coordinator carries `x-request-id`; for a completion it is the job id
the coordinator and workers log under (`cellswarm logs ID --dir LOGS` shows its timeline),
also the suffix of the response's id (`chatcmpl-ID`, `cmpl-ID`).

API keys (`--api-key-file`, access.py): when given, `Authorization: Bearer KEY` must name one
of them on these routes as on every client route (checked before the body is read); a
completion's job belongs to its key.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cellswarm.engine.sampling import SamplingParams
from cellswarm.engine.text import StopText
from cellswarm.errors import CellswarmError
from cellswarm.swarm.api.schema import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    body,
    chat_turns,
)
from cellswarm.swarm.api.schema import OpenAICommon as _Common
from cellswarm.swarm.control.coordinator import Coordinator

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


# -- requests --------------------------------------------------------------------------------


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
    sampling = {"temperature": 1.0, **req.sampling()}  # OpenAI's default temperature is 1
    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError, CellswarmError) as exc:
        raise OpenAIError(400, str(exc)) from None
    return sampling


def _prompt_ids(prompt: Any, tok: Any, limits: Any) -> list[int]:
    """A completion prompt: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise OpenAIError(400, f"prompt: {len(prompt)} prompts given; send one per request",
                          param="prompt")  # fmt: skip
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise OpenAIError(400, f"prompt: is not valid Unicode text (a lone surrogate at "
                              f"character {exc.start}); send UTF-8 text", param="prompt") from None
        ids = limits.encode(tok.encode, prompt, "prompt")
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        ids = limits.ids(prompt, "prompt")
    else:
        raise OpenAIError(400, "prompt must be a string or a list of token ids", param="prompt")
    if not ids:
        raise OpenAIError(400, "prompt: the prompt is empty", param="prompt")
    return ids


def _chat_ids(messages: list[ChatMessage], tok: Any, limits: Any) -> list[int]:
    text = tok.apply_chat_template(chat_turns(messages), add_generation_prompt=True)
    # the template wrote BOS if it wants one
    return list(limits.encode(lambda t: tok.encode(t, add_special=False), text, "messages"))


# -- following a job -------------------------------------------------------------------------


def _cancel(coord: Coordinator, job_id: str, reason: str, why: str) -> None:
    if coord.queue.cancel_job(job_id, reason):
        coord.log.event("cancelled", job_id, why=why)


async def _follow(coord: Coordinator, job_id: str, stream: StopText) -> AsyncIterator[str]:
    """The job's text deltas until it ends or a stop string does; then `stream.finish` is set
    ("stop"/"length"). A job the swarm gave up on raises
    a server_error."""
    from cellswarm.swarm.api.server import wait_for_job

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
                await coord.on_core(_cancel, coord, job_id, "a stop string ended the answer",
                                    "stop string")  # fmt: skip
            if stream.stopped or job.terminal:
                reason = str((job.result or {}).get("reason", ""))
                length = reason == "max_tokens" and not stream.stopped
                stream.finish = "length" if length else "stop"
                return


# -- the routes ------------------------------------------------------------------------------


class Answer:
    """One request's answer as OpenAI shapes it: its id and head, its choices (a message or
    a delta), the finish and usage once the job ends, and SSE events."""

    def __init__(self, routes: OpenAIRoutes, req: _Common, prompt: list[int], job_id: str,
                 route: str, stream: StopText) -> None:  # fmt: skip
        self.routes, self.req, self.prompt, self.job_id = routes, req, prompt, job_id
        self.route, self.chat, self.stream = route, route == "chat", stream
        self.head = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{job_id}",
                     "object": "chat.completion" if self.chat else "text_completion",
                     "created": int(time.time()), "model": routes.model_id}  # fmt: skip
        self.t0 = time.perf_counter()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def choice(self, text: str | None, finish: str | None, streaming: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0}
        if self.chat:
            message: dict[str, Any] = {} if text is None else {"content": text}
            if not streaming:
                message = {"role": "assistant", "content": text}
            c["delta" if streaming else "message"] = message
        else:
            c["text"] = text or ""
        c |= {"logprobs": None, "finish_reason": finish}
        if finish is not None:  # vLLM's: the stop string that ended it (None: a token, length)
            c["stop_reason"] = self.stream.stopped_by
        if finish is not None and self.req.return_token_ids:
            c["token_ids"] = self.stream.tokens[: self.stream.used]
        return c

    def done(self) -> tuple[str, dict[str, int]]:
        """The finish reason and usage, logged once the answer ends."""
        finish, used = str(self.stream.finish), self.stream.used
        ms = round(1000 * (time.perf_counter() - self.t0), 1)
        log = self.routes.coord.log
        log.event("answered", self.job_id, route=self.route, finish_reason=finish,
                  completion_tokens=used, ms=ms)  # fmt: skip
        return finish, {"prompt_tokens": len(self.prompt), "completion_tokens": used,
                        "total_tokens": len(self.prompt) + used}  # fmt: skip

    async def whole(self) -> JSONResponse:
        coord = self.routes.coord
        text = "".join([d async for d in _follow(coord, self.job_id, self.stream)])
        finish, used = self.done()
        return JSONResponse({**self.head, "choices": [self.choice(text, finish, False)],
                             "usage": used})  # fmt: skip

    def event(self, choices: list[dict[str, Any]], used: dict[str, int] | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk: dict[str, Any] = {**self.head, "object": obj, "choices": choices}
        if self.include_usage:
            chunk["usage"] = used
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        coord = self.routes.coord
        if self.chat:
            yield self.event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}])  # fmt: skip
        try:
            async for delta in _follow(coord, self.job_id, self.stream):
                yield self.event([self.choice(delta, None, True)])
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
            return
        except BaseException:  # the client went away mid-stream: stop the job too
            # not awaited (a cancelled stream cannot await), but still on the core thread
            coord.core.submit(_cancel, coord, self.job_id, "the client disconnected",
                              "client disconnected")  # fmt: skip
            raise
        finish, used = self.done()
        yield self.event([self.choice(None if self.chat else "", finish, True)])
        if self.include_usage:
            yield self.event([], used)
        yield "data: [DONE]\n\n"


class OpenAIRoutes:
    """What the routes share: the coordinator, the model's card, and submitting a job."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.path = Path(coord.config.model)
        self.model_id = self.path.name
        try:
            created = int(self.path.stat().st_mtime)
        except OSError:
            created = 0
        self.created = created
        self.trained: int | None = None  # the model's own context (GGUF context_length)

    def card(self) -> dict[str, Any]:
        """The model object. Its served context (prompt + completion, the most a request may
        ask) under the names clients read: vLLM's `max_model_len`, and llama.cpp's `meta`
        (n_ctx served, n_ctx_train the model's own, which --context may lower)."""
        from cellswarm.loader import read_config

        coord = self.coord
        if self.trained is None:  # read once: a big model's header takes a while
            with contextlib.suppress(CellswarmError):  # a bad file: each request says so
                self.trained = int(read_config(coord.config.model).context_length)
        trained = self.trained
        served = coord.context if trained is not None else None
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "cellswarm", "max_model_len": served,
                "meta": {"n_ctx": served, "n_ctx_train": trained}}  # fmt: skip

    def check_model(self, name: str) -> None:
        if name not in (self.model_id, self.path.stem):
            raise OpenAIError(404, f"The model `{name}` does not exist; this swarm serves "
                              f"`{self.model_id}`", param="model",
                              code="model_not_found")  # fmt: skip

    def tokenizer(self) -> Any:
        try:
            return self.coord.tokenizer
        except CellswarmError as exc:
            raise OpenAIError(400, str(exc)) from None

    def submit(self, request: Request, prompt: list[int], max_tokens: int | None, req: _Common,
               route: str) -> str:  # fmt: skip
        """The job's id: the request checked against the model first (a bad one is a 400
        even when no ring is up), then whether a ring can be had at all."""
        coord = self.coord
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_TOKENS if route == "completions" else max(
                coord.context - len(prompt), 1)  # fmt: skip
        coord.limits.generate(prompt, max_tokens, "messages" if route == "chat" else "prompt")
        sampling = _sampling(req)
        stop_ids = sorted(self.tokenizer().stop_ids)
        if coord.problem:
            raise OpenAIError(503, f"the swarm cannot serve the model: {coord.problem}",
                              type="server_error", code="no_ring")  # fmt: skip
        payload = {"prompt": prompt, "max_tokens": max_tokens, "sampling": sampling,
                   "stop_ids": stop_ids, "text": False}  # fmt: skip
        job = coord.submit(payload, owner=request.state.caller.owner)
        request.state.request_id = job.job_id
        coord.log.event("openai", job.job_id, route=route, stream=bool(req.stream),
                        prompt_tokens=len(prompt), max_tokens=max_tokens)  # fmt: skip
        return job.job_id

    async def run(
        self, request: Request, req: _Common, prompt: list[int], max_tokens: int | None,
        route: Literal["chat", "completions"],
    ) -> Response:  # fmt: skip
        _unsupported(req)
        stops = _stops(req.stop)
        tok = self.tokenizer()
        job_id = await self.coord.on_core(self.submit, request, prompt, max_tokens, req, route)
        skip = req.skip_special_tokens
        text = StopText(lambda ids: tok.decode(ids, skip_special=skip), stops)
        answer = Answer(self, req, prompt, job_id, route, text)
        if not req.stream:
            return await answer.whole()
        return StreamingResponse(answer.events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})  # fmt: skip


def add_openai_routes(app: FastAPI, coord: Coordinator) -> None:
    """OpenAI's routes on the coordinator's app (server.py puts access.Edge in front and
    answers their errors in OpenAI's shape)."""
    routes = OpenAIRoutes(coord)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [routes.card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        routes.check_model(name)
        return routes.card()

    @app.post("/v1/completions")
    async def completions(
        request: Request, req: Annotated[CompletionRequest, body(CompletionRequest)]
    ) -> Response:
        routes.check_model(req.model)
        prompt = _prompt_ids(req.prompt, routes.tokenizer(), coord.limits)
        return await routes.run(request, req, prompt, req.max_tokens, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(
        request: Request, req: Annotated[ChatRequest, body(ChatRequest)]
    ) -> Response:
        routes.check_model(req.model)
        try:
            prompt = _chat_ids(req.messages, routes.tokenizer(), coord.limits)
        except CellswarmError as exc:  # the template refused the conversation
            raise OpenAIError(400, str(exc), param="messages") from None
        return await routes.run(request, req, prompt, req.max_completion_tokens or req.max_tokens,
                                "chat")  # fmt: skip
