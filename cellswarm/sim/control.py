"""The coordinator as a resource: what membership and the job queue cost its CPU, so a
simulation shows whether the control plane, not only the network, limits the swarm.

The costs are measured on the real coordinator (this 2-core machine, SQLite):
- a heartbeat, in a rack's batch (`POST /v1/heartbeats`): `python -m bench.control_plane
  --nodes 100000 --rings 0`, 100,000 nodes beating every 25 s (4,000 beats/s), used 0.215 of
  a core, membership and liveness included: ~54 us a beat;
- a job's control traffic — lease and complete over HTTP, the events logged: the same bench
  with 4 rings' heads leasing did 477 jobs/s at 0.87 cores: ~1.4 ms of a core a job.

The real policy (swarm/control/coordinator.py): nodes beat every
max(heartbeat_s, nodes / max_beats_per_s) seconds and are lost after timeout_beats such
intervals of silence. So a bigger swarm sees failures later (the detection delay grows with
it) and the beats' load is capped by design; only a --max-beats beyond what the cores can
serve saturates the coordinator, and then every node is eventually declared lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cellswarm.errors import RequestError
from cellswarm.swarm import policy


@dataclass(frozen=True)
class ControlPlane:
    """One coordinator group's capacity (`cores` of CPU for the control plane) and policy."""

    beat_cpu_s: float = 54e-6  # coordinator CPU per heartbeat (bench/control_plane.py)
    job_cpu_s: float = 1.4e-3  # per job: lease, checkpoints, complete (the same bench)
    cores: float = 1.0
    heartbeat_s: float = policy.HEARTBEAT_S
    timeout_beats: float = policy.HEARTBEAT_TIMEOUT_S / policy.HEARTBEAT_S  # silent intervals
    max_beats_per_s: float = policy.MAX_BEATS_PER_S

    def __post_init__(self) -> None:
        for name in ("beat_cpu_s", "job_cpu_s", "cores", "heartbeat_s", "timeout_beats",
                     "max_beats_per_s"):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise RequestError(f"control plane {name} {value!r} must be a positive number")

    def interval_s(self, nodes: int) -> float:
        """How often each node beats in a swarm of `nodes`."""
        return max(self.heartbeat_s, nodes / self.max_beats_per_s)

    def detect_s(self, nodes: int) -> float:
        """Silence before a dead node is declared lost (and a spare is sent)."""
        return self.timeout_beats * self.interval_s(nodes)

    def beat_load(self, nodes: int) -> float:
        """The beats' share of the control plane's cores (>= 1: it cannot keep up)."""
        return nodes / self.interval_s(nodes) * self.beat_cpu_s / self.cores

    def saturated(self, nodes: int) -> bool:
        return self.beat_load(nodes) >= 1.0

    def job_s(self, nodes: int) -> float:
        """Coordinator time per job's control traffic, on what the beats leave of it
        (infinite when they leave nothing: no job is ever leased)."""
        spare = 1.0 - self.beat_load(nodes)
        return self.job_cpu_s / (spare * self.cores) if spare > 0 else math.inf

    def jobs_per_s(self, nodes: int) -> float:
        """The most jobs a second the coordinator can lease and complete."""
        return 1.0 / self.job_s(nodes)
