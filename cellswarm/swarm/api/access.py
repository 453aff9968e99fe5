"""Who may call what on the coordinator, and how much they may send: API keys, the routes
they guard, job ownership, and the body cap — one ASGI middleware (`Edge`) in front of every
route, before anything reads a byte of the body.

Routes come in four kinds (`ROUTE_AUTH`; a route not listed there is a client route):

    client  every route a client calls: /v1/requests, /v1/batches/..., /v1/status,
            /v1/ledger, the OpenAI routes, /docs, /openapi.json — and any path not known
            (a 404 is not handed to strangers). With `--api-key-file` each needs
            `Authorization: Bearer KEY`.
    node    the workers' routes (/v1/join, /v1/heartbeat, /v1/jobs/*, /v1/logs, ...): the
            cluster token's HMAC proof at join, the node's session afterwards.
    own     GET /v1/logs/{id} and POST /v1/doctor: an API key, a proof of the cluster token or
            a node's session, checked by the route (log_api.py).
    open    /healthz, and the dashboard's page and static files (`/`, `/static/*`: no data;
            its panels under /dashboard/ are client routes).

Keys (`--api-key-file`): one a line, blank lines and `#` comments skipped; a line `admin KEY`
makes KEY an admin key. A job or batch belongs to the key that submitted it (the jobs table
keeps the key's sha256, `Caller.owner`): another key gets a 404 for it, as for a job that
does not exist; an admin key sees and cancels every job. Without keys there are no owners.

The body cap (`--max-body`, default 4 MiB): a Content-Length over it is answered 413 at once,
unread; a chunked body is counted as it streams in, and the route reading it gets the 413 the
moment the count passes the cap — the coordinator never holds more than the cap of a body.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cellswarm.errors import RequestError

DEFAULT_MAX_BODY = 4 * 2**20
OPENAI_PREFIXES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                   "/detokenize", "/tokenizer_info")

ROUTE_AUTH: dict[tuple[str, str], str] = {
    ("GET", "/healthz"): "open",
    ("GET", "/"): "open",
    ("GET", "/static/{name}"): "open",
    ("GET", "/v1/logs/{request_id}"): "own",
    ("POST", "/v1/doctor"): "own",
    **{(method, path): "node" for method, path in (
        ("POST", "/v1/challenge"), ("POST", "/v1/join"), ("POST", "/v1/heartbeat"),
        ("POST", "/v1/heartbeats"), ("POST", "/v1/joins"),
        ("POST", "/v1/fault"), ("GET", "/v1/model/manifest"), ("GET", "/v1/model/chunks/{index}"),
        ("POST", "/v1/jobs/lease"), ("POST", "/v1/jobs/checkpoint"),
        ("POST", "/v1/jobs/complete"), ("POST", "/v1/jobs/fail"), ("POST", "/v1/jobs/release"),
        ("POST", "/v1/logs"),
    )},
}  # fmt: skip


def key_hash(key: str) -> str:
    """What the database keeps of a key: its sha256 (the key itself is never stored)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who is calling a client route: `owner` is their key's hash (None without keys),
    `admin` whether they see every job (always, without keys)."""

    owner: str | None
    admin: bool

    def sees(self, owner: str | None) -> bool:
        return self.admin or (self.owner is not None and owner == self.owner)


ANYONE = Caller(None, True)  # a coordinator without keys: everyone sees everything


@dataclass(frozen=True)
class Keys:
    """The API keys of `--api-key-file`, by sha256 (compared in constant time)."""

    hashes: frozenset[str] = frozenset()
    admins: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.hashes)

    def caller(self, authorization: str) -> Caller | str:
        """The caller a bearer key names, or why it names none (an OpenAI-style message)."""
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return ("You didn't provide an API key: send 'Authorization: Bearer KEY' with a key "
                    "from the coordinator's --api-key-file")  # fmt: skip
        digest = key_hash(key)
        match = None
        for known in self.hashes:  # every key compared, each in constant time
            if hmac.compare_digest(digest, known):
                match = known
        if match is None:
            shown = key[:3] + "*" * min(max(len(key) - 7, 0), 20) + key[-4:]
            return f"Incorrect API key provided: {shown}"
        return Caller(match, match in self.admins)


def load_keys(path: str | None) -> Keys:
    """`--api-key-file`: one key a line, `admin KEY` for an admin key, `#` comments."""
    if path is None:
        return Keys()
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise RequestError(f"--api-key-file {path}: {why}") from None
    hashes, admins = set(), set()
    for n, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        admin = words[0] == "admin" and len(words) == 2
        if len(words) != 1 + admin or not words[-1].isascii():
            raise RequestError(f"--api-key-file {path} line {n}: expected one key (or 'admin "
                               f"KEY'), got {len(words)} words")  # fmt: skip
        hashes.add(key_hash(words[-1]))
        if admin:
            admins.add(key_hash(words[-1]))
    if not hashes:
        raise RequestError(f"--api-key-file {path} holds no keys: one key per line")
    return Keys(frozenset(hashes), frozenset(admins))


def first_key(path: str) -> str:
    """The key a command-line client sends: the file's first (admin or not)."""
    load_keys(path)  # the same checks: exists, holds a key, well-formed
    for line in Path(path).read_text().splitlines():
        words = line.split()
        if words and not words[0].startswith("#"):
            return words[-1]
    raise AssertionError("load_keys found a key")


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PREFIXES)


def route_auth(routes: Iterable[BaseRoute], scope: Scope) -> str:
    """The kind of the route `scope` would reach; "client" for one not listed, or none."""
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return ROUTE_AUTH.get((scope["method"], getattr(route, "path", "")), "client")
    return "client"


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the cap; FastAPI hands an
    HTTPException raised while reading a body on as it is (a 413, not a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large(limit))


def too_large(limit: int, size: int | None = None) -> str:
    got = f"is {size:,} bytes" if size is not None else "is longer"
    return (f"The request body {got}; this coordinator takes at most {limit:,} bytes "
            "(--max-body): send a shorter prompt, or split the batch")  # fmt: skip


def error_response(path: str, status: int, message: str, code: str | None = None,
                   param: str | None = None) -> JSONResponse:  # fmt: skip
    """An error in the shape the path's clients read: OpenAI's for its routes, else the
    coordinator's (`{"error": {"message", "type"}}`, with the same extra fields)."""
    if is_openai_path(path):
        kind = "invalid_request_error" if status < 500 else "server_error"
    else:
        kind = {401: "unauthorized", 404: "NotFound", 413: "RequestError"}.get(status,
                                                                              "RequestError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    # (a 413 keeps the connection: the server drops the rest of the body as it comes, and
    # the client, which writes it all before it reads, gets the answer instead of a reset)
    return JSONResponse(body, status_code=status)


class Edge:
    """ASGI middleware in front of every route: an `x-request-id` on every response (the job
    id when a route sets `request.state.request_id`), the caller (`request.state.caller`)
    from an API key where one is needed, and the body cap."""

    def __init__(self, app: ASGIApp, keys: Keys, max_body: int, routes: list[BaseRoute]) -> None:
        self.app, self.keys, self.max_body, self.routes = app, keys, max_body, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["request_id"] = uuid.uuid4().hex[:16]  # as long as a job id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["x-request-id"] = str(state["request_id"])
            await send(message)

        path = scope["path"]
        headers = Headers(scope=scope)
        denied = self._admit(scope, headers, state)
        if denied is not None:
            return await denied(scope, receive, send_with_id)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            size = int(length) if length.isdigit() else None
            response = error_response(path, 413 if size else 400,
                                      too_large(self.max_body, size) if size else
                                      f"Content-Length {length[:20]!r} is not a byte count",
                                      code="body_too_large" if size else None)  # fmt: skip
            return await response(scope, receive, send_with_id)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        try:
            await self.app(scope, counted, send_with_id)
        except BodyTooLarge:  # raised where no handler turned it into the 413 itself
            if started:
                raise
            await error_response(path, 413, too_large(self.max_body),
                                 code="body_too_large")(scope, receive, send_with_id)  # fmt: skip

    def _admit(self, scope: Scope, headers: Headers,
               state: MutableMapping[str, object]) -> JSONResponse | None:  # fmt: skip
        """Sets state["caller"]; a 401 response for a client route without a good key."""
        if not self.keys:
            state["caller"] = ANYONE
            return None
        kind = route_auth(self.routes, scope)
        authorization = headers.get("authorization", "")
        caller = self.keys.caller(authorization)
        if isinstance(caller, Caller):
            state["caller"] = caller
            return None
        state["caller"] = None  # a node, an operator with a proof, or nobody
        if kind != "client":  # the route checks its own proof or session
            return None
        return error_response(scope["path"], 401, caller, code="invalid_api_key")
