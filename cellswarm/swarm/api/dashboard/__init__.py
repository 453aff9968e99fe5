"""The coordinator's dashboard at `/`: server-rendered HTML fragments, refreshed by htmx.

The page itself (`/`) and its static files are open: they hold no data. Each panel is a
fragment under `/dashboard/` that htmx polls — each ring in token order (node, layers,
address, tokens/s, heartbeat age), the node map by rack (state, what each node holds, memory
against its budget, step time, temperature where known, a shard's fetch progress), tokens/s
and request latency charts with axes over 1, 5 or 15 minutes, the queue, batches (done, dead,
running and queued in colour, rate, ETA), the requests that ended lately — each a click from
the waterfall of its events — and a chat box (the OpenAI chat route, static/dashboard.js). The
fragments are client routes: with `--api-key-file` they need an admin's key, which the page
asks for once and sends as `Authorization: Bearer` (static/dashboard.js). htmx is vendored
(static/README.md): nothing is fetched from a CDN. Templates autoescape, so a node id or an
event field can never become markup.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from cellswarm.swarm.api.dashboard import views
from cellswarm.swarm.api.schema import NotFound
from cellswarm.swarm.protocol.jsonvalue import JsonObject

if TYPE_CHECKING:
    from cellswarm.swarm.control.coordinator import Coordinator

HERE = Path(__file__).parent
STATIC = {"htmx.min.js": "text/javascript", "dashboard.js": "text/javascript",
          "dashboard.css": "text/css"}  # fmt: skip
TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
    undefined=jinja2.StrictUndefined,
)  # fmt: skip


def render(name: str, **values: object) -> HTMLResponse:
    return HTMLResponse(TEMPLATES.get_template(name).render(**values))


def add_dashboard_routes(app: FastAPI, coord: Coordinator, api_keys: bool) -> None:
    throughput, rates = views.Throughput(), views.NodeRates()

    def operator(request: Request) -> HTMLResponse | None:
        caller = request.state.caller
        if api_keys and (caller is None or not caller.admin):
            return HTMLResponse(TEMPLATES.get_template("message.html").render(
                message="the dashboard needs an admin's API key"), status_code=403)
        return None

    async def looked() -> JsonObject:
        """The status, with the throughput and each node's rate sampled from it."""
        status = await coord.on_core(coord.status)
        throughput.sample(views.tokens_so_far(status))
        rates.sample(status)
        return status

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return render("page.html", model=Path(str(coord.config.model)).name,
                      coordinator=coord.id, ranges=views.RANGES_S)  # fmt: skip

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC:
            raise NotFound(f"no static file {name!r}")
        return FileResponse(HERE / "static" / name, media_type=STATIC[name])

    @app.get("/dashboard/nodes", response_class=HTMLResponse)
    async def nodes(request: Request) -> HTMLResponse:
        if (denied := operator(request)) is not None:
            return denied
        status = await looked()
        return render("nodes.html", status=status, racks=views.racks(status, rates),
                      rings=views.rings(status, rates),
                      bottlenecks=views.bottleneck_texts(status))

    @app.get("/dashboard/throughput", response_class=HTMLResponse)
    async def charts(request: Request, range: int = 300) -> HTMLResponse:
        if (denied := operator(request)) is not None:
            return denied
        range_s = range if range in views.RANGES_S else 300
        status = await looked()
        recent = list(coord.requests.recent)
        return render("throughput.html", tokens=views.tokens_so_far(status), range_s=range_s,
                      ranges=views.RANGES_S, rate=throughput.chart(range_s),
                      latency=views.latency_chart(recent, range_s))  # fmt: skip

    @app.get("/dashboard/requests", response_class=HTMLResponse)
    async def recent(request: Request) -> HTMLResponse:
        if (denied := operator(request)) is not None:
            return denied
        return render("requests.html", rows=views.request_rows(list(coord.requests.recent)))

    @app.get("/dashboard/queue", response_class=HTMLResponse)
    async def queue(request: Request) -> HTMLResponse:
        if (denied := operator(request)) is not None:
            return denied
        ledger = await asyncio.to_thread(coord.queue.ledger)
        retries = await asyncio.to_thread(coord.queue.retries)
        return render("queue.html", rows=views.queue_rows(ledger, retries))

    @app.get("/dashboard/batches", response_class=HTMLResponse)
    async def batches(request: Request) -> HTMLResponse:
        if (denied := operator(request)) is not None:
            return denied
        infos = await asyncio.to_thread(coord.queue.recent_batches)
        return render("batches.html", batches=views.batch_rows(infos))

    @app.get("/dashboard/request", response_class=HTMLResponse)
    async def timeline(request: Request, id: str = "") -> HTMLResponse:
        if (denied := operator(request)) is not None:
            return denied
        rid = id.strip()[:64]
        events = await asyncio.to_thread(coord.events.timeline, rid) if rid else []
        return render("request.html", request_id=rid, rows=views.timeline_rows(events))
