"""What the lab asks of Linux: network namespaces, veth pairs, bridges, tc shaping, cgroups.

Each function is one kernel object made or removed through iproute2 or the cgroup file
system, so `lab down` can undo exactly what `lab up` did, and a half-built lab (a failed
`up`) is taken down the same way.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cellswarm.errors import LabError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def why_not_supported() -> str | None:
    """None when the lab can run here; else one line saying why not."""
    if not sys.platform.startswith("linux"):
        return f"the lab needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, veth, tc, cgroups): run it with sudo"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the lab needs iproute2's ip and tc (Debian: apt-get install iproute2)"
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces"
    if cgroup_kind() is None:
        return "no cgroup file system at /sys/fs/cgroup (neither v1 memory/cpu nor v2)"
    return None


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise LabError(f"{' '.join(cmd)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


# -- namespaces and links ------------------------------------------------------------------


def netns_add(ns: str) -> None:
    run("ip", "netns", "add", ns)
    run("ip", "-n", ns, "link", "set", "lo", "up")


def netns_list(prefix: str) -> list[str]:
    names = run("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in names if line.split() and line.startswith(prefix)]


def netns_pids(ns: str) -> list[int]:
    out = run("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def netns_delete(ns: str) -> None:
    run("ip", "netns", "delete", ns, check=False)  # its veth ends and bridges go with it


def bridge_add(ns: str, name: str = "br0") -> None:
    run("ip", "-n", ns, "link", "add", name, "type", "bridge")
    run("ip", "-n", ns, "link", "set", "dev", name, "up")


def veth_add(ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
    run("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b,
        "netns", ns_b)  # fmt: skip


def attach(ns: str, dev: str, bridge: str = "br0") -> None:
    run("ip", "-n", ns, "link", "set", "dev", dev, "master", bridge)
    run("ip", "-n", ns, "link", "set", "dev", dev, "up")


def address(ns: str, dev: str, cidr: str) -> None:
    run("ip", "-n", ns, "addr", "add", cidr, "dev", dev)
    run("ip", "-n", ns, "link", "set", "dev", dev, "up")


def link_state(ns: str, dev: str, up: bool) -> None:
    run("ip", "-n", ns, "link", "set", "dev", dev, "up" if up else "down")


def shape(ns: str, dev: str, rate_bits_per_s: float, control_port: int | None = None) -> None:
    """Egress of `dev` limited to the rate (htb). Small packets to or from `control_port`
    (the coordinator's: heartbeats, leases, checkpoints) have their own class, served first
    (strict priority), as a switch does with a QoS class for control traffic: a
    data plane that fills the link delays tokens, it must not make live nodes look dead.
    The data class queues at most ~50 ms of the rate (at least 10 packets), as a switch's
    buffer would, so TCP sees a full link, not an endless queue."""
    rate = int(rate_bits_per_s)
    burst = max(int(rate_bits_per_s / 8 * 0.004), 16 << 10)  # 4 ms of the rate, >= 16 KiB
    tc = ("ip", "netns", "exec", ns, "tc")
    run(*tc, "qdisc", "del", "dev", dev, "root", check=False)
    run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    link = ("burst", str(burst), "cburst", str(burst), "quantum", "1514")
    run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
        "rate", f"{rate}bit", "ceil", f"{rate}bit", *link)  # fmt: skip
    for cls, prio in (("1:10", "0"), ("1:20", "1")):  # both may use the whole link; control
        run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", cls, "htb",  # first
            "rate", f"{rate}bit", "ceil", f"{rate}bit", "prio", prio, *link)  # fmt: skip
    packets = max(10, int(rate_bits_per_s / 8 * 0.05 / 1514))
    run(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "pfifo", "limit", str(packets))
    if control_port is None:
        return
    # Control packets are small; full-size ones on that port are a shard being fetched,
    # bulk data that must not jump the queue: below 1,280 bytes (IP total length, the
    # 16 bits at offset 2) is 0x0000-0x03ff or 0x0400-0x04ff.
    for field, (length, mask) in itertools.product(("dport", "sport"),
                                                   (("0x0000", "0xfc00"), ("0x0400", "0xff00"))):
        run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
            "u32", "match", "ip", field, str(control_port), "0xffff",
            "match", "u16", length, mask, "at", "2", "flowid", "1:10")  # fmt: skip


def has_qdisc(kind: str) -> bool:
    """Whether the kernel can load a qdisc (netem is missing on some kernels)."""
    ns = f"csprobe{os.getpid()}"
    netns_add(ns)
    try:
        run("ip", "-n", ns, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
        ok = run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "d0", "root", kind,
                 *(["delay", "1ms"] if kind == "netem" else []), check=False)  # fmt: skip
        return ok.returncode == 0
    finally:
        netns_delete(ns)


# -- cgroups: memory limit and CPU quota per host -------------------------------------------


def cgroup_kind() -> str | None:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return "v2"
    if (CGROUP_ROOT / "memory").is_dir() and (CGROUP_ROOT / "cpu").is_dir():
        return "v1"
    return None


@dataclass(frozen=True)
class Cgroup:
    """One host's cgroup: `paths` are the folders whose cgroup.procs a process joins."""

    kind: str
    paths: tuple[str, ...]

    def procs_files(self) -> list[str]:
        return [str(Path(p) / "cgroup.procs") for p in self.paths]

    def memory_dir(self) -> Path:
        return Path(self.paths[0])

    def oom_kills(self) -> int:
        """How many processes the kernel killed in this cgroup for memory."""
        name = "memory.oom_control" if self.kind == "v1" else "memory.events"
        try:
            text = (self.memory_dir() / name).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


def cgroup_create(
    prefix: str, host: str, memory_bytes: int | None, cpu_quota: float | None
) -> Cgroup:
    kind = cgroup_kind()
    if kind == "v1":
        mem = CGROUP_ROOT / "memory" / prefix / host
        cpu = CGROUP_ROOT / "cpu" / prefix / host
        for d in (mem, cpu):
            d.mkdir(parents=True, exist_ok=True)
        if memory_bytes:
            (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
            swap = mem / "memory.memsw.limit_in_bytes"  # no swapping out of the budget
            if swap.exists():
                swap.write_text(str(memory_bytes))
        period = 100_000
        (cpu / "cpu.cfs_period_us").write_text(str(period))
        (cpu / "cpu.cfs_quota_us").write_text(str(int(cpu_quota * period) if cpu_quota else -1))
        return Cgroup("v1", (str(mem), str(cpu)))
    if kind == "v2":
        parent = CGROUP_ROOT / prefix
        parent.mkdir(exist_ok=True)
        (CGROUP_ROOT / "cgroup.subtree_control").write_text("+memory +cpu")
        (parent / "cgroup.subtree_control").write_text("+memory +cpu")
        d = parent / host
        d.mkdir(exist_ok=True)
        if memory_bytes:
            (d / "memory.max").write_text(str(memory_bytes))
            (d / "memory.swap.max").write_text("0")
        if cpu_quota:
            (d / "cpu.max").write_text(f"{int(cpu_quota * 100_000)} 100000")
        return Cgroup("v2", (str(d),))
    raise LabError("no cgroup file system at /sys/fs/cgroup")


def cgroup_limit_memory(cg: Cgroup, limit_bytes: int) -> None:
    """A new memory limit for a live cgroup (swap still none: memsw follows the limit,
    after it when lowering, before it when raising: v1 keeps memsw >= memory)."""
    d = cg.memory_dir()
    if cg.kind == "v2":
        (d / "memory.max").write_text(str(limit_bytes))
        return
    mem, swap = d / "memory.limit_in_bytes", d / "memory.memsw.limit_in_bytes"
    lowering = limit_bytes < int(mem.read_text())
    for f in (mem, swap) if lowering else (swap, mem):
        if f.exists():
            f.write_text(str(limit_bytes))


def cgroup_limit_cpu(cg: Cgroup, cores: float | None) -> None:
    """A new CPU quota for a live cgroup, in cores (None: no limit)."""
    period = 100_000
    quota = int(cores * period) if cores else -1
    if cg.kind == "v2":
        (Path(cg.paths[0]) / "cpu.max").write_text(f"{quota if quota > 0 else 'max'} {period}")
        return
    cpu = Path(cg.paths[1])
    (cpu / "cpu.cfs_period_us").write_text(str(period))
    (cpu / "cpu.cfs_quota_us").write_text(str(quota))


def cgroup_remove_all(prefix: str) -> None:
    """Remove the lab's cgroups (their processes must be gone; children before parents)."""
    for root in (CGROUP_ROOT / "memory", CGROUP_ROOT / "cpu", CGROUP_ROOT):
        top = root / prefix
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
            _rmdir(d)
        _rmdir(top)


def _rmdir(d: Path) -> None:
    with contextlib.suppress(OSError):
        d.rmdir()
