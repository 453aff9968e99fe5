"""`cellswarm lab`: a swarm of real hosts on one Linux machine.

Every host is a network namespace with its own address, its own folder (database, token,
logs, fetched shards, kernel cache: each starts empty, nothing read from another host's
folder or copied from this machine's) and its own cgroup (a memory limit, the machine's
RAM: the kernel kills what does not fit; a CPU quota makes a slow node). Switches are
namespaces too (topology.py), with htb-shaped ports. Coordinators and workers are started
through the real CLI, inside their host; the operator (this process, the tests) reaches
them through a port on the core switch.

The lab's description and the pids and commands it started are kept in STATE/lab.json, so
`lab status`, `lab run`, `lab restart` and `lab down` work from another shell; `down`
removes every process, namespace and cgroup whose name has the lab's prefix, whatever
state `up` left.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cellswarm.errors import LabError
from cellswarm.lab import system
from cellswarm.lab.topology import SUBNET, HostSpec, LabSpec, Topology, build, cpu_path
from cellswarm.swarm.auth import write_secret

COORDINATOR_PORT = 8470
READY = {"coordinator": "READY", "worker": "JOINED"}  # what each prints once up
RESTART_GRACE_S = 10.0  # `restart`: SIGTERM, then SIGKILL after this long
NATS_PORT = 4222  # with `nats`: on the coordinator's host
OPERATOR_ADDRESS = f"{SUBNET}.255.254"  # the operator's port on the core switch


LAB_CONTEXT_TOKENS = 256  # what every lab layout, test and bench was measured at


@dataclass
class Lab:
    spec: LabSpec
    state_dir: Path
    model: str | None = None  # default: the demo model
    prefix: str = "cslab"  # namespaces are PREFIX-HOST, cgroups PREFIX/HOST
    coordinator_args: tuple[str, ...] = ()  # extra `cellswarm coordinator` flags
    worker_args: tuple[str, ...] = ()  # extra `cellswarm worker` flags, every worker
    host_args: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per worker host
    # a limit other than the spec's (spec.host_memory, which lab.json keeps, is the same)
    cgroup_memory: dict[str, int] = field(default_factory=dict)
    heartbeat_s: float = 0.25
    heartbeat_timeout_s: float = 2.0
    stop_after_s: float = 3.0
    threads: int = 1
    tls: bool = False  # a cluster CA, a certificate per host, --tls on every process
    # workers join one after another in host order, so a ring's stages sit on consecutive
    # hosts (rack by rack), as the planner numbers them
    in_order: bool = False
    # a nats-server on the (first) coordinator's host: every process beats through it
    # (--control nats://, swarm/transport/beats.py)
    nats: bool = False
    say: Callable[[str], None] | None = None  # told as processes come up (`lab up` prints)
    topology: Topology = field(init=False)
    notes: list[str] = field(default_factory=list)  # what could not be applied, and why
    pids: dict[str, list[int]] = field(default_factory=dict)
    cgroups: dict[str, system.Cgroup] = field(default_factory=dict)
    # host -> process name -> the last one started by that name: its pid and command, in
    # lab.json, so `restart` from another shell runs the same command with the same flags
    started: dict[str, dict[str, Started]] = field(default_factory=dict)
    # the processes this Lab object started (their exit status is ours to read)
    _children: dict[tuple[str, str], subprocess.Popen[bytes]] = field(
        default_factory=dict, repr=False)  # fmt: skip

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir).resolve()
        self.topology = build(self.spec)
        if len(self.prefix) > 8 or not self.prefix.isalnum():
            raise LabError(f"lab prefix {self.prefix!r}: give 1-8 letters or digits")

    # -- names and places ------------------------------------------------------------------

    def ns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def host_dir(self, host: str) -> Path:
        return self.state_dir / "hosts" / host

    @property
    def urls(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        return [f"{scheme}://{h.address}:{COORDINATOR_PORT}" for h in self.topology.hosts
                if h.role == "coordinator"]  # fmt: skip

    @property
    def operator_tls(self) -> str | None:
        """The operator's certificate folder (for client calls), when the lab runs TLS."""
        return str(self.state_dir / "operator") if self.tls else None

    def _tls_args(self, host: str) -> list[str]:
        return ["--tls", str(self.host_dir(host) / "tls")] if self.tls else []

    @property
    def url(self) -> str:
        return self.urls[0]

    # -- up --------------------------------------------------------------------------------

    def up(self, start: bool = True) -> Lab:
        # what is missing is said before anything is built: one line, with how to install it
        why = self.missing_software() or system.why_not_supported()
        if why:
            raise LabError(why)
        self._claim_prefix()
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._build_network()
            self._make_hosts()
            self.save()
            if start:
                self.start_all()
        except BaseException:
            self.down()
            raise
        return self

    def _claim_prefix(self) -> None:
        """Namespaces of this prefix that are left over are swept; a lab still in use is not.

        A lab is in use while a process runs in one of its namespaces, or while the process
        that built it lives (a lab built without starting anything has empty namespaces). A
        killed test run or a crashed `lab up` leaves neither: its namespaces are swept, with
        a note, rather than refusing every later lab until someone finds the stale names."""
        if not system.netns_list(self.prefix + "-"):
            self._write_owner()
            return
        owner = read_owner(self.prefix)
        busy = [p for ns in system.netns_list(self.prefix + "-") for p in system.netns_pids(ns)]
        if busy or (owner is not None and owner.alive()):
            where = f" (its state in {owner.state_dir})" if owner else ""
            raise LabError(f"a lab with prefix {self.prefix!r} is already up{where}: take it "
                           f"down with `cellswarm lab down --prefix {self.prefix}`, or use "
                           "another --prefix")  # fmt: skip
        sweep(self.prefix)
        self.notes.append(f"a stale lab with prefix {self.prefix!r} (no process in its "
                          "namespaces, its builder gone) was swept before this one")  # fmt: skip
        self._write_owner()

    def _write_owner(self) -> None:
        OWNERS.mkdir(parents=True, exist_ok=True)
        me = Owner(os.getpid(), _start_ticks(os.getpid()), str(self.state_dir))
        (OWNERS / f"{self.prefix}.json").write_text(json.dumps(asdict(me)))

    def missing_software(self) -> str | None:
        """What this lab needs that this machine lacks (None: nothing), in one line."""
        if self.spec.coordinators > 1:
            try:  # the coordinators run in this Python: they need its psycopg
                import psycopg  # noqa: F401
            except ImportError:
                return (f"--coordinators {self.spec.coordinators} needs psycopg (PostgreSQL's "
                        f"client) in {sys.executable}: pip install 'cellswarm[postgres]' "
                        "(in a checkout: pip install -e '.[postgres]')")  # fmt: skip
            from cellswarm.lab.postgres import pg_bin

            if pg_bin() is None:
                return (f"--coordinators {self.spec.coordinators} needs PostgreSQL's "
                        "server binaries here (Debian: apt-get install postgresql)")  # fmt: skip
        if self.nats:
            from cellswarm.lab.nats import why_not

            if why_not():
                return f"--nats: {why_not()}"
        return None

    def _build_network(self) -> None:
        topo = self.topology
        for sw in topo.switches:
            system.netns_add(self.ns(sw))
            system.bridge_add(self.ns(sw))
        for h in topo.hosts:
            system.netns_add(self.ns(h.name))
        for link in topo.links:
            system.veth_add(self.ns(link.a), link.a_dev, self.ns(link.b), link.b_dev)
            for ns, dev in ((link.a, link.a_dev), (link.b, link.b_dev)):
                if ns in topo.switches:
                    system.attach(self.ns(ns), dev)
                else:
                    system.address(self.ns(ns), dev, f"{topo.host(ns).address}/16")
                if link.rate_bits_per_s:
                    system.shape(self.ns(ns), dev, link.rate_bits_per_s, COORDINATOR_PORT)
        # the operator's port: this (root) namespace reaches every host through the core
        op = f"{self.prefix}op"
        system.run("ip", "link", "add", op, "type", "veth", "peer", "name", "p-op",
                   "netns", self.ns("core"))  # fmt: skip
        system.attach(self.ns("core"), "p-op")
        system.run("ip", "addr", "add", f"{OPERATOR_ADDRESS}/16", "dev", op)
        system.run("ip", "link", "set", op, "up")
        if not system.has_qdisc("netem"):
            self.notes.append("delay, loss and reordering not applied: this kernel has no "
                              "netem (only rates are shaped, with htb)")  # fmt: skip

    def _make_hosts(self) -> None:
        token = secrets.token_hex(32)
        if self.tls:
            from cellswarm.swarm.tls import init_ca, issue

            if (self.state_dir / "ca").exists():
                shutil.rmtree(self.state_dir / "ca")
            init_ca(self.state_dir / "ca")
            issue(self.state_dir / "ca", "operator", self.state_dir / "operator")
        for h in self.topology.hosts:
            d = self.host_dir(h.name)
            if d.exists():
                shutil.rmtree(d)
            (d / "logs").mkdir(parents=True)
            # each host gets its own copy, 0600; nothing compiled or fetched here goes in:
            # a host builds its kernels and fetches its shard into its own empty cache, as a
            # machine does on day one (a warm cache hid a worker's cold start from the lab)
            write_secret(d / "cluster.token", token)
            if self.tls:  # as an operator would: the CA stays with them, a cert per host
                from cellswarm.swarm.tls import issue

                issue(self.state_dir / "ca", h.name, d / "tls", hosts=[h.address])
            memory = self.cgroup_memory.get(h.name, h.memory_limit_bytes)
            self.cgroups[h.name] = system.cgroup_create(self.prefix, h.name, memory,
                                                        h.cpu_quota)  # fmt: skip

    def start_all(self) -> None:
        if self.spec.coordinators > 1:
            self.start_database()
        if self.nats:
            self.start_nats()
        for h in self.topology.hosts:
            if h.role == "coordinator":
                self.start_coordinator(h.name)
                self._say(f"coordinator {h.name} up at {h.address}")
        for h in self.topology.workers():
            self.start_worker(h.name, wait=self.in_order)
        workers = self.topology.workers()
        for k, h in enumerate(workers, 1):
            self.wait_output(h.name, "worker", "JOINED")
            self._say(f"worker {h.name} joined ({h.address}, rack {h.rack}; "
                      f"{k} of {len(workers)})")  # fmt: skip
        if self.say is not None:  # then what the coordinator makes of them, until wired
            from cellswarm.errors import SwarmError
            from cellswarm.swarm.api import client

            try:
                client.wait_wired(self.url, tls=self.operator_tls, on_change=self.say)
            except SwarmError as exc:  # the lab is up all the same: status says the rest
                self.say(f"not wired: {exc}")

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line)

    # -- processes -------------------------------------------------------------------------

    def env(self, host: str) -> dict[str, str]:
        d = self.host_dir(host)
        env = {**os.environ, "HOME": str(d), "CELLSWARM_CACHE": str(d / "cache"),
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        workers = [h.name for h in self.topology.workers()]
        if self.topology.spec.cpus == "mix" and host in workers:  # this host's CPU path
            _, flags, core = cpu_path(self.topology.spec, workers.index(host))
            env |= {"CELLSWARM_CFLAGS": flags, "OPENBLAS_CORETYPE": core}
        return env

    def spawn(self, host: str, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        """Start `cmd` inside host: its namespace, its cgroup, its folder; output appended
        to HOST_DIR/NAME.out."""
        d = self.host_dir(host)
        with (d / f"{name}.out").open("ab") as out:
            p = subprocess.Popen([*self.enter(host), *cmd], cwd=d,
                                 env=self.env(host), stdout=out, stderr=subprocess.STDOUT,
                                 preexec_fn=self._enter_cgroup(host),
                                 start_new_session=True)  # fmt: skip
        self.pids.setdefault(host, []).append(p.pid)
        self.started.setdefault(host, {})[name] = Started(p.pid, tuple(cmd))
        self._children[host, name] = p
        self.save()
        return p

    def enter(self, host: str) -> list[str]:
        """The command prefix that runs a program in the host's network namespace. nsenter,
        not `ip netns exec`: that one remounts /sys, hiding /sys/fs/cgroup, where a worker
        reads its memory limit and OOM kills."""
        return ["nsenter", f"--net=/run/netns/{self.ns(host)}", "--"]

    def _enter_cgroup(self, host: str) -> Callable[[], None]:
        procs = self.cgroups[host].procs_files() if host in self.cgroups else []

        def enter() -> None:  # in the child, before exec: it and all it starts
            for f in procs:
                with open(f, "w") as fh:
                    fh.write(str(os.getpid()))

        return enter

    def cellswarm(self, host: str, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        return self.spawn(host, name, [sys.executable, "-m", "cellswarm.cli", *args])

    def output(self, host: str, name: str, since: int = 0) -> str:
        """What process `name` on `host` printed (from byte `since`: a restart's own)."""
        path = self.host_dir(host) / f"{name}.out"
        if not path.exists():
            return ""
        with path.open("rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def output_size(self, host: str, name: str) -> int:
        path = self.host_dir(host) / f"{name}.out"
        return path.stat().st_size if path.exists() else 0

    def wait_output(self, host: str, name: str, text: str, timeout_s: float = 600.0,
                    since: int = 0) -> None:  # fmt: skip
        """Until the process prints `text`; a LabError at once if it exits first (with its
        status and last lines: not after the whole timeout). The timeout is wide: a cold
        host compiles its kernels (~18 s of CPU on a 2-core AVX2 EPYC) beside every other
        host on a few cores, and beside whatever else the machine runs (8 hosts at once
        missed 180 s beside another test)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.output(host, name, since):
                return
            self.raise_if_exited(host, name, f"before printing {text!r}", since)
            time.sleep(0.1)
        raise LabError(f"{name} on {host} did not print {text!r} in {timeout_s:.0f} s: "
                       f"{self._tail(host, name, since)}")  # fmt: skip

    def raise_if_exited(self, host: str, name: str, when: str, since: int = 0) -> None:
        """A LabError naming the exit status and last lines if `name` on `host` is gone."""
        why = self._exit_status(host, name)
        if why is not None:
            raise LabError(f"{name} on {host} {why} {when}: {self._tail(host, name, since)}")

    def _exit_status(self, host: str, name: str) -> str | None:
        """None while it runs; else how it ended ('exited with status 1')."""
        child = self._children.get((host, name))
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            if code < 0:
                return f"was killed by {signal.Signals(-code).name}"
            return f"exited with status {code}"
        started = self.started.get(host, {}).get(name)  # started by another `cellswarm lab`
        if started is None or _alive(started.pid):
            return None
        return "exited (its status went to the shell that started it)"

    def _tail(self, host: str, name: str, since: int = 0, lines: int = 4) -> str:
        return " | ".join(self.output(host, name, since).strip().splitlines()[-lines:]) or (
            f"nothing in {self.host_dir(host) / (name + '.out')}")  # fmt: skip

    def start_coordinator(self, host: str) -> None:
        h, d = self.topology.host(host), self.host_dir(host)
        db = self.database_url or f"sqlite:///{d / 'coordinator.db'}"
        from cellswarm.demo import demo_model_path

        args = ["coordinator", "--model", self.model or str(demo_model_path()),
                "--listen", f"{h.address}:{COORDINATOR_PORT}", "--db", db,
                "--token-file", str(d / "cluster.token"), "--log-dir", str(d / "logs"),
                "--heartbeat", str(self.heartbeat_s),
                "--heartbeat-timeout", str(self.heartbeat_timeout_s),
                *self._control_args(), *self._tls_args(host), *self.coordinator_args]  # fmt: skip
        if "--context" not in args:  # the lab's fixed context (its layouts and benches were
            args += ["--context", str(LAB_CONTEXT_TOKENS)]  # made at it), not the fitted one
        since = self.output_size(host, "coordinator")
        self.cellswarm(host, "coordinator", args)
        self.wait_output(host, "coordinator", READY["coordinator"], since=since)

    def build_kernels(self, host: str) -> None:
        """The host compiles its own kernels into its own cache now (`cellswarm kernels
        build` in its namespace and cgroup). A worker does so itself before it joins; this is
        for a test that must have them built before it squeezes the host's memory."""
        if self.run(host, [sys.executable, "-m", "cellswarm.cli",
                           "kernels", "build"], timeout_s=300) != 0:  # fmt: skip
            raise LabError(f"{host}: its kernels did not compile")

    def limit_memory(self, host: str, limit_bytes: int) -> None:
        """The host's cgroup memory limit, now (e.g. squeezed below what its worker claims,
        once its kernels are built)."""
        system.cgroup_limit_memory(self.cgroups[host], limit_bytes)

    def limit_cpu(self, host: str, cores: float | None) -> None:
        """The host's CPU quota, now, in cores (e.g. slowed once its kernels are built)."""
        system.cgroup_limit_cpu(self.cgroups[host], cores)

    def start_worker(self, host: str, wait: bool = True) -> None:
        h, d = self.topology.host(host), self.host_dir(host)
        args = ["worker", "--join", ",".join(self.urls), "--memory", str(h.memory_bytes),
                "--node-id", host, "--token-file", str(d / "cluster.token"),
                "--log-dir", str(d / "logs"), "--threads", str(self.threads),
                "--stop-after", str(self.stop_after_s), *self._tls_args(host),
                *self._control_args(),
                *(["--rack", f"rack-{h.rack}"] if h.rack is not None else []),
                *self.worker_args, *self.host_args.get(host, ())]  # fmt: skip
        since = self.output_size(host, "worker")
        self.cellswarm(host, "worker", args)
        if wait:
            self.wait_output(host, "worker", READY["worker"], since=since)

    def restart(self, host: str, wait: bool = True) -> tuple[str, int]:
        """The host's worker (or, on a coordinator's host, its coordinator) stopped and
        started again with the same command: SIGTERM to its process group, SIGKILL after
        RESTART_GRACE_S; (which one, its new pid), once it printed JOINED (READY)."""
        name = self._restartable(host)
        old = self.started[host][name]
        _stop_group(old.pid, RESTART_GRACE_S)
        since = self.output_size(host, name)
        new = self.spawn(host, name, list(old.cmd))
        if wait:
            self.wait_output(host, name, READY[name], since=since)
        return name, new.pid

    def _restartable(self, host: str) -> str:
        for name in ("worker", "coordinator"):  # a host runs one of them (the lab's rule)
            if name in self.started.get(host, {}):
                return name
        known = [h for h, names in self.started.items() if set(names) & set(READY)]
        raise LabError(f"no worker or coordinator on host {host!r} to restart; hosts: "
                       f"{', '.join(known) or 'none started yet'}")  # fmt: skip

    # -- NATS: the heartbeats' transport with `nats` ------------------------------------------

    @property
    def control_url(self) -> str | None:
        if not self.nats:
            return None
        host = next(h for h in self.topology.hosts if h.role == "coordinator")
        return f"{'tls' if self.tls else 'nats'}://{host.address}:{NATS_PORT}"

    def _control_args(self) -> list[str]:
        return ["--control", self.control_url] if self.control_url else []

    def start_nats(self) -> None:
        """nats-server inside the first coordinator's host, listening on its address."""
        from cellswarm.lab.nats import nats_server_bin

        binary = nats_server_bin()
        if binary is None:
            raise LabError("nats needs nats-server on this machine (Debian: apt-get install "
                           "nats-server)")  # fmt: skip
        from cellswarm.swarm.auth import load_token
        from cellswarm.swarm.transport.beats import server_config

        host = next(h for h in self.topology.hosts if h.role == "coordinator")
        d = self.host_dir(host.name)  # as an operator would: `cellswarm nats config`
        conf = d / "nats.conf"
        write_secret(conf, server_config(f"{host.address}:{NATS_PORT}",
                                         load_token(d / "cluster.token"),
                                         d / "tls" if self.tls else None))  # fmt: skip
        self.spawn(host.name, "nats", [binary, "-c", str(conf)])
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection((host.address, NATS_PORT), 0.5).close()
                break
            except OSError:
                self.raise_if_exited(host.name, "nats", "before it listened")
                if time.monotonic() > deadline:
                    raise LabError(f"nats-server on {host.name} did not listen on "
                                   f"{host.address}:{NATS_PORT}") from None  # fmt: skip
                time.sleep(0.1)
        self._say(f"nats-server up on {host.name} ({host.address}:{NATS_PORT})")

    # -- the database host (several coordinators share PostgreSQL) -------------------------

    @property
    def database_url(self) -> str | None:
        if self.spec.coordinators < 2:
            return None
        return f"postgresql://postgres@{self.topology.host('db').address}:5432/cellswarm"

    def start_database(self) -> None:
        from cellswarm.lab.postgres import start_postgres

        start_postgres(self, "db")

    def reshape(self, host_bits_per_s: float) -> None:
        """Every shaped link again, for host ports of this rate (uplinks follow by their
        oversubscription): e.g. weights fetched at full speed, then measured at the rate of
        the nodes being emulated."""
        from dataclasses import replace

        self.spec = replace(self.spec, host_bits_per_s=host_bits_per_s)
        self.topology = build(self.spec)
        for link in self.topology.links:
            if link.rate_bits_per_s:
                system.shape(self.ns(link.a), link.a_dev, link.rate_bits_per_s, COORDINATOR_PORT)
                system.shape(self.ns(link.b), link.b_dev, link.rate_bits_per_s, COORDINATOR_PORT)
        self.save()

    # -- faults ----------------------------------------------------------------------------

    def kill_host(self, host: str, sig: int = signal.SIGKILL) -> list[int]:
        """Every process in the host's namespace gets `sig` (a host dying: power cut)."""
        pids = system.netns_pids(self.ns(host))
        for pid in pids:
            _signal(pid, sig)
        return pids

    def set_uplink(self, rack: int, up: bool) -> None:
        """A rack's uplink to the aggregation switch goes down (or comes back), both ends."""
        link = self.topology.uplink(rack)
        system.link_state(self.ns(link.a), link.a_dev, up)
        system.link_state(self.ns(link.b), link.b_dev, up)

    # -- looking -----------------------------------------------------------------------------

    def host_status(self, host: str) -> dict[str, Any]:
        h = self.topology.host(host)
        cg = self.cgroups.get(host)
        mem = _cgroup_memory(cg) if cg else {}
        alive = system.netns_pids(self.ns(host))
        return {"host": host, "role": h.role, "address": h.address, "rack": h.rack,
                "processes": len(alive), "cpu_quota": h.cpu_quota,
                "oom_kills": cg.oom_kills() if cg else 0, **mem}  # fmt: skip

    def status(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "state_dir": str(self.state_dir),
                "coordinators": self.urls, "notes": self.notes,
                "links": [asdict(lk) for lk in self.topology.links if lk.rate_bits_per_s],
                "hosts": [self.host_status(h.name) for h in self.topology.hosts]}  # fmt: skip

    def run(self, host: str, cmd: list[str], timeout_s: float | None = None) -> int:
        """Run a command inside a host (its namespace, cgroup and folder), in the foreground."""
        done = subprocess.run([*self.enter(host), *cmd],
                              cwd=self.host_dir(host), env=self.env(host), timeout=timeout_s,
                              preexec_fn=self._enter_cgroup(host))  # fmt: skip
        return done.returncode

    # -- persistence and down ----------------------------------------------------------------

    def save(self) -> None:
        data = {"spec": {**asdict(self.spec)}, "prefix": self.prefix, "model": self.model,
                "tls": self.tls, "nats": self.nats,
                "pids": self.pids, "notes": self.notes,
                "started": {h: {n: asdict(s) for n, s in names.items()}
                            for h, names in self.started.items()},
                "cgroups": {k: asdict(v) for k, v in self.cgroups.items()}}  # fmt: skip
        tmp = self.state_dir / "lab.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.state_dir / "lab.json")

    @classmethod
    def load(cls, state_dir: Path) -> Lab:
        path = Path(state_dir) / "lab.json"
        if not path.exists():
            raise LabError(f"no lab in {state_dir} (no lab.json): start one with "
                           "`cellswarm lab up`")  # fmt: skip
        data = json.loads(path.read_text())
        lab = cls(LabSpec(**data["spec"]), Path(state_dir), data["model"], data["prefix"],
                  tls=bool(data.get("tls")))  # fmt: skip
        lab.pids, lab.notes = data["pids"], data["notes"]
        lab.started = {h: {n: Started(s["pid"], tuple(s["cmd"])) for n, s in names.items()}
                       for h, names in data.get("started", {}).items()}  # fmt: skip
        lab.nats = bool(data.get("nats"))
        lab.cgroups = {k: system.Cgroup(v["kind"], tuple(v["paths"]))
                       for k, v in data["cgroups"].items()}  # fmt: skip
        return lab

    def down(self) -> None:
        """Every process, namespace and cgroup of this lab's prefix: gone."""
        from cellswarm.lab.postgres import stop_postgres

        started = [pid for pids in self.pids.values() for pid in pids]
        for pid in started:
            _signal(pid, signal.SIGKILL)
        sweep(self.prefix)  # what runs in its namespaces, and the namespaces
        _wait_gone(started, 10.0)
        stop_postgres(self)
        (self.state_dir / "lab.json").unlink(missing_ok=True)

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


# who built each lab, by prefix: outside any lab's state folder (a test's folder is gone with
# the test), so that a later `up` can tell a lab in use from one a killed run left behind
OWNERS = Path("/run/cellswarm-lab")


@dataclass(frozen=True)
class Owner:
    """The process that built a lab (its pid and start time: pids are reused)."""

    pid: int
    start_ticks: int
    state_dir: str

    def alive(self) -> bool:
        return _alive(self.pid) and _start_ticks(self.pid) == self.start_ticks


def read_owner(prefix: str) -> Owner | None:
    try:
        return Owner(**json.loads((OWNERS / f"{prefix}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def sweep(prefix: str) -> list[str]:
    """Every process, namespace, link and cgroup named with this prefix: gone (no state
    needed: `lab down --prefix` uses it when the lab's folder is lost). The namespaces swept."""
    namespaces = system.netns_list(prefix + "-")
    pids = [p for ns in namespaces for p in system.netns_pids(ns)]
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    _wait_gone(pids, 10.0)
    for ns in namespaces:
        system.netns_delete(ns)
    system.run("ip", "link", "delete", f"{prefix}op", check=False)
    system.cgroup_remove_all(prefix)
    (OWNERS / f"{prefix}.json").unlink(missing_ok=True)
    return namespaces


def _start_ticks(pid: int) -> int:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or -1."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class Started:
    """One process the lab started in a host: its pid (its process group's too: it was
    started in a session of its own) and its command, without the namespace prefix."""

    pid: int
    cmd: tuple[str, ...]


@functools.cache
def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and not _zombie(pid)


def _stop_group(pid: int, grace_s: float) -> None:
    """SIGTERM to the process group (the process and what it started), SIGKILL if it is
    still there after grace_s (as systemd stops a unit)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        _wait_gone([pid], wait_s)
        if not _alive(pid):
            return


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not Path(f"/proc/{pid}").exists() or _zombie(pid):
                break
            time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _cgroup_memory(cg: system.Cgroup) -> dict[str, int]:
    d = cg.memory_dir()
    names = {"v1": ("memory.usage_in_bytes", "memory.max_usage_in_bytes", "memory.limit_in_bytes"),
             "v2": ("memory.current", "memory.peak", "memory.max")}[cg.kind]  # fmt: skip
    out = {}
    for key, name in zip(("memory_used_bytes", "memory_peak_bytes", "memory_limit_bytes"), names,
                         strict=True):  # fmt: skip
        try:
            text = (d / name).read_text().strip()
            out[key] = int(text) if text.isdigit() else 0
        except OSError:
            out[key] = 0
    return out


__all__ = ["HostSpec", "Lab", "LabSpec"]
