"""The coordinator's log routes (logship.py has the rest): nodes ship batches of events,
operators read one request's timeline across nodes."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from cellswarm.errors import RequestError
from cellswarm.swarm.api.schema import NotFound, Reply, load_json
from cellswarm.swarm.auth import OPERATOR, verify
from cellswarm.swarm.protocol.messages import LogBatch, decode_body
from cellswarm.swarm.transport.wire import check_numbers

if TYPE_CHECKING:
    from cellswarm.swarm.control.coordinator import Coordinator


def add_log_routes(app: FastAPI, coord: Coordinator, api_keys: bool = False) -> None:
    """`POST /v1/logs` (a node's batch, with its session) and `GET /v1/logs/{request_id}`
    (for operators: an API key — an admin's for any request, another only for its own
    jobs — or a proof of the cluster token over a fresh nonce; open only when the
    coordinator has neither a token nor API keys). access.Edge has read the key."""

    @app.post("/v1/logs")
    async def ship(request: Request) -> Reply:
        d = load_json(await request.body())
        if not isinstance(d, dict) or not isinstance(d.get("events"), list):
            raise RequestError("a log batch is an object with a list of events")
        node = await coord.on_core(coord.authenticate, str(d.get("node_id")),
                                   str(d.get("session")))  # fmt: skip
        check_numbers(d, "log batch")  # a seq of 2^70 was a bare 500, a ts of 1e400 stored
        batch = decode_body(LogBatch, d)  # after the proof: a stranger hears 401 first
        if batch.clock_offset_s is not None:  # as a heartbeat reports it
            coord.node_clock[node.node_id] = (batch.clock_offset_s,
                                              batch.clock_error_s or 0.0)  # fmt: skip
        offset_s, error_s = coord.node_clock.get(node.node_id, (0.0, None))
        added = await asyncio.to_thread(coord.events.insert, node.node_id, batch.run,
                                        batch.events, offset_s, error_s)  # fmt: skip
        return {"acked": len(batch.events), "added": added}

    def operator(request: Request, request_id: str) -> None:
        require_operator(coord, request, api_keys, request_id)

    @app.get("/v1/logs/{request_id}")
    async def timeline(request_id: str, request: Request) -> Reply:
        await coord.on_core(operator, request, request_id)
        events = await asyncio.to_thread(coord.events.timeline, request_id)
        return {"request_id": request_id, "events": events}


def require_operator(coord: Coordinator, request: Request, api_keys: bool,
                     request_id: str | None = None) -> None:  # fmt: skip
    """An operator's route: an API key (an admin's; for `request_id`, also its owner's) or
    a proof of the cluster token over a fresh nonce; open only when the coordinator has
    neither a token nor API keys. PermissionError otherwise."""
    if coord.token is None and not api_keys:
        return
    h = request.headers
    caller = request.state.caller
    if api_keys and caller is not None:  # a good API key
        if caller.admin:
            return
        job = coord.queue.get(request_id) if request_id is not None else None
        if job is None or not caller.sees(job.owner):
            if request_id is None:
                raise PermissionError("this route needs an admin's API key")
            raise NotFound(f"no request {request_id!r}", param="request_id")
        return
    nonce, _, proof = h.get("x-cellswarm-proof", "").partition(":")
    # a nonce is single use, as for a join: spent once the proof over it held
    if coord.token is not None and nonce and verify(coord.token, nonce, OPERATOR, proof) \
            and coord.nonces.take(nonce, time.monotonic()):  # fmt: skip
        return
    # not a node's session: any member holds one, and an operator's route reads every
    # request's timeline or drives every node (a session is for its own node's routes)
    raise PermissionError(
        "this route needs an API key (Authorization: Bearer KEY) or a proof "
        "of the cluster token (--token-file)"
    )
