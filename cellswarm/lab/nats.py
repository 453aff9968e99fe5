"""A NATS server of our own for the tests and the benches (`nats-server`, Debian's package):
on a free port, no JetStream, no system service; stopped with the context."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cellswarm.errors import LabError
from cellswarm.swarm.auth import write_secret
from cellswarm.swarm.transport.beats import server_config


def nats_server_bin() -> str | None:
    return shutil.which("nats-server") or (
        "/usr/sbin/nats-server" if shutil.which("/usr/sbin/nats-server") else None)  # fmt: skip


def why_not() -> str:
    """Why no NATS server can be started here ('' when one can)."""
    try:
        import nats  # noqa: F401
    except ImportError:
        return "nats-py is not installed (pip install nats-py)"
    if nats_server_bin() is None:
        return "no nats-server binary: apt-get install nats-server"
    return ""


@dataclass
class NatsServer:
    """With `token`, the cluster's user and password (as `cellswarm nats config` writes);
    with `tls_dir`, mutual TLS with that certificate folder."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    token: bytes | None = None
    tls_dir: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    conf: Path | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls_dir else 'nats'}://{self.host}:{self.port}"

    def __enter__(self) -> NatsServer:
        binary = nats_server_bin()
        if binary is None:
            raise LabError("no nats-server binary: apt-get install nats-server")
        if not self.port:
            with socket.socket() as s:
                s.bind((self.host, 0))
                self.port = int(s.getsockname()[1])
        fd, name = tempfile.mkstemp(prefix="cellswarm-nats-", suffix=".conf")
        os.close(fd)  # 0600 from the start: it holds the password
        self.conf = Path(name)
        write_secret(self.conf, server_config(f"{self.host}:{self.port}", self.token,
                                              self.tls_dir))  # fmt: skip
        self.proc = subprocess.Popen([binary, "-c", str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.host, self.port), 0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise LabError(f"nats-server did not listen on {self.host}:{self.port}")

    def stop(self) -> None:
        if self.conf is not None:
            self.conf.unlink(missing_ok=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()
