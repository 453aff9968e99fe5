"""The coordinators' shared state in the database: the epoch (bumped on every rewiring) and
who leads. On PostgreSQL one coordinator leads at a time for a term (`elect`, a pure rule
over the `leader` row); on SQLite the only one leads from its start."""

from __future__ import annotations

import json
import logging
import time
from typing import TypedDict

from cellswarm.swarm.control.db import text
from cellswarm.swarm.control.state import CoordinatorState

log = logging.getLogger("cellswarm.coordinator")


class Election(CoordinatorState):
    """The epoch and the leader's term (a part of Coordinator)."""


    @property
    def epoch(self) -> int:
        """The layout's epoch, read from the database: every coordinator answers the same."""
        return int(self.store.get_meta("epoch", "0"))

    @property
    def wired_epoch(self) -> int | None:
        """The epoch the leader last finished wiring (wired: it equals `epoch`)."""
        value = self.store.get_meta("wired_epoch")
        return int(value) if value else None

    @wired_epoch.setter
    def wired_epoch(self, epoch: int | None) -> None:
        self.store.set_meta("wired_epoch", "" if epoch is None else str(epoch))

    def lead(self) -> bool:
        """Whether this coordinator runs timeouts, placement, wiring and lease expiry now.
        On SQLite it is the only one. On PostgreSQL the `leader` row of `meta` names the
        leader and the end of its term (`elect`), renewed every tick; a coordinator takes it
        over once the term has run out. A new leader starts a new epoch (the old one may have
        died halfway through wiring), so the stages are reset and the heads replay."""
        db, now = self.store.db, time.time()
        if db.dialect == "sqlite":
            leading = True
        else:
            db.execute("INSERT INTO meta(key, value) VALUES ('leader', '{}') "
                       "ON CONFLICT DO NOTHING")  # fmt: skip
            with db.transaction():
                rows = db.execute("SELECT value FROM meta WHERE key='leader'" + db.skip_locked)
                if not rows:  # another coordinator is electing right now: keep our term
                    leading = self.leading and now < self.lead_until
                else:
                    held = json.loads(text(rows[0], "value")) or None
                    term = elect(held, self.id, now, self.config.leader_ttl_s)
                    if term != held:
                        self.store.set_meta("leader", json.dumps(term))
                    leading = term["id"] == self.id
                    self.lead_until = float(term["until"]) if leading else 0.0
        if leading != self.leading:
            self.leading = leading
            self.log.event("leader" if leading else "follower", None, coordinator=self.id)
            log.warning("coordinator %s %s", self.id, "leads" if leading else "follows")
            if leading:
                self.unwire("took the lead")
                # a coordinator restart is not the holders' fault either: they could not
                # renew while none answered
                self.queue.extend_leases()
        return leading

    def unwire(self, why: str) -> None:
        """The layout changed: a new epoch (so not wired); stage frames of the old one are void."""
        epoch = self.store.next_epoch()
        self.log.event("unwire", None, epoch=epoch, why=why)
        log.info("rewiring the rings (epoch %d): %s", epoch, why)


class Term(TypedDict):
    """The leader's term, as the `leader` row of `meta` holds it (JSON)."""

    id: str
    until: float


def elect(held: Term | None, me: str, now: float, ttl_s: float) -> Term:
    """The leader's term after `me` asks for it at `now`: renewed if `me` holds it, taken if
    nobody does or its term ran out, else unchanged. (Terms are wall-clock times: the
    coordinators' clocks must agree to well within `ttl_s`.)"""
    if not held or held.get("id") == me or float(held.get("until", 0.0)) <= now:
        return {"id": me, "until": now + ttl_s}
    return held
