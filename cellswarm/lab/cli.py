"""`cellswarm lab up|status|restart|run|down`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from cellswarm.errors import LabError, RequestError
from cellswarm.units import format_bytes, parse_bytes

DEFAULT_STATE = "cellswarm-lab"


def add_lab_command(sub: Any) -> None:
    lab = sub.add_parser("lab", help="a swarm of real hosts (network namespaces) on this machine")
    cmds = lab.add_subparsers(dest="lab_command", required=True)
    up = cmds.add_parser("up", help="build the hosts and switches, start coordinators and workers")
    up.add_argument("--hosts", type=int, default=8, help="worker hosts")
    up.add_argument("--racks", type=int, default=2, help="racks (access switches)")
    up.add_argument("--coordinators", type=int, default=1,
                    help="2 or 3: they share PostgreSQL on a database host of its own")
    up.add_argument("--topology", help="a TOML file with the [lab] keys below and slow hosts")
    up.add_argument("--model", help="the .gguf file the coordinator places (default: demo)")
    up.add_argument("--memory", default="128M",
                    help="each worker's --memory: what it may use (its host holds more)")
    up.add_argument("--host-rate", default="1G", help="bits/s of a host port (default 1G)")
    up.add_argument("--oversubscription", default="2.4:4",
                    help="rack and aggregation uplink oversubscription "
                    "(default: the planner's 2.4:4)")  # fmt: skip
    up.add_argument("--host-memory", action="append", default=[], metavar="[HOST=]SIZE",
                    help="cgroup memory limit: SIZE for every worker host (default 256M, "
                    "room for gcc to build its kernels, or --memory if more), HOST=SIZE for "
                    "one host, any host (repeatable), e.g. 300M")
    up.add_argument("--cpu-quota", action="append", default=[], metavar="[HOST=]CORES",
                    help="cgroup CPU quota in cores: CORES for every worker host, HOST=CORES "
                    "for one host, any host (repeatable), e.g. 0.5; default: unlimited")
    up.add_argument("--slow", action="append", default=[], metavar="HOST=CORES",
                    help="a slow host: CPU quota in cores, e.g. h3=0.2 (repeatable; the "
                    "same as --cpu-quota HOST=CORES)")  # fmt: skip
    up.add_argument("--cpus", choices=("same", "mix"), default="same",
                    help="mix: worker hosts cycle kernel builds (native, AVX2, x86-64 "
                    "baseline) and BLAS core types, as different machines would")
    up.add_argument("--stages", type=int, help="the coordinator's --stages")
    up.add_argument("--expert-nodes", type=int, default=0, help="the coordinator's --expert-nodes")
    up.add_argument("--tls", action="store_true",
                    help="mutual TLS on both planes: a cluster CA in the lab's folder, a "
                    "certificate per host (the operator's in STATE/operator)")  # fmt: skip
    up.add_argument("--nats", action="store_true",
                    help="a nats-server on the coordinator's host; every process beats "
                    "through it (--control nats://)")  # fmt: skip
    up.add_argument("--prefix", default="cslab", help="names of namespaces and cgroups")
    up.add_argument("--state-dir", default=DEFAULT_STATE, help="each host's folder, lab.json")
    up.add_argument("--detach", action="store_true",
                    help="return once up (then `cellswarm lab down`); default: stay in the "
                    "foreground and take the lab down on Ctrl-C or SIGTERM")
    up.set_defaults(func=cmd_up)
    for name, helptext, func in (("status", "hosts, links, memory, the swarm", cmd_status),
                                 ("down", "stop every process, remove namespaces and cgroups",
                                  cmd_down)):  # fmt: skip
        p = cmds.add_parser(name, help=helptext)
        p.add_argument("--state-dir", default=DEFAULT_STATE)
        p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
        p.set_defaults(func=func)
        if name == "down":
            p.add_argument("--prefix", help="when the lab's folder is lost: sweep every "
                           "namespace, link and cgroup named with this prefix")  # fmt: skip
    restart = cmds.add_parser("restart", help="stop a host's worker (or coordinator) and "
                              "start it again with the same flags")  # fmt: skip
    restart.add_argument("host", help="the host, e.g. h3")
    restart.add_argument("--state-dir", default=DEFAULT_STATE)
    restart.add_argument("--no-wait", action="store_true",
                         help="return once started, not once it joined (READY)")
    restart.set_defaults(func=cmd_restart)
    run = cmds.add_parser("run", help="run a command inside a host: lab run [--host h1] -- CMD")
    run.add_argument("--host", default="c0", help="the host (default: the first coordinator)")
    run.add_argument("--state-dir", default=DEFAULT_STATE)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)


def spec_from_args(args: argparse.Namespace) -> Any:
    """The LabSpec of `lab up`'s flags over its --topology file (a flag wins over the file,
    one host's value over every host's); any bad value is one RequestError line."""
    from cellswarm.lab.topology import LabSpec
    from cellswarm.planner.profiles import parse_rate

    keys: dict[str, Any] = {}
    if args.topology:
        keys = _read_topology(Path(args.topology))
    over = str(keys.pop("oversubscription", args.oversubscription)).split(":")
    if len(over) != 2:
        raise RequestError(
            f"--oversubscription {args.oversubscription!r}: give ACCESS:AGG, e.g. 20:4"
        )
    limits = _limits(args, keys)
    try:
        return LabSpec(
            hosts=int(keys.pop("hosts", args.hosts)), racks=int(keys.pop("racks", args.racks)),
            coordinators=int(keys.pop("coordinators", args.coordinators)),
            host_bits_per_s=parse_rate(keys.pop("host_rate", args.host_rate)),
            access_oversubscription=float(over[0]), aggregation_oversubscription=float(over[1]),
            memory_bytes=parse_bytes(str(keys.pop("memory", args.memory))),
            cpus=str(keys.pop("cpus", args.cpus)), **limits, **keys,
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        raise RequestError(f"lab: {exc}") from None


def spec_of_file(path: Path) -> Any:
    """The LabSpec that `lab up --topology PATH` builds (every flag at its default): what
    `cellswarm plan --topology PATH` predicts for."""
    parser = argparse.ArgumentParser(prog="cellswarm")
    add_lab_command(parser.add_subparsers())
    return spec_from_args(parser.parse_args(["lab", "up", "--topology", str(path)]))


def _read_topology(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RequestError(f"--topology {path}: {exc}") from None
    return dict(data.get("lab", data))


HOST_KEYS = ("host_memory", "cpu_quota")  # what a [lab.host.NAME] table may set


def _limits(args: argparse.Namespace, keys: dict[str, Any]) -> dict[str, Any]:
    """The cgroup limits, as LabSpec fields: the file's, then the flags' over them. A host
    of None is every worker host."""
    memory, cpu = _file_limits(keys)
    flag_memory, flag_cpu = _flag_limits(args)
    memory, cpu = {**memory, **flag_memory}, {**cpu, **flag_cpu}
    return {"host_memory_bytes": memory.pop(None, None), "cpu_quota": cpu.pop(None, None),
            "host_memory": {str(k): v for k, v in memory.items()},
            "slow_hosts": {str(k): v for k, v in cpu.items()}}  # fmt: skip


Limits = tuple[dict[str | None, int], dict[str | None, float]]  # memory, CPU by host


def _file_limits(keys: dict[str, Any]) -> Limits:
    """[lab] host_memory / cpu_quota, [lab.slow] HOST = CORES, [lab.host.NAME] tables
    (popped from `keys`: what is left goes to LabSpec as it is)."""
    memory: dict[str | None, int] = {}
    cpu: dict[str | None, float] = {}
    if "host_memory" in keys:
        memory[None] = _size("host_memory", str(keys.pop("host_memory")))
    if "cpu_quota" in keys:
        cpu[None] = _cores("cpu_quota", keys.pop("cpu_quota"))
    for host, cores in dict(keys.pop("slow", {})).items():
        cpu[host] = _cores(f"[lab.slow] {host}", cores)
    for host, table in dict(keys.pop("host", {})).items():
        where = f"[lab.host.{host}]"
        if not isinstance(table, dict) or set(table) - set(HOST_KEYS):
            raise RequestError(f"--topology {where}: give a table of {' and '.join(HOST_KEYS)}, "
                               'e.g. host_memory = "300M", cpu_quota = 0.5')  # fmt: skip
        if "host_memory" in table:
            memory[host] = _size(f"{where} host_memory", str(table["host_memory"]))
        if "cpu_quota" in table:
            cpu[host] = _cores(f"{where} cpu_quota", table["cpu_quota"])
    return memory, cpu


def _flag_limits(args: argparse.Namespace) -> Limits:
    memory: dict[str | None, int] = {}
    cpu: dict[str | None, float] = {}
    for text in args.host_memory:
        host, value = _per_host(text)
        memory[host] = _size(f"--host-memory {text!r}", value)
    for text in args.cpu_quota:
        host, value = _per_host(text)
        cpu[host] = _cores(f"--cpu-quota {text!r}", value)
    for text in args.slow:  # one host, always: a bare number here is a slip, not "every host"
        host, value = _per_host(text)
        if host is None:
            raise RequestError(f"--slow {text!r}: give HOST=CORES, e.g. h3=0.2")
        cpu[host] = _cores(f"--slow {text!r}", value)
    return memory, cpu


def _per_host(text: str) -> tuple[str | None, str]:
    """'h3=300M' -> ('h3', '300M'); '300M' -> (None, '300M'): every worker host."""
    host, sep, value = text.partition("=")
    return (host.strip(), value.strip()) if sep else (None, text.strip())


def _size(where: str, text: str) -> int:
    from cellswarm.lab.topology import memory_limit_problem

    try:
        size = parse_bytes(text)
    except RequestError:
        raise RequestError(f"{where}: {text!r} is not a size; give e.g. 300M or 1.5G") from None
    why = memory_limit_problem(size)
    if why:
        raise RequestError(f"{where}: {why}")
    return size


def _cores(where: str, value: object) -> float:
    from cellswarm.lab.topology import cpu_quota_problem

    try:
        cores = float(str(value))
    except ValueError:
        raise RequestError(f"{where}: {value!r} is not a number of cores; give e.g. 0.5") from None
    why = cpu_quota_problem(cores)
    if why:
        raise RequestError(f"{where}: {why}")
    return cores


def cmd_up(args: argparse.Namespace) -> int:
    from cellswarm.lab.lab import Lab

    coordinator_args = ["--expert-nodes", str(args.expert_nodes)]
    if args.stages:
        coordinator_args += ["--stages", str(args.stages)]
    lab = Lab(spec_from_args(args), Path(args.state_dir), args.model, args.prefix,
              coordinator_args=tuple(coordinator_args), tls=args.tls, nats=args.nats,
              say=lambda line: print(line, flush=True))  # fmt: skip
    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        lab.up()
        print_status(lab)
        if args.detach:
            print(f"lab up; `cellswarm lab down --state-dir {args.state_dir}` takes it down")
            return 0
        print("lab up; Ctrl-C (or SIGTERM) takes it down")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("taking the lab down", file=sys.stderr)
        lab.down()
        return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cellswarm.lab.lab import Lab

    lab = Lab.load(Path(args.state_dir))
    if args.json:
        print(json.dumps(lab.status(), indent=1))
    else:
        print_status(lab)
    return 0


def print_status(lab: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    status = lab.status()
    t = Table(title=f"lab {status['prefix']} · coordinators {', '.join(status['coordinators'])}")
    for col in ("host", "role", "rack", "address", "processes", "memory (peak of limit)",
                "cpu", "oom kills"):  # fmt: skip
        t.add_column(col)
    for h in status["hosts"]:
        limit = h.get("memory_limit_bytes", 0)
        mem = (f"{format_bytes(h.get('memory_peak_bytes', 0))} of {format_bytes(limit)}"
               if limit and limit < 1 << 50 else "-")  # fmt: skip
        t.add_row(h["host"], h["role"], "-" if h["rack"] is None else str(h["rack"]),
                  h["address"], str(h["processes"]), mem,
                  f"{h['cpu_quota']:.2f} cores" if h["cpu_quota"] else "-",
                  str(h["oom_kills"]))  # fmt: skip
    Console().print(t)
    for lk in status["links"]:
        print(f"  {lk['tier']:<12} {lk['a']:>6} <-> {lk['b']:<6} {lk['rate_bits_per_s'] / 1e6:,.0f}"
              " Mbit/s each way (htb; the coordinator port first)")
    for note in status["notes"]:
        print(f"  note: {note}")


def cmd_down(args: argparse.Namespace) -> int:
    from cellswarm.lab.lab import Lab, sweep

    if args.prefix is not None and not (Path(args.state_dir) / "lab.json").exists():
        # the lab's folder is gone (a test's temporary folder, a wiped disk): its names are not
        gone = sweep(args.prefix)
        print(f"lab down: {len(gone)} namespaces of prefix {args.prefix!r} swept; no process, "
              "namespace or cgroup left")  # fmt: skip
        return 0
    Lab.load(Path(args.state_dir)).down()
    print("lab down: no process, namespace or cgroup left")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    from cellswarm.lab.lab import READY, Lab

    lab = Lab.load(Path(args.state_dir))
    name, pid = lab.restart(args.host, wait=not args.no_wait)
    state = "started" if args.no_wait else f"printed {READY[name]}"
    print(f"{name} on {args.host} restarted (pid {pid}, the same flags): {state}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from cellswarm.lab.lab import Lab

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise RequestError("lab run: give a command after --, e.g. lab run --host h1 -- ip addr")
    lab = Lab.load(Path(args.state_dir))
    if args.host not in {h.name for h in lab.topology.hosts}:
        raise LabError(f"no host {args.host!r}; hosts: {[h.name for h in lab.topology.hosts]}")
    return lab.run(args.host, cmd)
