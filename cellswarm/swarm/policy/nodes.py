"""A node's health as a pure function: `apply(health, event) -> (health, effects)`.

The coordinator (control/liveness.py, work.py) stores what this returns; the simulator
(sim/engine.py) keeps the same value per failed node, so a node the swarm keeps is a node
the simulator keeps. The rule is the one policy/__init__.py states: a failure that is the
node's own (a step it ran raised, a result outvoted) counts toward OFFLINE_AFTER in a row; a
node that is merely lost (silent, killed, its rack cut off) is not charged — it comes back
through its probe, as hardware that was rebooted does — and work it serves clears the count.
An offline node keeps beating and running its probe; passing it brings it back as a spare.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from cellswarm.swarm.policy import OFFLINE_AFTER


@dataclass(frozen=True)
class Health:
    failures: int = 0  # every failure and loss, for the operator
    consecutive_failures: int = 0  # its own failures since it last served or passed a probe
    offline: bool = False  # taken out: not placed again until it passes its probe

    def __post_init__(self) -> None:
        if min(self.failures, self.consecutive_failures) < 0:
            raise ValueError(f"a node's failure counts are never negative: {self}")


@dataclass(frozen=True)
class Charged:
    """A failure that is the node's own."""

    detail: str


@dataclass(frozen=True)
class Lost:
    """Silent past the timeout, killed, or unreachable: not its fault as far as anyone knows."""

    why: str


@dataclass(frozen=True)
class Served:
    """It completed work: it is healthy now."""


@dataclass(frozen=True)
class ProbePassed:
    """An offline node ran the probe and got the expected bits: back as a spare."""


Event = Charged | Lost | Served | ProbePassed


@dataclass(frozen=True)
class TakenOffline:
    message: str


Effect = TakenOffline


def apply(
    health: Health, event: Event, offline_after: int = OFFLINE_AFTER
) -> tuple[Health, tuple[Effect, ...]]:
    if isinstance(event, ProbePassed):
        return replace(health, consecutive_failures=0, offline=False), ()
    if health.offline:  # out until its probe passes
        return health, ()
    if isinstance(event, Served):
        return replace(health, consecutive_failures=0), ()
    if isinstance(event, Lost):
        return replace(health, failures=health.failures + 1), ()
    in_a_row = health.consecutive_failures + 1
    after = replace(health, failures=health.failures + 1, consecutive_failures=in_a_row)
    if in_a_row < offline_after:
        return after, ()
    message = f"offline after {in_a_row} failures in a row: {event.detail[:160]}"
    return replace(after, offline=True), (TakenOffline(message),)


# A gap between two of the coordinator's ticks (0.25 s apart) longer than this is time it was
# not listening: its event loop or its core thread was held (a big request, a slow fsync, the
# process stopped), and a beat sent then waited unread, through no fault of the node.
DEAF_AFTER_S = 1.0
DEAF_KEPT = 32  # the deaf spells remembered: enough to span any node's timeout


def deaf_spells(spells: Sequence[tuple[float, float]], last_tick_s: float,
                now_s: float) -> tuple[tuple[float, float], ...]:  # fmt: skip
    """The coordinator's deaf spells after a tick at now_s whose previous tick was at
    last_tick_s (0: none yet): the gap joins them when it is longer than DEAF_AFTER_S."""
    if last_tick_s and now_s - last_tick_s > DEAF_AFTER_S:
        spells = [*spells, (last_tick_s, now_s)]
    return tuple(spells[-DEAF_KEPT:])


def silence_s(last_seen_s: float, now_s: float, spells: Sequence[tuple[float, float]]) -> float:
    """How long a node has been silent as far as it could have been heard: the time since
    its last beat less every part of it the coordinator spent deaf. Why: a coordinator held
    for 5 s by one request had declared all its workers lost at its next tick, before it
    read the beats that had waited for it (issue 56)."""
    quiet = now_s - last_seen_s
    for a, b in spells:
        quiet -= max(0.0, min(b, now_s) - max(a, last_seen_s))
    return quiet
