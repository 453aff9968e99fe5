"""Batches on the default swarm (`cellswarm up --workers 3 --memory 128M`, issue 30): a ring
full of sequences makes work wait, it never spends a job's attempts — not on room, not on a
killed worker. Each batch mixes generations, `labels` and `completions` lines; every job
ends done, once (the ledger of tests/test_jobs_swarm.py)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

import cellswarm
from cellswarm.engine.model import GenerateOptions
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.test_jobs_swarm import check_ledger, drain, submit

MAX_TOKENS = 6


def mixed(n: int) -> list[dict[str, Any]]:
    """n lines: 40% generations, 30% three-way labels, 30% two completions."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        kind = i % 10
        if kind < 4:
            rows.append({"id": f"g{i}", "prompt": f"Item {i % 7} of the list is",
                         "max_tokens": MAX_TOKENS})  # fmt: skip
        elif kind < 7:
            rows.append({"id": f"l{i}", "prompt": f"Review {i % 5}: great value. Sentiment:",
                         "labels": [" positive", " negative", " neutral"]})  # fmt: skip
        else:
            rows.append({"id": f"c{i}", "prompt": f"The number {i % 9} is",
                         "completions": [" even", " odd"]})  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def generations(demo_path: Path) -> dict[str, list[int]]:
    model = cellswarm.load(demo_path)
    opts = GenerateOptions(MAX_TOKENS, stop_ids=model.tokenizer.stop_ids)
    return {p: model.generate(p, opts).token_ids
            for p in {r["prompt"] for r in mixed(10) + mixed(70) if "max_tokens" in r}}


def check(rows: list[dict[str, Any]], results: list[dict[str, Any]],
          generations: dict[str, list[int]]) -> None:  # fmt: skip
    assert [r["id"] for r in results] == [r["id"] for r in rows]
    bad = [r for r in results if r["state"] != "done"]
    assert bad == [], bad[:3]
    for row, res in zip(rows, results, strict=True):
        if "max_tokens" in row:
            assert res["tokens"] == generations[row["prompt"]], (row, res)
        elif "labels" in row:
            assert res["label"] in row["labels"]


def attempts_spent(swarm: LocalSwarm) -> int:
    """Failed attempts over every job in the queue (the coordinator's SQLite file)."""
    db = sqlite3.connect(swarm.state_dir / "coordinator.db")
    try:
        return int(db.execute("SELECT COALESCE(SUM(attempts), 0) FROM jobs").fetchone()[0])
    finally:
        db.close()


def test_a_mixed_batch_on_the_default_swarm_ends_all_done_twice(
    demo_path: Path, tmp_path: Path, generations: dict[str, list[int]]
) -> None:
    rows = mixed(50)
    with LocalSwarm(str(demo_path), 3, "128M", tmp_path) as swarm:
        swarm.wait_ready()
        for copy in range(2):
            batch = submit(swarm, rows)
            check(rows, drain(swarm, batch), generations)
            check_ledger(swarm, (copy + 1) * len(rows))
        assert attempts_spent(swarm) == 0  # none on room


def test_500_lines_with_a_worker_killed_mid_batch(
    demo_path: Path, tmp_path: Path, generations: dict[str, list[int]]
) -> None:
    """SIGKILL the head mid-batch and start it again (a supervisor's restart): its jobs go
    back to the queue at once, unharmed; the batch ends 500/500 done."""
    rows = [{**r, "id": f"{r['id']}-{i}"} for i, r in enumerate(mixed(10) * 50)]
    with LocalSwarm(str(demo_path), 3, "128M", tmp_path) as swarm:
        swarm.wait_ready()
        batch = submit(swarm, rows)
        while client.call(swarm.url, f"/v1/batches/{batch}")["finished"] < 100:
            time.sleep(0.2)
        head = next(n["node_id"] for n in swarm.status()["nodes"]
                    if n.get("stage") == 0)
        i = int(head.rsplit("-", 1)[1])
        swarm.kill(head)
        swarm.start_worker(i)
        results = drain(swarm, batch, timeout_s=600)
        assert [r["state"] for r in results].count("done") == 500
        for row, res in zip(rows, results, strict=True):
            if "max_tokens" in row:
                assert res["tokens"] == generations[row["prompt"]], (row, res)
        assert attempts_spent(swarm) == 0  # the loss spent none
        check_ledger(swarm, 500)
