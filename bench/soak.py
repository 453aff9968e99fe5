"""Strangers beside a running batch: no node lost, no job lost or run twice, memory flat.

A swarm (`cellswarm up`'s processes: a coordinator, 2 workers of 256M as 2 stages, heartbeats
through an open NATS server — the worst case, anyone may publish and subscribe) runs batches
of the demo model back to back while strangers, none holding the cluster token, keep at it
from this process for --minutes:

- challenge floods: `POST /v1/challenge {"count": 4096}`, 20 a second;
- 300 idle and 100 half-header HTTP connections to the coordinator, reopened when closed;
- 100 idle TCP connections to each stage's data port, reopened when closed;
- garbage on the data ports: a connection, 4 kB of random bytes, hung up, 10 a second;
- NATS: every heard beat sent again, an altered copy, and garbage, 20 a second;
- a member: a node of the swarm's own (it proved the cluster token and holds a session,
  as any of 100,000 PS3s would) that is in no ring, 20 times a second dials a stage and
  poses as the coordinator (a `reset` pointing the next hop at its own listener), as the
  previous stage (a forged first `hidden` step, a `prefix`, `token` frames into an answer)
  or as a client, proving the cluster token or its own node key (issue 56).

A prompt leaked is a connection to the member's listener; an answer changed is a prompt
whose outputs were not all the same (greedy, 8 tokens).

Every 10 s it samples the coordinator's and each worker's RSS, the epoch and the nodes'
states. At the end: jobs submitted vs done / dead / duplicated (the ledger), nodes lost, and
RSS at the end against RSS after the first fifth (the warm-up), which should be within ±10%.

    python -m bench.soak [--minutes 30] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from cellswarm.swarm.api import client
from cellswarm.swarm.auth import digest, node_key, prove
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.protocol import PROTOCOL
from cellswarm.swarm.protocol.dataplane import First, Hidden, Prefix, Reset, Token
from cellswarm.swarm.ring.frames import HANDSHAKE_PAYLOAD_BYTES, Frame, encode, read_frame_sync

BATCH = 40  # lines per batch; each 8 greedy tokens
MEMBER = "member-soak"  # the forging member (it never beats: lost, and not counted)
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3,"]


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) << 10


def states(status: Any) -> list[str]:
    """The swarm's nodes' states, the forging member's left out (it never beats: lost)."""
    return sorted(n["state"] for n in status["nodes"] if n["node_id"] != MEMBER)


def join_as(url: str, token: bytes, node_id: str, tls: str | None = None,
            memory_bytes: int = 1 << 20) -> str:  # fmt: skip
    """A session for `node_id`, which proves the cluster token over a fresh nonce, as a
    worker joins (auth.py): a member of the swarm's own."""
    nonce = client.call(url, "/v1/challenge", {}, tls=tls)["nonce"]
    return str(client.call(url, "/v1/join", {
        "node_id": node_id, "nonce": nonce, "proof": prove(token, nonce, node_id),
        "capabilities": {"memory_bytes": memory_bytes, "protocol": PROTOCOL}},
        tls=tls)["session"])  # fmt: skip


def pose(host: str, port: int, key: bytes, name: str, frame: Frame) -> str:
    """Prove `key` under `name` as a dialer of the old protocol did (no wait for the
    listener's proof back), send `frame` at once, and say what came back: "denied" and a
    closed connection, or anything else."""
    sock = socket.create_connection((host, port), timeout=10)
    try:
        challenge = read_frame_sync(sock, HANDSHAKE_PAYLOAD_BYTES)
        nonce = str(challenge.fields["nonce"])
        proof = Frame("proof", {"peer": name, "mac": prove(key, nonce, name), "nonce": "n" * 64})
        sock.sendall(encode(proof) + encode(frame))
        answer = read_frame_sync(sock, HANDSHAKE_PAYLOAD_BYTES).type
        sock.settimeout(5)
        return answer if sock.recv(1) == b"" else f"{answer}, then open"
    except (ConnectionResetError, BrokenPipeError):
        # hung up on with our frame unread: the kernel resets such a connection (and may
        # drop the "denied" sent before it)
        return "denied"
    finally:
        sock.close()


class Member:
    """A node of the swarm's own, in no ring, forging frames at each stage (issue 56)."""

    def __init__(self, swarm: LocalSwarm, stages: list[Any]) -> None:
        self.url, self.stages = swarm.url, stages
        self.token = swarm.token_file.read_bytes().strip()
        self.name = MEMBER
        self.own = node_key(self.token, digest(join_as(swarm.url, self.token, self.name)))
        self.trap = socket.create_server(("127.0.0.1", 0))  # where a hijacked stage would send
        self.trap.settimeout(0.05)

    def frames(self, epoch: int) -> dict[str, Frame]:
        rows = np.ones((16, 576), np.float32)
        trap = self.trap.getsockname()[1]
        return {
            "reset": Frame.of(Reset(epoch=epoch, next_host="127.0.0.1", next_port=trap,
                                    peers=[self.name])),
            "token": Frame.of(Token(seq=1, token=42, ep=epoch, at=0)),
            "hidden": Frame.of(Hidden(seq=1, pos=0, ep=epoch, first=First(
                capacity=16, req="forged", prompt=list(range(16)))), rows),
            "prefix": Frame.of(Prefix(seq=1, ep=epoch), rows),
        }

    def poses(self) -> list[tuple[int, str, str]]:
        """(stage, name, frame kind): the coordinator's reset, the previous stage's frames,
        its own name's and a client's."""
        n = len(self.stages)
        out = [(k, "coordinator", "reset") for k in range(n)]
        for k in range(n):
            prev = self.stages[k - 1]["node_id"]
            out += [(k, prev, kind) for kind in ("hidden", "prefix", "token")]
            out += [(k, self.name, "hidden"), (k, "client", "hidden")]
        return out

    def run(self, stop: threading.Event, count: Callable[[str], None]) -> None:
        rng, poses, epoch = random.Random(13), self.poses(), 0
        for i in itertools.count():
            if stop.wait(0.05):
                break
            with contextlib.suppress(TimeoutError, OSError):
                conn, _ = self.trap.accept()  # a stage that believed the forged reset
                conn.close()
                count("member: PROMPT LEAKED (a stage dialled its listener)")
            if i % 20 == 0:  # the current epoch, so that no frame is dropped only for its age
                epoch = int(client.call(self.url, "/v1/status")["epoch"])
            k, name, kind = rng.choice(poses)
            host, port = self.stages[k]["address"].rsplit(":", 1)
            key, whose = (self.token, "token") if i % 2 else (self.own, "own key")
            try:
                said = pose(host, int(port), key, name, self.frames(epoch)[kind])
            except OSError:
                said = "denied"
            role = name if name in ("coordinator", "client", self.name) else "previous stage"
            count(f"member as {role}, {kind}, {whose}: "
                  f"{'refused' if said == 'denied' else 'ADMITTED ' + said}")
        self.trap.close()


class Strangers:
    """The strangers' loops, on threads of this process, until `stop` is set."""

    def __init__(self, url: str, nats_url: str, data_ports: list[tuple[str, int]]) -> None:
        self.url, self.nats_url, self.data_ports = url, nats_url, data_ports
        self.stop = threading.Event()
        self.counts: dict[str, int] = {}
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def start(self) -> list[threading.Thread]:
        loops = [self.challenges, self.idle_http, self.garbage_frames, self.idle_data,
                 lambda: asyncio.run(self.nats())]  # fmt: skip
        threads = [threading.Thread(target=f, daemon=True) for f in loops]
        for t in threads:
            t.start()
        return threads

    def challenges(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self.stop.wait(0.05):
                try:
                    http.post(f"{self.url}/v1/challenge", json={"count": 4096})
                    self.count("challenge floods")
                except httpx.HTTPError:
                    self.count("challenge floods refused")

    def _keep_open(self, socks: list[socket.socket], where: tuple[str, int], n: int,
                   first: bytes, what: str) -> None:  # fmt: skip
        """Reopen those of `socks` the far side closed, up to n, each sending `first`."""
        for s in list(socks):
            s.settimeout(0)
            try:
                if s.recv(4096) == b"":
                    raise ConnectionError
            except BlockingIOError:
                continue
            except OSError:
                pass
            socks.remove(s)
            s.close()
            self.count(f"{what} closed by the server")
        while len(socks) < n and not self.stop.is_set():
            try:
                s = socket.create_connection(where, timeout=5)
                if first:
                    s.sendall(first)
                socks.append(s)
                self.count(f"{what} opened")
            except OSError:
                self.count(f"{what} refused")
                break

    def idle_http(self) -> None:
        idle: list[socket.socket] = []
        half: list[socket.socket] = []
        where = (self.host, self.port)
        while not self.stop.wait(1.0):
            self._keep_open(idle, where, 300, b"", "idle HTTP")
            self._keep_open(half, where, 100, b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\n",
                            "half-header HTTP")  # fmt: skip
        for s in idle + half:
            s.close()

    def idle_data(self) -> None:
        socks: dict[tuple[str, int], list[socket.socket]] = {w: [] for w in self.data_ports}
        while not self.stop.wait(1.0):
            for where, held in socks.items():
                self._keep_open(held, where, 100, b"", "idle data-port")
        for held in socks.values():
            for s in held:
                s.close()

    def garbage_frames(self) -> None:
        rng = random.Random(7)
        while not self.stop.wait(0.1):
            where = rng.choice(self.data_ports)
            try:
                with socket.create_connection(where, timeout=5) as s:
                    s.sendall(rng.randbytes(4096))
                self.count("garbage frames")
            except OSError:
                self.count("garbage frames refused")

    async def nats(self) -> None:
        import nats

        from cellswarm.swarm.transport.beats import SUBJECT

        nc = await nats.connect(self.nats_url)
        heard: list[bytes] = []

        async def hear(msg: Any) -> None:
            if len(heard) < 1000:
                heard.append(msg.data)

        await nc.subscribe(SUBJECT, cb=hear)
        rng = random.Random(11)
        while not self.stop.is_set():
            await asyncio.sleep(0.05)
            if not heard:
                continue
            data = rng.choice(heard)
            altered = data[:70] + bytes([data[70] ^ 1]) + data[71:] if len(data) > 71 else data
            for what, body in [("replayed", data), ("altered", altered),
                               ("garbage", rng.randbytes(200))]:  # fmt: skip
                try:
                    reply = await nc.request(SUBJECT, body, timeout=5)
                    refused = b'"status"' in reply.data
                    self.count(f"NATS {what} {'refused' if refused else 'ANSWERED'}")
                except Exception:  # a stranger's request may go unanswered
                    self.count(f"NATS {what} unanswered")
        await nc.close()


def run(minutes: float) -> dict[str, Any]:
    from cellswarm.demo import demo_model_path
    from cellswarm.lab.nats import NatsServer

    seconds = minutes * 60
    with tempfile.TemporaryDirectory() as tmp, NatsServer() as ns, LocalSwarm(
        str(demo_model_path()), workers=2, memory="256M", state_dir=Path(tmp), stages=2,
        control=ns.url,
    ) as swarm:  # fmt: skip
        status = swarm.wait_ready()
        epoch0 = status["epoch"]
        ports = [(n["address"].rsplit(":", 1)[0], int(n["address"].rsplit(":", 1)[1]))
                 for n in status["nodes"] if n.get("address")]  # fmt: skip
        strangers = Strangers(swarm.url, ns.url, ports)
        threads = strangers.start()
        ring = sorted((n for n in status["nodes"] if n["stage"] is not None),
                      key=lambda n: int(n["stage"] or 0))  # fmt: skip
        member = Member(swarm, ring)
        threads.append(threading.Thread(target=member.run, args=(strangers.stop,
                                                                strangers.count), daemon=True))
        threads[-1].start()
        pids = {name: p.pid for name, p in swarm.procs.items()}
        samples: list[dict[str, Any]] = []
        submitted, batches = 0, list[str]()
        t0 = time.monotonic()
        next_sample = t0
        while time.monotonic() - t0 < seconds:
            open_batches = [b for b in batches if client.call(
                swarm.url, f"/v1/batches/{b}")["finished"] < BATCH]  # fmt: skip
            if len(open_batches) < 2:  # keep the ring busy: one running, one queued
                items = [{"id": f"{submitted + i}", "prompt": PROMPTS[i % len(PROMPTS)],
                          "max_tokens": 8} for i in range(BATCH)]  # fmt: skip
                batches.append(client.call(swarm.url, "/v1/batches", {"items": items})[
                    "batch_id"])
                submitted += BATCH
            if time.monotonic() >= next_sample:
                st = client.call(swarm.url, "/v1/status")
                samples.append({"t_s": round(time.monotonic() - t0, 1), "epoch": st["epoch"],
                                "states": states(st),
                                "rss": {k: rss_bytes(p) for k, p in pids.items()}})  # fmt: skip
                next_sample += 10.0
            time.sleep(1.0)
        strangers.stop.set()
        for t in threads:
            t.join(30)
        deadline = time.monotonic() + 300  # the last batches finish without strangers
        while time.monotonic() < deadline and any(
                client.call(swarm.url, f"/v1/batches/{b}")["finished"] < BATCH
                for b in batches):  # fmt: skip
            time.sleep(1.0)
        ledger = client.call(swarm.url, "/v1/ledger")
        answers: dict[str, set[str]] = {}  # prompt -> its outputs (greedy: one each)
        for b in batches:
            for r in client.call(swarm.url, f"/v1/batches/{b}/results")["results"]:
                prompt = PROMPTS[int(r["id"]) % BATCH % len(PROMPTS)]
                answers.setdefault(prompt, set()).add(str(r.get("output")))
        final = client.call(swarm.url, "/v1/status")
    warm = samples[max(0, len(samples) // 5)]["rss"]
    end = samples[-1]["rss"]
    lost = sum(s["states"].count("lost") for s in samples)
    return {"minutes": minutes, "submitted": submitted, "ledger": ledger,
            "epochs": [epoch0, final["epoch"]], "lost_samples": lost,
            "final_states": states(final),
            "rss_warm_mib": {k: round(v / 2**20, 1) for k, v in warm.items()},
            "rss_end_mib": {k: round(v / 2**20, 1) for k, v in end.items()},
            "rss_change": {k: round(end[k] / warm[k] - 1, 3) for k in warm},
            "answers_changed": sum(len(v) > 1 for v in answers.values()),
            "strangers": dict(sorted(strangers.counts.items())), "samples": len(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = run(args.minutes)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    led = out["ledger"]
    print(f"soak, {out['minutes']:g} min: {out['submitted']} jobs submitted; done {led['done']}, "
          f"dead {led['dead']}, duplicates {led['duplicates']}, queued/leased "
          f"{led['queued']}/{led['leased']}")
    print(f"epoch {out['epochs'][0]} -> {out['epochs'][1]}; nodes lost in samples: "
          f"{out['lost_samples']}; at the end: {', '.join(out['final_states'])}")
    print(f"prompts whose answers differed between jobs: {out['answers_changed']}")
    for k in out["rss_warm_mib"]:
        print(f"  {k:12s} RSS {out['rss_warm_mib'][k]:7.1f} MiB after warm-up, "
              f"{out['rss_end_mib'][k]:7.1f} at the end ({out['rss_change'][k]:+.1%})")
    for k, v in out["strangers"].items():
        print(f"  {k:40s} {v:8d}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
