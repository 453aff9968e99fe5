"""A node of a test's own in a running swarm: joined as a worker joins (auth.py)."""

from __future__ import annotations

from cellswarm.swarm.api import client
from cellswarm.swarm.auth import prove
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.protocol import PROTOCOL


def join(swarm: LocalSwarm, node_id: str, memory_bytes: int = 1 << 20) -> str:
    """A session for `node_id`, which proves the cluster token over a fresh nonce."""
    token = swarm.token_file.read_bytes().strip()
    nonce = client.call(swarm.url, "/v1/challenge", {}, tls=swarm.tls_dir)["nonce"]
    return str(client.call(swarm.url, "/v1/join", {
        "node_id": node_id, "nonce": nonce, "proof": prove(token, nonce, node_id),
        "capabilities": {"memory_bytes": memory_bytes, "protocol": PROTOCOL}},
        tls=swarm.tls_dir)["session"])  # fmt: skip
