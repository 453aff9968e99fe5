"""Addresses across hosts: where a node listens, what it tells peers, how far its clock is off.

A node's data port must be reachable from the other hosts, so by default it listens on the
local address of the route to its coordinator (the interface the coordinator reaches it on),
never loopback unless the coordinator itself is on loopback. Behind NAT or in a container
the address peers must dial differs from the one bound: `--advertise HOST[:PORT]` says it.
"""

from __future__ import annotations

import http.client
import ipaddress
import math
import socket
import ssl
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import TextIO
from urllib.parse import urlsplit

from cellswarm.errors import RequestError


def fetch_answer(req: urllib.request.Request, timeout_s: float,
                 tls: ssl.SSLContext | None = None) -> bytes:  # fmt: skip
    """The body of the coordinator's answer. An answer cut short — the coordinator killed
    between its headers and its body — is a ConnectionError like a refused connection, not
    http.client's IncompleteRead (not an OSError), which once ended a worker's loop and so
    the worker."""
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=tls) as r:
            data: bytes = r.read()
            return data
    except http.client.HTTPException as exc:
        if isinstance(exc, OSError):  # RemoteDisconnected: already a ConnectionResetError
            raise
        raise ConnectionError(f"{req.full_url}: the answer was cut short ({exc!r})") from exc


@dataclass(frozen=True)
class Address:
    host: str
    port: int  # 0: any free port (listen) / the bound port (advertise)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(text: str, flag: str, default_port: int = 0) -> Address:
    """HOST or HOST:PORT (IPv6 as [::1]:PORT) -> Address; a one-line error names the flag."""
    text = text.strip()
    host, port = text, str(default_port)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or port
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise RequestError(f"{flag} {text!r} is not HOST or HOST:PORT (e.g. 10.0.0.5:9000)")
    return Address(host, int(port))


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this host only (127.0.0.0/8, ::1,
    localhost); a wildcard (0.0.0.0, ::) or an interface's address is not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def route_source(url: str) -> str:
    """The local address this host uses to reach `url`'s host (no packet is sent: a UDP
    socket's connect only looks up the route)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, parts.port or 80))
            return str(s.getsockname()[0])
    except OSError as exc:
        raise RequestError(
            f"no route to the coordinator {url} ({exc}); give --listen HOST explicitly"
        ) from exc


class ClockOffset:
    """Estimates how far a peer's clock is ahead of ours from request/answer pairs, as NTP
    does: offset = peer_time - (sent + received) / 2, trusting the exchange with the
    shortest round trip among the recent ones (its error is at most half that round trip)."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self.samples: list[tuple[float, float]] = []  # (round trip s, offset s)

    def add(self, sent_s: float, peer_s: float, received_s: float) -> None:
        rtt = max(0.0, received_s - sent_s)
        self.samples = [*self.samples[-(self.keep - 1):], (rtt, peer_s - (sent_s + received_s) / 2)]

    @property
    def offset_s(self) -> float | None:
        return min(self.samples)[1] if self.samples else None

    @property
    def error_s(self) -> float | None:
        return min(self.samples)[0] / 2 if self.samples else None


class Progress:
    """A long read's progress on one line (a shard's fetch, a model's verification): bytes,
    rate, ETA; printed at most every `every_s`, and once at the end."""

    def __init__(self, what: str, out: TextIO = sys.stdout, every_s: float = 1.0,
                 verb: str = "FETCHING") -> None:  # fmt: skip
        self.what, self.out, self.every_s, self.verb = what, out, every_s, verb
        self.t0 = time.monotonic()
        self.last = -math.inf  # the first call prints (monotonic time may start near 0)

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-6)
        eta = (total - done) / rate if rate > 0 else 0.0
        pct = 100.0 * done / total if total else 100.0
        print(f"{self.verb} {self.what}: {done / 2**20:,.1f} of {total / 2**20:,.1f} MiB "
              f"({pct:.0f}%) at {rate / 2**20:,.1f} MiB/s, ETA {eta:.0f} s",
              file=self.out, flush=True)  # fmt: skip
