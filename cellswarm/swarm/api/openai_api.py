"""The OpenAI-compatible API, served by the coordinator next to its own routes.

    GET  /v1/models                the one model: its file name as id, owned_by "cellswarm",
                                   its served context as max_model_len (vLLM's name)
    GET  /v1/models/{id}
    POST /v1/completions           prompt: a string, token ids, or a list of either
    POST /v1/chat/completions      messages -> the model's chat template (generation prompt on)
    POST /tokenize, /detokenize; GET /tokenizer_info    vLLM's (lm-eval's remote tokenizer)

Each choice is one job of the coordinator's queue (the job `/v1/requests` makes); a request
has prompts x n choices (at most 64), choice j of a prompt sampling with seed + j. A single
choice may stream: `stream: true` answers with server-sent events (`data: {chunk}` lines,
then `data: [DONE]`; a chat stream's first delta carries the role, and
`stream_options.include_usage` adds a last chunk with the usage); otherwise one JSON object
with `usage` and each choice's `finish_reason` ("stop": an end token of the model or a stop
string, which vLLM's `stop_reason` names; "length": max_tokens). Text is decoded from all
tokens so far and handed out only up to the last whole character, so a streamed answer's
deltas add up to the non-streamed text.

Options: max_tokens (chat: also max_completion_tokens; default 16 for completions, the rest
of the context for chat; 0 with echo: the prompt scored alone), temperature (default 1, as
OpenAI's; 0 is greedy), top_p, seed, stop, n, echo, presence_penalty and frequency_penalty
(OpenAI's definition, over the output), logit_bias, logprobs (completions: 0..20
alternatives; chat: logprobs + top_logprobs) — the answer is scored after it is made, by a
scoring job over the same tokens (the same logits, bit for bit: engine/openai_shapes.py) — user
and metadata (logged with the job). Extensions: top_k, min_p, repetition_penalty,
return_token_ids (each choice's `token_ids`) and skip_special_tokens (vLLM's names).
Refused with a 400 naming the parameter: a field this server does not know (OpenAI's own
"Unrecognized request argument supplied"), best_of > 1, suffix, tools and tool_choice other
than "none", parallel_tool_calls, reasoning_effort, a response_format other than text,
content parts other than text, several choices or log-probabilities with stream.

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

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cellswarm.engine.openai_shapes import Detail, chat_logprobs, completion_logprobs
from cellswarm.engine.sampling import SamplingParams
from cellswarm.engine.text import StopText
from cellswarm.errors import CellswarmError
from cellswarm.io.tokenizer import Tokenizer
from cellswarm.swarm.api.schema import (
    MAX_CHOICES,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    Reply,
    TokenizeRequest,
    body,
    chat_turns,
    check_speculative,
    limits_of,
)
from cellswarm.swarm.api.schema import OpenAICommon as _Common
from cellswarm.swarm.control.coordinator import Coordinator
from cellswarm.swarm.protocol.jsonvalue import JsonObject, JsonValue

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_POLL_S = 30.0
IDLE_S = 3.0  # a stream with no token for this long gets a comment saying why


def waiting_for(coord: Coordinator) -> str:
    """Why a job has no new token: what the swarm is doing."""
    if coord.problem:
        return f"the swarm cannot place the model ({coord.problem})"
    if coord.wired_epoch != coord.epoch:
        return "the ring is being rewired (a node was lost or joined); the request resumes"
    return "the ring is busy (queued behind other work, or a long step)"


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)  # fmt: skip

    def body(self) -> JsonObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# -- requests --------------------------------------------------------------------------------


def _unsupported(req: _Common, prompts: int) -> None:
    """Refuse, naming it, whatever this server would otherwise silently not do."""
    def refuse(param: str, why: str) -> None:
        raise OpenAIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")

    for name in req.model_extra or {}:  # OpenAI's own words for a field it does not know
        raise OpenAIError(400, f"Unrecognized request argument supplied: {name[:60]}",
                          param=name[:60], code="unrecognized_parameter")  # fmt: skip
    n = req.n or 1
    if n * prompts > MAX_CHOICES:
        refuse("n", f"{prompts} prompts x n={n} choices is over {MAX_CHOICES} in one request; "
               "send fewer, or use a batch (cellswarm batch submit)")
    if req.stream and n * prompts > 1:
        refuse("n" if n > 1 else "prompt", "several choices are not streamed; ask without "
               "stream, or send one request each")
    if req.stream and _top(req) is not None:
        refuse("logprobs", "log probabilities come with the whole answer; ask without stream")
    if req.tool_choice not in (None, "none"):
        refuse("tool_choice", "tool calls are not supported ('none' only)")
    if req.parallel_tool_calls is not None:
        refuse("parallel_tool_calls", "tool calls are not supported")
    if req.reasoning_effort is not None:
        refuse("reasoning_effort", "this model has no reasoning setting")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            refuse("best_of", "only 1 is supported (use n for several choices)")
        if req.suffix:
            refuse("suffix", "insertion (a suffix) is not supported")
        if req.max_tokens == 0 and not req.echo:
            refuse("max_tokens", "0 makes nothing: ask for 1 or more, or set echo")
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            refuse("top_logprobs", "needs logprobs: true")
        if req.tools:
            refuse("tools", "tool calls are not supported")
        if req.response_format and req.response_format.get("type", "text") != "text":
            refuse("response_format", "only {'type': 'text'} is supported")


def _top(req: _Common) -> int | None:
    """How many alternatives each token's log-probability lists; None: no log-probabilities."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if isinstance(req, ChatRequest) and req.logprobs:
        return req.top_logprobs or 0
    return None


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


def _prompts(prompt: object, tok: Tokenizer, limits: Limits) -> list[list[int]]:
    """A completion's prompts: a string, token ids, or a list of either (several prompts,
    each its own choices)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise OpenAIError(400, f"prompt: {len(prompt)} prompts is over {MAX_CHOICES} in one "
                              "request; use a batch", param="prompt")  # fmt: skip
        return [_prompt_ids(p, tok, limits) for p in prompt]
    return [_prompt_ids(prompt, tok, limits)]


def _prompt_ids(prompt: object, tok: Tokenizer, limits: Limits) -> list[int]:
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
        raise OpenAIError(400, "prompt must be a string, a list of token ids, or a list of "
                          "either", param="prompt")  # fmt: skip
    if not ids:
        raise OpenAIError(400, "prompt: the prompt is empty", param="prompt")
    return ids


def _chat_ids(messages: list[ChatMessage], tok: Tokenizer, limits: Limits) -> list[int]:
    text = tok.apply_chat_template(chat_turns(messages), add_generation_prompt=True)
    # the template wrote BOS if it wants one
    return list(limits.encode(lambda t: tok.encode(t, add_special=False), text, "messages"))


# -- following a job -------------------------------------------------------------------------


def _cancel(coord: Coordinator, job_id: str, reason: str, why: str) -> None:
    if coord.queue.cancel_job(job_id, reason):
        coord.log.event("cancelled", job_id, why=why)


async def _follow(coord: Coordinator, job_id: str, stream: StopText,
                  idle_s: float | None = None, drafts: Drafts | None = None,
                  ) -> AsyncIterator[str]:  # fmt: skip
    """The job's text deltas until it ends or a stop string does; then `stream.finish` is set
    ("stop"/"length"), and `drafts` to its speculative drafts verified and kept. A job the
    swarm gave up on raises a server_error. With `idle_s`, an empty delta each time that
    long passes without a token (a stream says it still waits)."""
    from cellswarm.swarm.api.server import wait_for_job

    seen = 0
    while True:
        job = await wait_for_job(coord, job_id, seen, idle_s or MAX_POLL_S)
        tokens = list(job.result.get("tokens", [])) if job.result else list(job.tokens)
        if idle_s and len(tokens) <= seen and not job.terminal:
            yield ""
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
                if drafts is not None and job.result:
                    drafts.add(job.result)
                reason = str((job.result or {}).get("reason", ""))
                length = reason == "max_tokens" and not stream.stopped
                stream.finish = "length" if length else "stop"
                return


class Drafts:
    """Speculative decoding's count for a request's usage: drafts the ring verified, and
    kept (OpenAI's names for predicted tokens: accepted_prediction_tokens, rejected_...)."""

    def __init__(self) -> None:
        self.drafted = self.accepted = 0

    def add(self, result: Mapping[str, object]) -> None:
        self.drafted += int(str(result.get("drafted") or 0))
        self.accepted += int(str(result.get("accepted") or 0))

    def details(self) -> JsonObject:
        """usage's `completion_tokens_details`, or nothing when none was drafted."""
        if not self.drafted:
            return {}
        return {"completion_tokens_details": {
            "accepted_prediction_tokens": self.accepted,
            "rejected_prediction_tokens": self.drafted - self.accepted}}


# -- the routes ------------------------------------------------------------------------------


class Answer:
    """One streamed answer as OpenAI shapes it: its id and head, its deltas as SSE events,
    the finish and usage once the job ends (several choices and log-probabilities are not
    streamed: `OpenAIRoutes.whole` answers those)."""

    def __init__(self, routes: OpenAIRoutes, req: _Common, prompt: list[int], job_id: str,
                 route: str, stream: StopText, echo: str = "") -> None:  # fmt: skip
        self.routes, self.req, self.prompt, self.job_id = routes, req, prompt, job_id
        self.route, self.chat, self.stream, self.echo = route, route == "chat", stream, echo
        self.head = routes.head(job_id, route)
        self.t0 = time.perf_counter()
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.drafts = Drafts()

    def choice(self, text: str | None, finish: str | None) -> JsonObject:
        c: JsonObject = {"index": 0}
        if self.chat:
            c["delta"] = {} if text is None else {"content": text}
        else:
            c["text"] = text or ""
        c |= {"logprobs": None, "finish_reason": finish}
        if finish is not None:
            c |= self.routes.ending(self.req, self.stream)
        return c

    def event(self, choices: list[JsonValue], used: JsonObject | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk: JsonObject = {**self.head, "object": obj, "choices": choices}
        if self.include_usage:
            chunk["usage"] = used
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        coord = self.routes.coord
        if self.chat:
            yield self.event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}])  # fmt: skip
        if self.echo:
            yield self.event([self.choice(self.echo, None)])
        try:
            if self.job_id:
                async for delta in _follow(coord, self.job_id, self.stream, IDLE_S,
                                           self.drafts):  # fmt: skip
                    # an SSE comment when nothing came for a while: clients skip it, a
                    # watcher sees the stream alive and why it waits
                    yield self.event([self.choice(delta, None)]) if delta else (
                        f": waiting {IDLE_S:.0f} s more: {waiting_for(coord)}\n\n")
            else:  # max_tokens 0: the echo alone
                self.stream.finish = "length"
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
            return
        except BaseException:  # the client went away mid-stream: stop the job too
            # not awaited (a cancelled stream cannot await), but still on the core thread
            coord.core.submit(_cancel, coord, self.job_id, "the client disconnected",
                              "client disconnected")  # fmt: skip
            raise
        used = self.routes.usage([self.prompt], [self.stream], self.drafts)
        self.routes.answered(self.job_id, self.route, [self.stream], self.t0)
        yield self.event([self.choice(None if self.chat else "", str(self.stream.finish))])
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

    def card(self) -> JsonObject:
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

    def tokenizer(self) -> Tokenizer:
        try:
            return self.coord.tokenizer
        except CellswarmError as exc:
            raise OpenAIError(400, str(exc)) from None

    def head(self, job_id: str, route: str) -> JsonObject:
        chat = route == "chat"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job_id}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_id}  # fmt: skip

    def submit(self, request: Request, prompt: list[int], max_tokens: int | None, req: _Common,
               route: str, seed_offset: int = 0) -> str:  # fmt: skip
        """The job's id: the request checked against the model first (a bad one is a 400
        even when no ring is up), then whether a ring can be had at all. Choice j of n
        samples with seed + j (each choice its own draw, all reproducible)."""
        coord = self.coord
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_TOKENS if route == "completions" else max(
                coord.context - len(prompt), 1)  # fmt: skip
        limits_of(coord).generate(prompt, max_tokens, "messages" if route == "chat" else "prompt")
        sampling = _sampling(req)
        limits_of(coord).ids(req.bias_ids(), "logit_bias")
        if seed_offset and sampling.get("seed") is not None:
            sampling["seed"] = (int(sampling["seed"]) + seed_offset) % 2**64
        stop_ids = sorted(self.tokenizer().stop_ids)
        check_speculative(coord, req.speculative)
        self.check_ring()
        payload = {"prompt": prompt, "max_tokens": max_tokens, "sampling": sampling,
                   "stop_ids": stop_ids, "text": False}  # fmt: skip
        if req.speculative is not None:
            payload["speculative"] = req.speculative
        job = coord.submit(payload, owner=request.state.caller.owner)
        request.state.request_id = job.job_id
        said = {k: v for k in ("user", "metadata") if (v := getattr(req, k)) is not None}
        coord.log.event("openai", job.job_id, route=route, stream=bool(req.stream),
                        prompt_tokens=len(prompt), max_tokens=max_tokens, **said)  # fmt: skip
        return job.job_id

    def check_ring(self) -> None:
        if self.coord.problem:
            raise OpenAIError(503, f"the swarm cannot serve the model: {self.coord.problem}",
                              type="server_error", code="no_ring")  # fmt: skip

    def submit_score(self, request: Request, ids: list[int], start: int, top: int) -> str:
        """A scoring job over ids[start:] given ids[:start], each token with its `top`
        likeliest alternatives."""
        coord = self.coord
        limits_of(coord).score(ids[:start], [ids[start:]], "prompt")
        self.check_ring()
        payload = {"prompt": ids[:start], "completions": [ids[start:]], "top": top}
        job = coord.submit(payload, kind="score", owner=request.state.caller.owner)
        coord.log.event("openai", job.job_id, route="logprobs", prompt_tokens=len(ids))
        return job.job_id

    async def detail(self, request: Request, ids: list[int], start: int,
                     top: int) -> Detail:  # fmt: skip
        """Each token of ids[start:] scored (engine/scoring.py token_detail); [] for none."""
        if start >= len(ids):
            return []
        from cellswarm.swarm.api.server import wait_for_job

        job_id = await self.coord.on_core(self.submit_score, request, ids, start, top)
        while not (job := await wait_for_job(self.coord, job_id, 0, MAX_POLL_S)).terminal:
            pass
        if job.state != "done" or not job.result or "detail" not in job.result:
            raise OpenAIError(500, f"the swarm could not score request {job_id}: "
                              f"{job.error or job.state}", type="server_error",
                              code="request_failed")  # fmt: skip
        return list(job.result["detail"][0])

    def ending(self, req: _Common, stream: StopText) -> JsonObject:
        """What a choice's last chunk adds: vLLM's stop_reason (the stop string that ended
        it; None for an end token or the length), and its token ids when asked."""
        out: JsonObject = {"stop_reason": stream.stopped_by}
        if req.return_token_ids:
            out["token_ids"] = [*stream.tokens[: stream.used]]
        return out

    @staticmethod
    def usage(prompts: list[list[int]], streams: list[StopText], drafts: Drafts) -> JsonObject:
        """OpenAI's usage: each prompt counted once (not once per choice); the drafts."""
        p, c = sum(len(x) for x in prompts), sum(s.used for s in streams)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                **drafts.details()}  # fmt: skip

    def answered(self, job_id: str, route: str, streams: list[StopText], t0: float) -> None:
        ms = round(1000 * (time.perf_counter() - t0), 1)
        self.coord.log.event("answered", job_id, route=route, ms=ms,
                             finish_reason=",".join(str(s.finish) for s in streams),
                             completion_tokens=sum(s.used for s in streams))  # fmt: skip

    def text_stream(self, req: _Common, stops: list[str]) -> StopText:
        tok, skip = self.tokenizer(), req.skip_special_tokens
        return StopText(lambda ids: tok.decode(ids, skip_special=skip), stops)

    async def one(self, request: Request, req: _Common, prompt: list[int],
                  max_tokens: int | None, route: str, j: int, stops: list[str],
                  started: list[str], drafts: Drafts) -> tuple[str, StopText]:  # fmt: skip
        """Choice j of a prompt: its job id ("" for an echo alone) and its text, ended; the
        job's id goes into `started` as soon as it is queued."""
        stream = self.text_stream(req, stops)
        if max_tokens == 0:
            stream.finish = "length"
            return "", stream
        job_id = await self.coord.on_core(self.submit, request, prompt, max_tokens, req, route, j)
        started.append(job_id)
        async for _ in _follow(self.coord, job_id, stream, drafts=drafts):
            pass
        return job_id, stream

    async def whole(self, request: Request, req: _Common, prompts: list[list[int]],
                    texts: list[str | None], max_tokens: int | None, route: str,
                    stops: list[str]) -> JSONResponse:  # fmt: skip
        """Every choice (prompts x n), in one JSON answer; log-probabilities scored after."""
        t0, n, top = time.perf_counter(), req.n or 1, _top(req)
        echo = isinstance(req, CompletionRequest) and bool(req.echo)
        started: list[str] = []
        drafts = Drafts()
        tasks = [asyncio.ensure_future(self.one(request, req, p, max_tokens, route, j, stops,
                                                started, drafts))
                 for p in prompts for j in range(n)]  # fmt: skip
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:  # one failed, or the client left: the others' jobs stop too
            for t in tasks:
                t.cancel()
            for job_id in started:  # (one that ended already is not cancelled)
                self.coord.core.submit(_cancel, self.coord, job_id, "another choice of its "
                                       "request failed", "sibling failed")  # fmt: skip
            raise
        tok = self.tokenizer()
        choices: list[JsonValue] = []
        for k, (_, stream) in enumerate(done):
            prompt, made = prompts[k // n], stream.tokens[: stream.used]
            shown = prompt + made if echo else made
            given = texts[k // n]
            prompt_text = given if given is not None else tok.decode(
                prompt, skip_special=req.skip_special_tokens)  # fmt: skip
            prefix = prompt_text if echo else ""
            c: JsonObject = {"index": k}
            if route == "chat":
                c["message"] = {"role": "assistant", "content": stream.text}
            else:
                c["text"] = prefix + stream.text
            c["logprobs"] = None
            if top is not None:
                start = 1 if echo else len(prompt)
                detail = await self.detail(request, prompt + made, start, top)
                c["logprobs"] = (chat_logprobs(tok, made, detail) if route == "chat" else
                                 completion_logprobs(tok, shown, detail,
                                                     len(prompt_text) - len(prefix)))  # fmt: skip
            c |= {"finish_reason": stream.finish, **self.ending(req, stream)}
            choices.append(c)
        first = next((j for j, _ in done if j), "")
        streams = [s for _, s in done]
        self.answered(first, route, streams, t0)
        return JSONResponse({**self.head(first or "echo", route), "choices": choices,
                             "usage": self.usage(prompts, streams, drafts)})  # fmt: skip

    async def run(
        self, request: Request, req: _Common, prompts: list[list[int]],
        texts: list[str | None], max_tokens: int | None, route: Literal["chat", "completions"],
    ) -> Response:  # fmt: skip
        _unsupported(req, len(prompts))
        stops = _stops(req.stop)
        if not req.stream:
            return await self.whole(request, req, prompts, texts, max_tokens, route, stops)
        prompt, stream = prompts[0], self.text_stream(req, stops)
        job_id = ""
        if max_tokens != 0:
            job_id = await self.coord.on_core(self.submit, request, prompt, max_tokens, req,
                                              route)  # fmt: skip
        echo = ""
        if isinstance(req, CompletionRequest) and req.echo:
            echo = texts[0] if texts[0] is not None else self.tokenizer().decode(
                prompt, skip_special=req.skip_special_tokens)  # fmt: skip
        answer = Answer(self, req, prompt, job_id, route, stream, echo)
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
    async def models() -> Reply:
        return {"object": "list", "data": [routes.card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Reply:
        routes.check_model(name)
        return routes.card()

    @app.post("/v1/completions")
    async def completions(
        request: Request, req: Annotated[CompletionRequest, body(CompletionRequest)]
    ) -> Response:
        routes.check_model(req.model)
        # tokenizing takes ~1 s a megabyte: off the event loop, which answers heartbeats
        prompts = await asyncio.to_thread(_prompts, req.prompt, routes.tokenizer(),
                                          limits_of(coord))  # fmt: skip
        given = req.prompt if isinstance(req.prompt, list) and prompts and len(prompts) == len(
            req.prompt) and not all(type(t) is int for t in req.prompt) else [req.prompt]
        texts = [p if isinstance(p, str) else None for p in given]
        return await routes.run(request, req, prompts, texts, req.max_tokens, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(
        request: Request, req: Annotated[ChatRequest, body(ChatRequest)]
    ) -> Response:
        routes.check_model(req.model)
        limits = limits_of(coord)
        limits.turns(req.messages)
        try:  # the template and the tokenizer off the event loop, as for a completion
            prompt = await asyncio.to_thread(_chat_ids, req.messages, routes.tokenizer(), limits)
        except CellswarmError as exc:  # the template refused the conversation
            raise OpenAIError(400, str(exc), param="messages") from None
        return await routes.run(request, req, [prompt], [None],
                                req.max_completion_tokens or req.max_tokens, "chat")  # fmt: skip

    add_tokenizer_routes(app, routes)


def add_tokenizer_routes(app: FastAPI, routes: OpenAIRoutes) -> None:
    """vLLM's tokenizer routes (lm-evaluation-harness' "remote" tokenizer uses them):

        POST /tokenize        {"prompt": text, "add_special_tokens": true} or {"messages"}
                              -> {"count", "max_model_len", "tokens"}
        POST /detokenize      {"tokens": [...]} -> {"prompt": text}
        GET  /tokenizer_info  the special tokens and the chat template
    """
    coord = routes.coord

    @app.post("/tokenize")
    async def tokenize(req: Annotated[TokenizeRequest, body(TokenizeRequest)]) -> Reply:
        tok = routes.tokenizer()

        def encode() -> list[int]:  # off the event loop: a long text takes a while
            if req.messages is not None:
                return _chat_ids(req.messages, tok, limits_of(coord))
            if req.prompt is None:
                raise OpenAIError(400, "send 'prompt' (text) or 'messages'", param="prompt")
            return list(limits_of(coord).encode(
                lambda t: tok.encode(t, add_special=req.add_special_tokens), req.prompt,
                "prompt"))  # fmt: skip

        ids = await asyncio.to_thread(encode)
        return {"count": len(ids), "max_model_len": coord.context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(
        req: Annotated[DetokenizeRequest, body(DetokenizeRequest)]
    ) -> Reply:
        ids = limits_of(coord).ids(req.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(routes.tokenizer().decode, ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Reply:
        tok = routes.tokenizer()

        def text(i: int | None) -> str | None:
            return None if i is None else tok.token_text(i)

        return {"tokenizer_class": "cellswarm", "model_max_length": coord.context,
                "eos_token": text(tok.eos_id), "bos_token": text(tok.bos_id),
                "pad_token": text(getattr(tok, "pad_id", None)),
                "chat_template": getattr(tok, "chat_template", None)}  # fmt: skip
