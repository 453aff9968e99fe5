"""The inner protocol's messages (swarm/protocol/messages.py): frozen typed values that
round-trip, refuse a field they do not have or a value of the wrong type in one line naming
it — in the unit and on a real coordinator's routes — and a package that imports nothing
from the swarm."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest

from cellswarm.errors import RequestError
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.protocol.messages import (
    Heartbeat,
    Message,
    NodeStats,
    StepHistogram,
    decode,
    encode,
)
from tests.members import join

PROTOCOL_DIR = Path(__file__).resolve().parents[1] / "cellswarm" / "swarm" / "protocol"


def beat() -> Heartbeat:
    return Heartbeat(node_id="n1", session="s" * 32, rss_bytes=1 << 20, data_port=9000,
                     stats=NodeStats(steps=3, busy_s=0.25, hop_s={"read": 1e-4},
                                     step_s=StepHistogram(le=[0.01], counts=[2, 1], sum_s=0.3)))


def test_a_beat_round_trips_and_leaves_its_defaults_at_home() -> None:
    sent = encode(beat())
    assert "refused" not in sent and "probe_ok" not in sent  # a beat stays small
    assert sent["stats"] == {"steps": 3, "busy_s": 0.25, "hop_s": {"read": 1e-4},
                             "step_s": {"le": [0.01], "counts": [2, 1], "sum_s": 0.3}}
    assert decode(Heartbeat, sent) == beat()


@pytest.mark.parametrize(("body", "named"), [
    ({"node_id": "n1", "session": "s", "bogus": 1}, "bogus"),
    ({"node_id": "n1", "session": "s", "rss_bytes": "lots"}, "rss_bytes"),
    ({"node_id": "n1", "session": "s", "stats": {"busy_s": "idle"}}, "stats.busy_s"),
    ({"node_id": "n1", "session": "s", "stats": {"step_s": {"le": [1]}}}, "step_s"),
    ({"session": "s"}, "node_id"),
    ([], "object"),
])  # fmt: skip
def test_a_wrong_field_is_refused_in_one_line_naming_it(body: object, named: str) -> None:
    with pytest.raises(RequestError) as exc:
        decode(Heartbeat, body)
    said = str(exc.value)
    assert named in said and "\n" not in said and said.startswith("a heartbeat: ")


def test_messages_are_frozen_and_no_message_is_a_dict() -> None:
    with pytest.raises(AttributeError):
        beat().rss_bytes = 0  # type: ignore[misc]
    for cls in Message.__subclasses__():
        assert cls.__struct_config__.frozen and cls.__struct_config__.forbid_unknown_fields
        assert not issubclass(cls, dict)


def test_the_protocol_package_imports_nothing_from_the_swarm() -> None:
    for path in PROTOCOL_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:  # (its own modules aside)
                outside = node.module.split(".")[:3] != ["cellswarm", "swarm", "protocol"]
                assert not (node.module.startswith("cellswarm.swarm") and outside), node.module
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("cellswarm.swarm") for a in node.names)


def test_a_coordinator_refuses_a_beat_it_cannot_read_and_goes_on(demo_path: Path,
                                                                 tmp_path: Path) -> None:
    """A member's beat with a field the protocol lacks, or a number as text: a 400 naming
    the field, never a 500, and its well-formed beat right after is answered."""
    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        session = join(swarm, "m1")
        base = {"node_id": "m1", "session": session}
        for extra, named in (({"bogus": 1}, "bogus"), ({"rss_bytes": "lots"}, "rss_bytes"),
                             ({"stats": {"steps": [1]}}, "stats.steps")):  # fmt: skip
            r = httpx.post(f"{swarm.url}/v1/heartbeat", json={**base, **extra}, timeout=30)
            assert (r.status_code, named in r.text) == (400, True), r.text
        r = httpx.post(f"{swarm.url}/v1/heartbeats", timeout=30,
                       json={**base, "beats": [{**base, "bogus": 1}, base]})  # fmt: skip
        answers = r.json()["answers"]
        assert "bogus" in answers[0]["error"] and "epoch" in answers[1]
        r = httpx.post(f"{swarm.url}/v1/heartbeat", json=base, timeout=30)
        assert r.status_code == 200 and "epoch" in r.json()



def test_an_answer_says_every_field_and_a_worker_reads_it_typed() -> None:
    """A heartbeat's answer carries every field, defaults too (what a node reads is always
    there); a held answer is one with `held` and nothing new."""
    from cellswarm.swarm.protocol.messages import HeartbeatAnswer

    sent = encode(HeartbeatAnswer(held=True, now_s=1.5, heartbeat_s=0.5))
    assert set(sent) == {f for f in HeartbeatAnswer.__struct_fields__}
    assert decode(HeartbeatAnswer, sent) == HeartbeatAnswer(held=True, now_s=1.5, heartbeat_s=0.5)
    assert decode(HeartbeatAnswer, {"epoch": 3}).shard is None
    with pytest.raises(RequestError, match="rogue"):
        decode(HeartbeatAnswer, {"rogue": 1})
