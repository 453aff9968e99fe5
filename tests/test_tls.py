"""Mutual TLS on both planes: certificates made by `cellswarm certs`, a real swarm over TLS
(coordinator HTTPS, stage-to-stage frames, a vocab part's blocking sockets, the resets), and
strangers refused at the handshake: another CA's worker, data-plane peer, or plain TCP."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cellswarm.cli import main as cli
from cellswarm.errors import ProtocolError, RequestError, SwarmError
from cellswarm.swarm.api import client
from cellswarm.swarm.auth import load_token
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.ring import frames
from cellswarm.swarm.tls import check_url, client_context, server_context
from tests.conftest import greedy_reference
from tests.waiting import wait_until

TEXTS = ["The capital of France is", "Once upon a time", "def fib(n):"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The cluster's CA and a node folder; another CA's node; and a `stranger`: this
    cluster's ca.pem (it is public) with a certificate another CA signed."""
    root = tmp_path_factory.mktemp("certs")
    assert cli(["certs", "init", "--dir", str(root / "ca")]) == 0
    assert cli(["certs", "node", "n1", "--dir", str(root / "ca"), "--host", "127.0.0.1"]) == 0
    assert cli(["certs", "init", "--dir", str(root / "other")]) == 0
    assert cli(["certs", "node", "n1", "--dir", str(root / "other")]) == 0
    stranger = root / "stranger"
    stranger.mkdir()
    (stranger / "ca.pem").write_bytes((root / "ca" / "ca.pem").read_bytes())
    for f in ("node.pem", "node.key"):
        (stranger / f).write_bytes((root / "other" / "n1" / f).read_bytes())
    return {"node": root / "ca" / "n1", "other": root / "other" / "n1", "stranger": stranger,
            "ca": root / "ca"}  # fmt: skip


def test_certs_cli_makes_a_ca_and_node_certificates(
    certs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cryptography import x509

    node = certs["node"]
    assert {p.name for p in node.iterdir()} == {"ca.pem", "node.pem", "node.key"}
    assert (node / "node.key").stat().st_mode & 0o777 == 0o600
    assert (certs["ca"] / "ca.key").stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate((node / "node.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["n1"]
    capsys.readouterr()
    # a second init would orphan every node certificate: refused, one line
    assert cli(["certs", "init", "--dir", str(certs["ca"])]) == 2
    assert "already holds a CA" in capsys.readouterr().err
    assert cli(["certs", "node", "n2", "--dir", str(tmp_path / "none")]) == 2
    assert "cellswarm certs init --dir" in capsys.readouterr().err
    with pytest.raises(RequestError, match=r"does not exist.*cellswarm certs init"):
        server_context(tmp_path / "missing")
    (tmp_path / "half").mkdir()
    with pytest.raises(RequestError, match=r"half: ca.pem is missing.*cellswarm certs node"):
        client_context(tmp_path / "half")
    with pytest.raises(RequestError, match="pass --tls"):
        check_url("https://10.0.0.1:8470", None)
    with pytest.raises(RequestError, match="not https"):
        check_url("http://10.0.0.1:8470", str(node))


async def _echo_server(tls: ssl.SSLContext) -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):  # a refused handshake lands here, or nowhere
            while (frame := await frames.read_frame(reader)) is not None:
                await frames.write_frame(writer, frame)
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0, ssl=tls)


def test_the_handshake_refuses_another_ca_both_ways(certs: dict[str, Path]) -> None:
    """A server and clients in this process: a node of the cluster talks; a client of
    another CA, a client trusting our CA but holding another's certificate, and a server of
    another CA are all refused before a frame passes."""

    async def run() -> None:
        server = await _echo_server(server_context(certs["node"]))
        port = server.sockets[0].getsockname()[1]
        hello = frames.Frame("hello", {"n": 1})

        async def echo_with(tls_dir: Path) -> frames.Frame | None:
            reader, writer = await frames.connect("127.0.0.1", port, tls=client_context(tls_dir))
            await frames.write_frame(writer, hello)
            try:
                return await asyncio.wait_for(frames.read_frame(reader), 5)
            finally:
                writer.close()

        assert await echo_with(certs["node"]) == hello
        with pytest.raises(ssl.SSLCertVerificationError):  # it does not trust our server
            await echo_with(certs["other"])
        # TLS 1.3: the server checks the client's certificate after the client is done, so
        # the refusal shows up as a connection closed with nothing read
        with contextlib.suppress(ssl.SSLError, ConnectionError, ProtocolError):
            assert await echo_with(certs["stranger"]) is None
        other = await _echo_server(server_context(certs["other"]))
        with pytest.raises(ssl.SSLCertVerificationError):  # we do not trust theirs
            await frames.connect("127.0.0.1", other.sockets[0].getsockname()[1],
                                 tls=client_context(certs["node"]))  # fmt: skip
        server.close()
        other.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def reference(demo_path: Path) -> dict[tuple[int, ...], list[int]]:
    """Prompt ids -> one process's greedy tokens (no stop ids: every run makes MAX_TOKENS)."""
    return greedy_reference(demo_path, TEXTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def swarm(
    demo_path: Path, certs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalSwarm]:
    """2 stages and 1 vocab node, all over TLS: stage-to-stage frames, the stages' blocking
    calls to the vocab node, the coordinator's resets and every HTTP call."""
    state = tmp_path_factory.mktemp("swarm")
    with LocalSwarm(str(demo_path), 3, "160M", state, stages=2, vocab_nodes=1,
                    tls_dir=str(certs["node"])) as s:  # fmt: skip
        s.wait_ready()
        yield s


def test_a_tls_swarm_gives_the_single_process_tokens(
    swarm: LocalSwarm,
    reference: dict[tuple[int, ...], list[int]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert swarm.url.startswith("https://")
    assert any(line.startswith("READY https://") for line in swarm.output["coordinator"])
    tls = swarm.tls_dir
    ids = [client.submit(swarm.url, {"prompt": list(p), "max_tokens": MAX_TOKENS}, tls=tls)
           for p in reference]  # fmt: skip
    for rid, expected in zip(ids, reference.values(), strict=True):
        result = client.wait(swarm.url, rid, timeout_s=120, tls=tls)
        assert result["state"] == "done", result
        assert result["tokens"] == expected
    holds = [n.get("holds") or "" for n in swarm.status()["nodes"]]
    assert sum("vocab" in h for h in holds) == 1  # the part's blocking sockets were TLS too
    capsys.readouterr()
    assert cli(["status", "--coordinator", swarm.url, "--tls", str(tls)]) == 0
    assert "ring wired" in capsys.readouterr().out
    with pytest.raises(RequestError, match="pass --tls"):  # a plain client: told what to do
        client.call(swarm.url, "/v1/status")


def _data_address(swarm: LocalSwarm) -> tuple[str, int]:
    node = next(n for n in swarm.status()["nodes"] if "layers" in (n.get("holds") or ""))
    host, _, port = node["address"].rpartition(":")
    return host, int(port)


def test_a_plain_tcp_peer_gets_nothing_from_a_tls_data_port(swarm: LocalSwarm) -> None:
    host, port = _data_address(swarm)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(frames.encode(frames.Frame("stats", {})))
        got = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(4096):
                got += chunk
    assert frames.MAGIC not in got  # no challenge, no frame: at most a TLS alert


def test_a_data_plane_peer_with_a_foreign_certificate_is_refused(
    swarm: LocalSwarm, certs: dict[str, Path]
) -> None:
    """Even holding the cluster token: TLS's handshake comes first, then the link's own."""
    host, port = _data_address(swarm)
    token = load_token(str(swarm.token_file))

    async def stats(tls_dir: Path) -> frames.Frame | None:
        reader, writer = await frames.connect(host, port, token, "coordinator",
                                              client_context(tls_dir))  # fmt: skip
        await frames.write_frame(writer, frames.Frame("stats", {}))
        try:
            return await asyncio.wait_for(frames.read_frame(reader), 5)
        finally:
            writer.close()

    for foreign in ("other", "stranger"):
        with pytest.raises((ssl.SSLError, ConnectionError, ProtocolError)):
            asyncio.run(stats(certs[foreign]))
        with pytest.raises((ssl.SSLError, ConnectionError, ProtocolError)):
            frames.connect_sync(host, port, token, "coordinator", 5, client_context(certs[foreign]))
    # the same calls with the cluster's certificate pass TLS, and reach the data port's own
    # handshake: the token proves a member, not the coordinator (hostile/test_members.py)
    with pytest.raises(ProtocolError, match="refused us as 'coordinator'"):
        asyncio.run(stats(certs["node"]))
    with pytest.raises(ProtocolError, match="refused us as 'coordinator'"):
        frames.connect_sync(host, port, token, "coordinator", 5, client_context(certs["node"]))


@pytest.mark.parametrize("who", ["other", "stranger"])
def test_a_worker_with_another_cas_certificate_never_joins(
    swarm: LocalSwarm, certs: dict[str, Path], who: str
) -> None:
    """It holds the cluster token, so only TLS keeps it out; it says why, and the
    coordinator never lists it."""
    cmd = [sys.executable, "-m", "cellswarm.cli", "worker", "--join", swarm.url,
           "--memory", "160M", "--node-id", f"intruder-{who}", "--model", swarm.model,
           "--token-file", str(swarm.token_file), "--tls", str(certs[who])]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    assert p.stdout is not None
    threading.Thread(target=lambda: out.extend(p.stdout or ()), daemon=True).start()
    try:  # up to the first failed handshake (its loop keeps trying, quietly after that)
        wait_until(lambda: "TLS with the coordinator failed" in "".join(out) or p.poll())
    finally:
        p.kill()
        p.wait()
    said = "".join(out)
    assert "TLS with the coordinator failed" in said, said
    assert f"--tls {certs[who]}" in said
    assert "JOINED" not in said
    nodes: dict[str, Any] = {n["node_id"]: n for n in swarm.status()["nodes"]}
    assert f"intruder-{who}" not in nodes
    with pytest.raises(SwarmError, match="cluster's CA"):  # a CLI with that folder: told so
        client.call(swarm.url, "/v1/status", timeout_s=5, tls=str(certs[who]))


def test_a_stranger_who_never_starts_the_handshake_is_closed(swarm: LocalSwarm) -> None:
    """400 TCP connections to the TLS coordinator that never send a ClientHello cost it
    under 100 kB each (asyncio gave each a 256 KiB read buffer at once: ~290 kB measured;
    tls.lean_tls_buffers) and are closed once HANDSHAKE_TIMEOUT_S is up (asyncio's default
    was 60 s, uvicorn passes none); it answers meanwhile (api/guard.py)."""
    import resource

    from cellswarm.swarm.api.guard import HANDSHAKE_TIMEOUT_S
    from tests.test_faults import closed

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))

    def rss_bytes() -> int:
        status = Path(f"/proc/{swarm.procs['coordinator'].pid}/status").read_text()
        line = next(x for x in status.splitlines() if x.startswith("VmRSS"))
        return int(line.split()[1]) * 1024

    before = rss_bytes()
    host, port = swarm.url.removeprefix("https://").rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(400)]
    assert swarm.status()["wired"]
    grown = rss_bytes() - before
    assert grown < 400 * 100_000, f"{grown / 400 / 1000:.0f} kB a connection"
    wait_until(lambda: all(closed(s) for s in socks), HANDSHAKE_TIMEOUT_S + 20)
    for s in socks:
        s.close()


def test_strangers_at_a_tls_data_port_cost_a_few_kb_until_they_prove_a_key(
    swarm: LocalSwarm,
) -> None:
    """400 TCP connections to a stage's TLS data port that never send a ClientHello (a
    data port caps only the connections past TLS that have not proved a key): under 100 kB
    each (asyncio's 256 KiB read buffer per connection was ~290 kB measured: 70 -> 361 MB for
    1,000, an OOM under a 256 MiB cgroup; tls.lean_tls_buffers), closed once the handshake
    timeout is up, and the ring serves meanwhile and after (its proven links read 256 KiB at
    a time again: tls.widen_tls_reads)."""
    import resource

    from cellswarm.swarm.ring.frames import TLS_HANDSHAKE_TIMEOUT_S
    from tests.test_faults import closed

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    host, port = _data_address(swarm)
    node = next(n for n in swarm.status()["nodes"] if n["address"] == f"{host}:{port}")
    pid = swarm.procs[node["node_id"]].pid

    def rss_bytes() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) * 1024

    before = rss_bytes()
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(400)]
    wait_until(lambda: rss_bytes() > before, 5)  # (accepted by now, or the test is lenient)
    grown = rss_bytes() - before
    assert grown < 400 * 100_000, f"{grown / 400 / 1000:.0f} kB a connection"
    wait_until(lambda: all(closed(s) for s in socks), TLS_HANDSHAKE_TIMEOUT_S + 20)
    for s in socks:
        s.close()
    rid = client.submit(swarm.url, {"prompt": TEXTS[0], "max_tokens": 3}, tls=swarm.tls_dir)
    assert client.wait(swarm.url, rid, tls=swarm.tls_dir)["state"] == "done"
