"""A member is a stranger on the data plane (issue 56). Every worker holds the cluster token;
before, a data port took a proof of the token under any name, so a member could pose as the
coordinator (a `reset` that pointed a middle stage's next hop at its own listener: the next
client's prompt and rows went to it), as the last stage (`token` frames into another
client's answer) or as the previous stage (a forged first `hidden` step left blocks in a
middle stage's prefix cache). Now each link proves a key only its two ends hold: the
coordinator a key derived from the node's session, a stage the key the wiring dealt its link.
Here, a member with the token and a session of its own tries each of those frames on each
stage, under each name: every attempt is refused at the handshake, before a frame is read,
and the ring goes on as if nothing happened."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.soak import pose
from cellswarm.errors import RequestError
from cellswarm.swarm.api import client
from cellswarm.swarm.auth import digest, node_key
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.protocol.dataplane import First, Hidden, Prefix, Reset, Token
from cellswarm.swarm.ring.frames import (
    HANDSHAKE_PAYLOAD_BYTES,
    Frame,
    connect,
    encode,
    read_frame_sync,
)
from tests.members import join

PROMPT = "The capital of France is"


def stages(swarm: LocalSwarm) -> list[dict[str, Any]]:
    nodes = [n for n in swarm.status()["nodes"] if n["stage"] is not None]
    return sorted(nodes, key=lambda n: n["stage"])


def answer(swarm: LocalSwarm) -> list[int]:
    rid = client.submit(swarm.url, {"prompt": PROMPT, "max_tokens": 6})
    done = client.wait(swarm.url, rid, timeout_s=120)
    assert done["state"] == "done", done
    return list(done["tokens"])


def test_a_member_holding_the_token_can_neither_read_nor_change_a_ring(
    demo_path: Path, tmp_path: Path
) -> None:
    with LocalSwarm(str(demo_path), 3, "200M", tmp_path, stages=3, rebalance=False) as swarm:
        swarm.wait_ready()
        before = answer(swarm)
        epoch = swarm.status()["epoch"]
        token = swarm.token_file.read_bytes().strip()
        member = "member-x"  # a node of the swarm's own, with a session: not in the ring
        own = node_key(token, digest(join(swarm, member)))
        ring = stages(swarm)
        ids = [n["node_id"] for n in ring]
        rows = np.ones((64, 576), np.float32)
        frames = {  # what each pose would send, as the hostile re-probe sent it
            "coordinator": Frame.of(
                Reset(epoch=epoch, next_host="127.0.0.1", next_port=9, peers=[member])
            ),
            "token": Frame.of(Token(seq=1, token=42, ep=epoch, at=0)),
            "hidden": Frame.of(Hidden(seq=1, pos=0, ep=epoch, first=First(
                capacity=64, req="forged", prompt=list(range(64)))), rows),
            "prefix": Frame.of(Prefix(seq=1, ep=epoch), rows),
        }
        said: dict[str, str] = {}
        for k, node in enumerate(ring):
            host, port = node["address"].rsplit(":", 1)
            prev = ids[k - 1]
            poses = [("coordinator", "coordinator"), (prev, "token"), (prev, "hidden"),
                     (prev, "prefix"), (member, "hidden"), ("client", "hidden")]  # fmt: skip
            for name, kind in poses:
                for key, whose in ((token, "token"), (own, "own key")):
                    said[f"{node['node_id']} as {name} with {whose}: {kind}"] = pose(
                        host, int(port), key, name, frames[kind])
            # and the new protocol's dialer, which waits for the listener's proof: refused
            try:
                asyncio.run(connect(host, int(port), token, "coordinator"))
                said[f"{node['node_id']}: connect as coordinator"] = "admitted"
            except Exception as exc:  # what it says is the point
                said[f"{node['node_id']}: connect as coordinator"] = str(exc)
        admitted = {k: v for k, v in said.items() if v != "denied" and "refused us" not in v}
        assert not admitted, admitted
        # nor take a ring node's id over by joining under it (its work was dropped, and the
        # member could be placed where it stood): the id is bound to that node's home
        for node_id in ids:
            with pytest.raises(RequestError, match="another --node-id"):
                join(swarm, node_id)
        status = swarm.status()
        assert status["epoch"] == epoch, status  # no rewiring, nobody charged
        assert all(n["failures"] == 0 for n in stages(swarm)), stages(swarm)
        assert answer(swarm) == before  # the prefix caches hold no forged block


def test_no_cluster_token_is_tracked_and_up_replaces_the_one_that_was(tmp_path: Path) -> None:
    """The repository tracked `cellswarm-state/cluster.token`, `up`'s default state folder:
    every clone that ran `up` from its root trusted anyone who had read the repository."""
    import subprocess

    from cellswarm.swarm.local.up import is_public_token

    root = Path(__file__).resolve().parents[2]
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if tracked.returncode:
        return  # not a git checkout (an sdist): nothing is tracked
    assert not [f for f in tracked.stdout.split() if f.endswith(".token")]
    ignored = subprocess.run(["git", "check-ignore", "-q", "cellswarm-state/cluster.token"],
                             cwd=root)  # fmt: skip
    assert ignored.returncode == 0  # `up`'s default state folder stays out of a commit
    old = tmp_path / "cluster.token"  # the public one, in an old clone's folder
    old.write_text("x" * 64)
    assert not is_public_token(old)
    public = subprocess.run(["git", "show", "f2ffb46:cellswarm-state/cluster.token"], cwd=root,
                            capture_output=True)  # fmt: skip
    if public.returncode == 0:  # (a shallow clone lacks the commit)
        old.write_bytes(public.stdout)
        assert is_public_token(old)


def test_a_swarm_without_a_token_keys_its_data_plane_all_the_same(
    demo_path: Path, tmp_path: Path
) -> None:
    """A loopback swarm started without a cluster token (hand-started processes may be): its
    data ports took any local process's frames unchallenged, and a stranger driving stage 0
    made the ring rewire (stage 0 blamed itself). Now each node's key comes from its session
    all the same (auth.NO_TOKEN): every pose of the first test, with the empty token or none,
    is refused at the handshake, and the ring goes on as if nothing happened."""
    with LocalSwarm(str(demo_path), 2, "200M", tmp_path, stages=2, rebalance=False,
                    no_token=True) as swarm:  # fmt: skip
        swarm.wait_ready()
        before = answer(swarm)
        epoch = swarm.status()["epoch"]
        ring = stages(swarm)
        rows = np.ones((8, 576), np.float32)
        frames = {
            "coordinator": Frame.of(Reset(epoch=epoch, next_host="127.0.0.1", next_port=9)),
            "hidden": Frame.of(Hidden(seq=1, pos=0, ep=epoch, first=First(
                capacity=8, req="forged", prompt=list(range(8)))), rows),
            "token": Frame.of(Token(seq=1, token=42, ep=epoch, at=0)),
        }
        said: dict[str, str] = {}
        for k, node in enumerate(ring):
            host, port = node["address"].rsplit(":", 1)
            prev = ring[k - 1]["node_id"]
            for name, kind in (("coordinator", "coordinator"), (prev, "hidden"), (prev, "token"),
                               ("client", "hidden")):  # fmt: skip
                said[f"{node['node_id']} as {name}: {kind}"] = pose(
                    host, int(port), b"", name, frames[kind])
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                # no handshake at all, as a token-less port once took: the frame unread
                first = read_frame_sync(sock, HANDSHAKE_PAYLOAD_BYTES).type
                sock.sendall(encode(frames["hidden"]))
                sock.settimeout(5)
                try:
                    rest = read_frame_sync(sock, HANDSHAKE_PAYLOAD_BYTES).type
                except (ConnectionResetError, OSError, ValueError):
                    rest = "denied"
                said[f"{node['node_id']} unproven"] = "denied" if (
                    first == "challenge" and rest == "denied") else f"{first}, {rest}"
        admitted = {k: v for k, v in said.items() if v != "denied"}
        assert not admitted, admitted
        assert swarm.status()["epoch"] == epoch
        assert all(n["failures"] == 0 for n in stages(swarm)), stages(swarm)
        assert answer(swarm) == before
