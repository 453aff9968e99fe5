"""`POST /v1/doctor`: one round of checks on every live node (control/checkup.py), judged.

An operator's route (log_api.require_operator: an admin's API key or a proof of the cluster
token). The round rides on heartbeats, so it takes two or three heartbeat intervals; a node
that has not answered within `wait_s` fails its echo. The answer is the list of results, in
the seed's order, for `cellswarm doctor --coordinator` to print.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from cellswarm.errors import TokenizerError
from cellswarm.swarm.api.log_api import require_operator
from cellswarm.swarm.api.schema import Reply, load_json
from cellswarm.swarm.control.checkup import Round, judge_round

if TYPE_CHECKING:
    from cellswarm.swarm.control.coordinator import Coordinator
    from cellswarm.swarm.control.store import Node

CHECKED_STATES = ("spare", "assigned", "offline")  # lost and refused nodes: status says why
DEFAULT_WAIT_S, MAX_WAIT_S = 20.0, 120.0


def add_doctor_routes(app: FastAPI, coord: Coordinator, api_keys: bool) -> None:
    @app.post("/v1/doctor")
    async def doctor(request: Request) -> Reply:
        await coord.on_core(require_operator, coord, request, api_keys)
        body = load_json(await request.body() or b"{}")
        wait_s = DEFAULT_WAIT_S
        if isinstance(body, dict) and isinstance(body.get("wait_s"), int | float):
            wait_s = min(max(float(body["wait_s"]), 1.0), MAX_WAIT_S)
        def start() -> tuple[list[Node], Round]:
            nodes = [n for n in coord.store.nodes() if n.state in CHECKED_STATES]
            return nodes, coord.checkups.start([n.node_id for n in nodes])

        nodes, rnd = await coord.on_core(start)
        deadline = time.monotonic() + wait_s
        while not rnd.complete and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            tokens: int | None = int(coord.tokenizer.vocab_size)
        except TokenizerError:  # a model without one: clients send token ids
            tokens = None
        results = await asyncio.to_thread(judge_round, str(coord.config.model), tokens, rnd,
                                          nodes)  # fmt: skip
        return {"round": rnd.round_id, "results": [asdict(r) for r in results]}
