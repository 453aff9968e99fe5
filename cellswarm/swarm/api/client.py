"""A small HTTP client for the coordinator (standard library only: workers and CLIs use it).

With `tls` (a node's certificate folder, swarm/tls.py) it speaks mutual TLS to an https URL;
with `api_key` it sends `Authorization: Bearer KEY` (a coordinator with --api-key-file).
"""

from __future__ import annotations

import functools
import http.client
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NotRequired, TypedDict

from cellswarm.errors import RequestError, SwarmError
from cellswarm.swarm.protocol.jsonvalue import JsonObject


class NodeRow(TypedDict):
    """One node of GET /v1/status (control/views.py `status`)."""

    node_id: str
    state: str
    layers: list[int] | None
    holds: str
    stage: int | None
    replica: int | None
    agreements: int
    disagreements: int
    memory_bytes: int
    rss_bytes: int
    peak_rss_bytes: int
    last_seen_s_ago: float
    served: int
    failures: int
    message: str
    profile: str | None
    serving: bool
    rack: str | None
    stats: JsonObject | None  # its latest heartbeat's stage counters
    busy_s: float
    address: str
    clock_offset_s: float | None
    clock_error_s: float | None


class Bottleneck(TypedDict):
    """A ring's slowest stage (control/rebalance.py `RingTimes.bottleneck`)."""

    node_id: str
    stage: int
    step_ms: float
    times_median: float
    steps_ms: list[float]


class Drafting(TypedDict):
    """Speculative decoding over the swarm: drafts verified, and kept."""

    drafted: int
    accepted: int


class Status(TypedDict):
    """GET /v1/status: the swarm as its coordinator sees it (control/views.py `status`)."""

    epoch: int
    wired: bool
    problem: str
    context: int
    sequences: int
    bottlenecks: list[Bottleneck]
    speculative: Drafting
    coordinator: str
    leader: bool
    model: str
    nodes: list[NodeRow]


class ModelCard(TypedDict):
    """The model a swarm serves, as GET /v1/models lists it (api/openai_api.py `card`)."""

    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int | None  # its served context, None with no model header to read
    meta: JsonObject


class ModelList(TypedDict):
    """GET /v1/models."""

    object: str
    data: list[ModelCard]


class Progress(TypedDict):
    """GET /v1/requests/ID (api/server.py `progress`); from `wait`, with all its tokens."""

    request_id: str
    state: str
    reason: str | None
    tokens: list[int]
    n_tokens: int
    attempts: int
    text: NotRequired[str]  # at its end, when it was sent as text


def call(
    url: str, path: str, data: Mapping[str, object] | None = None, timeout_s: float = 35.0,
    tls: str | None = None, headers: Mapping[str, str] | None = None, api_key: str | None = None,
) -> Any:  # fmt: skip
    """GET (data None) or POST JSON; a coordinator's error becomes a RequestError carrying
    its message; an unreachable one a SwarmError naming the URL. The answer is whatever JSON
    the route sends (its callers, many, read the route's fields they know: `Status`,
    `Progress` here for the routes this module waits on)."""
    body = None if data is None else json.dumps(data).encode()
    head = {"Content-Type": "application/json", **(headers or {})}
    if api_key is not None:
        head["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + path, body, head)
    try:
        with _open(req, timeout_s, tls_context(url, tls)) as r:
            raw = r.read(MAX_ANSWER_BYTES + 1)
        if len(raw) > MAX_ANSWER_BYTES:
            raise SwarmError(f"the coordinator at {url} answered {path} with over "
                             f"{MAX_ANSWER_BYTES:,} bytes: not a coordinator's answer")  # fmt: skip
        return _json(raw, url)
    except urllib.error.HTTPError as exc:
        raise RequestError(f"coordinator at {url}: {_message(exc)}") from None
    except (OSError, ValueError) as exc:
        if body is not None and len(body) > CUT_OFF_BYTES and _cut_off(exc):
            # a coordinator refuses a body over its --max-body with a 413 before reading it
            # and hangs up; urllib, still sending, sees only the broken connection
            raise RequestError(
                f"coordinator at {url} closed the connection while {len(body):,} bytes were "
                "sent: over its --max-body (a 413); send less at a time (split the batch file) "
                "or start it with a larger --max-body") from None  # fmt: skip
        hint = "is it running?" + (f" Is --tls {tls} of its cluster's CA?" if tls else "")
        raise SwarmError(f"no coordinator answers at {url} ({exc}); {hint}") from None


# A body this large that the coordinator hung up on was refused for its size, not lost
CUT_OFF_BYTES = 64 * 1024


def _cut_off(exc: BaseException) -> bool:
    """Whether the connection broke under us (the peer closed it mid-send), urllib's
    wrapping unwrapped."""
    reason = getattr(exc, "reason", exc)
    return isinstance(reason, BrokenPipeError | ConnectionResetError | ConnectionAbortedError)


def events(
    url: str, path: str, data: Mapping[str, object], timeout_s: float = 600.0,
    tls: str | None = None, api_key: str | None = None,
    on_comment: Callable[[str], None] | None = None,
) -> Iterator[JsonObject]:  # fmt: skip
    """POST JSON to a server-sent-events route (an OpenAI `stream: true`); each `data:`
    object as it comes, until `[DONE]`. An error event becomes a RequestError; a comment
    line (the coordinator's "waiting ..." while nothing comes) goes to `on_comment`."""
    head = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key is not None:
        head["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + path, json.dumps(data).encode(), head)
    try:
        resp = _open(req, timeout_s, tls_context(url, tls))
    except urllib.error.HTTPError as exc:
        raise RequestError(f"coordinator at {url}: {_message(exc)}") from None
    except (OSError, ValueError) as exc:
        raise SwarmError(f"no coordinator answers at {url} ({exc}); is it running?") from None
    with resp:
        while True:
            try:
                line = resp.readline(MAX_LINE_BYTES + 1)
            except (OSError, http.client.HTTPException) as exc:
                raise SwarmError(f"the coordinator at {url} went away mid-answer ({exc}); "
                                 "ask again once it is back") from None  # fmt: skip
            if len(line) > MAX_LINE_BYTES:
                raise SwarmError(f"the coordinator at {url} sent an event line of over "
                                 f"{MAX_LINE_BYTES:,} bytes: not a coordinator's")  # fmt: skip
            if not line or line.strip() == b"data: [DONE]":
                return
            if line.startswith(b":") and on_comment is not None:
                on_comment(line[1:].decode(errors="replace").strip())
            if not line.startswith(b"data:"):
                continue
            chunk = _json(line[5:], url)
            if not isinstance(chunk, dict):
                raise SwarmError(f"the coordinator at {url} sent an event that is not an object")
            if "error" in chunk:
                raise RequestError(f"coordinator at {url}: {chunk['error'].get('message')}")
            yield chunk


# What a coordinator's answer can be at most (a status of 100,000 nodes, a batch's results
# page): a server that sends more is not one, and is not read whole into memory
MAX_ANSWER_BYTES = 256 << 20
MAX_LINE_BYTES = 16 << 20  # one streamed event (a chunk's text and logprobs)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A coordinator never redirects; a redirect followed would carry the API key (urllib
    keeps the Authorization header) to wherever it points, another origin included."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> None:  # fmt: skip
        raise SwarmError(f"{req.full_url} answered a redirect ({code}) to {newurl[:200]}: "
                         "cellswarm follows none (it would take your API key along); give "
                         "the coordinator's own URL")  # fmt: skip


def _open(req: urllib.request.Request, timeout_s: float,
          context: ssl.SSLContext | None) -> Any:  # fmt: skip
    handlers: list[urllib.request.BaseHandler] = [_NoRedirects()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers).open(req, timeout=timeout_s)


def _json(raw: bytes, url: str) -> Any:
    """JSON from the coordinator; SwarmError (never a JSONDecodeError or a RecursionError
    from a thousand nested brackets) for anything else."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise SwarmError(f"the coordinator at {url} answered what is not JSON: "
                         f"{raw[:80]!r}") from None  # fmt: skip


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {exc.code}"


@functools.lru_cache(maxsize=8)
def tls_context(url: str, tls: str | None) -> ssl.SSLContext | None:
    """The client side of mutual TLS for `url`, loaded once per folder (a poll loop calls
    often); None for plain http."""
    from cellswarm.swarm.tls import check_url, client_context

    check_url(url, tls)
    return client_context(tls) if tls else None


def submit(url: str, request: Mapping[str, object], tls: str | None = None,
           api_key: str | None = None) -> str:  # fmt: skip
    return str(call(url, "/v1/requests", request, tls=tls, api_key=api_key)["request_id"])


def wait(
    url: str, request_id: str, on_tokens: Callable[[list[int]], None] | None = None,
    timeout_s: float = 600.0, patience_s: float = 60.0, tls: str | None = None,
    api_key: str | None = None,
) -> Progress:  # fmt: skip
    """Long-poll until the request ends; its final state with all its tokens. `on_tokens` gets
    each new batch as it comes. Rides out a coordinator restart (`patience_s` without one)."""
    tokens: list[int] = []
    deadline, last_ok = time.monotonic() + timeout_s, time.monotonic()
    while time.monotonic() < deadline:
        try:
            r: Progress = call(url, f"/v1/requests/{request_id}?after={len(tokens)}&wait_s=10",
                               tls=tls, api_key=api_key)  # fmt: skip
        except SwarmError:
            if time.monotonic() - last_ok > patience_s:
                raise
            time.sleep(0.2)
            continue
        last_ok = time.monotonic()
        if r["tokens"] and on_tokens is not None:
            on_tokens(list(r["tokens"]))
        tokens += r["tokens"]
        if r["state"] in ("done", "dead", "cancelled"):
            return {**r, "tokens": tokens}
    raise SwarmError(f"request {request_id} did not finish within {timeout_s:.0f} s")


def wait_wired(url: str, timeout_s: float = 120.0, tls: str | None = None,
               api_key: str | None = None,
               on_change: Callable[[str], None] | None = None) -> Status:  # fmt: skip
    """Until the coordinator reports a wired ring; its status. `on_change` is told each node
    that joins or changes what it does, one line each (what `up` shows while it waits)."""
    deadline = time.monotonic() + timeout_s
    status: Status | None = None
    seen: dict[str, tuple[str, str]] = {}
    problem = ""  # the coordinator's reason it cannot place the model, last said
    while time.monotonic() < deadline:
        try:
            status = call(url, "/v1/status", timeout_s=5, tls=tls, api_key=api_key)
            if on_change is not None:
                _tell_changes(status, seen, on_change)
                if status.get("problem") and status["problem"] != problem:  # once a change
                    problem = str(status["problem"])
                    on_change(f"cannot place the model: {problem}")
            if status["wired"]:
                if on_change is not None:
                    on_change(f"wired: epoch {status.get('epoch')}, {len(seen)} nodes")
                return status
        except SwarmError:
            pass
        time.sleep(0.1)
    nodes = ", ".join(f"{n['node_id']} {n['state']} {n['message']}"
                      for n in (status.get("nodes", []) if status is not None else []))  # fmt: skip
    raise SwarmError(
        f"the swarm at {url} was not ready after {timeout_s:.0f} s: {nodes or 'no nodes'}"
    )


def _tell_changes(status: Status, seen: dict[str, tuple[str, str]],
                  say: Callable[[str], None]) -> None:  # fmt: skip
    nodes = status.get("nodes", [])
    for n in nodes:
        now = (str(n["state"]), str(n.get("holds") or "-"))
        before = seen.get(n["node_id"])
        if before == now:
            continue
        seen[n["node_id"]] = now
        what = "joined" if before is None else now[0]
        holds = f", {now[1]}" if now[1] != "-" else ""
        say(f"node {n['node_id']} {what} ({now[0]}{holds}); "
            f"{sum(x['state'] == 'assigned' for x in nodes)} of {len(nodes)} nodes assigned")


def fetch_timeline(url: str, request_id: str, token: bytes | None = None,
                   api_key: str | None = None, tls: str | None = None,
                   ) -> tuple[list[JsonObject], dict[str, tuple[float, float | None]]]:  # fmt: skip
    """One request's events from a coordinator, as `logs.timeline` reads them from files,
    and each node's clock correction (offset s, error s) once."""
    from urllib.parse import quote

    from cellswarm.swarm.auth import OPERATOR, prove

    headers: dict[str, str] = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    elif token is not None:
        nonce = str(call(url, "/v1/challenge", {}, tls=tls)["nonce"])
        headers["X-Cellswarm-Proof"] = f"{nonce}:{prove(token, nonce, OPERATOR)}"
    answer = call(url, f"/v1/logs/{quote(request_id, safe='')}", tls=tls, headers=headers)
    events: list[JsonObject] = []
    clocks: dict[str, tuple[float, float | None]] = {}
    for e in answer["events"]:
        offset, error = e.pop("clock_offset_s", 0.0), e.pop("clock_error_s", None)
        e.pop("node_ts", None)
        clocks.setdefault(e["node"], (offset, error))
        events.append(e)
    return events, clocks


def api_key(args: object) -> str | None:
    """The key a client command sends: the first of --api-key-file, if given."""
    from cellswarm.swarm.api.access import first_key

    path = getattr(args, "api_key_file", None)
    return first_key(path) if path else None
