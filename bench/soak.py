"""Strangers beside a running batch: no node lost, no job lost or run twice, memory flat.

A swarm (`cellswarm up`'s processes: a coordinator, 2 workers of 256M as 2 stages, heartbeats
through an open NATS server — the worst case, anyone may publish and subscribe) runs batches
of the demo model back to back while strangers, none holding the cluster token, keep at it
from this process for --minutes:

- challenge floods: `POST /v1/challenge {"count": 4096}`, 20 a second;
- 300 idle and 100 half-header HTTP connections to the coordinator, reopened when closed;
- 100 idle TCP connections to each stage's data port, reopened when closed;
- garbage on the data ports: a connection, 4 kB of random bytes, hung up, 10 a second;
- NATS: every heard beat sent again, an altered copy, and garbage, 20 a second.

Every 10 s it samples the coordinator's and each worker's RSS, the epoch and the nodes'
states. At the end: jobs submitted vs done / dead / duplicated (the ledger), nodes lost, and
RSS at the end against RSS after the first fifth (the warm-up), which should be within ±10%.

    python -m bench.soak [--minutes 30] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm

BATCH = 40  # lines per batch; each 8 greedy tokens
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3,"]


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) << 10


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
        pids = {name: p.pid for name, p in swarm.procs.items()}
        samples: list[dict[str, Any]] = []
        submitted, batches = 0, []
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
                                "states": sorted(n["state"] for n in st["nodes"]),
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
        final = client.call(swarm.url, "/v1/status")
    warm = samples[max(0, len(samples) // 5)]["rss"]
    end = samples[-1]["rss"]
    lost = sum(s["states"].count("lost") for s in samples)
    return {"minutes": minutes, "submitted": submitted, "ledger": ledger,
            "epochs": [epoch0, final["epoch"]], "lost_samples": lost,
            "final_states": sorted(n["state"] for n in final["nodes"]),
            "rss_warm_mib": {k: round(v / 2**20, 1) for k, v in warm.items()},
            "rss_end_mib": {k: round(v / 2**20, 1) for k, v in end.items()},
            "rss_change": {k: round(end[k] / warm[k] - 1, 3) for k in warm},
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
    for k in out["rss_warm_mib"]:
        print(f"  {k:12s} RSS {out['rss_warm_mib'][k]:7.1f} MiB after warm-up, "
              f"{out['rss_end_mib'][k]:7.1f} at the end ({out['rss_change'][k]:+.1%})")
    for k, v in out["strangers"].items():
        print(f"  {k:40s} {v:8d}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
