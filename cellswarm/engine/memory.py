"""Memory accounting: what a model, or any shard of it, holds and needs.

The planner and the workers use these numbers to decide what fits, so they are computed from
the tensors really held (their packed byte sizes), not from parameter counts.
"""

from __future__ import annotations

import resource
import sys
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cellswarm.io.names import tensor_kind
from cellswarm.io.weights import WeightStore

if TYPE_CHECKING:
    from cellswarm.engine.model import Model


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a model (or shard) holds and needs; every field is in bytes."""

    weights_by_kind: Mapping[str, int]
    kv_bytes_per_token: int
    scratch_bytes: int
    context: int
    batch: int

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights_by_kind.values())

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.context * self.batch

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.scratch_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "weights_by_kind": dict(sorted(self.weights_by_kind.items())),
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes": self.kv_bytes,
            "scratch_bytes": self.scratch_bytes,
            "context": self.context,
            "batch": self.batch,
            "total_bytes": self.total_bytes,
        }


def weights_by_kind(weights: WeightStore) -> dict[str, int]:
    """Packed bytes held, grouped by tensor kind (attention, ffn, experts, embedding, ...)."""
    out: dict[str, int] = defaultdict(int)
    for name, tensor in weights.items():
        out[tensor_kind(name)] += int(tensor.nbytes)
    return dict(out)


def memory_report(model: Model, batch: int, context: int) -> MemoryReport:
    return MemoryReport(
        weights_by_kind=weights_by_kind(model.weights),
        kv_bytes_per_token=model.kv_bytes_per_token(),
        scratch_bytes=model.arch.scratch_bytes(batch, context),
        context=context,
        batch=batch,
    )


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process in bytes (Linux; empty
    elsewhere): the one reader of /proc/self/status."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def rss_bytes() -> int:
    """This process's resident set size now (0 where /proc is missing)."""
    return proc_status().get("VmRSS", 0)


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    On Linux, VmHWM from /proc/self/status: ru_maxrss survives fork + exec, so a worker
    started by a big parent would report the parent's peak as its own.
    """
    peak_hwm = proc_status().get("VmHWM")
    if peak_hwm is not None:
        return peak_hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(peak if sys.platform == "darwin" else peak * 1024)



def cgroup_memory() -> dict[str, int]:
    """This process's memory cgroup: its limit and how many processes the kernel killed in it
    for memory (v1 memory.oom_control / v2 memory.events; {} when unreadable)."""
    from pathlib import Path

    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    found: tuple[Path, str, str] | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1: the memory hierarchy's own line
            found = (Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes",
                     "memory.oom_control")  # fmt: skip
            break
        if controllers == "" and found is None:  # v2: the unified line
            found = (Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max", "memory.events")
    if found is None:
        return {}
    folder, limit_file, events_file = found
    try:
        limit = (folder / limit_file).read_text().strip()
        events = dict(x.split(" ", 1) for x in (folder / events_file).read_text().splitlines()
                      if " " in x)  # fmt: skip
    except OSError:
        return {}
    out = {"oom_kills": int(events.get("oom_kill", "0"))}
    if limit.isdigit() and int(limit) < 1 << 60:
        out["limit_bytes"] = int(limit)
    return out


def available_bytes() -> int | None:
    """MemAvailable: what the kernel could give without swapping (None where unreadable)."""
    from pathlib import Path

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
