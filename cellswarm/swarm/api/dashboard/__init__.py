"""The coordinator's dashboard at `/`: server-rendered HTML fragments, refreshed by htmx.

The page itself (`/`) and its static files are open: they hold no data. Each panel is a
fragment under `/dashboard/` that htmx polls — the node map by rack (state, what each node
holds, memory against its budget, step time, temperature where known), tokens/s over the
last minutes, the queue, batches with progress, and one request's timeline from its id. The
fragments are client routes: with `--api-key-file` they need an admin's key, which the page
asks for once and sends as `Authorization: Bearer` (static/dashboard.js). htmx is vendored
(static/README.md): nothing is fetched from a CDN. Templates autoescape, so a node id or an
event field can never become markup.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from cellswarm.swarm.api.dashboard import views
from cellswarm.swarm.api.schema import NotFound

if TYPE_CHECKING:
    from cellswarm.swarm.control.coordinator import Coordinator

HERE = Path(__file__).parent
STATIC = {"htmx.min.js": "text/javascript", "dashboard.js": "text/javascript",
          "dashboard.css": "text/css"}  # fmt: skip
TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
    undefined=jinja2.StrictUndefined,
)  # fmt: skip


def render(name: str, **values: Any) -> HTMLResponse:
    return HTMLResponse(TEMPLATES.get_template(name).render(**values))


def add_dashboard_routes(app: FastAPI, coord: Coordinator, api_keys: bool) -> None:
    throughput = views.Throughput()

    def operator(request: Request) -> HTMLResponse | None:
        caller = request.state.caller
        if api_keys and (caller is None or not caller.admin):
            return HTMLResponse(TEMPLATES.get_template("message.html").render(
                message="the dashboard needs an admin's API key"), status_code=403)
        return None

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return render("page.html", model=Path(str(coord.config.model)).name,
                      coordinator=coord.id)  # fmt: skip

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC:
            raise NotFound(f"no static file {name!r}")
        return FileResponse(HERE / "static" / name, media_type=STATIC[name])

    @app.get("/dashboard/nodes", response_class=HTMLResponse)
    async def nodes(request: Request) -> HTMLResponse:
        if (denied := operator(request)) is not None:
            return denied
        status = await coord.on_core(coord.status)
        throughput.sample(views.tokens_so_far(status))
        return render("nodes.html", status=status, racks=views.racks(status))

    @app.get("/dashboard/throughput", response_class=HTMLResponse)
    async def rate(request: Request) -> HTMLResponse:
        if (denied := operator(request)) is not None:
            return denied
        status = await coord.on_core(coord.status)
        tokens = views.tokens_so_far(status)
        throughput.sample(tokens)
        points, now, peak = throughput.sparkline()
        return render("throughput.html", points=points, now=now, peak=peak, tokens=tokens)

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
