"""Batch jobs over HTTP: a JSONL file's lines become jobs, read back in input order.

    POST /v1/batches {name, items: [line, ...], verify_fraction, idempotency_key}
    GET  /v1/batches/{id}            counts by state, tokens, tokens/s, ETA
    GET  /v1/batches/{id}/results    one row per input line, in order: output or error
    POST /v1/batches/{id}/cancel     queued and leased jobs -> cancelled
    POST /v1/batches/{id}/retry-failed   dead jobs -> queued, fresh attempts

A line is `{"id", "prompt" | "messages", "max_tokens", "temperature", "top_p", "top_k",
"seed", ...}` to generate, or adds `"completions": [...]` (their log-likelihoods given the
prompt) or `"labels": [...]` (the most likely label: offline classification) to score.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from fastapi import FastAPI, Request

from cellswarm.engine.sampling import SamplingParams
from cellswarm.errors import CellswarmError, RequestError
from cellswarm.swarm.jobs import TERMINAL, Job

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
MAX_ITEMS = 100_000


def add_batch_routes(app: FastAPI, coord: Any) -> None:
    @app.post("/v1/batches")
    async def submit(request: Request) -> dict[str, Any]:
        d = await request.json()
        items = d.get("items")
        if not isinstance(items, list) or not items or len(items) > MAX_ITEMS:
            raise RequestError(f"items must be a list of 1..{MAX_ITEMS} objects")
        jobs = [item_job(coord, item, i) for i, item in enumerate(items)]
        fraction = float(d.get("verify_fraction") or 0.0)
        if not 0.0 <= fraction <= 1.0:
            raise RequestError(f"--verify {fraction} must be within 0..1")
        key = d.get("idempotency_key")
        batch_id = coord.queue.submit_batch(
            str(d.get("name") or "batch"), jobs, verify_fraction=fraction,
            batch_id=_batch_id(key) if key else None,
        )  # fmt: skip
        coord.log.event("batch", None, batch=batch_id, jobs=len(jobs), verify=fraction)
        return {"batch_id": batch_id, "total": len(jobs)}

    @app.get("/v1/batches/{batch_id}")
    async def info(batch_id: str) -> dict[str, Any]:
        return batch_progress(coord, batch_id)

    @app.get("/v1/batches/{batch_id}/results")
    async def results(batch_id: str) -> dict[str, Any]:
        _known(coord, batch_id)
        return {"results": [result_row(coord, job) for job in coord.queue.batch(batch_id)]}

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str) -> dict[str, Any]:
        _known(coord, batch_id)
        return {"cancelled": coord.queue.cancel(batch_id)}

    @app.post("/v1/batches/{batch_id}/retry-failed")
    async def retry(batch_id: str) -> dict[str, Any]:
        _known(coord, batch_id)
        return {"requeued": coord.queue.retry_failed(batch_id)}


def _batch_id(key: str) -> str:
    return hashlib.sha256(str(key).encode()).hexdigest()[:12]


def _known(coord: Any, batch_id: str) -> dict[str, Any]:
    info = coord.queue.batch_info(batch_id)
    if info is None:
        raise RequestError(f"no batch {batch_id!r}")
    return dict(info)


def batch_progress(coord: Any, batch_id: str) -> dict[str, Any]:
    info = _known(coord, batch_id)
    counts = info["counts"]
    finished = sum(counts[s] for s in TERMINAL)
    elapsed_s = max(time.time() - float(info["created_s"]), 1e-3)
    rate = finished / elapsed_s
    left = info["total"] - finished
    eta_s = 0.0 if not left else (round(left / rate, 1) if rate > 0 else None)
    return {**info, "finished": finished, "elapsed_s": round(elapsed_s, 2),
            "tokens_per_s": round(info["tokens"] / elapsed_s, 2), "eta_s": eta_s}  # fmt: skip


def item_job(coord: Any, item: Any, index: int) -> tuple[str, dict[str, Any]]:
    """One line of a batch file as (kind, payload), or RequestError naming the line."""
    try:
        if not isinstance(item, dict):
            raise RequestError("a line must be a JSON object")
        return _item_job(coord, item)
    except (RequestError, TypeError, ValueError) as exc:
        raise RequestError(f"line {index + 1} (id {item_id(item, index)!r}): {exc}") from None


def item_id(item: Any, index: int) -> str:
    return str(item.get("id", index)) if isinstance(item, dict) else str(index)


def _item_job(coord: Any, item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    tok = coord.tokenizer
    if "messages" in item:
        text = tok.apply_chat_template(item["messages"], add_generation_prompt=True)
        prompt = tok.encode(text, add_special=False)
    elif isinstance(item.get("prompt"), str):
        prompt = tok.encode(item["prompt"])
    else:
        raise RequestError("needs a 'prompt' string or 'messages'")
    base = {"id": item_id(item, 0), "prompt": prompt}
    if "completions" in item or "labels" in item:
        options = item.get("completions", item.get("labels"))
        if not isinstance(options, list) or not options or not all(
            isinstance(o, str) and o for o in options
        ):
            raise RequestError("'completions' / 'labels' must be a list of non-empty strings")
        completions = [tok.encode(o, add_special=False) for o in options]
        return "score", {**base, "completions": completions, "options": options,
                         "labels": "labels" in item}  # fmt: skip
    sampling = {k: item[k] for k in SAMPLING_KEYS if k in item and item[k] is not None}
    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError, CellswarmError) as exc:
        raise RequestError(str(exc)) from None
    max_tokens = item.get("max_tokens", 64)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"max_tokens {max_tokens!r} must be a positive integer")
    return "generate", {**base, "max_tokens": max_tokens, "sampling": sampling,
                        "stop_ids": sorted(tok.stop_ids), "text": True}  # fmt: skip


def result_row(coord: Any, job: Job) -> dict[str, Any]:
    """A results line: the input's id, its state, and its output or its error."""
    row: dict[str, Any] = {"id": job.payload.get("id", job.position), "state": job.state,
                           "job_id": job.job_id}  # fmt: skip
    if job.state != "done" or job.result is None:
        row["error"] = job.error or job.state
        return row
    r = job.result
    if job.kind == "score":
        scores = [float(s) for s in r["scores"]]
        row["scores"] = dict(zip(job.payload["options"], scores, strict=True))
        if job.payload.get("labels"):
            row["label"] = job.payload["options"][max(range(len(scores)), key=scores.__getitem__)]
        return row
    row["tokens"] = r["tokens"]
    row["output"] = coord.tokenizer.decode(r["tokens"], skip_special=True)
    row["finish_reason"] = r.get("reason", "")
    if job.runs:
        row["verified_runs"] = len(job.runs)
    return row
