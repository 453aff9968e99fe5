"""Batch jobs over HTTP: a JSONL file's lines become jobs, read back in input order.

    POST /v1/batches {name, items: [line, ...], verify_fraction, idempotency_key}
    GET  /v1/batches/{id}            counts by state, tokens, tokens/s, ETA
    GET  /v1/batches/{id}/results    one row per input line, in order: output or error
    POST /v1/batches/{id}/cancel     queued and leased jobs -> cancelled
    POST /v1/batches/{id}/retry-failed   dead jobs -> queued, fresh attempts

A line is `{"id", "prompt" | "messages", "max_tokens", "temperature", "top_p", "top_k",
"min_p", "repetition_penalty", "seed"}` to generate, or adds `"completions": [...]` (their
log-likelihoods given the prompt) or `"labels": [...]` (the most likely label: offline
classification) to score — `schema.BatchItem`, every field checked at submit, an unknown one
refused. Ids must be unique within a batch (a line without one is named by its position).
A batch, its results, cancel and retry belong to the API key that submitted it (access.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request

from cellswarm.engine.sampling import SamplingParams
from cellswarm.errors import CellswarmError
from cellswarm.swarm.api.access import Caller
from cellswarm.swarm.api.schema import (
    BadRequest,
    BatchItem,
    BatchRequest,
    NotFound,
    Reply,
    body,
    chat_turns,
    check_speculative,
    limits_of,
    parse,
)
from cellswarm.swarm.control.jobs import TERMINAL, Job
from cellswarm.swarm.protocol.jsonvalue import JsonObject

if TYPE_CHECKING:
    from cellswarm.swarm.control.coordinator import Coordinator


def add_batch_routes(app: FastAPI, coord: Coordinator) -> None:
    @app.post("/v1/batches")
    async def submit(
        request: Request, req: Annotated[BatchRequest, body(BatchRequest)]
    ) -> Reply:
        caller: Caller = request.state.caller
        refuse_duplicates(req.items)
        # tokenizing up to --max-body of prompts takes a while: not on the event loop, which
        # answers the workers' heartbeats
        jobs = await asyncio.to_thread(
            lambda: [item_job(coord, item, i) for i, item in enumerate(req.items)])
        fraction = req.verify_fraction or 0.0
        key = req.idempotency_key
        batch_id = await asyncio.to_thread(  # chunked transactions, off the event loop
            coord.queue.submit_batch, req.name or "batch", jobs, verify_fraction=fraction,
            batch_id=_batch_id(key, caller.owner) if key else None, owner=caller.owner,
        )  # fmt: skip
        coord.notify()  # heads waiting in a long poll take the first jobs now
        coord.log.event("batch", None, batch=batch_id, jobs=len(jobs), verify=fraction)
        return {"batch_id": batch_id, "total": len(jobs)}

    @app.get("/v1/batches/{batch_id}")
    async def info(request: Request, batch_id: str) -> Reply:
        return await asyncio.to_thread(batch_progress, coord, batch_id, request.state.caller)

    @app.get("/v1/batches/{batch_id}/results")
    async def results(request: Request, batch_id: str) -> Reply:
        def rows() -> list[JsonObject]:  # decoding a big batch's texts: off the loop
            _known(coord, batch_id, request.state.caller)
            return [result_row(coord, job) for job in coord.queue.batch(batch_id)]

        return {"results": await asyncio.to_thread(rows)}

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> Reply:
        await asyncio.to_thread(_known, coord, batch_id, request.state.caller)
        return {"cancelled": await coord.on_core(coord.queue.cancel, batch_id)}

    @app.post("/v1/batches/{batch_id}/retry-failed")
    async def retry(request: Request, batch_id: str) -> Reply:
        await asyncio.to_thread(_known, coord, batch_id, request.state.caller)
        requeued = await coord.on_core(coord.queue.retry_failed, batch_id)
        coord.notify()
        return {"requeued": requeued}


def _batch_id(key: str, owner: str | None = None) -> str:
    """A batch's id from its idempotency key — within its API key's batches."""
    text = str(key) if owner is None else f"{owner}:{key}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _known(coord: Coordinator, batch_id: str, caller: Caller) -> dict[str, object]:
    info = coord.queue.batch_info(batch_id)
    owner = None if info is None else info.get("owner")
    if info is None or not caller.sees(owner if isinstance(owner, str) else None):
        raise NotFound(f"no batch {batch_id!r}", param="batch_id")
    return {k: v for k, v in info.items() if k != "owner"}


def refuse_duplicates(items: list[object]) -> None:
    """Each line's id names its result: two lines with one id are refused, naming them."""
    first: dict[str, int] = {}
    clashes: list[tuple[int, int, str]] = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("id") is not None:
            key = str(item["id"])
            if key in first:
                clashes.append((first[key], i, key))
            else:
                first[key] = i
    if clashes:
        a, b, key = clashes[0]
        more = f" ({len(clashes)} lines repeat an earlier id)" if len(clashes) > 1 else ""
        raise BadRequest(f"lines {a + 1} and {b + 1} have the same id {key!r}{more}: give "
                         "every line its own id", param="items")  # fmt: skip


def batch_progress(coord: Coordinator, batch_id: str, caller: Caller) -> JsonObject:
    return progress(_known(coord, batch_id, caller), time.time())


def progress(info: dict[str, Any], now_s: float) -> JsonObject:
    """A batch's counts as progress: finished, elapsed, tokens/s, ETA. A finished batch's
    clock stopped at its last job's end (its tokens/s stays what it was)."""
    counts = info["counts"]
    finished = sum(counts[s] for s in TERMINAL)
    end_s = float(info.get("last_s") or now_s) if finished == info["total"] else now_s
    elapsed_s = max(end_s - float(info["created_s"]), 1e-3)
    rate = finished / elapsed_s
    left = info["total"] - finished
    eta_s = 0.0 if not left else (round(left / rate, 1) if rate > 0 else None)
    return {**info, "finished": finished, "elapsed_s": round(elapsed_s, 2),
            "tokens_per_s": round(info["tokens"] / elapsed_s, 2), "eta_s": eta_s}  # fmt: skip


def item_job(coord: Coordinator, item: object, index: int) -> tuple[str, dict[str, object]]:
    """One line of a batch file as (kind, payload), or BadRequest naming the line."""
    where = f"line {index + 1} (id {item_id(item, index)[:60]!r})"
    if not isinstance(item, dict):
        raise BadRequest(f"{where}: a line must be a JSON object", param="items")
    it = parse(BatchItem, item, where)
    try:
        return _item_job(coord, it, index)
    except BadRequest as exc:
        raise BadRequest(f"{where}: {exc.message}", param="items", code=exc.code) from None
    except (CellswarmError, TypeError, ValueError) as exc:  # e.g. the template refused it
        raise BadRequest(f"{where}: {exc}", param="items") from None


def item_id(item: object, index: int) -> str:
    return str(item.get("id", index)) if isinstance(item, dict) else str(index)


def _item_job(coord: Coordinator, it: BatchItem, index: int) -> tuple[str, dict[str, object]]:
    tok, limits = coord.tokenizer, limits_of(coord)
    if it.messages is not None:
        limits.turns(it.messages)
        text = tok.apply_chat_template(chat_turns(it.messages), add_generation_prompt=True)
        prompt = limits.encode(lambda t: tok.encode(t, add_special=False), text, "messages")
    else:
        assert it.prompt is not None  # BatchItem wants one of the two
        prompt = limits.encode(tok.encode, it.prompt, "prompt")
    if not prompt:
        raise BadRequest("the prompt makes no tokens; send more text")
    base: dict[str, object] = {"id": str(index if it.id is None else it.id), "prompt": prompt}
    if it.extra():
        base["extra"] = it.extra()
    limits.ids(it.bias_ids(), "logit_bias")
    options = it.completions if it.completions is not None else it.labels
    if options is not None:
        field = "completions" if it.completions is not None else "labels"
        limits.options(options, field)
        completions = [tok.encode(o, add_special=False) for o in options]
        empty = next((i for i, c in enumerate(completions) if not c), None)
        if empty is not None:
            raise BadRequest(f"{field}[{empty}] makes no tokens; give it some text")
        limits.score(prompt, completions, field)
        detail = {} if it.labels is not None else {"top": 0}  # completions: each token's too
        return "score", {**base, "completions": completions, "options": options,
                         "labels": it.labels is not None, **detail}  # fmt: skip
    limits.generate(prompt, it.max_tokens)
    sampling = it.sampling()
    SamplingParams(**sampling)  # the engine's own checks, which the ring will run
    check_speculative(coord, it.speculative)
    spec = {} if it.speculative is None else {"speculative": it.speculative}
    return "generate", {**base, "max_tokens": it.max_tokens, "sampling": sampling,
                        "stop_ids": sorted(tok.stop_ids), "text": True, **spec}  # fmt: skip


def result_row(coord: Coordinator, job: Job) -> JsonObject:
    """A results line: the input's id, its state, and its output or its error."""
    row: JsonObject = {"id": job.payload.get("id", job.position), "state": job.state,
                           "job_id": job.job_id}  # fmt: skip
    if job.payload.get("extra"):
        row["extra"] = job.payload["extra"]
    if job.state != "done" or job.result is None:
        row["error"] = job.error or job.state
        return row
    r = job.result
    if job.kind == "score":
        scores = [float(s) for s in r["scores"]]
        row["scores"] = dict(zip(job.payload["options"], scores, strict=True))
        if job.payload.get("labels"):
            row["label"] = job.payload["options"][max(range(len(scores)), key=scores.__getitem__)]
        if r.get("detail") is not None:  # each token's log-probability; all of it greedy?
            options = job.payload["options"]
            row["token_logprobs"] = {o: [e[0] for e in d] for o, d in zip(options, r["detail"],
                                                                         strict=True)}
            row["greedy"] = {o: all(e[1] for e in d) for o, d in zip(options, r["detail"],
                                                                     strict=True)}
        return row
    row["tokens"] = r["tokens"]
    row["output"] = coord.tokenizer.decode(r["tokens"], skip_special=True)
    row["finish_reason"] = r.get("reason", "")
    if r.get("drafted"):  # speculative decoding: drafts verified, and kept
        row["drafted_tokens"], row["accepted_tokens"] = r["drafted"], r.get("accepted", 0)
    if job.runs:
        row["verified_runs"] = len(job.runs)
    return row
