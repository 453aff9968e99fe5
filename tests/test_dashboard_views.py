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
    c = t.chart(range_s=3.0, now_s=3.0)  # the last 3 s, 600 x 120: rates at 1, 2 and 3 s
    assert (c.latest, c.peak) == (0.0, 100.0)
    assert c.points.split() == ["200.0,60.0", "400.0,0.0", "600.0,120.0"]
    assert [label for _, label in c.y_ticks] == ["0 tok/s", "50 tok/s", "100 tok/s"]
    assert [label for _, label in c.x_ticks] == ["-0.05 min", "-0.0333 min", "-0.0167 min",
                                                 "now"]  # fmt: skip


def test_batches_and_the_queue_and_a_timeline() -> None:
    [b] = views.batch_rows([{"batch_id": "b1", "name": "n", "total": 4, "tokens": 30,
                             "created_s": 100.0, "last_s": 105.0,
                             "counts": {"queued": 1, "done": 2, "dead": 1}}], now_s=106.0)
    assert (b.finished, b.pct) == (3, 75.0) and "2 done" in b.detail
    assert b.segments == [("done", 50.0, 2), ("dead", 25.0, 1), ("queued", 25.0, 1)]
    assert (b.rate, b.eta) == ("0.50 items/s", "ETA 2 s")
    [idle] = views.batch_rows([{"batch_id": "b2", "name": "n", "total": 2, "tokens": 0,
                                "created_s": 100.0, "counts": {"queued": 2}}], now_s=160.0)
    assert idle.eta == "waiting: nothing has finished yet"
    assert ("retries", 3) in views.queue_rows({"queued": 2}, 3)
    rows = views.timeline_rows([{"ts": 10.0, "node": "c", "event": "submitted", "k": 1},
                                {"ts": 10.25, "node": "w", "event": "done", "node_ts": 1}])
    assert [(r.at_ms, r.event, r.fields) for r in rows] == [("0.0", "submitted", "k=1"),
                                                            ("250.0", "done", "")]
    assert [(r.left_pct, r.width_pct, r.lane) for r in rows] == [(0.0, 100.0, 0),
                                                                 (100.0, 0.4, 1)]  # fmt: skip


def test_rings_in_token_order_and_a_bottleneck_in_words() -> None:
    status = {"nodes": [node("b", "assigned", [15, 30], stage=1, replica=0),
                        node("a", "assigned", [0, 15], stage=0, replica=0),
                        node("c", "spare")]}  # fmt: skip
    [r] = views.rings(status)
    assert [(v.node_id, v.layers) for v in r.stages] == [("a", "0..14"), ("b", "15..29")]
    text = views.bottleneck_text({"node_id": "b", "stage": 1, "step_ms": 41.23,
                                  "times_median": 1.84})  # fmt: skip
    assert text == "stage 1 on b: 41.2 ms a step (1.8x the median)"
    rates = views.NodeRates()
    rates.sample({"nodes": [node("a", "assigned", [0, 15], decode_steps=10)]}, now_s=0.0)
    rates.sample({"nodes": [node("a", "assigned", [0, 15], decode_steps=40)]}, now_s=2.0)
    assert rates.rate == {"a": 15.0}


def test_a_node_id_never_becomes_markup() -> None:
    from cellswarm.swarm.api.dashboard import TEMPLATES

    status = {"epoch": 1, "wired": True, "problem": "", "bottlenecks": [],
              "nodes": [node("<script>alert(1)</script>", "spare")]}  # fmt: skip
    html = TEMPLATES.get_template("nodes.html").render(
        status={**status, "context": 64, "sequences": 2}, racks=views.racks(status), rings=[],
        bottlenecks=[])  # fmt: skip
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_a_shards_fetch_shows_while_it_runs() -> None:
    n = node("f", "assigned", [0, 15])
    n["stats"] = {"fetch_done_bytes": 3 << 20, "fetch_total_bytes": 12 << 20}
    v = views.node_view(n)
    assert (v.fetch_pct, v.fetch) == (25.0, "3.0 MiB of 12.0 MiB")
    n["stats"] = {"fetch_done_bytes": 12 << 20, "fetch_total_bytes": 12 << 20}
    assert views.node_view(n).fetch_pct is None  # done: no bar
