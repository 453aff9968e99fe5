"""What every node and the coordinator must agree on to talk: the protocol's version.

Every join carries it (`capabilities.protocol`); a node of another version is refused in one
line naming both (HTTP 409), and the worker stops with that line rather than retrying: a
version does not come right by waiting. Bump PROTOCOL when a message between processes
changes its shape or meaning. This package imports nothing from the swarm above it: its
modules are the messages themselves (messages.py between a node and the coordinator,
dataplane.py around the ring).
"""

from __future__ import annotations

from cellswarm.swarm.protocol.messages import Shard

# 2: a shard is a typed value (messages.Shard), the beat's answer carries an Assignment
# 3: a part server's shard holds a PartHolding (its experts or vocabulary rows, no longer a
#    placeholder address beside them): its `spec`, and so the shard id a node reports, differ
# 4: a lease carries a job's typed work (JobWork: the client's own fields stay with the
#    queue), a shipped log line is a LogEvent (its own fields nested under `fields`)
# 5: speculative decoding: a job's work and a `generate` frame say `speculative`, a
#    `hidden` frame carries the drafts its rows verify, a `token` frame the tokens a step
#    kept after its first (`more`), `done` the drafts verified and kept; a job's output too
# 6: a `hidden` frame's `token` without drafts is a round of its own (a guess sent behind
#    others, ring/rounds.py): run in order, not batched, and dropped at the last stage when
#    void; a 5 would batch it and so could run it out of order
# 7: a `token` frame says whose answer it is (`at`, `follows`): stage 0 drops one that does
#    not continue its text where it stands, rather than emit it (and counts it: `tokens_stray`)
# 8: an Assignment says the KV cache type (`cache_type`: f16 by default; a 7 kept f32, so its
#    stages would give other bits than an 8's)
# 9: a data-plane link proves its own key, not the cluster token, and the listener proves
#    it back (`welcome`): the coordinator a node's key, a stage the key the wiring dealt its
#    link; a `reset` carries the keys sealed, a stage admits only its wired previous stage
#    (and the coordinator), and each only the frames its role sends; a `token`'s `at` is
#    required
# 10: a node's capabilities say whether it was started with a draft model (`draft`): a
#    request for `speculative: "draft"` that no ring's first stage can run is refused at
#    submit; and its `binding` (auth.node_binding): a re-join under a node's id must bring it
PROTOCOL = 10


class VersionMismatch(Exception):
    """A node speaks another protocol version than this coordinator."""


def check_version(theirs: object, node_id: str) -> None:
    """VersionMismatch, in one line naming both versions, unless `theirs` is ours."""
    if type(theirs) is int and theirs == PROTOCOL:
        return
    said = ("no protocol version (an older cellswarm)" if theirs is None
            else f"protocol {str(theirs)[:20]}")  # fmt: skip
    raise VersionMismatch(f"node {node_id[:64]} speaks {said}; this coordinator speaks "
                          f"protocol {PROTOCOL}: run the same cellswarm version on both")


def shard_id(shard: Shard) -> str:
    """What identifies a shard's content: a worker reports it once loaded."""
    return shard.content_id
