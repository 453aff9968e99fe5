"""The swarm's failure policy, in one place: how often a job is tried, how long a lease lasts
and how retries back off, when a request is quarantined as poison, when a node is taken out.

The job queue (jobs.py), the coordinator's config and flags (coordinator.py, commands.py)
and the simulator (sim/params.py) all read these; nothing else writes the numbers. Pure: no
sqlite, no sockets, so the simulator imports it without the queue.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_ATTEMPTS = 3  # leases a job gets; the next failure dead-letters it with its reason

# A request whose attempts fail on the nodes running it, each failure looking like the
# node's own, is the likely cause after this many in a row without progress: it is
# quarantined (dead, with the reason) instead of taking node after node offline.
POISON_AFTER = 3

# A node failing this many steps in a row goes offline. Below POISON_AFTER (and
# MAX_ATTEMPTS) on purpose: a broken node is taken out while the requests it broke still
# have an attempt left.
OFFLINE_AFTER = 2

LEASE_S = 10.0  # a holder renews by checkpointing well within this, or the job goes elsewhere
BACKOFF_S = 0.5  # after a failed attempt: BACKOFF_S x 2^(attempt-1), capped
MAX_BACKOFF_S = 30.0

# Liveness: a node beats every max(HEARTBEAT_S, nodes / MAX_BEATS_PER_S) seconds and is lost
# after HEARTBEAT_TIMEOUT_S / HEARTBEAT_S such intervals of silence (coordinator.py).
HEARTBEAT_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0
MAX_BEATS_PER_S = 4000.0


@dataclass(frozen=True)
class Retry:
    """When a failed job may be leased again."""

    lease_s: float = LEASE_S
    backoff_s: float = BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after the `attempts`-th failed attempt."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** max(attempts - 1, 0)))

MIN_DISK_BYTES = 1 << 30  # the kernel cache, fetched shards and logs want room (doctor)
