"""Prefix affinity (swarm/control/affinity.py): a replica takes first the jobs whose prompt
starts with a block it already holds, then unclaimed ones, then the rest — never idles."""

from __future__ import annotations

import functools
from pathlib import Path

from cellswarm.engine.prefix_cache import BLOCK_TOKENS
from cellswarm.swarm.control.affinity import (
    AFFINITY_TOKENS,
    ELSEWHERE,
    HERE,
    NOWHERE,
    PrefixHomes,
    prefix_key,
)
from cellswarm.swarm.control.db import SQLiteDatabase
from cellswarm.swarm.control.jobs import Job, JobQueue, QueueConfig

A = [7] * AFFINITY_TOKENS  # two instructions of one block each
B = [9] * AFFINITY_TOKENS


def test_the_key_is_the_prefix_cache_s_first_block() -> None:
    assert AFFINITY_TOKENS == BLOCK_TOKENS  # the control plane does not import the engine
    assert prefix_key({"prompt": A}) is None  # one whole block and nothing after: no reuse
    assert prefix_key({"prompt": [*A, 1]}) == prefix_key({"prompt": [*A, 2, 3]})
    assert prefix_key({"prompt": [*A, 1]}) != prefix_key({"prompt": [*B, 1]})
    assert prefix_key({"messages": "hi"}) is None


def test_ranks_here_nowhere_elsewhere_and_forgetting() -> None:
    homes = PrefixHomes(most=2)
    job = {"prompt": [*A, 1]}
    assert homes.rank(job, "0") == NOWHERE
    homes.note(job, "0")
    assert (homes.rank(job, "0"), homes.rank(job, "1")) == (HERE, ELSEWHERE)
    homes.forget("0")  # rewired: its cache is gone
    assert homes.rank(job, "1") == NOWHERE
    for first in (5, 6, 8):  # LRU of two prefixes
        homes.note({"prompt": [first] * 65}, "1")
    assert len(homes) == 2 and homes.rank({"prompt": [5] * 65}, "1") == NOWHERE


def test_two_replicas_split_two_instructions_between_them(tmp_path: Path) -> None:
    db = SQLiteDatabase(str(tmp_path / "q.db"))
    queue, homes = JobQueue(db, QueueConfig()), PrefixHomes()
    for i in range(8):  # interleaved: A, B, A, B, ...
        queue.submit({"prompt": [*(A if i % 2 == 0 else B), i]})

    def lease(replica: str, n: int) -> list[int]:
        jobs = queue.lease(f"head-{replica}", replica, n, exclusive=False,
                           rank=functools.partial(rank, replica))  # fmt: skip
        for job in jobs:
            homes.note(job.payload, replica)
        return [job.payload["prompt"][0] for job in jobs]

    def rank(replica: str, job: Job) -> int:
        return homes.rank(job.payload, replica)

    assert lease("0", 1) == [7]  # the oldest: replica 0 now holds A
    assert lease("1", 2) == [9, 9]  # B first: nobody holds it; A is held by replica 0
    assert lease("0", 2) == [7, 7]  # its own prefix before the older B
    assert lease("1", 3) == [9, 9, 7]  # and it never idles while work is queued
    db.close()


def test_priority_comes_before_affinity(tmp_path: Path) -> None:
    db = SQLiteDatabase(str(tmp_path / "q.db"))
    queue, homes = JobQueue(db, QueueConfig()), PrefixHomes()
    homes.note({"prompt": [*A, 0]}, "0")
    queue.submit({"prompt": [*A, 1]})
    queue.submit({"prompt": [*B, 2]}, priority=1)  # an interactive request
    [job] = queue.lease("head", "0", 1, rank=lambda j: homes.rank(j.payload, "0"))
    assert job.payload["prompt"][-1] == 2
    db.close()
