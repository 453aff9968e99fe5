"""Nothing fails silently (issue 34, item 5): a worker that cannot join says why in one line
— a URL that is not one, a coordinator that does not answer (said once a minute while it
keeps trying), a token the coordinator refuses (it gives up), a budget no shard fits (the
coordinator's reason, said by the worker) — and the coordinator says what it does."""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from cellswarm.swarm.auth import write_secret
from cellswarm.swarm.local.pipeline import free_port
from tests.waiting import wait_until

CLI = [sys.executable, "-m", "cellswarm.cli"]


class Output:
    """A process's stdout and stderr, read as it runs (a full pipe would stop it)."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def said(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def coordinator(demo_path: Path, tmp_path: Path, token: Path) -> tuple[Output, str]:
    port = free_port()
    out = Output([*CLI, "coordinator", "--model", str(demo_path), "--listen",
                  f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp_path / 'c.db'}",
                  "--token-file", str(token)])  # fmt: skip
    wait_until(lambda: out.said("READY") or out.proc.poll() is not None, 120)
    assert out.said("READY"), out.lines
    return out, f"http://127.0.0.1:{port}"


def token(path: Path) -> Path:
    write_secret(path, secrets.token_hex(32))
    return path


def test_a_join_url_that_is_not_one_is_one_line_at_once() -> None:
    for url in ("127.0.0.1:8000", "ftp://10.0.0.5", "http://", "http://host:99999"):
        out = subprocess.run([*CLI, "worker", "--join", url, "--memory", "256M"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 2, (url, out)
        [line] = out.stderr.strip().splitlines()
        assert "is not a coordinator's URL: give http://HOST:PORT" in line, (url, line)


def test_a_coordinator_that_does_not_answer_is_said_once_while_the_worker_keeps_trying(
    tmp_path: Path,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    w = Output([*CLI, "worker", "--join", url, "--memory", "256M"])
    try:
        wait_until(lambda: w.said("cannot reach the coordinator"), 120)
        time.sleep(3)  # ~6 more attempts: none said again, and it keeps trying
        assert len(w.said("cannot reach the coordinator")) == 1, w.lines
        assert url in w.said("cannot reach")[0] and w.proc.poll() is None
    finally:
        w.stop()


def test_a_refused_token_ends_the_worker_with_one_line_saying_which(
    demo_path: Path, tmp_path: Path
) -> None:
    coord, url = coordinator(demo_path, tmp_path, token(tmp_path / "cluster.token"))
    try:
        w = Output([*CLI, "worker", "--join", url, "--memory", "256M", "--node-id", "w1",
                    "--token-file", str(token(tmp_path / "other.token"))])  # fmt: skip
        assert w.proc.wait(120) == 2, w.lines
        time.sleep(0.2)  # the reader takes the last lines
        [error] = w.said("cellswarm: error:")
        assert "refused to let w1 join 3 times (proof does not match the cluster token)" in error
        assert "is --token-file the cluster's token?" in error
        assert not any("{" in line for line in w.lines), w.lines  # no raw JSON
    finally:
        coord.stop()


def test_a_budget_no_shard_fits_is_said_by_the_worker_and_the_coordinator(
    demo_path: Path, tmp_path: Path
) -> None:
    tok = token(tmp_path / "cluster.token")
    coord, url = coordinator(demo_path, tmp_path, tok)
    w = Output([*CLI, "worker", "--join", url, "--memory", "8M", "--node-id", "tiny",
                "--token-file", str(tok)])  # fmt: skip
    try:
        wait_until(lambda: w.said("holds no shard"), 120)
        [line] = w.said("holds no shard")
        assert "tiny holds no shard: the coordinator cannot place the model (" in line, line
        assert coord.said("node tiny joined from 127.0.0.1 with 8.0 MiB"), coord.lines
        wait_until(lambda: len(coord.said("cannot place the model")) == 2, 30)
        # before the worker came, none was live; then the reason the worker was told
        first, then = coord.said("cannot place the model")
        assert first.endswith("no live workers") and then.split(": ", 1)[1] in line, coord.lines
        time.sleep(2)  # beats go on: neither says it again within the minute
        assert len(w.said("holds no shard")) == 1 and len(coord.said("cannot place")) == 2
    finally:
        w.stop()
        coord.stop()


def test_cli_mistakes_are_one_line_not_a_traceback(tmp_path: Path) -> None:
    """A busy port, a byte count that is none, a URL that is none: one line each, exit 2."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        mistakes = [
            ["coordinator", "--listen", f"127.0.0.1:{port}", "--db", f"sqlite:///{tmp_path}/c.db"],
            ["worker", "--join", "http://127.0.0.1:9", "--memory", "lots"],
            ["worker", "--join", "localhost", "--memory", "256M"],
        ]
        for args in mistakes:
            out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
            assert out.returncode == 2, (args, out)
            [line] = out.stderr.strip().splitlines()
            assert line.startswith("cellswarm: error: ") and "Traceback" not in out.stdout, line


# Common command-line mistakes, each with what its one line must name. Each runs as a real
# process (a traceback escapes only there), in parallel pairs.
MISTAKES: list[tuple[str, str]] = [
    ("generate", "prompt"),
    ("generate hi --max-tokens -5", "max_tokens -5"),
    ("generate hi --max-tokens lots", "'lots'"),
    ("generate hi --model /nonexistent.gguf", "/nonexistent.gguf"),
    ("generate hi --model README.md", "not a GGUF file"),
    ("generate hi --temperature -1", "temperature"),
    ("generate hi --top-p 0", "top_p"),
    ("generate hi --threads 0", "--threads 0"),
    ("generate hi --kv-budget lots", "'lots'"),
    ("generate hi --quant q9_9", "q9_9"),
    ("generate a,b --ids", "'a,b'"),
    ("generate hi --context 1.5", "1.5"),
    ("generate hi --coordinator ftp://x", "ftp://x"),
    ("generate hi --coordinator http://127.0.0.1:1", "no coordinator answers"),
    ("worker --memory lots", "'lots'"),
    ("worker --join localhost:8470 --memory 64M", "localhost:8470"),
    ("coordinator --listen nonsense", "nonsense"),
    ("coordinator --db mysql://x", "mysql://x"),
    ("coordinator --model /nonexistent.gguf", "/nonexistent.gguf"),
    ("up --workers 0", "--workers 0"),
    ("up --workers two", "'two'"),
    ("up --memory 1X", "'1X'"),
    ("up --workers 2 --memory 64M", "add workers or memory"),  # before any process starts
    ("plan", "model"),
    ("plan nosuchmodel", "nosuchmodel"),
    ("plan kimi-k3 --node nosuchnode", "nosuchnode"),
    ("plan kimi-k3 --count -1", "--count -1"),
    ("batch submit /nonexistent.jsonl", "/nonexistent.jsonl"),
    ("batch submit README.md --coordinator http://127.0.0.1:1", "not JSON"),
    ("status --coordinator http://127.0.0.1:1", "no coordinator answers"),
    ("logs abc --dir /nonexistent", "/nonexistent"),
    ("verify /nonexistent.gguf", "/nonexistent.gguf"),
    ("eval --quant q9_9", "model"),
    ("simulate --hours -1", "--hours"),
    ("kernels build --nonsense", "--nonsense"),
    ("lab bogus", "bogus"),
]


def test_common_cli_mistakes_are_one_line_each_never_a_traceback() -> None:
    from concurrent.futures import ThreadPoolExecutor

    root = Path(__file__).resolve().parents[1]

    def run(line: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, *line.split()], capture_output=True, text=True,
                              timeout=120, cwd=root, stdin=subprocess.DEVNULL)  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(run, [line for line, _ in MISTAKES]))
    assert len(MISTAKES) >= 30
    for (line, names), r in zip(MISTAKES, runs, strict=True):
        said = (r.stdout + r.stderr).strip().splitlines()
        assert r.returncode != 0, (line, said)
        assert "Traceback" not in r.stderr, (line, r.stderr)
        assert len(said) == 1 and names in said[0], (line, said)


def test_a_stream_that_waits_says_why(demo_path: Path, tmp_path: Path) -> None:
    """A stage stopped mid-request (SIGSTOP): the OpenAI stream carries a comment every few
    seconds saying what the swarm is doing, and the answer still comes once it is back."""
    import signal

    from cellswarm.swarm.api import client
    from cellswarm.swarm.local.up import LocalSwarm

    with LocalSwarm(str(demo_path), 2, "160M", tmp_path) as swarm:
        swarm.wait_ready()
        said: list[str] = []
        swarm.kill("worker-1", signal.SIGSTOP)
        timer = threading.Timer(8.0, swarm.kill, ("worker-1", signal.SIGCONT))
        timer.start()
        try:
            body = {"model": demo_path.name, "prompt": "The capital of France is",
                    "max_tokens": 8, "temperature": 0, "stream": True}  # fmt: skip
            chunks = list(client.events(swarm.url, "/v1/completions", body, timeout_s=180,
                                        on_comment=said.append))  # fmt: skip
        finally:
            timer.join()
        assert said and all(line.startswith("waiting 3 s more: ") for line in said), said
        assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)
