"""The coordinator's edges (issue 13), against a real coordinator process over real HTTP:
every bad request is a 4xx at submit naming the field (never a job that dies later on a
worker, never a 500), bodies are capped before they are read, every client route needs a key
and a job is its key's, and the coordinator's secrets are on disk 0600.

The coordinator runs without workers: nothing here needs a ring, and a request the edge let
through would sit in the queue — which the ledger checks show never happens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cellswarm.errors import RequestError
from cellswarm.swarm.api.access import ROUTE_AUTH, first_key, load_keys
from cellswarm.swarm.auth import prove, write_secret
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.protocol import PROTOCOL

ALICE, BOB, ROOT = "sk-alice-0123456789", "sk-bob-0123456789", "sk-root-0123456789"
VOCAB = 49152  # the demo model's
CONTEXT = 256  # LocalSwarm's --context
MB = 2**20


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def swarm(demo_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    state = tmp_path_factory.mktemp("edges")
    keys = state / "api-keys"
    keys.write_text(f"# clients\n{ALICE}\n{BOB}\n\nadmin {ROOT}\n")
    with LocalSwarm(str(demo_path), 0, "120M", state, api_key_file=str(keys)) as s:
        yield s


@pytest.fixture(scope="module")
def http(swarm: LocalSwarm) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=swarm.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(demo_path: Path) -> str:
    return demo_path.name


def ledger(http: httpx.Client) -> dict[str, int]:
    r = http.get("/v1/ledger", headers=auth(ROOT))
    assert r.status_code == 200, r.text
    return dict(r.json())


def rss(swarm: LocalSwarm) -> tuple[int, int]:
    """The coordinator process's resident and peak resident bytes (VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{swarm.procs['coordinator'].pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def one_line_error(r: httpx.Response, status: int, *says: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    message = err["message"]
    assert "\n" not in message and "Traceback" not in message and len(message) < 400, message
    for s in says:
        assert s in message, (s, message)
    return dict(err)


# -- bad fields: a 400 at submit naming the field ---------------------------------------------

GOOD = {"prompt": "The capital of France is", "max_tokens": 4}
LINE = {"id": "a", "prompt": "The capital of France is", "max_tokens": 4}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


def completion(**kw: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 4, **kw}


BAD: list[tuple[str, dict[str, Any], str]] = [
    # /v1/requests: every field, its range and its type
    ("/v1/requests", {**GOOD, "sampling": {"seed": -1}}, "sampling.seed"),
    ("/v1/requests", {**GOOD, "sampling": {"seed": 2**64}}, "sampling.seed"),
    ("/v1/requests", {**GOOD, "sampling": {"seed": "7"}}, "sampling.seed"),
    ("/v1/requests", {**GOOD, "sampling": {"seed": True}}, "sampling.seed"),
    ("/v1/requests", {**GOOD, "sampling": {"temperature": -0.1}}, "sampling.temperature"),
    ("/v1/requests", {**GOOD, "sampling": {"temperature": 2.5}}, "sampling.temperature"),
    ("/v1/requests", {**GOOD, "sampling": {"top_p": 0}}, "sampling.top_p"),
    ("/v1/requests", {**GOOD, "sampling": {"top_k": -1}}, "sampling.top_k"),
    ("/v1/requests", {**GOOD, "sampling": {"min_p": 1}}, "sampling.min_p"),
    ("/v1/requests", {**GOOD, "sampling": {"repetition_penalty": 0}}, "sampling.repetition_p"),
    ("/v1/requests", {**GOOD, "sampling": {"temprature": 0.5}}, "sampling.temprature"),
    ("/v1/requests", {**GOOD, "sampling": 3}, "sampling"),
    ("/v1/requests", {"prompt": [], "max_tokens": 4}, "prompt"),
    ("/v1/requests", {"prompt": "", "max_tokens": 4}, "prompt"),
    ("/v1/requests", {"prompt": [1, VOCAB], "max_tokens": 4}, f"token id {VOCAB}"),
    ("/v1/requests", {"prompt": [1, -1], "max_tokens": 4}, "prompt"),
    ("/v1/requests", {"prompt": [1, True], "max_tokens": 4}, "prompt"),
    ("/v1/requests", {"prompt": [1, 2.5], "max_tokens": 4}, "prompt"),
    ("/v1/requests", {"prompt": "a\udc80b", "max_tokens": 4}, "prompt"),
    ("/v1/requests", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("/v1/requests", {**GOOD, "max_tokens": "4"}, "max_tokens"),
    ("/v1/requests", {**GOOD, "max_tokens": 4.0}, "max_tokens"),
    ("/v1/requests", {**GOOD, "max_tokens": CONTEXT}, "maximum context length"),
    ("/v1/requests", {**GOOD, "stop_ids": [1.5]}, "stop_ids[0]"),
    ("/v1/requests", {**GOOD, "stop_ids": ["2"]}, "stop_ids[0]"),
    ("/v1/requests", {**GOOD, "stop_ids": [VOCAB + 7]}, "stop_ids"),
    ("/v1/requests", {**GOOD, "request_id": "x" * 300}, "request_id"),
    ("/v1/requests", {**GOOD, "max_token": 4}, "max_token"),
    # batches: each line is checked, and named
    ("/v1/batches", {"items": []}, "items"),
    ("/v1/batches", {"items": [LINE], "verify_fraction": 2}, "verify_fraction"),
    ("/v1/batches", {"items": [LINE, {**LINE, "id": "b", "seed": -1}]}, "line 2 (id 'b'): seed"),
    ("/v1/batches", {"items": [LINE, {**LINE, "id": "b", "top_p": 1.5}]}, "line 2 (id 'b'): top_p"),
    ("/v1/batches", {"items": [{"id": "a", "max_tokens": 4}]}, "line 1 (id 'a'): needs a 'prompt'"),
    ("/v1/batches", {"items": [{**LINE, "temprature": 1}]},
     "line 1 (id 'a'): 'temprature' is not a field; did you mean 'temperature'"),
    ("/v1/batches", {"items": [{**LINE, "max_tokens": 1000}]}, "maximum context length"),
    ("/v1/batches", {"items": [LINE, 5]}, "line 2"),
    ("/v1/batches", {"items": [LINE, {**LINE, "id": "b"}, {**LINE, "id": "a"}]},
     "lines 1 and 3 have the same id 'a'"),
    ("/v1/batches", {"items": [{**LINE, "labels": [f" {i}" for i in range(65)]}]},
     "65 options, but a line takes at most 64"),
    ("/v1/batches", {"items": [{**LINE, "labels": []}]}, "labels"),
    ("/v1/batches", {"items": [{**LINE, "messages": [{"role": "user", "content": "x"}]}]},
     "not both"),
    # the OpenAI routes: issue 13's example first
    ("/v1/completions", completion(temperature=0.5, seed=-1), "seed"),
    ("/v1/completions", completion(seed=2**64), "seed"),
    ("/v1/completions", completion(prompt=[1, VOCAB]), f"token id {VOCAB}"),
    ("/v1/completions", completion(max_tokens=CONTEXT), "maximum context length"),
    ("/v1/completions", completion(top_k=-1), "top_k"),
    ("/v1/chat/completions", chat(seed=-5), "seed"),
    ("/v1/chat/completions", chat(repetition_penalty=0), "repetition_penalty"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a\udc80"}]),
     "messages[0].content"),
    ("/v1/chat/completions", chat(stop=[""]), "stop[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "says"), BAD,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_a_bad_field_is_a_400_at_submit_naming_it(
    http: httpx.Client, model_id: str, path: str, body: dict[str, Any], says: str
) -> None:
    if "completions" in path:
        body = {"model": model_id, **body}
    before = ledger(http)
    # json.dumps keeps a lone surrogate as an escape, as any JSON client would send it
    r = http.post(path, content=json.dumps(body), headers=auth(ALICE))
    one_line_error(r, 400, says)
    assert ledger(http) == before  # nothing was queued


@pytest.mark.parametrize(("raw", "says"), [
    (b'{"prompt": "hi", "sampling": {"temperature": NaN}}', "NaN"),
    (b'{"prompt": "hi", "max_tokens": Infinity}', "Infinity"),
    (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
    (b"[" * 200_000, "nests too deeply"),
    (b'{"prompt": "hi",', "not valid JSON"),
    (b"", "empty"),
    (b'["prompt"]', "JSON object"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "JSON"),
])  # fmt: skip
def test_a_body_that_is_not_json_gets_a_one_line_400(
    http: httpx.Client, raw: bytes, says: str
) -> None:
    for path in ("/v1/requests", "/v1/batches", "/v1/completions"):
        r = http.post(path, content=raw, headers={**auth(ALICE), "content-type": "text/plain"})
        one_line_error(r, 400, says)


def test_the_issue_s_seed_is_refused_on_every_edge(http: httpx.Client, model_id: str) -> None:
    """"temperature": 0.5, "seed": -1 — accepted before, then the last stage raised while
    sampling, three times. Now a 400 on each route that takes a seed."""
    for path, body in [
        ("/v1/completions", {"model": model_id, **completion(temperature=0.5, seed=-1)}),
        ("/v1/chat/completions", {"model": model_id, **chat(temperature=0.5, seed=-1)}),
        ("/v1/requests", {**GOOD, "sampling": {"temperature": 0.5, "seed": -1}}),
        ("/v1/batches", {"items": [{**LINE, "temperature": 0.5, "seed": -1}]}),
    ]:
        err = one_line_error(http.post(path, json=body, headers=auth(ALICE)), 400, "seed", "-1")
        assert "greater than or equal to 0" in err["message"]
    ok = http.post("/v1/requests", json={**GOOD, "sampling": {"temperature": 0.5,
                                                              "seed": 2**64 - 1}},
                   headers=auth(ALICE))  # fmt: skip
    assert ok.status_code == 200, ok.text  # the whole range is good


# -- bodies: capped before they are read --------------------------------------------------------


def test_a_50_mb_prompt_is_a_413_before_it_is_read(
    swarm: LocalSwarm, http: httpx.Client, model_id: str
) -> None:
    http.post("/v1/requests", json=GOOD, headers=auth(ALICE))  # tokenizer, limits: loaded
    _, peak = rss(swarm)
    body = json.dumps({"model": model_id, "prompt": "a " * (25 * MB), "max_tokens": 4})
    t0 = time.monotonic()
    r = http.post("/v1/completions", content=body, headers=auth(ALICE))
    took_s = time.monotonic() - t0
    err = one_line_error(r, 413, "--max-body", f"{len(body):,} bytes")
    assert err["code"] == "body_too_large" and err["type"] == "invalid_request_error"
    assert took_s < 10  # was 72 s
    assert rss(swarm)[1] - peak < 20 * MB  # was 5.9 GB
    # 10 MB to /v1/requests (was: accepted, 1.67 M tokens, no context check)
    r = http.post("/v1/requests", json={"prompt": "word " * (2 * MB)}, headers=auth(ALICE))
    one_line_error(r, 413, "--max-body")
    assert rss(swarm)[1] - peak < 20 * MB


def test_a_client_over_max_body_hears_the_413_s_advice_not_is_it_running(
    swarm: LocalSwarm,
) -> None:
    """`batch submit` of a file over --max-body said "no coordinator answers ... is it
    running?": the coordinator answers 413 before reading and hangs up, and the client,
    still sending, saw a broken connection (issue 56)."""
    from cellswarm.swarm.api import client

    items = [{"prompt": "word " * 1000}] * 2000  # ~10 MB, over the default 4 MiB
    with pytest.raises(RequestError, match="over its --max-body"):
        client.call(swarm.url, "/v1/batches", {"items": items}, api_key=ALICE)


def test_a_chunked_body_is_counted_as_it_streams(swarm: LocalSwarm, http: httpx.Client) -> None:
    """No Content-Length to check: the coordinator counts and stops at the cap."""
    _, peak = rss(swarm)
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(50):
            sent += MB
            yield b"a" * MB
        yield b'"}'

    r = http.post("/v1/requests", content=chunks(), headers=auth(ALICE))
    one_line_error(r, 413, "--max-body")
    assert "content-length" not in r.request.headers  # httpx sent it chunked
    assert rss(swarm)[1] - peak < 20 * MB


def test_text_that_cannot_fit_the_context_is_refused_untokenized(
    swarm: LocalSwarm, http: httpx.Client
) -> None:
    """3 MB of text under the body cap: refused by its length, in well under a second of
    the coordinator's time, instead of tokenizing it (seconds, and ~20x its size in memory)."""
    http.post("/v1/requests", json=GOOD, headers=auth(ALICE))
    _, peak = rss(swarm)
    t0 = time.monotonic()
    r = http.post("/v1/requests", json={"prompt": "word " * 600_000}, headers=auth(ALICE))
    err = one_line_error(r, 400, "prompt", "context of 256 tokens")
    assert err["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 5
    assert rss(swarm)[1] - peak < 20 * MB


# -- keys ------------------------------------------------------------------------------------


def concrete(path: str) -> str:
    """A route's path with its parameters filled in."""
    filled = {"index": "0", "name": "htmx.min.js"}  # a chunk, a static file that exists
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: filled.get(m.group(1), "x"), path)


NODE_BODY = {"node_id": "x", "session": "not-a-session", "nonce": "n", "proof": "p",
             "capabilities": {"memory_bytes": 1}, "runs": [], "job_id": "j", "fence": 1,
             "result": {}, "reason": "r", "events": [], "run": "r", "n": 1}  # fmt: skip


def test_every_client_route_needs_a_key(
    demo_path: Path, tmp_path: Path, swarm: LocalSwarm, http: httpx.Client
) -> None:
    """Walk the app's routes (as built in-process, the same code the coordinator runs), so
    a route added later cannot escape: each is a client route (401 without a key), a node
    route (401 without a session), the logs (401 without a key, proof or session) or open."""
    from cellswarm.swarm.api.server import build_app
    from cellswarm.swarm.control.coordinator import Coordinator, CoordinatorConfig

    app = build_app(Coordinator(CoordinatorConfig(str(demo_path), db=str(tmp_path / "c.db"))))
    routes = [(m, r.path) for r in app.routes for m in sorted(getattr(r, "methods", None) or ())]
    assert {"/v1/requests", "/v1/batches/{batch_id}/cancel", "/docs", "/openapi.json",
            "/v1/status", "/v1/ledger", "/v1/chat/completions"} <= {p for _, p in routes}
    assert set(ROUTE_AUTH) <= set(routes)  # the table names routes that exist
    for method, path in routes:
        url = concrete(path)
        kind = ROUTE_AUTH.get((method, path), "client")
        body = json.dumps(NODE_BODY) if method == "POST" else None
        r = http.request(method, url, content=body)
        if kind == "open" or (method, path) == ("POST", "/v1/challenge"):  # a nonce: no secret
            assert r.status_code == 200, (method, path, r.text)
            continue
        assert r.status_code == 401, (method, path, kind, r.status_code, r.text)
        if method != "HEAD":
            assert r.json()["error"]["message"], (method, path)
        if kind == "client":  # and with a key, the key is not what stops it
            r = http.request(method, url, content=body, headers=auth(BOB))
            assert r.status_code != 401, (method, path, r.text)
    # a path no route serves: the key first (strangers learn nothing), then a 404
    assert http.get("/v1/nothing-here").status_code == 401
    assert http.get("/v1/nothing-here", headers=auth(BOB)).status_code == 404
    r = http.get("/v1/status", headers=auth("sk-wrong-key-123"))
    one_line_error(r, 401, "Incorrect API key")


def test_a_job_is_its_key_s_and_an_admin_sees_all(swarm: LocalSwarm, http: httpx.Client) -> None:
    a = http.post("/v1/requests", json={**GOOD, "request_id": "mine"}, headers=auth(ALICE))
    rid = a.json()["request_id"]
    assert http.get(f"/v1/requests/{rid}", headers=auth(ALICE)).json()["state"] == "queued"
    one_line_error(http.get(f"/v1/requests/{rid}", headers=auth(BOB)), 404, f"no request {rid!r}")
    assert http.get(f"/v1/requests/{rid}", headers=auth(ROOT)).status_code == 200
    assert http.get("/v1/requests/doesnotexist", headers=auth(BOB)).status_code == 404  # alike
    # the same request id from another key is another job; from the same key, the same one
    b = http.post("/v1/requests", json={**GOOD, "request_id": "mine"}, headers=auth(BOB))
    assert b.json()["request_id"] != rid
    again = http.post("/v1/requests", json={**GOOD, "request_id": "mine"}, headers=auth(ALICE))
    assert again.json()["request_id"] == rid
    # the logs of a request: its key's, or an admin's
    assert http.get(f"/v1/logs/{rid}", headers=auth(BOB)).status_code == 404
    assert http.get(f"/v1/logs/{rid}", headers=auth(ALICE)).status_code == 200
    assert http.get(f"/v1/logs/{rid}", headers=auth(ROOT)).status_code == 200

    batch = {"items": [LINE, {**LINE, "id": "b"}], "idempotency_key": "k1"}
    bid = http.post("/v1/batches", json=batch, headers=auth(ALICE)).json()["batch_id"]
    for method, suffix in [("GET", ""), ("GET", "/results"), ("POST", "/cancel"),
                           ("POST", "/retry-failed")]:  # fmt: skip
        r = http.request(method, f"/v1/batches/{bid}{suffix}", headers=auth(BOB))
        one_line_error(r, 404, f"no batch {bid!r}")
    info = http.get(f"/v1/batches/{bid}", headers=auth(ALICE)).json()
    assert info["counts"]["queued"] == 2 and "owner" not in info
    rows = http.get(f"/v1/batches/{bid}/results", headers=auth(ALICE)).json()["results"]
    assert [r["id"] for r in rows] == ["a", "b"]
    # the same idempotency key from another key is another batch
    other = http.post("/v1/batches", json=batch, headers=auth(BOB)).json()["batch_id"]
    assert other != bid
    assert http.post("/v1/batches", json=batch, headers=auth(ALICE)).json()["batch_id"] == bid
    # bob's cancel did nothing; the admin's cancels alice's batch
    assert http.get(f"/v1/batches/{bid}", headers=auth(ALICE)).json()["counts"]["queued"] == 2
    assert http.post(f"/v1/batches/{bid}/cancel", headers=auth(ROOT)).json() == {"cancelled": 2}
    assert http.get(f"/v1/batches/{bid}", headers=auth(ALICE)).json()["counts"]["cancelled"] == 2
    assert http.post(f"/v1/batches/{other}/cancel", headers=auth(BOB)).json() == {"cancelled": 2}


def test_key_files(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# comment\n\nsk-one\n  admin   sk-two  \n")
    keys = load_keys(str(f))
    assert len(keys.hashes) == 2 and len(keys.admins) == 1
    one, two = keys.caller("Bearer sk-one"), keys.caller("bearer sk-two")
    assert not isinstance(one, str) and not one.admin
    assert not isinstance(two, str) and two.admin
    assert isinstance(keys.caller("Bearer admin"), str)
    assert isinstance(keys.caller("sk-one"), str)  # no scheme
    assert first_key(str(f)) == "sk-one"
    for bad, says in [("sk-a sk-b\n", "line 1: expected one key"),
                      ("ok\nroot sk-x\n", "line 2"), ("# none\n", "holds no keys")]:  # fmt: skip
        f.write_text(bad)
        with pytest.raises(RequestError, match=says):
            load_keys(str(f))


# -- secrets on disk -------------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_database_and_the_token_are_0600(swarm: LocalSwarm, tmp_path: Path) -> None:
    state = swarm.state_dir
    for name in ("coordinator.db", "coordinator.db-wal", "coordinator.db-shm", "cluster.token"):
        assert mode(state / name) == 0o600, name
    # a database an older version made 0644 is made 0600 when opened
    from cellswarm.swarm.control.db import SQLiteDatabase

    old = tmp_path / "old.db"
    sqlite3.connect(old).execute("CREATE TABLE t (x)").connection.close()
    old.chmod(0o644)
    SQLiteDatabase(str(old)).close()
    assert mode(old) == 0o600
    # a token is written to a private file and renamed over the old one
    token = tmp_path / "cluster.token"
    token.write_text("old")
    token.chmod(0o644)
    write_secret(token, "new-token")
    assert token.read_text() == "new-token" and mode(token) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_sessions_are_stored_hashed(demo_path: Path, tmp_path: Path) -> None:
    """The database keeps sha256(session): a copy of it lets nobody act as a worker."""
    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm, \
            httpx.Client(base_url=swarm.url, timeout=30) as http:  # fmt: skip
        token = swarm.token_file.read_bytes().strip()
        nonce = http.post("/v1/challenge").json()["nonce"]
        session = http.post("/v1/join", json={
            "node_id": "n1", "nonce": nonce, "proof": prove(token, nonce, "n1"),
            "capabilities": {"memory_bytes": 1000, "protocol": PROTOCOL},
        }).json()["session"]  # fmt: skip
        db = sqlite3.connect(swarm.state_dir / "coordinator.db")
        stored = db.execute("SELECT session FROM nodes WHERE node_id='n1'").fetchone()[0]
        db.close()
        assert stored == hashlib.sha256(session.encode()).hexdigest() != session
        beat = {"node_id": "n1", "rss_bytes": 1}
        assert http.post("/v1/heartbeat", json={**beat, "session": stored}).status_code == 401
        assert http.post("/v1/heartbeat", json={**beat, "session": session}).status_code == 200


# -- the schema migration --------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "jobs.db")
    return str(request.getfixturevalue("pg_url"))


def test_a_database_from_before_owners_is_migrated(db_url: str) -> None:
    from cellswarm.swarm.api.access import ANYONE, Caller
    from cellswarm.swarm.control.db import open_database
    from cellswarm.swarm.control.jobs import SCHEMA, JobQueue

    old_schema = re.sub(r",\s*\n\s*owner TEXT[^\n]*", "", SCHEMA)
    assert " owner " not in old_schema
    db = open_database(db_url)
    db.script(old_schema)
    db.execute("INSERT INTO jobs(job_id, kind, payload, state, created_s, updated_s) "
               "VALUES ('old', 'generate', '{}', 'queued', 1, 1)")  # fmt: skip
    queue = JobQueue(db)  # adds the columns
    JobQueue(db)  # and again: a no-op
    old = queue.get("old")
    assert old is not None and old.owner is None
    job, _ = queue.submit({"prompt": [1]}, owner="h" * 64)
    assert queue.get(job.job_id).owner == "h" * 64  # type: ignore[union-attr]
    batch = queue.submit_batch("b", [("generate", {"prompt": [1]})], owner="h" * 64)
    assert queue.batch_info(batch)["owner"] == "h" * 64  # type: ignore[index]
    assert ANYONE.sees(None) and not Caller("x" * 64, False).sees(None)
    db.close()


# -- the batch file --------------------------------------------------------------------------


def test_a_batch_file_with_bad_lines_is_refused_naming_them(tmp_path: Path) -> None:
    from cellswarm.swarm.batch_cli import read_items

    f = tmp_path / "b.jsonl"
    f.write_bytes(b'{"id": "a", "prompt": "x"}\n\n{"id": "b", "prompt": "\xff"}\n'
                  b'{"id": "a", "prompt": "y"}\n{"id": "c", "prompt": "z"}\n')  # fmt: skip
    with pytest.raises(RequestError) as e:
        read_items(f)
    message = str(e.value)
    assert "line 3: byte 0xff at column 24 is not UTF-8" in message
    assert "line 4 repeats the id 'a' of line 1" in message
    f.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    assert [i["id"] for i in read_items(f)] == ["a", "b"]
    os.remove(f)
