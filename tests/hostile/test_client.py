"""`cellswarm.connect(url)` against a server that is not a coordinator (issue 56): it followed a
redirect to another origin with the API key, read a 100 MB line whole (336 MB peak), and let
a JSONDecodeError or a RecursionError escape. Now: no redirect is followed, answers and
event lines are read to a bound, and anything that is not a coordinator's JSON is one
SwarmError naming the URL."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import cellswarm
from cellswarm.errors import SwarmError
from cellswarm.swarm.api import client

MODELS = b'{"object": "list", "data": [{"id": "m", "max_model_len": 64}]}'
Answer = Callable[[BaseHTTPRequestHandler], None]


@contextmanager
def server(answer: Answer) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A local HTTP server answering every GET and POST with `answer`; its URL, and the
    headers of each request it saw."""
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def handle_one(self) -> None:
            seen.append(dict(self.headers))
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            answer(self)

        do_GET = do_POST = handle_one

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def send(h: BaseHTTPRequestHandler, body: bytes, status: int = 200,
         headers: dict[str, str] | None = None) -> None:  # fmt: skip
    h.send_response(status)
    for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


def test_a_redirect_to_another_origin_is_not_followed_and_the_key_stays_home() -> None:
    with server(lambda h: send(h, MODELS)) as (elsewhere, seen_there):
        moved = {"Location": elsewhere + "/v1/models"}
        with (
            server(lambda h: send(h, b"", 307, moved)) as (url, _),
            pytest.raises(SwarmError, match="answered a redirect"),
        ):
            cellswarm.connect(url, api_key="sk-secret-key-123")
        assert seen_there == []  # the key never left for the other origin


def test_what_is_not_a_coordinator_s_json_is_one_error() -> None:
    for body in (b"[" * 100_000, b"<html>not json</html>", b'{"data": '):
        with (
            server(lambda h, b=body: send(h, b)) as (url, _),  # type: ignore[misc]
            pytest.raises(SwarmError, match="not JSON"),
        ):
            cellswarm.connect(url)


def test_a_huge_event_line_is_refused_at_its_bound_not_read_whole() -> None:
    def answer(h: BaseHTTPRequestHandler) -> None:
        if h.path.endswith("/v1/models"):
            return send(h, MODELS)
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        chunk = b"x" * (1 << 20)
        h.wfile.write(b"data: ")
        for _ in range(client.MAX_LINE_BYTES // len(chunk) + 2):  # no newline, ever
            h.wfile.write(chunk)

    with server(answer) as (url, _):
        swarm = cellswarm.connect(url)
        with pytest.raises(SwarmError, match="event line of over"):
            list(swarm("hi", stream=True))
