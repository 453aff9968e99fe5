"""The coordinator's control plane under many simulated nodes: joins, heartbeats, liveness.

    python -m bench.control_plane [--nodes 1000,10000,100000] [--via http,nats] [--rack 40]
                                  [--seconds 20] [--direct] [--rings 4] [--jobs 20000]
                                  [--max-join-s 300] [--json]

Per step: a fresh coordinator process (SQLite, the demo model, the cluster token) on
loopback, then N simulated nodes speaking its real protocol from this process (asyncio, a
pool of keep-alive HTTP/1.1 connections written by hand, so the load generator costs little
next to what it measures):

- join: per rack, its first node joins alone (`/v1/challenge`, then `/v1/join` with the
  HMAC proof); as the rack's relay it then asks for the other nodes' nonces in one challenge
  and sends their proofs in one `POST /v1/joins` (`--direct`: every node joins alone). 64
  racks at a time; p50/p99 of a node's challenge and join requests. Each node claims 1 MiB
  (it cannot hold a layer), so every node stays a spare and the step measures membership,
  not placement or the data plane.
- heartbeat: a rack beats from the moment it joined, at the interval the coordinator gives:
  one `POST /v1/heartbeats` per rack of `--rack` nodes per interval, as a rack's relay sends
  them (`--direct`: one `POST /v1/heartbeat` per node); with `--via nats` the same batch as
  one NATS request to the coordinators' subject, through a nats-server started for the step
  (the coordinator runs with `--control`: transport/beats.py). `--via http,nats` runs every
  step both ways. Measured for `--seconds` once every rack joined: p50/p99 of a request,
  and any beat refused.
- false lost: nodes the coordinator calls lost while they beat (every simulated node beats
  throughout, so any is false), read from /v1/status at the end.
- the coordinator's CPU (cores: its process's user+system time over the measured seconds)
  and RSS, from /proc.
- lease: `--rings` rings of 2 simulated stages join first (so placement gives them the
  model), answer the coordinator's `reset` frames on data ports of their own (the token's
  handshake), and each ring's head leases (`POST /v1/jobs/lease`, a long poll, 8 at a time)
  and completes each job at once from `--jobs` queued as a batch before the measurement:
  p50/p99 of a lease request that brought jobs, and jobs completed a second.

A step that cannot finish its joins within `--max-join-s` is reported with the nodes it
reached.

One JSON object per step with --json (nodes, join_p50_s, join_p99_s, heartbeat_p50_s,
heartbeat_p99_s, heartbeat_interval_s, lease_p50_s, lease_p99_s, leases_per_s, false_lost,
coordinator_cpu_cores, coordinator_rss_bytes, ...), else a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from cellswarm.demo import demo_model_path
from cellswarm.swarm.auth import digest, node_key, prove
from cellswarm.swarm.protocol import PROTOCOL
from cellswarm.swarm.protocol.messages import (
    Assignment,
    JobOutput,
    JobResult,
    Shard,
    decode,
    encode,
)

CONNECTIONS = 64  # keep-alive connections from the simulated nodes (a relay's, a rack's)
JOIN_CONCURRENCY = 64
NODE_MEMORY_BYTES = 1 << 20  # holds no layer: every node stays a spare
RING_MEMORY_BYTES = 1 << 30  # a simulated stage claims room for half the demo model


class Conn:
    """One keep-alive HTTP/1.1 connection: JSON in, JSON out; opened again when the server
    closed it (uvicorn closes a connection idle for 5 s)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        for attempt in range(2):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            try:
                return await self._post(path, body)
            except (ConnectionError, IndexError, asyncio.IncompleteReadError):
                self.writer.close()
                self.writer = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        assert self.writer is not None
        data = json.dumps(body, separators=(",", ":")).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: c\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        return int(status_line.split()[1]), json.loads(payload) if payload else None


class Pool:
    def __init__(self, host: str, port: int, size: int) -> None:
        self.host, self.port, self.size = host, port, size
        self.free: asyncio.Queue[Conn] = asyncio.Queue()

    async def open(self) -> None:
        for _ in range(self.size):
            self.free.put_nowait(Conn(self.host, self.port))

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, float]:
        conn = await self.free.get()
        t0 = time.perf_counter()
        try:
            status, answer = await conn.post(path, body)
        finally:
            self.free.put_nowait(conn)
        return status, answer, time.perf_counter() - t0

    def close(self) -> None:
        while not self.free.empty():
            conn = self.free.get_nowait()
            if conn.writer is not None:
                conn.writer.close()


class Coordinator:
    """The real coordinator as its own process; its CPU and memory read from /proc."""

    def __init__(self, state: Path, port: int, heartbeat_s: float, timeout_s: float,
                 replicas: int, control: str | None) -> None:  # fmt: skip
        self.token = state / "cluster.token"
        self.token.write_text(secrets.token_hex(32))
        cmd = [sys.executable, "-m", "cellswarm.cli", "coordinator", "--model",
               str(demo_model_path()), "--listen", f"127.0.0.1:{port}", "--db",
               f"sqlite:///{state / 'c.db'}", "--token-file", str(self.token),
               "--heartbeat", str(heartbeat_s), "--heartbeat-timeout", str(timeout_s)]
        if control:  # heartbeats through NATS too
            cmd += ["--control", control]
        if replicas:  # rings of 2 stages for the simulated heads' leases
            cmd += ["--stages", "2", "--replicas", str(replicas)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)  # fmt: skip
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("READY"):
                break
        else:
            raise SystemExit(f"the coordinator did not start (exit {self.proc.wait()})")
        self.tail: list[str] = []  # its output, read on (a full pipe would stop it)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail = [*self.tail[-20:], line.rstrip()]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Racks:
    """The simulated nodes, a rack at a time: a rack joins (`join`), then beats at the
    interval the coordinator gives until the step ends (`beat`), as real nodes do — a node
    that joined and stayed silent would rightly be lost. Latencies are kept only while
    `measuring` (after every rack joined)."""

    def __init__(self, pool: Pool, token: bytes, n: int, rack: int, direct: bool,
                 interval_s: float) -> None:  # fmt: skip
        self.pool, self.token, self.direct = pool, token, direct
        ids = [f"sim-{i:06d}" for i in range(n)]
        self.racks = [ids[i : i + rack] for i in range(0, n, rack)]
        self.sessions: dict[str, str] = {}
        self.join_times: list[float] = []
        self.beat_times: list[float] = []
        self.refused = 0
        self.interval_s = interval_s
        self.measuring = False
        self.stop = False
        self.caps = {"memory_bytes": NODE_MEMORY_BYTES, "protocol": PROTOCOL}
        self.nc: Any = None  # a NATS connection: the racks beat through it (--via nats)
        self.seq = time.time_ns() // 1000  # the sealed beats' numbers (transport/beats.py)

    async def join_one(self, node: str) -> None:
        t0 = time.perf_counter()
        _, c, _ = await self.pool.post("/v1/challenge", {})
        status, answer, _ = await self.pool.post("/v1/join", {
            "node_id": node, "nonce": c["nonce"], "proof": prove(self.token, c["nonce"], node),
            "capabilities": self.caps})  # fmt: skip
        if status == 200:
            self.sessions[node] = answer["session"]
            self.join_times.append(time.perf_counter() - t0)

    async def join(self, nodes: list[str]) -> None:
        """Its first node joins alone and, as the rack's relay, asks for the others' nonces
        in one challenge and sends their proofs in one `POST /v1/joins` (direct: each alone)."""
        if self.direct:
            for node in nodes:
                await self.join_one(node)
            return
        await self.join_one(nodes[0])
        relay, rest = nodes[0], nodes[1:]
        if relay not in self.sessions or not rest:
            return
        t0 = time.perf_counter()
        _, c, _ = await self.pool.post("/v1/challenge", {"count": len(rest)})
        joins = [{"node_id": x, "nonce": nonce, "proof": prove(self.token, nonce, x),
                  "capabilities": self.caps} for x, nonce in zip(rest, c["nonces"], strict=True)]
        status, answer, _ = await self.pool.post("/v1/joins", {
            "node_id": relay, "session": self.sessions[relay], "joins": joins})  # fmt: skip
        took = time.perf_counter() - t0
        for a in answer.get("answers", []) if status == 200 else []:
            if "session" in a:
                self.sessions[a["node_id"]] = a["session"]
                self.join_times.append(took)

    def _beat(self, node: str) -> dict[str, Any]:
        return {"node_id": node, "session": self.sessions[node], "rss_bytes": 30 << 20,
                "peak_rss_bytes": 30 << 20, "data_port": None, "ready": None,
                "sent_s": time.time()}  # fmt: skip

    async def beat(self, nodes: list[str]) -> None:
        """Beat until the step ends: one request per rack per interval (its relay's), or one
        per node (direct); the first beat a random part of the interval after joining."""
        nodes = [x for x in nodes if x in self.sessions]
        if not nodes:
            return
        await asyncio.sleep(random.uniform(0, self.interval_s))  # clocks drift apart
        while not self.stop:
            started = time.monotonic()
            if self.direct:
                for node in nodes:
                    status, answer, took = await self.pool.post("/v1/heartbeat", self._beat(node))
                    self._took(took, 1 if status != 200 else 0, answer if status == 200 else {})
            else:
                relay = nodes[0]
                beats = [self._beat(x) for x in nodes]
                body = {"node_id": relay, "session": self.sessions[relay], "beats": beats}
                if self.nc is not None:  # the rack's beats as one sealed NATS request
                    status, answer, took = await self._request(beats)
                else:
                    status, answer, took = await self.pool.post("/v1/heartbeats", body)
                answers = answer.get("answers", []) if status == 200 else []
                ok = [a for a in answers if "error" not in a]
                self._took(took, len(nodes) - len(ok), ok[0] if ok else {})
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def _request(self, beats: list[dict[str, Any]]) -> tuple[int, Any, float]:
        """A rack's beats as a relay sends them on NATS (transport/beats.py): its own beat in
        its sealed envelope, each other node's sealed by that node; the answers."""
        from cellswarm.swarm.auth import digest
        from cellswarm.swarm.transport.beats import SUBJECT, beat_key, holds, seal, unseal

        self.seq += 1
        keys = {b["node_id"]: beat_key(self.token, digest(self.sessions[b["node_id"]]))
                for b in beats}  # fmt: skip
        own = [{k: v for k, v in b.items() if k != "session"} for b in beats]
        relay = own[0]["node_id"]
        body = {"node_id": relay, "seq": self.seq, "beats": [own[0]] + [
            seal(keys[b["node_id"]], {**b, "seq": self.seq}).decode() for b in own[1:]]}
        t0 = time.perf_counter()
        try:
            msg = await self.nc.request(SUBJECT, seal(keys[relay], body), timeout=10)
            mac, raw, reply = unseal(msg.data)
        except Exception:  # no answer in time, NATS gone, or refused: a refused beat
            return 0, {}, time.perf_counter() - t0
        took = time.perf_counter() - t0
        return (200 if holds(keys[relay], mac, raw) else 0), reply, took

    def _took(self, took: float, refused: int, answer: dict[str, Any]) -> None:
        if self.measuring:
            self.beat_times.append(took)
            self.refused += refused
        if answer.get("heartbeat_s"):
            self.interval_s = float(answer["heartbeat_s"])

    async def run(self, max_join_s: float, settle_s: float, seconds: float,
                  on_measure: Any, before_measure: Any = None) -> float:  # fmt: skip
        """Join every rack (64 at a time, within max_join_s), beat, and measure for `seconds`
        once all joined and `settle_s` passed; the joins' wall time."""
        deadline = time.monotonic() + max_join_s
        gate = asyncio.Semaphore(JOIN_CONCURRENCY)
        beating: list[asyncio.Task[None]] = []

        async def rack(nodes: list[str]) -> None:
            async with gate:
                if time.monotonic() > deadline:
                    return
                await self.join(nodes)
            beating.append(asyncio.create_task(self.beat(nodes)))

        t0 = time.monotonic()
        await asyncio.gather(*(rack(r) for r in self.racks))
        join_s = time.monotonic() - t0
        await asyncio.sleep(settle_s)
        if before_measure is not None:
            await before_measure()
        self.measuring = True
        on_measure()
        await asyncio.sleep(seconds)
        self.measuring, self.stop = False, True
        on_measure()
        await asyncio.gather(*beating)
        return join_s


class Rings:
    """`replicas` rings of 2 simulated stages, joined before every rack (so placement gives
    them the model: they claim the memory for it) and speaking the rest of the protocol: each
    beats on its own, reports its shard loaded, answers the coordinator's `reset` frames on a
    data port of its own (frames.accept: the token's handshake), and each ring's head leases
    jobs, long-polling, and completes each at once (a ring that computes in no time, so the
    figures are the control plane's). Lease latency: a lease request that brought jobs."""

    def __init__(self, pool: Pool, port: int, token: bytes, replicas: int) -> None:
        self.pool, self.port, self.token = pool, port, token
        self.ids = [f"ring-{r}-{k}" for r in range(replicas) for k in range(2)]
        self.sessions: dict[str, str] = {}
        self.shards: dict[str, Shard] = {}  # what each was given (the beat's Assignment)
        self.data_ports: dict[str, int] = {}
        self.wired = asyncio.Event()
        self.lease_times: list[float] = []
        self.completed = 0
        self.measuring = False
        self.stop = False
        self.servers: list[asyncio.Server] = []

    async def start(self) -> None:
        """Join, beat, serve resets, lead: until the coordinator says the rings are wired."""
        await self.join()
        interval = [0.5]
        self.tasks = [asyncio.create_task(self.beat(n, interval)) for n in self.ids]
        self.tasks += [asyncio.create_task(self.head(n)) for n in self.ids]
        try:
            await asyncio.wait_for(self.wired.wait(), 60)
        except TimeoutError:
            raise SystemExit("the simulated rings were not wired within 60 s") from None

    async def join(self) -> None:
        from cellswarm.swarm.ring.frames import Frame, accept, read_frame, write_frame

        def serving(node: str) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                           Awaitable[None]]:  # fmt: skip
            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                # the coordinator proves this node's own key (auth.node_key, of its session)
                key = node_key(self.token, digest(self.sessions.get(node, "")))
                try:
                    if await accept(reader, writer, {"coordinator": key}):
                        frame = await read_frame(reader)
                        if frame is not None and frame.type == "reset":
                            await write_frame(writer, Frame("reset_done", {}))
                finally:
                    writer.close()

            return serve

        for node in self.ids:
            server = await asyncio.start_server(serving(node), "127.0.0.1", 0)
            self.servers.append(server)
            self.data_ports[node] = server.sockets[0].getsockname()[1]
            _, c, _ = await self.pool.post("/v1/challenge", {})
            status, answer, _ = await self.pool.post("/v1/join", {
                "node_id": node, "nonce": c["nonce"],
                "proof": prove(self.token, c["nonce"], node),
                "capabilities": {"memory_bytes": RING_MEMORY_BYTES,
                                 "protocol": PROTOCOL}})  # fmt: skip
            if status != 200:
                raise SystemExit(f"ring node {node} could not join: {answer}")
            self.sessions[node] = answer["session"]

    async def beat(self, node: str, interval: list[float]) -> None:
        from cellswarm.swarm.protocol import shard_id

        while not self.stop:
            shard = self.shards.get(node)
            status, answer, _ = await self.pool.post("/v1/heartbeat", {
                "node_id": node, "session": self.sessions[node], "rss_bytes": 100 << 20,
                "peak_rss_bytes": 100 << 20, "data_port": self.data_ports[node],
                "ready": shard_id(shard) if shard else None, "max_sequences": 8,
                "sent_s": time.time()})  # fmt: skip
            if status == 200:
                if answer.get("shard"):
                    self.shards[node] = decode(Assignment, answer["shard"]).shard
                if answer.get("wired"):
                    self.wired.set()
                interval[0] = float(answer.get("heartbeat_s") or interval[0])
            await asyncio.sleep(interval[0])

    async def head(self, node: str) -> None:
        """Lease (a long poll), complete each job at once; the leases' latency kept."""
        while not self.stop:
            shard = self.shards.get(node)
            if shard is None or shard.stage != 0:
                await asyncio.sleep(0.2)
                continue
            t0 = time.perf_counter()
            status, answer, _ = await self.pool.post("/v1/jobs/lease", {
                "node_id": node, "session": self.sessions[node], "n": 8, "wait_s": 1.0})
            took = time.perf_counter() - t0
            jobs = answer.get("jobs", []) if status == 200 else []
            if jobs and self.measuring:
                self.lease_times.append(took)
            for job in jobs:  # the result as a head posts it: the protocol's own message
                out = JobOutput(tokens=[1], reason="max_tokens")
                done = JobResult(job["job_id"], job["fence"], out)
                status, answer, _ = await self.pool.post("/v1/jobs/complete", {
                    "node_id": node, "session": self.sessions[node], **encode(done)})
                if status != 200:  # (a result the protocol refuses made this figure 0 once)
                    raise SystemExit(f"a simulated head's result was refused: {answer}")
                self.completed += self.measuring

    async def submit(self, jobs: int) -> None:
        items = [{"prompt": f"item {i}", "max_tokens": 1} for i in range(jobs)]
        status, answer, _ = await self.pool.post("/v1/batches", {"name": "bench",
                                                                  "items": items})  # fmt: skip
        if status != 200:
            raise SystemExit(f"the batch was refused: {answer}")

    async def close(self) -> None:
        self.stop = True
        for server in self.servers:
            server.close()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def step(n: int, args: argparse.Namespace, via: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cs-control-") as tmp, Transport(via) as nats_url:
        port = free_port()
        coord = Coordinator(Path(tmp), port, args.heartbeat, args.timeout, args.rings,
                            nats_url)  # fmt: skip
        pool = Pool("127.0.0.1", port, CONNECTIONS)
        rings, racks = None, None
        try:
            await pool.open()
            token = coord.token.read_bytes().strip()
            if args.rings:
                rings = Rings(pool, port, token, args.rings)
                await rings.start()
            racks = Racks(pool, token, n, args.rack, args.direct, args.heartbeat)
            if nats_url:
                import nats

                racks.nc = await nats.connect(nats_url)
            marks: list[tuple[float, float]] = []  # (cpu s, wall s) as measuring starts, ends

            def measure() -> None:
                marks.append((coord.cpu_s(), time.monotonic()))
                if rings is not None:
                    rings.measuring = not rings.measuring

            submit = (lambda: rings.submit(args.jobs)) if rings is not None else None
            join_s = await racks.run(args.max_join_s, 2 * args.heartbeat, args.seconds,
                                     measure, submit)  # fmt: skip
            cores = (marks[1][0] - marks[0][0]) / (marks[1][1] - marks[0][1])
            status = await get_status(port)
            lost = [x for x in status["nodes"] if x["state"] == "lost"]
            rss = coord.rss_bytes()
        finally:
            if rings is not None:
                await rings.close()
            if racks is not None and racks.nc is not None:
                await racks.nc.close()
            pool.close()
            coord.stop()
    bt = np.asarray(racks.beat_times or [np.nan])
    lt = np.asarray((rings.lease_times if rings else []) or [np.nan])
    jt = np.asarray(racks.join_times or [np.nan])
    return {
        "nodes": len(racks.sessions), "asked_nodes": n, "mode": "direct" if args.direct else
        f"{'nats' if via == 'nats' else 'relay'}/{args.rack}", "via": via,
        "join_s": round(join_s, 2),
        "join_p50_s": _q(jt, 50), "join_p99_s": _q(jt, 99),
        "heartbeat_interval_s": racks.interval_s, "heartbeat_requests": len(racks.beat_times),
        "heartbeat_p50_s": _q(bt, 50), "heartbeat_p99_s": _q(bt, 99),
        "heartbeats_refused": racks.refused, "lease_p50_s": _q(lt, 50),
        "lease_p99_s": _q(lt, 99),
        "leases_per_s": round(rings.completed / args.seconds, 1) if rings else None,
        "false_lost": len(lost), "coordinator_cpu_cores": round(cores, 3),
        "coordinator_rss_bytes": rss,
    }  # fmt: skip


class Transport:
    """`nats`: a nats-server of our own for the step (its URL), else nothing (None)."""

    def __init__(self, via: str) -> None:
        self.server = None
        if via == "nats":
            from cellswarm.lab.nats import NatsServer, why_not

            if why_not():
                raise SystemExit(f"--via nats: {why_not()}")
            self.server = NatsServer()

    def __enter__(self) -> str | None:
        return self.server.__enter__().url if self.server is not None else None

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.__exit__(*exc)


async def get_status(port: int) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/status HTTP/1.1\r\nHost: c\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():  # not from uvicorn for a JSON body
        raise SystemExit("unexpected chunked status")
    return dict(json.loads(body))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _q(a: np.ndarray, q: float) -> float | None:
    v = float(np.nanpercentile(a, q)) if np.isfinite(a).any() else None
    return None if v is None else round(v, 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1000,10000,100000", help="steps, comma-separated")
    parser.add_argument("--rack", type=int, default=40, help="nodes per relay batch")
    parser.add_argument("--direct", action="store_true", help="one request per node's beat")
    parser.add_argument("--via", default="http,nats",
                        help="the racks' beats over http (POST /v1/heartbeats), nats (a NATS "
                             "request to the coordinators' subject) or both, each a step")
    parser.add_argument("--seconds", type=float, default=20.0, help="heartbeat phase length")
    parser.add_argument("--heartbeat", type=float, default=0.5, help="coordinator's --heartbeat")
    parser.add_argument("--timeout", type=float, default=3.0, help="its --heartbeat-timeout")
    parser.add_argument("--max-join-s", type=float, default=300.0, help="joins per step, at most")
    parser.add_argument("--rings", type=int, default=4,
                        help="simulated 2-stage rings whose heads lease (0: none)")
    parser.add_argument("--jobs", type=int, default=20000, help="jobs queued for the heads")
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if not args.json:
        print(f"{'nodes':>7} {'mode':>9} {'join s':>7} {'join p99':>9} {'beat every':>10} "
              f"{'beat p50':>9} {'beat p99':>9} {'refused':>7} {'lost':>5} {'lease p99':>9} "
              f"{'jobs/s':>7} {'CPU':>6} {'RSS MiB':>8}")  # fmt: skip
    vias = [v.strip() for v in args.via.split(",") if v.strip()]
    if "nats" in vias:
        from cellswarm.lab.nats import why_not

        if why_not() and len(vias) > 1:  # the default asks for both: run what can run
            print(f"skipping --via nats: {why_not()}", file=sys.stderr, flush=True)
            vias.remove("nats")
        elif why_not():
            raise SystemExit(f"--via nats: {why_not()}")
    for n, via in ((int(x), v) for x in args.nodes.split(",") for v in vias):
        r = asyncio.run(step(n, args, via))
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        print(f"{r['nodes']:>7} {r['mode']:>9} {r['join_s']:>7.1f} {r['join_p99_s'] or 0:>9.4f} "
              f"{r['heartbeat_interval_s']:>9.2f}s {r['heartbeat_p50_s'] or 0:>9.4f} "
              f"{r['heartbeat_p99_s'] or 0:>9.4f} {r['heartbeats_refused']:>7} "
              f"{r['false_lost']:>5} {r['lease_p99_s'] or 0:>9.4f} {r['leases_per_s'] or 0:>7.1f} "
              f"{r['coordinator_cpu_cores']:>6.2f} "
              f"{r['coordinator_rss_bytes'] / 2**20:>8.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
