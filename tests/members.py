"""A node of a test's own in a running swarm: joined as a worker joins (auth.py)."""

from __future__ import annotations

from bench.soak import join_as
from cellswarm.swarm.local.up import LocalSwarm


def join(swarm: LocalSwarm, node_id: str, memory_bytes: int = 1 << 20) -> str:
    """A session for `node_id`, which proves the cluster token over a fresh nonce."""
    return join_as(swarm.url, swarm.token_file.read_bytes().strip(), node_id, swarm.tls_dir,
                   memory_bytes)
