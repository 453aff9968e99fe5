"""The job queue under a real local swarm, with processes killed, stopped and lying.

Each test ends with a ledger in the style of Jepsen's queue checker: every acknowledged
job is terminal exactly once (lost = 0), nothing unexpected is in the queue, and no job has
more than one committed result (duplicates = 0).
"""

from __future__ import annotations

import random
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cellswarm
from cellswarm.engine.model import GenerateOptions
from cellswarm.engine.scoring import log_likelihood
from cellswarm.errors import RequestError, SwarmError
from cellswarm.lab.topology import cpu_paths
from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm
from tests.waiting import wait_until

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3,",
           "Water boils at", "My favourite colour is"]  # fmt: skip
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def expected(demo_path: Path) -> dict[str, list[int]]:
    """Greedy tokens of the single-process engine for each prompt (with the text path's
    stop tokens, as the coordinator sets them for text prompts)."""
    model = cellswarm.load(demo_path)
    opts = GenerateOptions(MAX_TOKENS, stop_ids=model.tokenizer.stop_ids)
    return {p: model.generate(p, opts).token_ids for p in PROMPTS}


def items(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"id": f"j{i}", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS,
             **extra} for i in range(n)]  # fmt: skip


def submit(swarm: LocalSwarm, rows: list[dict[str, Any]], **kw: Any) -> str:
    answer = client.call(swarm.url, "/v1/batches", {"items": rows, **kw})
    assert answer["total"] == len(rows)
    return str(answer["batch_id"])


def drain(swarm: LocalSwarm, batch: str, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """The batch's results once it finished; only an unreachable coordinator (one being
    restarted) is waited through: an error it answers with fails the test as it is."""
    deadline = time.monotonic() + timeout_s
    info: dict[str, Any] | str = "no answer from the coordinator"
    while time.monotonic() < deadline:
        try:
            info = client.call(swarm.url, f"/v1/batches/{batch}", timeout_s=5)
            if info["finished"] == info["total"]:
                return list(client.call(swarm.url, f"/v1/batches/{batch}/results")["results"])
        except SwarmError:  # unreachable: a coordinator being restarted
            pass
        time.sleep(0.3)
    raise AssertionError(f"batch {batch} did not finish within {timeout_s:.0f} s: {info}")


def check_ledger(swarm: LocalSwarm, submitted: int, dead: int = 0) -> dict[str, int]:
    ledger = client.call(swarm.url, "/v1/ledger")
    terminal = ledger["done"] + ledger["dead"] + ledger["cancelled"]
    assert terminal == submitted, ledger  # lost = 0 and unexpected = 0
    assert ledger["queued"] == ledger["leased"] == 0
    assert ledger["duplicates"] == 0 and ledger["done_without_commit"] == 0, ledger
    assert ledger["dead"] == dead, ledger
    return dict(ledger)


def check_outputs(rows: list[dict[str, Any]], expected: dict[str, list[int]]) -> None:
    for i, row in enumerate(rows):
        assert row["id"] == f"j{i}"  # input order
        assert row["state"] == "done", row
        assert row["tokens"] == expected[PROMPTS[i % len(PROMPTS)]], row


def test_batch_results_in_input_order_with_scoring(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    labels = [" Paris", " London", " Berlin"]
    rows = [*items(8), {"id": "classify", "prompt": PROMPTS[0], "labels": labels},
            {"id": "score", "prompt": PROMPTS[3], "completions": [" 4, 5", " 7, 9"]}]  # fmt: skip
    with LocalSwarm(str(demo_path), 1, "400M", tmp_path) as swarm:
        swarm.wait_ready()
        batch = submit(swarm, rows)
        results = drain(swarm, batch)
        check_outputs(results[:8], expected)
        assert results[8]["label"] == " Paris"
        # the log-likelihoods (the prompt once, then both completions after it, in one
        # sequence) equal to the bit each completion scored alone in one process
        model = cellswarm.load(demo_path)
        tok = model.tokenizer
        prompt = tok.encode(PROMPTS[3])
        for text, score in results[9]["scores"].items():
            ids = prompt + tok.encode(text, add_special=False)
            logits = model.logits(ids)[len(prompt) - 1 : len(ids) - 1].astype(np.float64)
            assert score == log_likelihood(logits, np.asarray(ids[len(prompt) :])), text
        assert results[9]["scores"][" 4, 5"] > results[9]["scores"][" 7, 9"]
        check_ledger(swarm, len(rows))
        # the same file again is the same batch; cancel and retry-failed answer
        again = client.call(swarm.url, "/v1/batches", {"items": rows, "idempotency_key": "k"})
        assert client.call(swarm.url, "/v1/batches", {"items": rows, "idempotency_key": "k"})[
            "batch_id"] == again["batch_id"]  # fmt: skip
        drain(swarm, again["batch_id"])
        check_ledger(swarm, 2 * len(rows))


def test_the_same_key_five_times_at_once_is_one_job(demo_path: Path, tmp_path: Path) -> None:
    with LocalSwarm(str(demo_path), 1, "400M", tmp_path) as swarm:
        swarm.wait_ready()
        ids: list[str] = []

        def go() -> None:
            ids.append(client.submit(swarm.url, {"prompt": PROMPTS[0], "max_tokens": 4,
                                                 "request_id": "same-key"}))  # fmt: skip

        threads = [threading.Thread(target=go) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(ids)) == 1
        assert client.wait(swarm.url, ids[0])["state"] == "done"
        check_ledger(swarm, 1)


def test_a_poison_job_gets_three_attempts_then_dead_letter(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    with LocalSwarm(str(demo_path), 1, "400M", tmp_path) as swarm:
        swarm.wait_ready()
        batch = submit(swarm, items(12))
        with pytest.raises(RequestError, match="vocabulary"):  # the edge refuses it now ...
            client.submit(swarm.url, {"prompt": [1, 2, 10**9], "max_tokens": 4})
        poison = poison_job(swarm)  # ... so it goes into the queue behind the edge's back
        results = drain(swarm, batch)
        check_outputs(results, expected)
        dead = client.wait(swarm.url, poison)
        assert dead["state"] == "dead" and dead["attempts"] == 3
        assert "failed 3 times" in dead["reason"] and "token ids outside" in dead["reason"]
        check_ledger(swarm, 13, dead=1)


def poison_job(swarm: LocalSwarm) -> str:
    """A job no worker can run (a token id past the vocabulary), written straight into the
    coordinator's queue: what a bug at the edge, or an older coordinator, could leave."""
    from cellswarm.swarm.control.db import SQLiteDatabase
    from cellswarm.swarm.control.jobs import JobQueue

    db = SQLiteDatabase(str(swarm.state_dir / "coordinator.db"))
    job, _ = JobQueue(db).submit({"prompt": [1, 2, 10**9], "max_tokens": 4, "sampling": {},
                                  "stop_ids": [], "text": False}, priority=1)  # fmt: skip
    db.close()
    return job.job_id


def test_a_stale_holder_s_late_result_is_refused(demo_path: Path, tmp_path: Path) -> None:
    """SIGSTOP the head holding a long job for twice the lease: the job goes to the other
    replica; after SIGCONT the stopped head's checkpoint/result is refused (fencing)."""
    with LocalSwarm(str(demo_path), 2, "400M", tmp_path, replicas=2, lease_s=1.5,
                    heartbeat_timeout_s=4.0, stop_after_s=20.0) as swarm:  # fmt: skip
        swarm.wait_ready()
        rid = client.submit(swarm.url, {"prompt": PROMPTS[1], "max_tokens": 120})
        wait_until(lambda: client.call(swarm.url, f"/v1/requests/{rid}")["n_tokens"] >= 5)
        holder = holder_of(swarm, rid)
        swarm.kill(holder, signal.SIGSTOP)
        time.sleep(3.0)  # twice the lease
        swarm.kill(holder, signal.SIGCONT)
        result = client.wait(swarm.url, rid)
        assert result["state"] == "done" and result["attempts"] == 2
        # resumed, not restarted: the second lease began from the checkpointed tokens
        leases = [e for e in coordinator_events(swarm, rid) if e["event"] == "leased"]
        assert leases[0]["resume"] == 0 and leases[1]["resume"] >= 5
        assert leases[1]["worker"] != holder
        wait_until(lambda: any(e["event"] == "stale" and e.get("worker") == holder
                               for e in coordinator_events(swarm, rid)))  # fmt: skip
        check_ledger(swarm, 1)


def test_a_member_that_does_not_hold_a_lease_cannot_touch_it(
    demo_path: Path, tmp_path: Path
) -> None:
    """A joined node (a real session: it holds the cluster token) that is not the job's
    lease holder tries every holder's route on a running job, at every fence it might guess:
    complete with forged tokens (alone, as a list, and with a checkpoint), fail, release,
    checkpoint (marked at its frontier); a malformed list of results is one line of error. Each
    is refused ('stale'); its fault reports (a forged step failure of the job, a part
    server, a sender, the next stage) strike nothing and unwire nothing: it runs no step of
    the ring. The job is untouched and finishes with one process's tokens on its first
    attempt."""
    from tests.members import join

    with LocalSwarm(str(demo_path), 1, "400M", tmp_path) as swarm:
        swarm.wait_ready()
        rid = client.submit(swarm.url, {"prompt": PROMPTS[0], "max_tokens": 60})
        wait_until(lambda: client.call(swarm.url, f"/v1/requests/{rid}")["n_tokens"] >= 2)
        me = {"node_id": "m1", "session": join(swarm, "m1")}
        for fence in (0, 1, 2, 3):
            run = {"job_id": rid, "fence": fence}
            done = client.call(swarm.url, "/v1/jobs/complete", {
                **me, **run, "result": {"tokens": [42, 42, 42], "reason": "max_tokens"}})
            assert done["outcome"] == "stale", (fence, done)
            several = client.call(swarm.url, "/v1/jobs/complete", {**me, "results": [
                {**run, "result": {"tokens": [42], "reason": "max_tokens"}}] * 2})
            assert several["outcomes"] == ["stale", "stale"], (fence, several)
            failed = client.call(swarm.url, "/v1/jobs/fail", {**me, **run, "reason": "forged"})
            assert failed["outcome"] == "stale", (fence, failed)
            assert client.call(swarm.url, "/v1/jobs/release", {
                **me, "runs": [run]})["released"] == 0
            assert client.call(swarm.url, "/v1/jobs/checkpoint", {
                **me, "runs": [{**run, "tokens": [42], "frontier": True}]})["stale"] == [rid]
            both = client.call(swarm.url, "/v1/jobs/checkpoint", {**me, "runs": [], "results": [
                {**run, "result": {"tokens": [42], "reason": "max_tokens"}}]})
            assert both == {"stale": [], "outcomes": ["stale"]}, (fence, both)
        for path in ("/v1/jobs/complete", "/v1/jobs/checkpoint"):
            with pytest.raises(RequestError, match="results: a list of at most"):
                client.call(swarm.url, path, {**me, "runs": [], "results": [{"job_id": rid}]})
        epoch = client.call(swarm.url, "/v1/status")["epoch"]
        for kind, detail in [("forward", "forged"), ("part", "worker-0"),
                             ("sender", "worker-0"), ("next", "")] * 3:  # fmt: skip
            client.call(swarm.url, "/v1/fault", {**me, "kind": kind, "detail": detail,
                                                 "epoch": epoch, "job": rid})  # fmt: skip
        status = client.call(swarm.url, "/v1/status")
        assert status["epoch"] == epoch, "a member outside the ring unwired it"
        assert next(n for n in status["nodes"] if n["node_id"] == "worker-0")["state"] == (
            "assigned")
        result = client.wait(swarm.url, rid)
        assert result["state"] == "done" and result["attempts"] == 1, result
        model = cellswarm.load(demo_path)
        assert result["tokens"] == model.generate(
            PROMPTS[0], GenerateOptions(60, stop_ids=model.tokenizer.stop_ids)).token_ids
        check_ledger(swarm, 1)


def test_worker_churn_200_jobs(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """A random worker SIGKILLed every few seconds and restarted, during a 200-job batch."""
    rng = random.Random(7)
    with LocalSwarm(str(demo_path), 4, "400M", tmp_path, replicas=2,
                    lease_s=3.0) as swarm:  # fmt: skip
        swarm.wait_ready()
        batch = submit(swarm, items(200))
        kills = 0
        while client.call(swarm.url, f"/v1/batches/{batch}")["finished"] < 200 and kills < 8:
            time.sleep(rng.uniform(1.0, 2.5))
            victim = rng.randrange(4)
            swarm.kill(f"worker-{victim}")
            swarm.start_worker(victim)
            kills += 1
        results = drain(swarm, batch)
        check_outputs(results, expected)
        check_ledger(swarm, 200)
        assert kills >= 3


def test_coordinator_killed_20_times_loses_nothing(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    rng = random.Random(3)
    with LocalSwarm(str(demo_path), 2, "400M", tmp_path, replicas=2, lease_s=3.0,
                    stop_after_s=30.0) as swarm:  # fmt: skip
        swarm.wait_ready()
        batch = submit(swarm, items(60))  # acknowledged: it must survive every crash
        for _ in range(20):
            time.sleep(rng.uniform(0.1, 0.6))
            swarm.kill("coordinator")
            swarm.start_coordinator()
        results = drain(swarm, batch)
        check_outputs(results, expected)
        check_ledger(swarm, 60)
        swarm.kill("coordinator")
        db = sqlite3.connect(swarm.state_dir / "coordinator.db")
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_lying_worker_is_outvoted_and_taken_out(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """worker-0 corrupts 20% of its outputs; with --verify 1.0 every job runs on two
    replicas, disagreements go to a third run, no wrong result is accepted, and the liar is
    taken out at its first outvote (honest nodes agree to the bit: the default) or at its
    first contradiction of itself — before that, with two replicas, a job whose honest run
    came first died of "no two agree" whenever the liar lied twice on it (seen in CI)."""
    with LocalSwarm(str(demo_path), 3, "400M", tmp_path, replicas=2, perturb={0: 0.2}) as swarm:
        swarm.wait_ready()
        batch = submit(swarm, items(40), verify_fraction=1.0)
        results = drain(swarm, batch)
        check_outputs(results, expected)  # 0 wrong results accepted
        check_ledger(swarm, 40)
        liar = next(n for n in swarm.status()["nodes"] if n["node_id"] == "worker-0")
        # outvoted by the others, or by itself: a correct node gives one result per job
        assert liar["state"] == "evicted" and "outvoted" in liar["message"], liar
        assert liar["disagreements"] >= 1


def test_a_worker_with_one_flipped_weight_bit_is_caught_and_its_jobs_rerun(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """worker-0 has one bit of one weight flipped (--flip-bit): its text is mostly the same,
    its logits' bits are not. --verify 1.0 compares those bits (every correct node computes
    the same on any CPU), so its first outvote takes it out and its jobs are rerun: every
    result accepted is the correct one. Three replicas: a disagreement between two is
    decided by a third (its own second run would agree with itself: not counted)."""
    with LocalSwarm(str(demo_path), 3, "400M", tmp_path, replicas=3,
                    flip_bit=frozenset({0})) as swarm:  # fmt: skip
        swarm.wait_ready()
        batch = submit(swarm, items(12), verify_fraction=1.0)
        results = drain(swarm, batch)
        check_outputs(results, expected)
        check_ledger(swarm, 12)
        nodes = {n["node_id"]: n for n in swarm.status()["nodes"]}
        bad = nodes.pop("worker-0")
        # taken out at its first outvote; runs it finished before that are each marked as
        # they are decided, so its count may be above 1. No honest node is ever marked.
        assert bad["state"] == "evicted" and bad["disagreements"] >= 1, bad
        assert [n["disagreements"] for n in nodes.values()] == [0] * len(nodes), nodes


def test_sixty_jobs_verified_across_three_kernel_builds_never_disagree(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """Three replicas on three CPU paths — the native kernels, a step older (-mno-avx512f,
    or -mno-avx2 on a CPU without AVX-512), the portable build (-march=x86-64) — each
    compiled cold in its own cache, with another BLAS core type each: 60 jobs, every one run
    on two of them (--verify 1.0), give 0 disagreements and the one-process tokens (issue 32:
    the same bits on every CPU)."""
    paths = cpu_paths()  # those this CPU can run (SkylakeX's BLAS needs AVX-512)
    env = {i: {"CELLSWARM_CFLAGS": flags, "OPENBLAS_CORETYPE": core,
               "CELLSWARM_CACHE": str(tmp_path / f"cache-{i}")}
           for i, (_, flags, core) in enumerate(paths)}  # fmt: skip
    with LocalSwarm(str(demo_path), 3, "400M", tmp_path, replicas=3, worker_env=env) as swarm:
        swarm.wait_ready()
        batch = submit(swarm, items(60), verify_fraction=1.0)
        results = drain(swarm, batch, timeout_s=600)
        check_outputs(results, expected)
        check_ledger(swarm, 60)
        nodes = swarm.status()["nodes"]
        assert [n["disagreements"] for n in nodes] == [0, 0, 0], nodes
        assert sum(n["agreements"] for n in nodes) >= 120, nodes  # two runs a job, at least
        for i in range(3):  # each compiled its own kernels: nothing shared
            assert list((tmp_path / f"cache-{i}" / "kernels").glob("kernels-*.so")), i


def holder_of(swarm: LocalSwarm, rid: str) -> str:
    leased = [e for e in coordinator_events(swarm, rid) if e["event"] == "leased"]
    return str(leased[-1]["worker"])


def coordinator_events(swarm: LocalSwarm, rid: str) -> list[dict[str, Any]]:
    from cellswarm.swarm.logs import timeline

    return [e for e in timeline(swarm.log_dir, rid) if e["node"] == "coordinator"]


