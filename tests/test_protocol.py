"""The inner protocol's messages (swarm/protocol/messages.py): frozen typed values that
round-trip, refuse a field they do not have or a value of the wrong type in one line naming
it — in the unit and on a real coordinator's routes — and a package that imports nothing
from the swarm."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec.inspect as mi
import pytest

from cellswarm.errors import RequestError
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.protocol.dataplane import DataMessage, Sampling
from cellswarm.swarm.protocol.messages import (
    Heartbeat,
    JobWork,
    LogEvent,
    Message,
    NodeStats,
    StepHistogram,
    decode,
    decode_leases,
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


def _untyped(t: mi.Type, path: str, seen: set[type]) -> Iterator[str]:
    """Where in a message's type an untyped value (Any, object) may sit."""
    if isinstance(t, mi.AnyType):
        yield path
    elif isinstance(t, mi.StructType) and t.cls not in seen:
        seen.add(t.cls)
        for f in t.fields:
            yield from _untyped(f.type, f"{path}.{f.name}", seen)
    elif isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        yield from _untyped(t.item_type, f"{path}[]", seen)
    elif isinstance(t, mi.DictType):
        yield from _untyped(t.value_type, f"{path}{{}}", seen)
    elif isinstance(t, mi.UnionType | mi.TupleType):
        for item in t.types if isinstance(t, mi.UnionType) else t.item_types:
            yield from _untyped(item, path, seen)


def test_no_message_holds_an_untyped_value_anywhere_in_it() -> None:
    """Not a `dict[str, object]`, not Any, in any field at any depth: every message between
    the swarm's processes, control plane and data plane."""
    def every(cls: type) -> Iterator[type]:
        for sub in cls.__subclasses__():
            yield sub
            yield from every(sub)

    kinds = [*every(Message), *every(DataMessage)]
    assert len(kinds) > 40
    assert [p for k in kinds for p in _untyped(mi.type_info(k), k.__name__, set())] == []


def test_a_lease_carries_only_the_work_and_a_bad_job_fails_alone() -> None:
    stored = {"prompt": [1, 2], "max_tokens": 4, "sampling": {"temperature": 0.5},
              "stop_ids": [2], "text": True, "id": "row-7", "extra": {"k": [1]}}  # fmt: skip
    work = JobWork.of(stored)  # the client's own fields stay with the queue
    assert work == JobWork(prompt=[1, 2], max_tokens=4, sampling=Sampling(temperature=0.5),
                           stop_ids=[2])  # fmt: skip
    with pytest.raises(RequestError, match="prompt"):
        JobWork.of({"prompt": "hello", "max_tokens": 4})
    good = {"job_id": "a", "kind": "generate", "fence": 1, "payload": encode(work)}
    bad = {"job_id": "b", "kind": "generate", "fence": 2, "payload": {"prompt": [1.5]}}
    answer, failed = decode_leases({"jobs": [bad, good], "ring_sequences": 4})
    assert [j.job_id for j in answer.jobs] == ["a"] and answer.ring_sequences == 4
    [(ref, why)] = failed
    assert (ref.job_id, ref.fence) == ("b", 2) and "payload.prompt" in why
    with pytest.raises(RequestError, match="job_id"):  # no job to fail: the answer is bad
        decode_leases({"jobs": [{"fence": 1}]})


def test_a_log_line_travels_typed_its_own_fields_nested() -> None:
    line = {"ts": 12.5, "node": "w1", "request_id": "r", "event": "step", "seq": 3,
            "ms": 1.25, "layers": [0, 1], "ok": True}  # fmt: skip
    event = LogEvent.of(line)
    assert (event.seq, event.ts, event.event, event.request_id) == (3, 12.5, "step", "r")
    assert event.fields == {"ms": 1.25, "layers": "[0,1]", "ok": True}  # a list as its JSON
    assert decode(LogEvent, encode(event)) == event
    with pytest.raises(RequestError, match="seq"):
        LogEvent.of({"ts": 1.0, "event": "step"})


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


def test_a_part_shard_and_an_assignment_carry_typed_holdings_and_addresses() -> None:
    """A part server's shard holds a PartHolding (no raw dict): it round-trips, keeps the
    layer keys in decimal as PartAddress does, and names the same content id however it was
    built; a stage's assignment names its part servers as PartAddresses."""
    from cellswarm.swarm.protocol.dataplane import PartAddress
    from cellswarm.swarm.protocol.messages import Assignment, PartHolding, Shard
    from cellswarm.swarm.ring.parts import PartSpec

    holding = PartSpec("experts-0", 0, experts={3: (1, 5), 10: (0,)}).holding()
    assert holding == PartHolding(experts={"3": [1, 5], "10": [0]})
    shard = Shard(slot=2, n=3, role="part", spec=holding)
    sent = encode(shard)
    assert sent["spec"] == {"experts": {"3": [1, 5], "10": [0]}}
    assert decode(Shard, sent) == shard
    again = Shard(slot=2, n=3, role="part", spec=PartHolding(experts={"10": [0], "3": [1, 5]}))
    assert again.content_id == shard.content_id
    assert Shard(slot=2, n=3, role="part", spec=PartHolding(vocab_rows=(0, 9))).content_id \
        != shard.content_id  # fmt: skip
    with pytest.raises(RequestError, match="spec"):
        decode(Shard, {**sent, "spec": {"experts": {"3": [1]}, "node_id": "x"}})
    part = holding.at("n7", "10.0.0.7", 9001)
    assert part == PartAddress(node_id="n7", host="10.0.0.7", port=9001,
                               experts={"3": [1, 5], "10": [0]})  # fmt: skip
    assert PartSpec.from_wire(part).experts == {3: (1, 5), 10: (0,)}
    given = Assignment(shard=shard, model="m", context=8, max_sequences=1, cache_type="f16",
                       parts=[part])
    assert decode(Assignment, encode(given)).parts == [part]


def test_a_check_result_carries_typed_host_facts_and_digest() -> None:
    """A doctor round's answer: its host's facts (every key sent, null where unreadable) and
    its forward step's digest as typed values, round-tripping through a beat."""
    import numpy as np

    from cellswarm.swarm.protocol.messages import CheckResult, ForwardDigest, HostFacts
    from cellswarm.swarm.ring import checks

    env = checks.environment([None])
    assert isinstance(env, HostFacts) and env.cellswarm and env.pid > 0
    digest = checks.forward_of(np.ones((1, 4), np.float32), 3)
    assert isinstance(digest, ForwardDigest) and digest.n == 4 and len(digest.proj) == 16
    result = CheckResult(round="r1", env=env, matmul=[1.0], forward=digest)
    sent = encode(result)
    assert set(sent["env"]) == set(HostFacts.__struct_fields__)  # every key, as before
    assert decode(Heartbeat, {"node_id": "n", "check": sent}).check == result
    assert checks.digest(np.ones((1, 4), np.float32), 3) == sent["forward"]


def test_a_layout_an_older_protocol_stored_is_placed_again() -> None:
    """PROTOCOL 2 kept a placeholder address beside a part server's experts: a coordinator
    upgraded over its database reads such a layout as none (and places the nodes again)
    rather than fail to start."""
    from cellswarm.swarm.control.membership import load_layout

    old = ('[{"slot": 0, "n": 2, "role": "stage", "stage": 0, "layers": [0, 30], '
           '"first": true, "last": true}, {"slot": 1, "n": 2, "role": "part", "spec": '
           '{"node_id": "experts-0", "port": 0, "host": "127.0.0.1", "experts": {"1": [0]}, '
           '"vocab_rows": null}}]')  # fmt: skip
    assert load_layout(old) == []
    assert len(load_layout(old.replace('"node_id": "experts-0", "port": 0, "host": '
                                       '"127.0.0.1", ', ""))) == 2  # fmt: skip
