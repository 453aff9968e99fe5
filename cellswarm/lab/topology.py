"""The lab's wiring as data: hosts, switches, links and their rates — pure, no system calls.

The seed's three tiers, each switch a network namespace holding one Linux bridge:

    worker hosts --host ports--> rack (access) switch --uplink--> aggregation --uplink--> core
    coordinator / database hosts --host ports--> core

Every host is on one flat /16 (bridges forward layer 2), so addresses never change when a
link goes down: the host is simply unreachable, as a real rack behind a dead uplink is.
Port rates come from the node profile's link; an uplink carries the rack's (or the
aggregation's) host rate divided by its oversubscription — the planner's network model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUBNET = "10.77"  # 10.77.0.0/16: infrastructure hosts in .0.x, rack r's hosts in .(r+1).x
MIN_MEMORY_BYTES = 16 << 20  # a host's smallest cgroup memory limit
# A worker host's memory when no limit is given: a PS3's RAM (the seed's node), or the
# worker's --memory if that is more. A host compiles its own kernels (its cache starts
# empty) and gcc's cc1 peaks at ~210 MB on kernels.c at -O3: in 128 MiB it is killed, and
# the host would run the numpy path, whose arithmetic is not the fused kernels'.
DEFAULT_HOST_MEMORY_BYTES = 256 << 20
MIN_CPU_QUOTA = 0.01  # cores: cgroups' smallest CFS quota, 1 ms per 100 ms period


@dataclass(frozen=True)
class HostSpec:
    name: str  # c0, c1, db, h1, h2, ...
    role: str  # "coordinator", "database" or "worker"
    address: str
    switch: str  # the switch namespace's short name its port is on
    rack: int | None = None  # None: infrastructure, on the core switch
    memory_bytes: int | None = None  # a worker's --memory (what it claims it has)
    memory_limit_bytes: int | None = None  # its cgroup's memory limit, None: unlimited
    cpu_quota: float | None = None  # cores (0.5: half of one), None: unlimited


@dataclass(frozen=True)
class LinkSpec:
    """One veth pair between namespaces `a` and `b` (short names), shaped both ways."""

    a: str
    a_dev: str
    b: str
    b_dev: str
    rate_bits_per_s: float | None  # None: unshaped
    tier: str  # "host", "access" (rack uplink) or "aggregation" (aggregation uplink)


@dataclass(frozen=True)
class LabSpec:
    hosts: int = 8  # worker hosts
    racks: int = 2
    coordinators: int = 1  # more than one: they share PostgreSQL on a host of its own
    racks_per_aggregation: int = 2
    host_bits_per_s: float = 1e9
    access_oversubscription: float = 2.4  # host ports : rack uplink (planner default)
    aggregation_oversubscription: float = 4.0
    memory_bytes: int = 128 << 20  # each worker's --memory: what it may use for shards
    # cgroup limits: every worker host's (the weak nodes; coordinators and the database
    # host are unlimited unless named), then per host (any host), which wins
    host_memory_bytes: int | None = None  # None: DEFAULT_HOST_MEMORY_BYTES or --memory
    cpu_quota: float | None = None  # cores, None: unlimited
    host_memory: dict[str, int] = field(default_factory=dict)  # host -> memory limit
    slow_hosts: dict[str, float] = field(default_factory=dict)  # host -> CPU quota (cores)
    # "mix": worker hosts cycle cpu_paths() (kernel builds, BLAS core types), as a pile of
    # different machines would; "same": every host this machine's native build
    cpus: str = "same"

    def __post_init__(self) -> None:
        self._check_shape()
        self._check_limits()

    def _check_shape(self) -> None:
        if self.cpus not in ("same", "mix"):
            raise ValueError(f"--cpus {self.cpus!r}: give 'same' or 'mix'")
        if self.hosts < 1 or self.racks < 1 or self.racks > self.hosts:
            raise ValueError(f"--hosts {self.hosts} --racks {self.racks}: need 1 <= racks <= hosts")
        if self.racks > 200 or self.hosts > 250 * self.racks:
            raise ValueError(f"{self.hosts} hosts in {self.racks} racks do not fit 10.77.0.0/16")
        if not 1 <= self.coordinators <= 3:
            raise ValueError(f"--coordinators {self.coordinators}: give 1, 2 or 3")
        for what in ("host_bits_per_s", "access_oversubscription", "aggregation_oversubscription"):
            if getattr(self, what) <= 0:
                raise ValueError(f"{what} must be positive")

    def host_names(self) -> list[str]:
        infra = [f"c{k}" for k in range(self.coordinators)]
        return infra + (["db"] if self.coordinators > 1 else []) + [
            f"h{i + 1}" for i in range(self.hosts)]  # fmt: skip

    def _check_limits(self) -> None:
        memory = {"every worker host": self.host_memory_bytes, **self.host_memory}
        for who, limit in memory.items():
            if limit is not None and (why := memory_limit_problem(limit)):
                raise ValueError(f"host memory for {who}: {why}")
        cpu = {"every worker host": self.cpu_quota, **self.slow_hosts}
        for who, cores in cpu.items():
            if cores is not None and (why := cpu_quota_problem(cores)):
                raise ValueError(f"cpu quota for {who}: {why}")
        names = self.host_names()
        for host in [*self.host_memory, *self.slow_hosts]:
            if host not in names:
                raise ValueError(f"no host {host!r} in this lab (limits name a host); hosts: "
                                 f"{', '.join(names)}")  # fmt: skip


def memory_limit_problem(limit_bytes: int) -> str | None:
    """Why a host's cgroup memory limit cannot be (None: it can): below 16 MiB nothing
    starts, it would not be a weak node but a dead one."""
    if limit_bytes < MIN_MEMORY_BYTES:
        return (f"{limit_bytes} bytes is below 16M (a Python process alone needs more); "
                "give e.g. 300M")  # fmt: skip
    return None


def cpu_quota_problem(cores: float) -> str | None:
    """Why a CPU quota (cores) cannot be (None: it can)."""
    if not cores >= MIN_CPU_QUOTA:  # NaN too
        return (f"{cores:g} cores is below 0.01 (the kernel's smallest quota, 1 ms per "
                "100 ms); give e.g. 0.5")  # fmt: skip
    if math.isinf(cores):
        return "inf cores: give a number of cores, e.g. 0.5, or leave the quota out"
    return None


# The CPU paths a mixed lab's worker hosts cycle through (--cpus mix): the kernels built for
# this CPU, for one a step older and for the portable x86-64 baseline, each with another
# OpenBLAS core type. Every host compiles its own (its cache starts empty); the results are
# the same bits (kernels/exact.c), which is what the mixed lab's tests hold it to. The steps
# depend on the CPU: a core type it lacks the instructions for dies of SIGILL at its first
# matrix product (SkylakeX on an AMD EPYC without AVX-512).
AVX512_PATHS = (("native", "", "SkylakeX"), ("avx2", "-mno-avx512f", "Haswell"),
                ("x86-64", "-march=x86-64", "Prescott"))  # fmt: skip
AVX2_PATHS = (("native", "", "Haswell"), ("avx", "-mno-avx2 -mno-fma -mno-f16c", "Sandybridge"),
              ("x86-64", "-march=x86-64", "Prescott"))  # fmt: skip
OLD_PATHS = (("native", "", "Prescott"), ("x86-64", "-march=x86-64", "Prescott"))


def cpu_paths(flags: frozenset[str] | None = None) -> tuple[tuple[str, str, str], ...]:
    """(name, CELLSWARM_CFLAGS, OPENBLAS_CORETYPE) of each path a CPU with `flags` (this
    machine's when None) can run, its own build first."""
    have = host_cpu_flags() if flags is None else flags
    if "avx512f" in have:
        return AVX512_PATHS
    return AVX2_PATHS if "avx2" in have else OLD_PATHS


def host_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (/proc/cpuinfo; none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def cpu_path(spec: LabSpec, worker_index: int,
             flags: frozenset[str] | None = None) -> tuple[str, str, str]:  # fmt: skip
    """(name, CELLSWARM_CFLAGS, OPENBLAS_CORETYPE) of worker host `worker_index` (0-based)."""
    paths = cpu_paths(flags)
    return paths[worker_index % len(paths)] if spec.cpus == "mix" else paths[0]


@dataclass(frozen=True)
class Topology:
    spec: LabSpec
    hosts: tuple[HostSpec, ...]
    switches: tuple[str, ...]  # core, agg0.., rack0..
    links: tuple[LinkSpec, ...]

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in this lab; hosts: {[h.name for h in self.hosts]}")

    def workers(self) -> list[HostSpec]:
        return [h for h in self.hosts if h.role == "worker"]

    def rack_hosts(self, rack: int) -> list[HostSpec]:
        return [h for h in self.workers() if h.rack == rack]

    def uplink(self, rack: int) -> LinkSpec:
        return next(lk for lk in self.links if lk.tier == "access" and lk.a == f"rack{rack}")

    def network_spec(self) -> Any:
        """The planner's NetworkSpec of this lab (what `plan` and `simulate` are given to
        predict it): its rack size, uplink rates and oversubscriptions; the bridges add
        no round trip worth counting (microseconds, against the shaper's queueing)."""
        from cellswarm.planner.profiles import NetworkSpec

        spec = self.spec
        access = [lk.rate_bits_per_s or 0.0 for lk in self.links if lk.tier == "access"]
        agg = [lk.rate_bits_per_s or 0.0 for lk in self.links if lk.tier == "aggregation"]
        return NetworkSpec(
            nodes_per_access_switch=-(-spec.hosts // spec.racks), access_uplinks=1,
            access_uplink_bits_per_s=min(access),
            access_oversubscription=spec.access_oversubscription,
            access_switches_per_aggregation=spec.racks_per_aggregation, aggregation_uplinks=1,
            aggregation_uplink_bits_per_s=min(agg),
            aggregation_oversubscription=spec.aggregation_oversubscription,
            core_bandwidth_bits_per_s=sum(agg), access_added_rtt_s=0.0,
            aggregation_added_rtt_s=0.0, core_added_rtt_s=0.0,
        )  # fmt: skip


def rack_of(index: int, hosts: int, racks: int) -> int:
    """Worker host `index` (0-based) goes to rack index * racks // hosts: racks as even as
    can be, consecutive hosts together (a pipeline's hops mostly stay inside a rack)."""
    return index * racks // hosts


def build(spec: LabSpec) -> Topology:
    infra = [f"c{k}" for k in range(spec.coordinators)] + (["db"] if spec.coordinators > 1 else [])
    hosts = [
        HostSpec(name, "database" if name == "db" else "coordinator", f"{SUBNET}.0.{k + 1}",
                 "core", memory_limit_bytes=spec.host_memory.get(name),
                 cpu_quota=spec.slow_hosts.get(name))
        for k, name in enumerate(infra)
    ]  # fmt: skip
    per_rack: dict[int, int] = {}
    for i in range(spec.hosts):
        rack = rack_of(i, spec.hosts, spec.racks)
        per_rack[rack] = per_rack.get(rack, 0) + 1
        name = f"h{i + 1}"
        default = max(spec.memory_bytes, DEFAULT_HOST_MEMORY_BYTES)
        limit = spec.host_memory.get(name, spec.host_memory_bytes or default)
        hosts.append(HostSpec(name, "worker", f"{SUBNET}.{rack + 1}.{per_rack[rack]}",
                              f"rack{rack}", rack, spec.memory_bytes, limit,
                              spec.slow_hosts.get(name, spec.cpu_quota)))  # fmt: skip
    n_agg = -(-spec.racks // spec.racks_per_aggregation)
    switches = ("core", *(f"agg{a}" for a in range(n_agg)),
                *(f"rack{r}" for r in range(spec.racks)))  # fmt: skip
    links = [LinkSpec(h.name, "eth0", h.switch, f"p-{h.name}",
                      None if h.rack is None else spec.host_bits_per_s, "host")
             for h in hosts]  # fmt: skip
    uplink = [per_rack.get(r, 0) * spec.host_bits_per_s / spec.access_oversubscription
              for r in range(spec.racks)]  # fmt: skip
    for r in range(spec.racks):
        agg = r // spec.racks_per_aggregation
        links.append(LinkSpec(f"rack{r}", "uplink", f"agg{agg}", f"p-rack{r}", uplink[r], "access"))
    for a in range(n_agg):  # as the planner: what its racks' uplinks bring, oversubscribed
        down = sum(uplink[a * spec.racks_per_aggregation:(a + 1) * spec.racks_per_aggregation])
        links.append(LinkSpec(f"agg{a}", "uplink", "core", f"p-agg{a}",
                              down / spec.aggregation_oversubscription, "aggregation"))  # fmt: skip
    return Topology(spec, tuple(hosts), switches, tuple(links))
