"""A coordinator and worker processes over real HTTP and TCP, killed and stopped for real.

Every test compares the swarm's greedy tokens with the single-process engine's, and ends by
checking that every worker's peak RSS stayed within its budget.
"""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cellswarm.errors import RequestError
from cellswarm.swarm.api import client
from cellswarm.swarm.auth import prove
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.logs import timeline
from cellswarm.swarm.protocol import PROTOCOL
from cellswarm.units import parse_bytes
from tests.conftest import greedy_reference
from tests.test_swarm_parts import PROMPTS as PARTS_PROMPTS
from tests.test_swarm_parts import moe  # noqa: F401  (a fixture)
from tests.waiting import wait_until as wait_for

pytestmark = pytest.mark.slow  # swarms of processes

TEXTS = [
    "The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3,",
    "The best way to learn", "In 1969, astronauts", "Water boils at", "My favourite",
]  # fmt: skip
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(demo_path: Path) -> dict[tuple[int, ...], list[int]]:
    return greedy_reference(demo_path, TEXTS, MAX_TOKENS)


def submit_all(swarm: LocalSwarm, prompts: list[tuple[int, ...]], copies: int = 1) -> list[str]:
    """Job ids; each prompt's index is remembered in INDEX for check_results."""
    ids = []
    for k in range(copies):
        for i, p in enumerate(prompts):
            rid = client.submit(swarm.url, {"prompt": list(p), "max_tokens": MAX_TOKENS,
                                            "request_id": f"r{k}-{i}"})  # fmt: skip
            INDEX[rid] = i
            ids.append(rid)
    return ids


INDEX: dict[str, int] = {}


def check_results(
    swarm: LocalSwarm, ids: list[str], reference: dict[tuple[int, ...], list[int]]
) -> list[dict[str, Any]]:
    expected = list(reference.values())
    results = [client.wait(swarm.url, rid, timeout_s=180) for rid in ids]
    for rid, r in zip(ids, results, strict=True):
        i = INDEX[rid]
        assert r["state"] == "done", r
        assert r["tokens"] == expected[i], rid
        assert 1 <= r["attempts"] <= 3
    return results


def check_budgets(swarm: LocalSwarm) -> None:
    for n in swarm.status()["nodes"]:
        if n["peak_rss_bytes"]:
            assert n["peak_rss_bytes"] <= n["memory_bytes"], n


def tokens_so_far(swarm: LocalSwarm, ids: list[str]) -> int:
    return sum(client.call(swarm.url, f"/v1/requests/{rid}")["n_tokens"] for rid in ids)


def node(swarm: LocalSwarm, node_id: str) -> dict[str, Any]:
    return next(n for n in swarm.status()["nodes"] if n["node_id"] == node_id)


@pytest.mark.parametrize("workers", [1, 3])
def test_swarm_output_equals_the_single_process_engine(
    demo_path: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]], workers: int
) -> None:
    memory = "400M" if workers == 1 else "128M"  # 128M: the model must be split over three
    with LocalSwarm(str(demo_path), workers, memory, tmp_path) as swarm:
        status = swarm.wait_ready()
        assert sum(n["state"] == "assigned" for n in status["nodes"]) == workers
        ids = submit_all(swarm, list(reference))
        check_results(swarm, ids, reference)
        check_budgets(swarm)
        assert all(n["served"] == len(ids) for n in swarm.status()["nodes"])
        text = client.wait(swarm.url, client.submit(swarm.url, {"prompt": TEXTS[0],
                                                                "max_tokens": 3}))  # fmt: skip
        assert "Paris" in text["text"]
        # one request's timeline, merged across the coordinator's and every worker's log
        events = timeline(swarm.log_dir, ids[0])
        assert {e["node"] for e in events} == {"coordinator", *(f"worker-{i}"
                                                                for i in range(workers))}
        assert [e["event"] for e in events][:2] == ["submitted", "leased"]
        # the end: "completed" — but for the stages after the first, whose "decode" tallies
        # are logged as they let the request go, which may be after it
        assert [e["event"] for e in events if e["event"] != "decode"][-1] == "completed"


@pytest.mark.parametrize("spare", [True, False], ids=["spare", "re-placed"])
def test_a_worker_killed_mid_decode_of_20_requests_costs_a_replay(
    demo_path: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]], spare: bool
) -> None:
    prompts = list(reference)
    # 32 tokens of context x 20 sequences: two workers can still hold the model after a kill
    with LocalSwarm(str(demo_path), 4 if spare else 3, "160M", tmp_path, stages=3,
                    context=32, max_sequences=20) as swarm:  # fmt: skip
        swarm.wait_ready()
        ids = submit_all(swarm, prompts, copies=3)[:20]
        wait_for(lambda: tokens_so_far(swarm, ids) >= 30)
        swarm.kill("worker-1")  # the middle stage: noticed from the broken link
        check_results(swarm, ids, reference)
        status = swarm.status()
        assert node(swarm, "worker-1")["state"] == "lost"
        assert sum(n["state"] == "assigned" for n in status["nodes"]) == (3 if spare else 2)
        if spare:
            assert node(swarm, "worker-3")["state"] == "assigned"
        check_budgets(swarm)


def test_a_worker_that_always_fails_goes_offline_and_its_spare_finishes(
    demo_path: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    with LocalSwarm(str(demo_path), 4, "160M", tmp_path, stages=3, fail_forward=[1],
                    offline_after=2) as swarm:  # fmt: skip
        swarm.wait_ready()
        ids = submit_all(swarm, list(reference)[:4])
        check_results(swarm, ids, reference)
        bad = node(swarm, "worker-1")
        assert bad["state"] == "offline" and bad["failures"] == 2
        assert bad["layers"] is None and node(swarm, "worker-3")["state"] == "assigned"
        wait_for(lambda: "failed its probe" in node(swarm, "worker-1")["message"], 20)
        assert node(swarm, "worker-1")["state"] == "offline"  # the probe keeps it out


def test_workers_cut_off_from_the_coordinator_stop_and_rejoin(
    demo_path: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    with LocalSwarm(str(demo_path), 3, "128M", tmp_path, stop_after_s=2.0) as swarm:
        swarm.wait_ready()
        swarm.kill("coordinator", signal.SIGSTOP)
        wait_for(lambda: all(any(x.startswith("STOPPED") for x in swarm.output[f"worker-{i}"])
                             for i in range(3)), 20)  # fmt: skip
        swarm.kill("coordinator", signal.SIGCONT)
        wait_for(lambda: sum(x.startswith("JOINED") for x in swarm.output["worker-0"]) == 2, 20)
        swarm.wait_ready()
        ids = submit_all(swarm, list(reference)[:4])
        check_results(swarm, ids, reference)
        # a worker that stopped keeps its logs: the earlier events are still there
        events = [json.loads(line)["event"] for f in swarm.log_dir.glob("worker-*.jsonl")
                  for line in f.read_text().splitlines()]  # fmt: skip
        assert events.count("stop") >= 3 and "step" in events


def test_a_coordinator_killed_and_restarted_keeps_its_nodes_and_finishes(
    demo_path: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    with LocalSwarm(str(demo_path), 3, "128M", tmp_path, stop_after_s=8.0) as swarm:
        swarm.wait_ready()
        ids = submit_all(swarm, list(reference))
        wait_for(lambda: tokens_so_far(swarm, ids) >= 10)
        swarm.kill("coordinator")
        swarm.start_coordinator()  # same database, same port
        assert {n["node_id"] for n in swarm.status()["nodes"]} == {"worker-0", "worker-1",
                                                                   "worker-2"}  # fmt: skip
        check_results(swarm, ids, reference)
        assert all(sum(x.startswith("JOINED") for x in swarm.output[f"worker-{i}"]) == 1
                   for i in range(3))  # fmt: skip


def _post(url: str, data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(data).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_joining_needs_a_fresh_proof_of_the_cluster_token(demo_path: Path, tmp_path: Path) -> None:
    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        token = swarm.token_file.read_bytes().strip()
        caps = {"memory_bytes": parse_bytes("1G"), "protocol": PROTOCOL}

        def join(proof_of: Any, nonce: str | None = None) -> tuple[int, dict[str, Any], str]:
            nonce = nonce or _post(swarm.url + "/v1/challenge", {})[1]["nonce"]
            body = {"node_id": "intruder", "nonce": nonce, "proof": proof_of(nonce),
                    "capabilities": caps}  # fmt: skip
            code, answer = _post(swarm.url + "/v1/join", body)
            return code, answer, nonce

        assert join(lambda n: "")[0] == 401  # no token
        assert join(lambda n: prove(b"not-the-cluster-token", n, "intruder"))[0] == 401
        code, _, used = join(lambda n: prove(token, n, "intruder"))
        assert code == 200  # the right proof joins ...
        code, answer, _ = join(lambda n: prove(token, used, "intruder"), nonce=used)
        assert code == 401 and "nonce" in answer["error"]["message"]  # ... once
        assert _post(swarm.url + "/v1/heartbeat", {"node_id": "intruder", "session": "guess"})[
            0
        ] == 401
        intruder = node(swarm, "intruder")  # only the one good join is known, and idle
        assert intruder["served"] == 0 and intruder["failures"] == 0
        # (the coordinator may give it layers: it joined with the token and claims 1 GiB)
        # a node of another protocol version (or one too old to say it) is refused by name
        for theirs, says in ((PROTOCOL + 1, f"speaks protocol {PROTOCOL + 1}"),
                             (None, "no protocol version (an older cellswarm)")):  # fmt: skip
            caps = {"memory_bytes": parse_bytes("1G"), "protocol": theirs}
            code, answer, _ = join(lambda n: prove(token, n, "intruder"))
            message = answer["error"]["message"]
            assert code == 409 and says in message, message
            assert f"this coordinator speaks protocol {PROTOCOL}" in message
            assert "\n" not in message


def test_a_worker_of_another_protocol_says_so_and_stops(demo_path: Path, tmp_path: Path) -> None:
    """A worker that a coordinator refuses for its version stops at once, in one line
    naming both versions (retrying cannot help), exit 2."""
    import subprocess
    import sys

    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        code = ("import sys; import cellswarm.swarm.protocol as p; p.PROTOCOL = 99; "
                "from cellswarm.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-c", code, "worker", "--join", swarm.url, "--memory", "200M",
             "--token-file", str(swarm.token_file), "--node-id", "old"],
            capture_output=True, text=True, timeout=120)  # fmt: skip
        said = [line for line in (run.stdout + run.stderr).splitlines() if "protocol" in line]
        assert run.returncode == 2, run.stderr[-2000:]
        assert len(said) == 1 and "speaks protocol 99" in said[0], said
        assert f"this coordinator speaks protocol {PROTOCOL}" in said[0]


def test_bad_requests_get_a_clear_error(demo_path: Path, tmp_path: Path) -> None:
    with LocalSwarm(str(demo_path), 0, "120M", tmp_path) as swarm:
        cases = [({"prompt": []}, "prompt"), ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                 ({"prompt": "hi", "sampling": 3}, "sampling")]  # fmt: skip
        for bad, says in cases:
            with pytest.raises(RequestError, match=says):
                client.submit(swarm.url, bad)
        with pytest.raises(RequestError, match="no request"):
            client.call(swarm.url, "/v1/requests/nope")


def test_a_budget_too_small_for_any_shard_is_reported(demo_path: Path, tmp_path: Path) -> None:
    with LocalSwarm(str(demo_path), 2, "48M", tmp_path) as swarm:
        wait_for(lambda: "short" in swarm.status()["problem"], 30)
        problem = swarm.status()["problem"]
        assert "48.0 MiB" in problem or "50,331,648" in problem
        assert all(n["layers"] is None for n in swarm.status()["nodes"])


def test_workers_fetch_only_their_shard_once(
    demo_path: Path, tmp_path: Path, reference: dict[tuple[int, ...], list[int]]
) -> None:
    size = demo_path.stat().st_size
    with LocalSwarm(str(demo_path), 3, "128M", tmp_path, fetch=True) as swarm:
        swarm.wait_ready()
        fetched = [_fetched(swarm, i)[-1] for i in range(3)]
        # each a part of the file (the tied embedding serves both ends, so both fetch it)
        assert all(0 < b < 0.7 * size for b in fetched)
        # and its progress rode on its heartbeats (the dashboard's bar): all of it, now
        wait_for(lambda: all(
            (n.get("stats") or {}).get("fetch_total_bytes") == fetched[int(n["node_id"][-1])]
            == n["stats"].get("fetch_done_bytes") for n in swarm.status()["nodes"]), 20)
        check_results(swarm, submit_all(swarm, list(reference)[:4]), reference)
        swarm.kill("worker-1")
        swarm.start_worker(1)  # back before its heartbeat timeout: the same shard again
        swarm.wait_ready()
        assert node(swarm, "worker-1")["state"] == "assigned"
        assert _fetched(swarm, 1) == [0]  # the restarted worker read its cache: 0 bytes
        ids = submit_all(swarm, list(reference), copies=2)[len(reference):]  # ids r1-*
        check_results(swarm, ids, reference)


def _fetched(swarm: LocalSwarm, i: int) -> list[int]:
    """Bytes each FETCHED line of worker i reported."""
    lines = [x for x in swarm.output[f"worker-{i}"] if x.startswith("FETCHED")]
    return [int(x.split("(")[1].split()[0].replace(",", "")) for x in lines]


def test_moe_experts_and_vocabulary_on_their_own_nodes_survive_a_kill(
    moe: tuple[Path, list[list[int]]], tmp_path: Path  # noqa: F811  (the imported fixture)
) -> None:
    """2 stages (attention, routers, shared experts), 2 expert nodes, 1 vocab node; then an
    expert node is SIGKILLed mid-generation and the layout shrinks to the 4 nodes left."""
    folder, expected = moe
    with LocalSwarm(str(folder), 5, "400M", tmp_path, stages=2, expert_nodes=2,
                    vocab_nodes=1) as swarm:  # fmt: skip
        status = swarm.wait_ready()
        holds = sorted(n["holds"] for n in status["nodes"])
        assert sum("experts x" in h for h in holds) == 2 and sum("vocab" in h for h in holds) == 1

        submitted: dict[str, list[str]] = {}

        def run(tag: str, kill: str | None = None) -> list[list[int]]:
            ids = [client.submit(swarm.url, {"prompt": p, "max_tokens": 8,
                                             "request_id": f"{tag}-{i}"})
                   for i, p in enumerate(PARTS_PROMPTS)]  # fmt: skip
            submitted[tag] = ids
            if kill:  # at once: this tiny model finishes 8 tokens in milliseconds
                swarm.kill(kill)
            return [client.wait(swarm.url, rid, timeout_s=180)["tokens"] for rid in ids]

        assert run("a") == expected
        expert_node = next(n["node_id"] for n in status["nodes"] if "experts x" in n["holds"])
        assert run("b", kill=expert_node) == expected
        after = swarm.status()["nodes"]
        assert sum(n["state"] == "assigned" for n in after) == 4
        assert node(swarm, expert_node)["state"] == "lost"
        assert max(client.call(swarm.url, f"/v1/requests/{rid}")["attempts"]
                   for rid in submitted["b"]) == 2  # fmt: skip
        check_budgets(swarm)
