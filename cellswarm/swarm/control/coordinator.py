"""The coordinator: membership, placement, the ring's wiring, and the job queue.

    worker --HTTP join/heartbeat/fault--> coordinator (database) --reset frames--> stages
    head (stage 0's worker) --HTTP lease/checkpoint/complete--> coordinator: jobs

Workers join with an HMAC proof of the cluster token, heartbeat their memory and readiness,
and learn their shard from the heartbeat's answer. The coordinator places shards with the
planner's inventory (`budget_split`), fills a lost node's stage with a spare or re-places,
and — once every stage of the layout is loaded — wires each ring with one `reset` frame per
stage (new epoch, next stage's address, who may connect). Requests and batch lines are jobs
(jobs.py) that replicas' heads pull, checkpoint and complete under fenced leases; after a
failure (or a coordinator restart) a job resumes from its checkpointed tokens. With several
coordinators on PostgreSQL one leader places and wires; every one answers every call.
"""

from __future__ import annotations

import logging

from cellswarm.swarm.control.election import elect
from cellswarm.swarm.control.liveness import oom_message
from cellswarm.swarm.control.state import PEER_ID, Beat
from cellswarm.swarm.control.views import Views, describe
from cellswarm.swarm.control.wiring import MONITOR_TICK_S, STUCK_STEP_S
from cellswarm.swarm.settings import CoordinatorConfig

__all__ = ["MONITOR_TICK_S", "PEER_ID", "STUCK_STEP_S", "Beat", "Coordinator",
           "CoordinatorConfig", "describe", "elect", "oom_message"]  # fmt: skip

log = logging.getLogger("cellswarm.coordinator")


class Coordinator(Views):
    """One coordinator: its state (state.py) and its jobs, each a class of the chain below
    it — election, joining, liveness, placing, wiring, work, verification, views."""

    def __init__(self, config: CoordinatorConfig) -> None:
        super().__init__(config)
        self.part_specs = self._part_specs()
        self.lead()  # taking the lead (at once on SQLite) rewires whatever was there
