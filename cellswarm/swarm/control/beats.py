"""Heartbeats in batches, over HTTP or NATS: one function answers a batch either way.

A batch is a rack's beats (its relay's message) or one node's: `{"node_id", "session",
"beats": [...]}`. The sender is a joined node, checked first (a stranger is refused as a
whole); each beat carries its own node's session and gets its own answer or error, so one
bad beat costs no other node its place.

With `--control nats://HOST:PORT` the beats travel on NATS instead of HTTP: the coordinators
subscribe to `SUBJECT` in one queue group, so NATS hands each message to one of them (several
coordinators share the load; a rack's leaf node or the cluster routes them), and a node's
request gets the answers as the reply. NATS is the proven engine for exactly this fan-in;
everything else — joins, leases, results, the ledger — stays on HTTP and the database, whose
guarantees (idempotency, fencing) the queue's tests hold. A node whose NATS request fails
beats over HTTP instead, so a NATS outage costs no node its place.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from cellswarm.errors import RequestError

log = logging.getLogger("cellswarm.beats")

SUBJECT = "cellswarm.beats"
QUEUE_GROUP = "coordinators"
MAX_BEATS = 4096  # a rack's beats in one message, at most


def beat_batch(coord: Any, d: dict[str, Any], via: str) -> dict[str, Any]:
    """The answers to a batch of beats that came `via` http or nats (counted per beat in
    the coordinator's metrics); raises PermissionError for a stranger sender."""
    coord.authenticate(str(d["node_id"]), str(d["session"]))
    beats = d.get("beats")
    if not isinstance(beats, list) or len(beats) > MAX_BEATS:
        raise RequestError(f"a heartbeat batch is an object with a list of at most "
                           f"{MAX_BEATS} beats")  # fmt: skip
    answers: list[dict[str, Any]] = []
    for beat in beats:
        try:
            if not isinstance(beat, dict):
                raise RequestError("a beat is an object")
            node = coord.authenticate(str(beat["node_id"]), str(beat["session"]))
            answers.append(coord.heartbeat(node, beat))
        except (PermissionError, KeyError, RequestError) as exc:
            answers.append({"error": str(exc) if not isinstance(exc, KeyError)
                            else f"a beat needs {exc}"})  # fmt: skip
    coord.beats_via[via] += len(answers)
    return {"answers": answers}


def check_control_url(url: str) -> str:
    if not url.startswith("nats://"):
        raise RequestError(f"--control {url!r}: give nats://HOST:PORT (a NATS server)")
    return url


async def subscribe(coord: Any, url: str) -> Any:
    """Answer beats arriving on NATS (in the coordinators' queue group); the connection."""
    import nats

    async def handle(msg: Any) -> None:
        try:
            d = json.loads(msg.data)
            if not isinstance(d, dict):
                raise RequestError("a heartbeat batch is a JSON object")
            reply = await coord.on_core(beat_batch, coord, d, "nats")
        except PermissionError as exc:
            reply = {"error": str(exc), "status": 401}
        except (RequestError, KeyError, ValueError) as exc:
            reply = {"error": f"bad heartbeat batch: {exc}", "status": 400}
        await msg.respond(json.dumps(reply, separators=(",", ":")).encode())

    nc = await nats.connect(check_control_url(url), name=f"coordinator {coord.id}",
                            max_reconnect_attempts=-1)  # fmt: skip
    await nc.subscribe(SUBJECT, queue=QUEUE_GROUP, cb=handle)
    log.warning("heartbeats also on %s (subject %s)", url, SUBJECT)
    return nc


class NatsBeats:
    """A node's side: its beat as a NATS request (a batch of one); None when NATS cannot
    answer now — not connected (reconnecting in the background), a failed connect in the
    last RETRY_S, no answer within the timeout — so the caller beats over HTTP at once: a
    beat must never wait out a NATS outage, or the node would be lost for it."""

    RETRY_S = 10.0  # after a failed connect, HTTP only for this long

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = check_control_url(url), name
        self.nc: Any = None
        self.failed_at = -float("inf")

    async def beat(self, beat: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        import nats.errors

        try:
            if self.nc is None or self.nc.is_closed:
                if time.monotonic() - self.failed_at < self.RETRY_S:
                    return None
                self.nc = await nats.connect(self.url, name=self.name, connect_timeout=1,
                                             max_reconnect_attempts=-1)  # fmt: skip
            if not self.nc.is_connected:  # reconnecting: it comes back on its own
                return None
            body = {"node_id": beat["node_id"], "session": beat["session"], "beats": [beat]}
            msg = await self.nc.request(SUBJECT, json.dumps(body).encode(), timeout=timeout_s)
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            if self.nc is None or self.nc.is_closed:
                self.failed_at = time.monotonic()
            log.warning("no heartbeat over %s (%s): beating over HTTP", self.url, exc)
            return None
        reply: dict[str, Any] = json.loads(msg.data)
        if "answers" not in reply:  # the sender (this node) was refused: join again
            raise PermissionError(str(reply.get("error", "refused")))
        answer: dict[str, Any] = reply["answers"][0]
        if "error" in answer:
            raise PermissionError(str(answer["error"]))
        return answer

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()
