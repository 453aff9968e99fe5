"""Job queue throughput (swarm/control/jobs.py): how many jobs the coordinator's database
turns over.

    python -m bench.jobs [--jobs N] [--dir PATH]

* leases/s: lease + complete round trips (each one transaction or two, each committed to
  disk), by 1 and 2 leasers at once — threads, each with its own connection, as two
  coordinators sharing one database would be;
* submissions/s: one `submit` per job (a commit each), and `submit_batch` (one commit per
  batch of 100).

SQLite: a file (not tmpfs, unless --dir says so) in WAL mode with synchronous=FULL, as the
coordinator opens it. PostgreSQL: the same rows when CELLSWARM_PG_URL is set (the run leaves
its jobs done in that database's tables; use a scratch database).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cellswarm.swarm.control.db import Database, open_database
from cellswarm.swarm.control.jobs import JobQueue

BATCH = 100


def submissions(open_db: Callable[[], Database], jobs: int, batched: bool) -> float:
    db = open_db()
    q = JobQueue(db)
    t0 = time.perf_counter()
    if batched:
        for start in range(0, jobs, BATCH):
            items = [("generate", {"prompt": [i]}) for i in range(start, min(jobs, start + BATCH))]
            q.submit_batch("bench", items)
    else:
        for i in range(jobs):
            q.submit({"prompt": [i]})
    elapsed = time.perf_counter() - t0
    db.close()
    return jobs / elapsed


def leases(open_db: Callable[[], Database], jobs: int, leasers: int) -> float:
    """Lease + complete round trips per second, `leasers` threads with their own connections,
    until the `jobs` queued ones are done."""
    db = open_db()
    q = JobQueue(db)
    for start in range(0, jobs, BATCH):
        items = [("generate", {"prompt": [i]}) for i in range(start, min(jobs, start + BATCH))]
        q.submit_batch("bench", items)
    done = [0] * leasers
    errors: list[BaseException] = []
    go = threading.Barrier(leasers + 1)

    def leaser(k: int) -> None:
        own = open_db()
        lq = JobQueue(own)
        try:
            go.wait()
            while True:
                got = lq.lease(f"bench-{k}", str(k))
                if not got:
                    break
                job = got[0]
                outcome = lq.complete(job.job_id, job.fence, {"tokens": [1]}, replica=str(k))
                assert outcome == "done", outcome
                done[k] += 1
        except BaseException as e:
            errors.append(e)
        finally:
            own.close()

    threads = [threading.Thread(target=leaser, args=(k,)) for k in range(leasers)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    ledger = q.ledger()
    assert ledger["duplicates"] == 0 and ledger["done_without_commit"] == 0, ledger
    db.close()
    return sum(done) / elapsed


def run(name: str, fresh: Callable[[], Callable[[], Database]], jobs: int) -> list[str]:
    rows = []
    for leasers in (1, 2):
        rate = leases(fresh(), jobs, leasers)
        rows.append(f"{name:<10} {'lease+complete':<22} {leasers:>7} {rate:>10.0f}")
    rate = submissions(fresh(), jobs, batched=False)
    rows.append(f"{name:<10} {'submit':<22} {1:>7} {rate:>10.0f}")
    rate = submissions(fresh(), jobs, batched=True)
    rows.append(f"{name:<10} {f'submit_batch ({BATCH})':<22} {1:>7} {rate:>10.0f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1000, help="jobs per measurement")
    ap.add_argument("--dir", default=None, help="where the SQLite files go (default: a temp dir)")
    ap.add_argument("--swarm-jobs", type=int, default=48, help="jobs in the local-swarm batch")
    args = ap.parse_args()

    print(f"{'database':<10} {'measure':<22} {'leasers':>7} {'per s':>10}")
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        n = [0]

        def sqlite_fresh() -> Callable[[], Database]:
            n[0] += 1
            path = str(Path(root) / f"jobs{n[0]}.db")
            return lambda: open_database(path)

        for row in run("sqlite", sqlite_fresh, args.jobs):
            print(row, flush=True)

    url = os.environ.get("CELLSWARM_PG_URL")
    cluster = None
    if not url:  # a throwaway cluster of our own, as the tests start one
        from tests import pg_cluster

        reason = pg_cluster.why_not()
        if reason:
            print(f"postgres   skipped: {reason} (or set CELLSWARM_PG_URL)")
        else:
            cluster = pg_cluster.start()
            url = cluster.new_database()
    if url:
        try:
            open_database(url).close()
        except Exception as e:  # no driver, no db_postgres module yet, no server
            print(f"postgres   skipped: cannot open CELLSWARM_PG_URL ({type(e).__name__}: {e})")
        else:

            def pg_fresh() -> Callable[[], Database]:
                return lambda: open_database(url)

            for row in run("postgres", pg_fresh, args.jobs):
                print(row, flush=True)
    if cluster is not None:
        cluster.stop()

    for replicas in (1, 2):
        print(swarm_batch(replicas, args.swarm_jobs), flush=True)


def swarm_batch(replicas: int, jobs: int) -> str:
    """A batch through a local swarm (the demo model, one 400M worker per replica, each
    holding the whole model): generated tokens per second from submit to the last result,
    and the single-process engine's rate on the same prompts for scale."""
    import tempfile
    import time

    from cellswarm.demo import demo_model_path
    from cellswarm.swarm.api import client
    from cellswarm.swarm.local.up import LocalSwarm

    prompts = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3,"]
    items = [{"id": str(i), "prompt": prompts[i % 4], "max_tokens": 16} for i in range(jobs)]
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(
        str(demo_model_path()), replicas, "400M", Path(tmp), replicas=replicas, threads=1
    ) as swarm:
        swarm.wait_ready()
        t0 = time.perf_counter()
        batch = client.call(swarm.url, "/v1/batches", {"items": items})["batch_id"]
        while client.call(swarm.url, f"/v1/batches/{batch}")["finished"] < jobs:
            time.sleep(0.1)
        took = time.perf_counter() - t0
        rows = client.call(swarm.url, f"/v1/batches/{batch}/results")["results"]
    tokens = sum(len(r.get("tokens", [])) for r in rows)
    return (f"swarm      {replicas} replica(s) x 1 worker: {jobs} jobs, {tokens} tokens in "
            f"{took:.1f} s = {tokens / took:.1f} tokens/s")  # fmt: skip


if __name__ == "__main__":
    main()
