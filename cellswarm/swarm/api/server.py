"""The coordinator's HTTP face (FastAPI on uvicorn): workers join and heartbeat, clients
submit requests and read their tokens, `cellswarm status` reads the node table.

Every request passes `access.Edge` first (API keys, the body cap, the request id); client
bodies are checked against `schema.py` before anything is queued. Errors leave as JSON
`{"error": {"message", "type", "param", "code"}}` with a 4xx status, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Annotated, TypedDict

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cellswarm.engine.sampling import SamplingParams
from cellswarm.errors import CellswarmError, RequestError, StorageFullError
from cellswarm.swarm.api import schema
from cellswarm.swarm.api.access import Caller, Edge, error_response, load_keys
from cellswarm.swarm.api.dashboard import add_dashboard_routes
from cellswarm.swarm.api.doctor_api import add_doctor_routes
from cellswarm.swarm.api.guard import Guarded, bound_handshakes
from cellswarm.swarm.api.log_api import add_log_routes
from cellswarm.swarm.api.openai_api import add_openai_routes
from cellswarm.swarm.api.schema import (
    BadRequest,
    NotFound,
    Reply,
    SubmitRequest,
    check_speculative,
    invalid,
    limits_of,
    load_json,
)
from cellswarm.swarm.control.coordinator import Coordinator, CoordinatorConfig
from cellswarm.swarm.control.jobs import Job
from cellswarm.swarm.control.store import Node
from cellswarm.swarm.protocol import VersionMismatch
from cellswarm.swarm.protocol.jsonvalue import JsonObject, JsonValue
from cellswarm.swarm.protocol.messages import (
    FailReport,
    Fault,
    Heartbeat,
    JobResult,
    LeaseAnswer,
    LeaseAsk,
    ReleaseAsk,
    Report,
    decode,
    decode_body,
    encode,
)
from cellswarm.swarm.transport.beats import BEAT_ANSWER_S, MAX_BEATS, beat_batch, settled
from cellswarm.swarm.transport.wire import check_numbers

MAX_WAIT_S = 30.0
MAX_LEASE_WAIT_S = 1.5  # under the worker's HTTP timeout (worker.HTTP_TIMEOUT_S + wait)
MAX_RESULTS_PER_POST = 256  # = head.RESULTS_PER_POST: the work one post asks of the core


async def node_body(request: Request) -> dict[str, object]:
    """A node's body (the workers' routes keep their plain-dict protocol)."""
    data = load_json(await request.body())
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    check_numbers(data)  # transport/wire.py: no number a field could not mean
    return data


def result_items(results: object) -> list[JobResult]:
    """A head's posted results; BadRequest unless a list of at most MAX_RESULTS_PER_POST
    objects with job_id, fence and result."""
    if not isinstance(results, list) or len(results) > MAX_RESULTS_PER_POST:
        raise BadRequest(f"results: a list of at most {MAX_RESULTS_PER_POST} objects with "
                         "job_id, fence and result", param="results")  # fmt: skip
    try:
        return [decode(JobResult, r) for r in results]
    except RequestError:
        raise BadRequest(f"results: a list of at most {MAX_RESULTS_PER_POST} objects with "
                         "job_id, fence and result", param="results") from None  # fmt: skip


def node_of(coord: Coordinator, data: Mapping[str, object]) -> Node:
    return coord.authenticate(str(data["node_id"]), str(data["session"]))


def _beat(coord: Coordinator, d: dict[str, object]) -> Reply:
    """One node's heartbeat (on the core thread): its answer."""
    answer = coord.heartbeat(node_of(coord, d), decode(Heartbeat, d))
    coord.beats_via["http"] += 1
    return answer


def session_node(coord: Coordinator, request: Request) -> Node:
    who = request.headers.get("x-cellswarm-session", "")
    node_id, _, session = who.partition(":")
    return coord.authenticate(node_id, session)


DEFAULT_POWER_PROFILE = "laptop"  # whose watts a node without --profile is estimated at


def power_of(caps: Mapping[str, object]) -> list[JsonValue]:
    """[busy W, idle W, profile] for a node's energy estimate: its --profile's figures, else a
    laptop's (the estimate says which)."""
    return list(_power(str(caps.get("profile") or DEFAULT_POWER_PROFILE)))


@functools.lru_cache(maxsize=256)
def _power(profile: str) -> tuple[float, float, str]:
    """Remembered per name: finding a profile parses the profiles' TOML (~3 ms), which was
    most of a join's cost (joins were ~300 a second)."""
    from cellswarm.errors import CellswarmError
    from cellswarm.planner.profiles import get_profile

    try:
        p = get_profile(profile)
    except CellswarmError:
        p = get_profile(DEFAULT_POWER_PROFILE)
    return (p.power_busy_w, p.power_idle_w, p.name)


def joined(coord: Coordinator, answer: Mapping[str, JsonValue],
           join: Mapping[str, object]) -> JsonObject:  # fmt: skip
    """A join's answer: its session, how often to beat, and its energy estimate's watts."""
    caps = join.get("capabilities") or {}
    assert isinstance(caps, Mapping)  # its join was answered: coord.join took it as one
    return {**answer, "heartbeat_s": coord.heartbeat_interval_s(),
            "heartbeat_timeout_s": coord.heartbeat_timeout_s(),
            "power_w": power_of(caps)}  # fmt: skip


def capabilities(join: Mapping[str, object]) -> dict[str, object]:
    """A join's capabilities as `dict()` makes them of what it sent (an object, or key-value
    pairs; a TypeError or ValueError, a 400, for anything else)."""
    caps = join.get("capabilities") or {}
    if not isinstance(caps, Iterable):
        raise TypeError(f"{type(caps).__name__!r} object is not iterable")  # as dict() says
    return dict(caps)


def build_app(coord: Coordinator) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(coord.monitor())
        warm = asyncio.create_task(asyncio.to_thread(coord.warm_up))
        nats = None
        if coord.config.control:  # beats over NATS too, once it answers (transport/beats.py)
            from cellswarm.swarm.transport.beats import subscribe

            nats = await subscribe(coord, coord.config.control)
        yield
        if nats is not None:
            nats.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await nats
        task.cancel()
        warm.cancel()
        coord.log_shipper.close()  # its own events still in the buffer

    app = FastAPI(title="cellswarm coordinator", lifespan=lifespan)
    keys = load_keys(coord.config.api_key_file)
    app.add_middleware(Edge, keys=keys, max_body=coord.config.max_body_bytes,
                       routes=app.router.routes)  # fmt: skip
    add_error_handlers(app)
    add_openai_routes(app, coord)  # openai_api.py
    add_log_routes(app, coord, bool(keys))  # log_api.py: POST /v1/logs, GET /v1/logs/{id}
    add_doctor_routes(app, coord, bool(keys))  # doctor_api.py: POST /v1/doctor
    add_dashboard_routes(app, coord, bool(keys))  # dashboard/: GET /, /dashboard/*

    @app.exception_handler(StorageFullError)
    async def full(_: Request, exc: StorageFullError) -> JSONResponse:
        coord.disk_full.warn(str(exc))  # once a minute in the log; every caller is told
        return _error(507, str(exc), "StorageFullError")

    add_node_routes(app, coord)
    add_request_routes(app, coord)
    add_head_routes(app, coord)
    from cellswarm.swarm.api.batch_api import add_batch_routes

    add_batch_routes(app, coord)
    return app


def add_node_routes(app: FastAPI, coord: Coordinator) -> None:
    """A node's: the challenge, joining, heartbeats, faults, and the model's bytes."""

    @app.post("/v1/challenge")
    async def challenge(request: Request) -> Reply:
        """A nonce for a join's proof; `{"count": n}`: n of them (a rack's relay)."""
        d = await node_body(request) if await request.body() else {}
        count = d.get("count", 1)
        if not isinstance(count, int) or not 1 <= count <= MAX_BEATS:
            raise RequestError(f"count must be a whole number from 1 to {MAX_BEATS}, not "
                               f"{count!r}")  # fmt: skip
        host = request.client.host if request.client else "127.0.0.1"
        nonces = await coord.on_core(coord.challenges, count, host)
        return {"nonce": nonces[0], "nonces": nonces}

    @app.post("/v1/join")
    async def join(request: Request) -> Reply:
        d = await node_body(request)
        host = request.client.host if request.client else "127.0.0.1"
        session = await coord.on_core(coord.join, str(d["node_id"]), str(d["nonce"]),
                                      str(d.get("proof", "")), capabilities(d),
                                      host)  # fmt: skip
        return joined(coord, {"session": session}, d)

    @app.post("/v1/joins")
    async def joins(request: Request) -> Reply:
        """A rack's joins in one request, sent by its relay (a joined node, checked first as
        for /v1/heartbeats); each join carries its own proof and gets its own answer."""
        d = await node_body(request)
        await coord.on_core(node_of, coord, d)
        joins = d.get("joins")
        if not isinstance(joins, list) or len(joins) > MAX_BEATS:
            raise RequestError(f"a join batch is an object with a list of at most {MAX_BEATS} "
                               "joins")  # fmt: skip
        host = request.client.host if request.client else "127.0.0.1"
        answers = await coord.on_core(coord.join_many, joins, host)
        return {"answers": [joined(coord, a, j) if "session" in a else a
                            for j, a in zip(joins, answers, strict=True)]}  # fmt: skip

    @app.post("/v1/heartbeat")
    async def heartbeat(request: Request) -> Reply:
        d = await node_body(request)
        beat = asyncio.get_running_loop().run_in_executor(coord.core, _beat, coord, d)
        try:
            return await asyncio.wait_for(asyncio.shield(beat), BEAT_ANSWER_S)
        except TimeoutError:  # the core is busy: say "heard", record the beat when it can
            held = coord.held_answer(str(d.get("node_id")), str(d.get("session")))
            if held is None:
                return await beat
            beat.add_done_callback(settled)
            return held

    @app.post("/v1/heartbeats")
    async def heartbeats(request: Request) -> Reply:
        """Many nodes' heartbeats in one request (a rack's relay: one message per rack per
        interval instead of one per node); transport/beats.py answers it, as it does on NATS."""
        return await coord.on_core(beat_batch, coord, await node_body(request), "http")

    @app.post("/v1/fault")
    async def fault(request: Request) -> Reply:
        d = await node_body(request)

        def fault() -> None:
            node = node_of(coord, d)  # a stranger hears 401 before any field is read
            f = decode(Fault, d)
            coord.fault(node, f.kind, f.detail, f.epoch, f.job or None)

        await coord.on_core(fault)
        return {"ok": True}

    @app.get("/v1/model/manifest")
    async def manifest(request: Request) -> Response:
        await coord.on_core(session_node, coord, request)  # the weights go to members only
        m = await asyncio.to_thread(coord.manifest)
        return Response(m.to_json(), media_type="application/json")

    @app.get("/v1/model/chunks/{index}")
    async def chunk(index: int, request: Request) -> Response:
        from cellswarm.swarm.transport.fetch import read_chunk

        await coord.on_core(session_node, coord, request)
        m = await asyncio.to_thread(coord.manifest)
        if not 0 <= index < m.n_chunks:
            raise RequestError(f"chunk {index} is not in 0..{m.n_chunks - 1}")
        data = await asyncio.to_thread(read_chunk, coord.config.model, m, index)
        return Response(data, media_type="application/octet-stream")


def add_request_routes(app: FastAPI, coord: Coordinator) -> None:
    """A client's: health, status, submitting a request and following it."""

    @app.get("/healthz")
    async def healthz() -> Reply:
        return {"ok": True}

    @app.get("/v1/status")
    async def status() -> Reply:
        return await coord.on_core(coord.status)

    @app.get("/metrics")
    async def metrics() -> Response:
        """The swarm in Prometheus' text format (api/metrics.py); a client route."""
        from cellswarm.swarm.api.metrics import CONTENT_TYPE, render

        return Response(await coord.on_core(render, coord), media_type=CONTENT_TYPE)

    @app.get("/v1/metrics/targets")
    async def metrics_targets() -> Sequence[Reply]:
        """Every worker's /metrics, in Prometheus' http_sd_configs format."""
        return await coord.on_core(coord.metrics_targets)

    @app.post("/v1/requests")
    async def submit(
        request: Request, req: Annotated[SubmitRequest, schema.body(SubmitRequest)]
    ) -> Reply:
        caller: Caller = request.state.caller
        payload = await asyncio.to_thread(_payload, coord, req)  # tokenizing: not on the core
        job = await coord.on_core(functools.partial(
            coord.submit, payload, scoped_key(caller, req.request_id), owner=caller.owner))
        request.state.request_id = job.job_id  # the x-request-id header
        return {"request_id": job.job_id, "state": job.state}

    @app.get("/v1/requests/{request_id}")
    async def progress(
        request: Request, request_id: str, after: Annotated[int, Query(ge=0)] = 0,
        wait_s: Annotated[float, Query(ge=0, allow_inf_nan=False)] = 0.0,
    ) -> Reply:  # fmt: skip
        await coord.on_core(owned_job, coord, request.state.caller, request_id)
        job = await wait_for_job(coord, request_id, after, wait_s)
        tokens = job.tokens if job.result is None else list(job.result.get("tokens", []))
        out = {
            "request_id": job.job_id, "state": job.state, "reason": _reason(job),
            "tokens": tokens[after:], "n_tokens": len(tokens), "attempts": job.leases,
        }  # fmt: skip
        if job.terminal and job.payload.get("text"):
            out["text"] = coord.tokenizer.decode(tokens, skip_special=True)
        if job.result and job.result.get("drafted"):  # speculative decoding's drafts
            out["drafted_tokens"] = job.result["drafted"]
            out["accepted_tokens"] = job.result.get("accepted", 0)
        return out

    @app.get("/v1/ledger")
    async def ledger() -> Reply:
        return await coord.on_core(coord.queue.ledger)


def add_head_routes(app: FastAPI, coord: Coordinator) -> None:
    """A pipeline head's: lease, checkpoint, complete, fail, release. Each proves its
    session before its fields are read (and again on the core, with the action: the node's
    state then is what the action sees)."""

    @app.post("/v1/jobs/lease")
    async def lease(request: Request) -> dict[str, object]:
        d = await node_body(request)
        node = await coord.on_core(node_of, coord, d)
        ask = decode_body(LeaseAsk, d)
        n, wait_s = ask.n, min(max(ask.wait_s, 0.0), MAX_LEASE_WAIT_S)
        deadline = time.monotonic() + wait_s
        while not (jobs := await coord.on_core(coord.lease, node, n)) and \
                time.monotonic() < deadline:  # fmt: skip
            # a long poll: look again on news (a submission, a finished job, a requeue) or
            # every 0.5 s (another coordinator sharing the database may have queued one)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(coord.pulse.wait(), 0.5)
        sequences = await coord.on_core(coord.ring_sequences, node)
        return encode(LeaseAnswer(jobs=jobs, ring_sequences=sequences))

    @app.post("/v1/jobs/checkpoint")
    async def checkpoint(request: Request) -> Reply:
        """Runs' tokens so far ("runs"), and ended jobs' results ("results", as `complete`
        takes them) committed first: a head's one post for both."""
        d = await node_body(request)
        await coord.on_core(node_of, coord, d)  # a stranger hears 401 before a field is read
        items = result_items(d["results"]) if "results" in d else []
        runs = decode_body(Report, {"runs": d.get("runs", [])}).runs
        stale, outcomes = await coord.on_core(
            lambda: coord.report(node_of(coord, d), items, runs))
        return {"stale": stale, **({"outcomes": outcomes} if items else {})}

    @app.post("/v1/jobs/complete")
    async def complete(request: Request) -> Reply:
        """One result (job_id, fence, result), or several ("results": a list of them, at most
        MAX_RESULTS_PER_POST): each with the outcome it would have alone, in one commit."""
        d = await node_body(request)
        await coord.on_core(node_of, coord, d)
        one = "results" not in d
        items = [decode_body(JobResult, d)] if one else result_items(d["results"])
        outcomes = await coord.on_core(lambda: coord.complete_all(node_of(coord, d), items))
        return {"outcome": outcomes[0]} if one else {"outcomes": outcomes}

    @app.post("/v1/jobs/fail")
    async def fail(request: Request) -> Reply:
        d = await node_body(request)
        await coord.on_core(node_of, coord, d)
        said = decode_body(FailReport, d)
        outcome = await coord.on_core(lambda: coord.fail(
            node_of(coord, d), said.job_id, said.fence, said.reason, said.fault))
        return {"outcome": outcome}

    @app.post("/v1/jobs/release")
    async def release(request: Request) -> Reply:
        d = await node_body(request)
        await coord.on_core(node_of, coord, d)
        runs = decode_body(ReleaseAsk, d).runs
        return {"released": await coord.on_core(
            lambda: coord.release(node_of(coord, d), runs))}


def add_error_handlers(app: FastAPI) -> None:
    """Every error as one line of JSON (OpenAI's shape on its routes): never a traceback."""

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(request.url.path, exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_fields(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await bad_request(request, invalid(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(
            exc.status_code)  # fmt: skip
        message = str(exc.detail) if exc.status_code == 413 else (
            f"{request.method} {request.url.path}: {exc.detail}")  # fmt: skip
        return error_response(request.url.path, exc.status_code, message, code)

    @app.exception_handler(VersionMismatch)
    async def other_version(_: Request, exc: VersionMismatch) -> JSONResponse:
        return _error(409, str(exc), "VersionMismatch")

    @app.exception_handler(PermissionError)
    async def denied(request: Request, exc: PermissionError) -> JSONResponse:
        return error_response(request.url.path, 401, str(exc))

    @app.exception_handler(CellswarmError)
    async def bad(request: Request, exc: CellswarmError) -> JSONResponse:
        return _error(400, str(exc), type(exc).__name__)

    @app.exception_handler(KeyError)
    async def missing(_: Request, exc: KeyError) -> JSONResponse:
        return _error(400, f"missing field {exc}", "RequestError")

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def bad_value(_: Request, exc: Exception) -> JSONResponse:  # a node's malformed field
        return _error(400, f"a field has the wrong type or value: {exc}", "RequestError")


def scoped_key(caller: Caller, key: str | None) -> str | None:
    """An idempotency key within its API key's jobs: two clients choosing the same
    request id get two jobs, and neither learns of the other's."""
    if key is None or caller.owner is None:
        return key
    return f"{caller.owner[:32]}/{key}"


def owned_job(coord: Coordinator, caller: Caller | None, job_id: str) -> Job:
    """The job, if the caller may see it; NotFound alike when it does not exist."""
    job = coord.queue.get(job_id)
    if job is None or caller is None or not caller.sees(job.owner):
        raise NotFound(f"no request {job_id!r}", param="request_id")
    return job


async def wait_for_job(coord: Coordinator, job_id: str, after: int, wait_s: float) -> Job:
    """The job once it has more than `after` tokens or is over, or when `wait_s` is up.
    Woken by this coordinator's own progress; polls too, for work another coordinator saw."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_s, MAX_WAIT_S)
    while True:
        job = await coord.on_core(coord.queue.get, job_id)
        if job is None:
            raise NotFound(f"no request {job_id!r}")
        tokens = job.result.get("tokens", []) if job.result else job.tokens
        left = deadline - loop.time()
        if job.terminal or len(tokens) > after or left <= 0:
            return job
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(coord.pulse.wait(), min(left, 0.25))


def _reason(job: Job) -> str:
    if job.state == "done" and job.result is not None:
        return str(job.result.get("reason", ""))
    return job.error


def _payload(coord: Coordinator, req: SubmitRequest) -> dict[str, object]:
    """A request as the ring takes it: prompt token ids, max_tokens, sampling, stop ids —
    each checked against the model (vocabulary, context) before it is queued."""
    limits = limits_of(coord)
    text = isinstance(req.prompt, str)
    if isinstance(req.prompt, str):
        prompt = limits.encode(coord.tokenizer.encode, req.prompt, "prompt")
    else:
        prompt = limits.ids(req.prompt, "prompt")
    if not prompt:
        raise BadRequest("prompt: the text makes no tokens; send more text", param="prompt")
    limits.generate(prompt, req.max_tokens)
    sampling = req.sampling.sampling() if req.sampling else {}
    SamplingParams(**sampling)  # the engine's own checks, which the ring will run
    limits.ids(req.sampling.bias_ids() if req.sampling else [], "logit_bias")
    stop_ids = limits.ids(req.stop_ids or [], "stop_ids")
    if text and not stop_ids:
        stop_ids = sorted(coord.tokenizer.stop_ids)
    check_speculative(coord, req.speculative)
    spec = {} if req.speculative is None else {"speculative": req.speculative}
    return {"prompt": prompt, "max_tokens": req.max_tokens, "sampling": sampling,
            "stop_ids": stop_ids, "text": text, **spec}  # fmt: skip


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


# Open files a coordinator wants: one per connection (a node's, a client's, a stranger's)
WANT_OPEN_FILES = 4096


def raise_open_files() -> None:
    """The soft open-file limit up to the hard one (systemd's default soft limit, 1024,
    let 1,100 idle connections make the coordinator unreachable); a warning when even the
    hard one is low (docs/deploy.md's unit sets LimitNOFILE)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft != resource.RLIM_INFINITY and soft < WANT_OPEN_FILES:
        print(f"warning: at most {soft} open files (ulimit -n): every connection takes one; "
              f"raise it to {WANT_OPEN_FILES} or more (LimitNOFILE= in a systemd unit)",
              flush=True)  # fmt: skip


def serve(config: CoordinatorConfig) -> None:
    """Run until interrupted. Prints `READY http://HOST:PORT` (https with TLS) once listening."""
    import uvicorn

    raise_open_files()
    check_free(config.host, config.port)
    if not logging.getLogger().handlers:  # joins, placements, losses, rewirings: said
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    coord = Coordinator(config)
    if coord.token is None:
        print("warning: no --token-file: any process that can reach this port may join",
              flush=True)  # fmt: skip
    uv = uvicorn.Config(build_app(coord), host=config.host, port=config.port,
                        log_level="warning", lifespan="on", http=Guarded,
                        **_tls(config.tls_dir))  # fmt: skip
    server = uvicorn.Server(uv)

    async def run() -> None:
        bound_handshakes(asyncio.get_running_loop())  # guard.py: strangers who say nothing
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                return await task
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        scheme = "https" if config.tls_dir else "http"
        print(f"READY {scheme}://{config.host}:{port}", flush=True)
        await task

    asyncio.run(run())


def check_free(host: str, port: int) -> None:
    """RequestError, one line, if the coordinator could not listen on host:port (uvicorn
    says so in a traceback, after the coordinator took the lead)."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host.strip("[]"), port))
        except OSError as exc:
            raise RequestError(f"--listen {host}:{port}: {exc.strerror or exc}; is another "
                               "coordinator there? give another port") from None  # fmt: skip


class TLSOptions(TypedDict, total=False):
    """uvicorn.Config's TLS options."""

    ssl_certfile: str
    ssl_keyfile: str
    ssl_ca_certs: str
    ssl_cert_reqs: int
    ssl_version: int
    ssl_ciphers: str


def _tls(tls_dir: str | None) -> TLSOptions:
    """uvicorn's options for mutual TLS: our certificate, and a client's required (tls.py)."""
    if tls_dir is None:
        return {}
    import ssl

    from cellswarm.swarm.tls import TLS12_CIPHERS, files, lean_tls_buffers

    lean_tls_buffers()  # the coordinator's inbound requests are small (tls.py)
    ca, cert, key = files(tls_dir)
    return {"ssl_certfile": cert, "ssl_keyfile": key, "ssl_ca_certs": ca,
            "ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_version": ssl.PROTOCOL_TLS_SERVER,
            "ssl_ciphers": TLS12_CIPHERS}  # fmt: skip
