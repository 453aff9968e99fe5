"""Heartbeats in batches, over HTTP or NATS: one function answers a batch either way.

A batch is a rack's beats (its relay's message) or one node's: `{"node_id", "session",
"beats": [...]}` over HTTP. The sender is a joined node, checked first (a stranger is
refused as a whole); each beat carries its own node's proof and gets its own answer or
error, so one bad beat costs no other node its place.

With `--control nats://HOST:PORT` (or `tls://`) the beats travel on NATS instead of HTTP:
the coordinators subscribe to `SUBJECT` in one queue group, so NATS hands each message to
one of them (several coordinators share the load; a rack's leaf node or the cluster routes
them), and a node's request gets the answers as the reply. NATS is the proven engine for
exactly this fan-in; everything else — joins, leases, results, the ledger — stays on HTTP
and the database, whose guarantees (idempotency, fencing) the queue's tests hold. A node
whose NATS request fails beats over HTTP instead, so a NATS outage costs no node its place.

NATS is a broadcast medium — whoever may subscribe hears every message — so nothing on it
is a reusable secret. A message is *sealed*: an HMAC-SHA256 over its bytes with the node's
beat key (`beat_key`: from the cluster token and the digest of its session, which the
coordinator keeps), a newline, then the JSON. It names the node and a sequence number that
must grow (a replayed message is refused); the session itself never travels. The answer is
sealed with the same key over the same sequence number, so a forged answer is ignored (the
node beats over HTTP instead). A relay seals its envelope with its own key and carries each
other node's beat sealed by that node. The NATS server itself admits only the cluster: a
user and password derived from the token (`nats_password`), and with `--tls` mutual TLS
with the cluster's certificates (`server_config` writes nats-server's file for both).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from cellswarm.errors import RequestError
from cellswarm.swarm.auth import digest
from cellswarm.swarm.protocol.messages import Heartbeat, decode
from cellswarm.swarm.transport.wire import check_numbers

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

log = logging.getLogger("cellswarm.beats")
T = TypeVar("T")


class _Node(Protocol):
    @property
    def node_id(self) -> str: ...


N = TypeVar("N", bound=_Node)  # the coordinator's record of a node (control/store.py: Node)


class _TlsConfig(Protocol):
    @property
    def tls_dir(self) -> str | None: ...


class Coordinator(Protocol[N]):
    """What answering beats needs of the coordinator (control/coordinator.py): a seam, so
    transport imports nothing of control (tests/test_layers.py)."""

    @property
    def id(self) -> str: ...
    @property
    def token(self) -> bytes | None: ...
    @property
    def config(self) -> _TlsConfig: ...
    @property
    def core(self) -> concurrent.futures.Executor: ...
    @property
    def beats_via(self) -> dict[str, int]: ...
    def authenticate(self, node_id: str, session: str) -> N: ...
    def authenticate_sealed(self, beat: Mapping[str, object], mac: str,
                            raw: bytes) -> tuple[N, bytes, int]: ...  # fmt: skip
    def held_sealed(self, env: Mapping[str, object], mac: str, raw: bytes) -> bytes | None: ...
    def heartbeat(self, node: N, beat: Heartbeat) -> dict[str, object]: ...

SUBJECT = "cellswarm.beats"
QUEUE_GROUP = "coordinators"
MAX_BEATS = 4096  # a rack's beats in one message, at most
NATS_USER = "cellswarm"
MAC_HEX = 64  # a seal's length: SHA-256 in hex
MAX_IN_FLIGHT = 512  # NATS messages a coordinator answers at once (each a task)
PENDING_MSGS = 65536  # and how many more may wait in its subscription (NATS drops the rest:
PENDING_BYTES = 64 << 20  # their nodes get no answer and beat over HTTP)
# How long a beat waits for a busy core before it is answered "held" (well under the
# node's HTTP timeout, worker.HTTP_TIMEOUT_S, and its NATS one)
BEAT_ANSWER_S = 1.0


def beat_batch(coord: Coordinator[N], d: Mapping[str, object], via: str) -> dict[str, object]:
    """The answers to a batch of beats that came `via` http (counted per beat in the
    coordinator's metrics); raises PermissionError for a stranger sender."""
    coord.authenticate(str(d["node_id"]), str(d["session"]))
    answers: list[object] = []
    for beat in _beats(d):
        try:
            if not isinstance(beat, dict):
                raise RequestError("a beat is an object")
            node = coord.authenticate(str(beat["node_id"]), str(beat["session"]))
            answers.append(coord.heartbeat(node, decode(Heartbeat, beat)))
        except (PermissionError, KeyError, RequestError) as exc:
            answers.append(_error(exc))
    coord.beats_via[via] += len(answers)
    return {"answers": answers}


def _beats(d: Mapping[str, object]) -> list[object]:
    beats = d.get("beats")
    if not isinstance(beats, list) or len(beats) > MAX_BEATS:
        raise RequestError(f"a heartbeat batch is an object with a list of at most "
                           f"{MAX_BEATS} beats")  # fmt: skip
    return beats


def _error(exc: Exception) -> dict[str, object]:
    return {"error": f"a beat needs {exc}" if isinstance(exc, KeyError) else str(exc)}


# -- seals: what makes a NATS message the node's own ----------------------------------------


def beat_key(token: bytes | None, session_digest: str) -> bytes:
    """The key a node's NATS beats and their answers are sealed with. The node derives it
    from its session, the coordinator from the session's digest it keeps: neither sends it."""
    return hmac.new(token or b"", b"cellswarm beat key|" + session_digest.encode(),
                    hashlib.sha256).digest()  # fmt: skip


def nats_password(token: bytes) -> str:
    """The NATS server's password for the cluster (user NATS_USER): from the token, so
    every member knows it and nobody types or stores another secret."""
    return hmac.new(token, b"cellswarm nats password", hashlib.sha256).hexdigest()


def seal(key: bytes, body: Mapping[str, object]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return hmac.new(key, data, hashlib.sha256).hexdigest().encode() + b"\n" + data


def unseal(data: bytes) -> tuple[str, bytes, dict[str, object]]:
    """(seal, the bytes it covers, their JSON object) of a sealed message; RequestError
    when it is not one. Whether the seal holds needs the key: `holds`."""
    mac, sep, raw = data.partition(b"\n")
    if not sep or len(mac) != MAC_HEX:
        raise RequestError("a sealed beat is a 64-hex-digit seal, a newline, a JSON object")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:
        raise RequestError(f"a sealed beat's JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("a sealed beat's JSON is an object")
    check_numbers(body, "beat")
    return mac.decode("ascii", "replace"), raw, body


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def holds(key: bytes, mac: str, raw: bytes) -> bool:
    return hmac.compare_digest(hmac.new(key, raw, hashlib.sha256).hexdigest(), mac)


def sealed_batch(coord: Coordinator[N], data: bytes) -> bytes:
    """The sealed answer to a sealed batch from NATS (on the core thread). PermissionError
    for a sender whose seal or sequence does not hold — it cannot be answered sealed."""
    mac, raw, env = unseal(data)
    sender, key, seq = coord.authenticate_sealed(env, mac, raw)
    answers: list[object] = []
    for beat in _beats(env):
        try:
            if isinstance(beat, dict) and beat.get("node_id") == sender.node_id:
                node = sender  # the sender's own beat: its envelope's seal covers it
            elif isinstance(beat, str):  # another node's, sealed by that node
                b_mac, b_raw, beat = unseal(beat.encode())
                node = coord.authenticate_sealed(beat, b_mac, b_raw)[0]
            else:
                raise RequestError("a beat in a sealed batch is the sender's object or "
                                   "another node's sealed beat")  # fmt: skip
            answers.append(coord.heartbeat(node, decode(Heartbeat, beat)))
        except (PermissionError, KeyError, RequestError) as exc:
            answers.append(_error(exc))
    coord.beats_via["nats"] += len(answers)
    return seal(key, {"seq": seq, "answers": answers})


def check_control_url(url: str, tls_dir: str | Path | None = None) -> str:
    scheme = url.partition("://")[0].lower()
    if scheme not in ("nats", "tls"):
        raise RequestError(f"--control {url!r}: give nats://HOST:PORT (a NATS server), or "
                           f"tls://HOST:PORT with --tls")  # fmt: skip
    if scheme == "tls" and tls_dir is None:
        raise RequestError(f"--control {url!r} is TLS: pass --tls DIR (the node's "
                           f"certificate folder), whose CA the NATS server trusts")  # fmt: skip
    return url


async def connect(url: str, name: str, token: bytes | None, tls_dir: str | Path | None,
                  within_s: float, connect_timeout: int = 2) -> Client:  # fmt: skip
    """A NATS connection as a member, or ConnectionError/OSError within `within_s`: the
    cluster's user and password when there is a token, mutual TLS with --tls, reconnecting
    on its own once made (nats-py would retry a first connect forever: bounded here). With
    --tls the password goes only over TLS: to a server that does not ask for TLS it is not
    sent."""
    from nats.aio.client import Client

    from cellswarm.swarm.tls import client_context

    check_control_url(url, tls_dir)
    host, _, port = url.partition("://")[2].rpartition(":")
    _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)),
                                       within_s)  # fmt: skip
    writer.close()  # it listens: a refused port says so at once, without nats-py's retries
    nc = Client()

    def password() -> str:
        if tls_dir is not None and not nc._server_info.get("tls_required"):
            raise ConnectionError(f"the NATS server at {url} does not require TLS although "
                                  f"--tls is given: its password is not sent in the clear "
                                  f"(configure it with `cellswarm nats config --tls`)")  # fmt: skip
        return nats_password(token) if token else ""

    async def quiet(exc: Exception) -> None:  # nats-py logs a traceback per retry otherwise
        log.debug("NATS at %s: %s", url, exc)

    tls = client_context(tls_dir) if tls_dir is not None else None
    try:
        await asyncio.wait_for(nc.connect(url, name=name, error_cb=quiet,
                                          max_reconnect_attempts=-1,
                                          connect_timeout=connect_timeout,
                                          user=NATS_USER if token else None,
                                          password=password if token else None, tls=tls),
                               within_s)  # fmt: skip
    except TimeoutError:
        why = nc._err
        with contextlib.suppress(Exception):
            await nc.close()
        raise ConnectionError(f"NATS at {url}: {why or f'no answer in {within_s:.1f} s'}"
                              ) from None  # fmt: skip
    return nc


async def subscribe(coord: Coordinator[N], url: str) -> asyncio.Task[None]:
    """Answer beats arriving on NATS (in the coordinators' queue group), connecting in
    the background until NATS answers (a NATS outage at start is one like any other: the
    coordinator serves HTTP meanwhile); the task, cancelled at shutdown."""
    return asyncio.create_task(_subscribed(coord, url))


async def _subscribed(coord: Coordinator[N], url: str) -> None:
    import nats.errors

    # nats-py runs a subscription's callback for one message at a time: awaiting the answer
    # there made every batch wait for the one before it to cross to the core thread and back,
    # so at 100,000 nodes (2,500 racks a round) beats timed out with the core half idle. Each
    # message is answered in a task of its own instead, at most MAX_IN_FLIGHT at once; the
    # rest wait in the subscription's queue, bounded by PENDING_MSGS / PENDING_BYTES.
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    replying: set[asyncio.Task[None]] = set()

    async def reply(msg: Msg) -> None:
        try:
            await msg.respond(await answer(coord, msg.data))
        except nats.errors.Error as exc:  # the connection went: the node beats over HTTP
            log.debug("a beat's answer was not sent: %s", exc)
        finally:
            slots.release()

    async def handle(msg: Msg) -> None:
        await slots.acquire()
        task = asyncio.create_task(reply(msg))
        replying.add(task)
        task.add_done_callback(replying.discard)

    tls_dir = coord.config.tls_dir
    wait_s, nc = 1.0, None
    try:
        while nc is None:
            try:
                nc = await connect(url, f"coordinator {coord.id}", coord.token, tls_dir,
                                   5.0, connect_timeout=2)  # fmt: skip
            except (OSError, TimeoutError, nats.errors.Error) as exc:
                log.warning("NATS at %s does not answer (%s): heartbeats over HTTP only; "
                            "trying again in %.0f s", url, exc or type(exc).__name__, wait_s)
                await asyncio.sleep(wait_s)
                wait_s = min(30.0, wait_s * 2)
        await nc.subscribe(SUBJECT, queue=QUEUE_GROUP, cb=handle, pending_msgs_limit=PENDING_MSGS,
                           pending_bytes_limit=PENDING_BYTES)  # fmt: skip
        log.warning("heartbeats also on %s (subject %s)", url, SUBJECT)
        await asyncio.Event().wait()  # until cancelled
    finally:
        for task in list(replying):
            task.cancel()
        if nc is not None and not nc.is_closed:
            await nc.close()


async def answer(coord: Coordinator[N], data: bytes) -> bytes:
    """What the coordinator replies to one NATS message: sealed answers, "held" ones when
    the core is busy longer than BEAT_ANSWER_S, or an unsealed error (which a node takes
    for no answer, and beats over HTTP, where a real refusal is said)."""
    loop = asyncio.get_running_loop()
    try:
        mac, raw, env = unseal(data)
        work = loop.run_in_executor(coord.core, sealed_batch, coord, data)
        try:
            return await asyncio.wait_for(asyncio.shield(work), BEAT_ANSWER_S)
        except TimeoutError:
            held = coord.held_sealed(env, mac, raw)
            if held is None:
                return await work
            work.add_done_callback(settled)
            return held
    except PermissionError as exc:
        reply: dict[str, object] = {"error": str(exc), "status": 401}
    except (RequestError, KeyError, ValueError, TypeError) as exc:
        reply = {"error": f"bad heartbeat batch: {exc}", "status": 400}
    return json.dumps(reply, separators=(",", ":")).encode()


def settled(work: asyncio.Future[T]) -> None:
    """A held beat's own outcome, read so that its error (a session gone since) is not
    reported as never retrieved: the node hears of it on its next beat."""
    if not work.cancelled():
        work.exception()


class NatsBeats:
    """A node's side: its beat as a sealed NATS request (a batch of one); None when NATS
    cannot answer now — not connected (reconnecting in the background), a failed connect
    in the last RETRY_S, no answer within the timeout, an answer whose seal does not hold —
    so the caller beats over HTTP at once: a beat must never wait out a NATS outage, or the
    node would be lost for it."""

    RETRY_S = 10.0  # after a failed connect, HTTP only for this long

    def __init__(self, url: str, name: str, token: bytes | None = None,
                 tls_dir: str | Path | None = None) -> None:  # fmt: skip
        self.url, self.name = check_control_url(url, tls_dir), name
        self.token, self.tls_dir = token, tls_dir
        self.nc: Client | None = None
        self.failed_at = -float("inf")
        self.seq = time.time_ns() // 1000  # grows across restarts too; each beat adds one
        self.said = ""  # the last complaint logged, so it is logged once

    async def beat(self, beat: Mapping[str, object], timeout_s: float) -> dict[str, object] | None:
        import nats.errors

        try:
            if self.nc is None or self.nc.is_closed:
                if time.monotonic() - self.failed_at < self.RETRY_S:
                    return None
                self.nc = await connect(self.url, self.name, self.token, self.tls_dir,
                                        min(1.0, timeout_s), connect_timeout=1)  # fmt: skip
            if not self.nc.is_connected:  # reconnecting: it comes back on its own
                return None
            self.seq += 1
            key = beat_key(self.token, digest(str(beat["session"])))
            own = {k: v for k, v in beat.items() if k != "session"}
            body = {"node_id": beat["node_id"], "seq": self.seq, "beats": [own]}
            msg = await self.nc.request(SUBJECT, seal(key, body), timeout=timeout_s)
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            if self.nc is None or self.nc.is_closed:
                self.failed_at = time.monotonic()
            self._say(f"no heartbeat over {self.url} ({exc or type(exc).__name__})")
            return None
        return self._answer(key, msg.data)

    def _answer(self, key: bytes, data: bytes) -> dict[str, object] | None:
        try:
            mac, raw, reply = unseal(data)
        except RequestError:  # a refusal (said unsealed) or not the coordinator at all
            self._say(f"an unsealed answer on {self.url}: {data[:200]!r}")
            return None
        if not holds(key, mac, raw) or reply.get("seq") != self.seq:
            self._say(f"an answer on {self.url} whose seal does not hold: ignored")
            return None
        answers = reply.get("answers")
        answer = answers[0] if isinstance(answers, list) and answers else None
        if not isinstance(answer, dict):  # (its seal held: the coordinator's own bug)
            raise TypeError(f"a sealed answer on {self.url} holds no beat's answer")
        if "error" in answer:
            raise PermissionError(str(answer["error"]))
        self.said = ""
        return answer

    def _say(self, what: str) -> None:
        if what != self.said:
            log.warning("%s: beating over HTTP", what)
        self.said = what

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()


def server_config(listen: str, token: bytes | None, tls_dir: str | Path | None) -> str:
    """nats-server's configuration for a cluster's heartbeats (`cellswarm nats config`):
    on `listen` (HOST:PORT), the cluster's user and password from its token, and with a
    TLS folder mutual TLS with its certificates — a client without one chained to the
    cluster's CA is refused at the handshake. It holds the password: keep it 0600."""
    lines = [f"listen: {json.dumps(listen)}",
             "max_payload: 1048576  # a rack's beats in one message fit well under it",
             "max_connections: 65536", "write_deadline: \"10s\""]  # fmt: skip
    if token:
        lines += ["authorization {", f"  user: {json.dumps(NATS_USER)}",
                  f"  password: {json.dumps(nats_password(token))}", "  timeout: 2", "}"]
    if tls_dir is not None:
        from cellswarm.swarm.tls import files

        ca, cert, key = files(tls_dir)
        lines += ["tls {", f"  cert_file: {json.dumps(cert)}", f"  key_file: {json.dumps(key)}",
                  f"  ca_file: {json.dumps(ca)}", "  verify: true", "  timeout: 2", "}"]
    return "\n".join(lines) + "\n"
