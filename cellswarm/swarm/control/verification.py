"""Verification votes (`--verify N`): a job run on several replicas is done when a quorum
agrees; a replica that disagrees is struck, a job with no quorum says so."""

from __future__ import annotations

import logging

from cellswarm.swarm.control.jobs import inconsistent, same_result
from cellswarm.swarm.control.store import Node
from cellswarm.swarm.control.wiring import Wiring

log = logging.getLogger("cellswarm.coordinator")


class Verification(Wiring):
    """Quorum votes on replicated jobs (a part of Coordinator)."""

    def _record_votes(self, job_id: str) -> None:
        """After a verified job: nodes of runs that agreed with the result get an agreement,
        the others a disagreement; a node that keeps disagreeing is taken out."""
        job = self.queue.get(job_id)
        if job is None or len(job.runs) < 2 or job.result is None:
            return
        for run in job.runs:
            agreed = same_result(run["result"], job.result)
            for nid in run["nodes"]:
                n = self.store.node(nid)
                if n is None:
                    continue
                if agreed:
                    self.store.update_node(nid, agreements=n.agreements + 1)
                    continue
                self._disagreed(n, job_id, "outvoted {} times by other replicas: taken out")

    def _record_contradiction(self, job_id: str) -> None:
        """A verification run that contradicts an earlier run of the job on the same nodes:
        those nodes are not deterministic (a correct node gives the same bits every time), so
        each gets a disagreement now, before the job is decided — a liar caught only by a
        later majority could meanwhile spend the job's runs."""
        job = self.queue.get(job_id)
        for nid in inconsistent(job.runs) if job is not None else []:
            n = self.store.node(nid)
            if n is not None and n.state != "evicted":
                self._disagreed(n, job_id, "gave two results for one job {} times "
                                "(outvoted by itself: not deterministic): taken out")  # fmt: skip

    def _disagreed(self, n: Node, job_id: str, why: str) -> None:
        """One disagreement more for node `n`; taken out at the configured count (`why` is
        the message, the count in its braces)."""
        n = self.store.update_node(n.node_id, disagreements=n.disagreements + 1)
        self.log.event("disagreed", job_id, worker=n.node_id, disagreements=n.disagreements)
        if n.state != "evicted" and n.disagreements >= self.config.evict_after_disagreements:
            self.store.update_node(n.node_id, state="evicted", shard=None,
                                   message=why.format(n.disagreements))  # fmt: skip
            self.unwire(f"{n.node_id} keeps disagreeing")
