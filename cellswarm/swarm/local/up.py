"""`cellswarm up`: a coordinator and N workers as separate processes on this machine.

The same processes a real deployment runs (`cellswarm coordinator`, `cellswarm worker`),
talking over real sockets; the tests, the demo and bench/swarm.py drive a swarm through it.
The command (`commands.cmd_up`) runs it under `stop_on_signals`: SIGTERM, SIGINT and SIGHUP
stop every child, as does the coordinator's death (nothing runs without it); a dead worker
is the coordinator's business (a spare takes its shard), never a reason to stop.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO

from cellswarm.errors import SwarmError
from cellswarm.lifecycle import DIE_WITH_ENV
from cellswarm.planner.placement import ContextFit, fit_context
from cellswarm.swarm.api import client
from cellswarm.swarm.api.client import Status
from cellswarm.swarm.auth import write_secret
from cellswarm.swarm.local.pipeline import free_port
from cellswarm.swarm.ring.costs import costs_at
from cellswarm.swarm.settings import CoordinatorConfig, WorkerConfig, to_flags
from cellswarm.units import parse_bytes

TEST_CONTEXT_TOKENS = 256


# The sha256 of a token this repository once tracked (cellswarm-state/cluster.token, until
# issue 56): every clone had it, so a swarm `up` started with it from an old clone's root
# trusted anyone who has read the repository. Found there, it is replaced by a new one.
PUBLIC_TOKENS = frozenset({"6592cdc280f9e9e6c58020d44a32d42f290a29d41cb087d058470ed534108862"})


def is_public_token(path: Path) -> bool:
    return hashlib.sha256(path.read_bytes()).hexdigest() in PUBLIC_TOKENS


@dataclass
class LocalSwarm:
    model: str
    workers: int
    memory: str  # per worker, e.g. "256M"
    state_dir: Path
    profile: str | None = None
    stages: int | None = None
    expert_nodes: int = 0
    replicas: int = CoordinatorConfig.replicas
    lease_s: float = CoordinatorConfig.lease_s
    evict_after: int = CoordinatorConfig.evict_after_disagreements
    perturb: dict[int, float] = field(default_factory=dict)  # worker -> wrong-output fraction
    flip_bit: frozenset[int] = frozenset()  # workers with one bit of one weight flipped
    vocab_nodes: int = 0
    # tokens a sequence may hold; None: fitted to these workers (`fit`), as `cellswarm up`
    # does. Tests and benches keep a short one: their budgets and timings were sized for it
    context: int | None = TEST_CONTEXT_TOKENS
    max_sequences: int = CoordinatorConfig.max_sequences
    cache_type: str = CoordinatorConfig.cache_type  # the swarm's KV cache type
    heartbeat_s: float = 0.25  # quicker than a deployment's (settings.py): tests wait less
    heartbeat_timeout_s: float = 2.0
    stop_after_s: float = 3.0  # quicker than a deployment's (settings.py): tests wait less
    offline_after: int = CoordinatorConfig.offline_after
    threads: int = 1
    worker_memory: dict[int, str] = field(default_factory=dict)  # per-worker overrides
    fail_forward: Sequence[int] = ()  # workers whose every forward pass fails (tests)
    worker_env: dict[int, dict[str, str]] = field(default_factory=dict)  # e.g. PYTHONPATH
    fail_token: int | None = None  # every worker fails a request's step with this token (tests)
    stall_step: dict[int, float] = field(default_factory=dict)  # worker -> its one long step (s)
    stall_core: float = 0.0  # the coordinator's core thread stalls once this long (s)
    fetch: bool = False  # workers fetch their shards from the coordinator into state_dir
    dram_budget: str | None = None  # workers tier their shard's experts (engine/tiered/)
    api_key_file: str | None = None  # the coordinator's --api-key-file (OpenAI API keys)
    port: int = 0
    coordinators: int = 1  # more than one: they share `db`, which must be PostgreSQL
    db: str | None = None  # default: a SQLite file in state_dir
    leader_ttl_s: float = CoordinatorConfig.leader_ttl_s
    rebalance: bool = True  # off: the placement stays as first made (measurements)
    # mutual TLS on both planes: a node's certificate folder (`cellswarm certs node`), used by
    # the coordinator, every worker and this object's own calls
    tls_dir: str | None = None
    own_log_dirs: bool = False  # no shared disk: logs-<i> per worker, logs-coordinator
    control: str | None = None  # nats://HOST:PORT: heartbeats through NATS (transport/beats.py)
    keep_awake: bool = WorkerConfig.keep_awake  # workers hold a CPU wake-latency bound (awake.py)
    draft: str | None = None  # workers' --draft: a draft model for a ring's first stage
    no_token: bool = False  # tests: no cluster token, as hand-started loopback processes run
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    output: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.token_file = self.state_dir / "cluster.token"
        if not self.token_file.exists() or is_public_token(self.token_file):
            write_secret(self.token_file, secrets.token_hex(32))
        self.log_dir = self.state_dir / "logs"
        if self.coordinators > 1 and not (self.db or "").startswith("postgres"):
            raise SwarmError(f"{self.coordinators} coordinators must share a PostgreSQL "
                             "database: pass db='postgresql://...'")  # fmt: skip
        self.port = self.port or free_port()
        self.ports = [self.port, *(free_port() for _ in range(self.coordinators - 1))]
        scheme = "https" if self.tls_dir else "http"
        self.urls = [f"{scheme}://127.0.0.1:{p}" for p in self.ports]
        self.url = self.urls[0]
        if self.draft is not None:
            self.worker_config(0)  # a bad --draft: one line, before any process starts

    def _spawn(self, name: str, args: list[str], ready: str,
               env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:  # fmt: skip
        cmd = [sys.executable, "-m", "cellswarm.cli", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", DIE_WITH_ENV: str(os.getpid()),
               **(env_extra or {})}  # fmt: skip
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True)  # fmt: skip
        self.procs[name] = p
        lines: list[str] = []
        self.output[name] = lines
        got = threading.Event()

        kept = Kept(self.state_dir / f"{name}.out")  # what it said, for a failure's reader

        def pump() -> None:  # keep reading, so a chatty process never blocks on its pipe
            assert p.stdout is not None
            for line in p.stdout:
                lines.append(line.rstrip())
                kept.write(line)
                if line.startswith(ready):
                    got.set()
            kept.close()
            got.set()

        threading.Thread(target=pump, daemon=True).start()
        got.wait(120)
        if p.poll() is not None or not any(x.startswith(ready) for x in lines):
            raise SwarmError(f"{name} did not start: {' | '.join(lines[-5:])}")
        return p

    def node_log_dir(self, node: int | str) -> Path:
        """Where a worker (its index) or the coordinator writes its JSON-line log."""
        return self.state_dir / f"logs-{node}" if self.own_log_dirs else self.log_dir

    def start_coordinator(self, k: int = 0) -> None:
        """Coordinator k (named `coordinator`, then `coordinator-1`, ...)."""
        check_port_free(self.ports[k])
        db = self.db or f"sqlite:///{self.state_dir / 'coordinator.db'}"
        args = ["coordinator", "--model", self.model, "--listen", f"127.0.0.1:{self.ports[k]}",
                "--db", db, *to_flags(self.coordinator_config())]  # fmt: skip
        args += ["--tls", str(self.tls_dir)] if self.tls_dir else []
        self._spawn(f"coordinator-{k}" if k else "coordinator", args, "READY")

    def coordinator_config(self) -> CoordinatorConfig:
        """What this swarm's coordinators run with (their flags are derived from it)."""
        return CoordinatorConfig(
            model=self.model, token_file=None if self.no_token else str(self.token_file),
            api_key_file=self.api_key_file,
            log_dir=str(self.node_log_dir("coordinator")), heartbeat_s=self.heartbeat_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s, offline_after=self.offline_after,
            stages=self.stages, expert_nodes=self.expert_nodes, vocab_nodes=self.vocab_nodes,
            context=self.context, max_sequences=self.max_sequences, replicas=self.replicas,
            lease_s=self.lease_s, evict_after_disagreements=self.evict_after,
            leader_ttl_s=self.leader_ttl_s, rebalance=self.rebalance, control=self.control,
            stall_core_s=self.stall_core, cache_type=self.cache_type, draft=self.draft,
        )

    def worker_config(self, i: int) -> WorkerConfig:
        """What worker i runs with (its flags are derived from it). Sharing a disk, every
        worker reads the coordinator's file; with `fetch`, as a host sharing no disk, each
        fetches only its shard's bytes over HTTP into a cache of its own."""
        memory = parse_bytes(self.worker_memory.get(i, self.memory))
        return WorkerConfig(
            join=",".join(self.urls), memory_bytes=memory, node_id=f"worker-{i}",
            profile=self.profile, token_file=None if self.no_token else str(self.token_file),
            model=None if self.fetch else self.model, threads=self.threads,
            log_dir=str(self.node_log_dir(i)), stop_after_s=self.stop_after_s,
            fail_forward=i in self.fail_forward, perturb=self.perturb.get(i, 0.0),
            flip_bit=i in self.flip_bit,
            stall_step_s=self.stall_step.get(i, 0.0),
            dram_budget_bytes=parse_bytes(self.dram_budget) if self.dram_budget else None,
            cache_dir=str(self.state_dir / f"cache-{i}") if self.fetch else None,
            fail_token=self.fail_token, control=self.control, keep_awake=self.keep_awake,
            draft=self.draft,
        )  # fmt: skip

    def start_worker(self, i: int) -> None:
        args = ["worker", *to_flags(self.worker_config(i))]
        args += ["--tls", str(self.tls_dir)] if self.tls_dir else []
        self._spawn(f"worker-{i}", args, "JOINED", self.worker_env.get(i))

    def fit_to_workers(self) -> ContextFit:
        """The context and sequences in flight these workers serve, set on this swarm (as
        `cellswarm up` runs): the coordinator is told both, so it places for them and
        waits for the workers that hold them, whatever order they join in."""
        fit = self.fit()
        self.context, self.max_sequences = fit.context_tokens, fit.sequences
        return fit

    def fit(self) -> ContextFit:
        """What these workers serve at this context (None: the planner's rule, the model's
        own context capped by their memory: placement.fit_context); BudgetError, naming the
        context and the longest that fits, when not one sequence does. Without --context
        (or --stages) one worker is left out of the fit: it stays a spare, so a dead
        worker's shard moves at once, as `up` always did; a context asked for may take
        every worker."""
        from cellswarm.loader import read_config

        memory = min(parse_bytes(self.worker_memory.get(i, self.memory))
                     for i in range(max(self.workers, 1)))  # fmt: skip
        config = read_config(self.model)
        parts = self.expert_nodes + self.vocab_nodes  # part servers hold no layers
        workers = max(self.workers // self.replicas - parts, 1)
        spare = self.context is None and workers > 1
        stages = min(self.stages or workers - spare, int(config.n_layers))
        return fit_context(costs_at(self.model, self.expert_nodes > 0, self.vocab_nodes > 0,
                                    self.cache_type, self.draft),
                           stages, memory, int(config.context_length), self.max_sequences,
                           self.context)  # fmt: skip

    def start(self, say: Callable[[str], None] | None = None) -> None:
        """The coordinator(s), then every worker; on any failure (or a signal), none. `say`
        is told as each process is up (what `cellswarm up` shows while it waits)."""
        if self.context is None:
            self.fit_to_workers()
        try:
            for k in range(self.coordinators):
                self.start_coordinator(k)
                if say is not None:
                    say(f"coordinator {self.urls[k]} up")
            for i in range(self.workers):
                self.start_worker(i)
                if say is not None:
                    say(f"worker-{i} up ({i + 1} of {self.workers})")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LocalSwarm:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 120.0,
                   on_change: Callable[[str], None] | None = None) -> Status:  # fmt: skip
        return client.wait_wired(self.url, timeout_s, tls=self.tls_dir, api_key=self.api_key,
                                 on_change=on_change)  # fmt: skip

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            p.wait()

    def close(self, grace_s: float = 0.0) -> None:
        """Stop every process: SIGTERM and up to `grace_s` to exit (the coordinator flushes
        its log), then SIGKILL."""
        live = [p for p in self.procs.values() if p.poll() is None]
        if grace_s > 0:
            for p in live:
                p.terminate()
            deadline = time.monotonic() + grace_s
            while any(p.poll() is None for p in live) and time.monotonic() < deadline:
                time.sleep(0.05)
        for p in live:
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()

    def watch(self, say: Callable[[str], None] = print) -> int:
        """Serve while the coordinator lives (then 1: nothing runs without it). A worker that
        dies is said once and left to the coordinator, which gives its shard to a spare or
        places the model again: never a reason to stop the swarm."""
        said: set[str] = set()
        while (code := self.procs["coordinator"].poll()) is None:
            for name, p in self.procs.items():
                if p.poll() is not None and name not in said:
                    said.add(name)
                    say(f"{name} exited ({describe_exit(p.returncode)}); the coordinator "
                        "moves its shard to a spare or places the model again")  # fmt: skip
            time.sleep(0.2)
        say(f"the coordinator exited ({describe_exit(code)}): stopping the swarm")
        return 1

    def status(self) -> Status:
        status: Status = client.call(self.url, "/v1/status", tls=self.tls_dir,
                                     api_key=self.api_key)  # fmt: skip
        return status

    @property
    def api_key(self) -> str | None:
        """The first key of `api_key_file`, for this object's own calls."""
        from cellswarm.swarm.api.access import first_key

        return first_key(self.api_key_file) if self.api_key_file else None


class Kept:
    """A process's output copied to a file, best effort: a full disk (the disk-full tests
    put the state folder on a tiny tmpfs) stops the copy, never the pump reading the pipe —
    a pump that died would leave the process blocked on a full pipe."""

    def __init__(self, path: Path) -> None:
        self.file: TextIO | None = None
        with contextlib.suppress(OSError):
            self.file = path.open("a")

    def write(self, line: str) -> None:
        if self.file is None:
            return
        try:
            self.file.write(line)
            self.file.flush()
        except OSError:
            self.close()

    def close(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()


def kill_strays() -> None:
    """In `cellswarm up`'s own process, where every child is the swarm's: kill and reap any
    child still there after close — one a stop signal interrupted _spawn for, started but not
    yet recorded — so none is ever orphaned. (Not for a process with other children.)"""
    for pid in child_pids(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def child_pids(parent: int) -> set[int]:
    """This machine's processes whose parent is `parent` (from /proc; empty elsewhere)."""
    out = set()
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                out.add(int(entry.name))
    return out


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise Stopped in the main thread; the first one only: the
    cleanup that follows must not be cut short by a second."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        ignore_stop_signals()
        raise Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def ignore_stop_signals() -> None:
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


class Stopped(BaseException):
    """`cellswarm up` got a signal to stop (a BaseException: no `except Exception` eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"status {code}"


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """SwarmError (one line) when something already listens on the port we are to use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the coordinator binds
        try:
            s.bind((host, port))
        except OSError as exc:
            raise SwarmError(
                f"port {port} on {host} is in use ({exc.strerror}): another coordinator or "
                "`cellswarm up`? Stop it, or pass --port with a free port"
            ) from None
