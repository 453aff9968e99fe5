"""The dashboard's data (api/dashboard/views.py): pure functions, tested with tables."""

from __future__ import annotations

from typing import Any

import pytest

from cellswarm.swarm.api.dashboard import views


def node(node_id: str, state: str, layers: list[int] | None = None, rack: str | None = None,
         decode_steps: int = 0, **kw: Any) -> dict[str, Any]:  # fmt: skip
    stats = {"decode_steps": decode_steps, "decode_s": decode_steps * 0.01} if layers else None
    return {"node_id": node_id, "state": state, "layers": layers, "rack": rack,
            "holds": f"layers {layers[0]}..{layers[1] - 1}" if layers else "-",
            "memory_bytes": 200 << 20, "rss_bytes": 100 << 20, "address": "10.0.1.5:7000",
            "stats": stats, **kw}  # fmt: skip


def test_nodes_group_by_rack_else_by_host_in_state_order() -> None:
    status = {"nodes": [node("b", "spare", rack="r1"), node("a", "lost", [0, 4], rack="r1"),
                        node("c", "assigned", [0, 4], rack="r1", decode_steps=10),
                        node("d", "assigned", [4, 8])]}  # fmt: skip
    got = views.racks(status)
    assert [(r.name, [n.node_id for n in r.nodes]) for r in got] == [
        ("host 10.0.1.5", ["d"]), ("r1", ["c", "b", "a"])]
    c = got[1].nodes[0]
    assert (c.layers, c.memory_pct, c.step_ms) == ("0..3", 50.0, "10.0 ms")
    assert got[1].nodes[1].layers == "" and got[1].nodes[1].step_ms == "-"


@pytest.mark.parametrize(
    ("nodes", "tokens"),
    [
        ([], 0),
        ([node("a", "spare")], 0),
        ([node("a", "assigned", [0, 4], decode_steps=9), node("b", "assigned", [4, 8],
                                                              decode_steps=7)], 7),
        ([node("b", "assigned", [4, 8], decode_steps=7), node("d", "assigned", [4, 8],
                                                              decode_steps=5)], 12),  # 2 rings
    ],
)  # fmt: skip
def test_tokens_are_the_last_stages_decode_steps(nodes: list[dict[str, Any]], tokens: int) -> None:
    assert views.tokens_so_far({"nodes": nodes}) == tokens


def test_throughput_is_a_rate_and_a_restart_is_not_negative() -> None:
    t = views.Throughput(min_gap_s=0.5)
    for at, tokens in ((0.0, 0), (0.2, 5), (1.0, 50), (2.0, 150), (3.0, 10)):
        t.sample(tokens, at)
    assert t.rates() == [50.0, 100.0, 0.0]  # 0.2 s was too soon; the drop is a restart
    points, now, peak = t.sparkline(width=100, height=10)
    assert (now, peak) == (0.0, 100.0) and points.split() == ["0.0,5.0", "50.0,0.0", "100.0,10.0"]


def test_batches_and_the_queue_and_a_timeline() -> None:
    [b] = views.batch_rows([{"batch_id": "b1", "name": "n", "total": 4, "tokens": 30,
                             "counts": {"queued": 1, "done": 2, "dead": 1}}])  # fmt: skip
    assert (b.finished, b.pct) == (3, 75.0) and "2 done" in b.detail
    assert ("retries", 3) in views.queue_rows({"queued": 2}, 3)
    rows = views.timeline_rows([{"ts": 10.0, "node": "c", "event": "submitted", "k": 1},
                                {"ts": 10.25, "node": "w", "event": "done", "node_ts": 1}])
    assert [(r.at_ms, r.event, r.fields) for r in rows] == [("0.0", "submitted", "k=1"),
                                                            ("250.0", "done", "")]


def test_a_node_id_never_becomes_markup() -> None:
    from cellswarm.swarm.api.dashboard import TEMPLATES

    status = {"epoch": 1, "wired": True, "problem": "", "bottlenecks": [],
              "nodes": [node("<script>alert(1)</script>", "spare")]}  # fmt: skip
    html = TEMPLATES.get_template("nodes.html").render(status=status, racks=views.racks(status))
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
