"""Faults charged where they belong, on a real swarm (coordinator and worker processes over
sockets): a job's own data fails that job, never a node; a query of death is quarantined; the
data plane reads nothing from a peer before its proof and blames a malformed frame on its
sender; `cellswarm up` outlives a dead worker and takes every child with it when told to stop.

Jobs whose data the HTTP edge may refuse (a seed of -1, a token id beyond int64) are put into
the coordinator's queue directly: what is tested is that a stage or a head that meets such
data — from an older coordinator, a batch, a bug at the edge — fails that job and nothing else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cellswarm.engine.sampling import SamplingParams
from cellswarm.errors import ProtocolError
from cellswarm.swarm.api import client
from cellswarm.swarm.auth import load_token
from cellswarm.swarm.control.db import open_database
from cellswarm.swarm.control.jobs import POISON_AFTER, JobQueue
from cellswarm.swarm.local.pipeline import free_port
from cellswarm.swarm.local.up import LocalSwarm
from cellswarm.swarm.ring.frames import MAGIC, PREFIX, Frame, connect_sync, read_frame_sync
from tests.test_jobs_swarm import (  # noqa: F401  (expected: a fixture)
    MAX_TOKENS,
    PROMPTS,
    check_ledger,
    check_outputs,
    drain,
    expected,
    items,
    submit,
)
from tests.waiting import wait_until

BAD_SEED = {"temperature": 0.5, "seed": -1}  # valid SamplingParams; numpy refuses the seed


def bad_seed(reason: str) -> bool:
    """The reason names the seed and its value (whichever check found it)."""
    return "seed" in reason and "-1" in reason


def insert_job(swarm: LocalSwarm, payload: dict[str, Any]) -> str:
    """A job straight into the coordinator's queue (SQLite in WAL mode: a second writer is
    fine), as an interactive request: ahead of batch work."""
    db = open_database(str(swarm.state_dir / "coordinator.db"))
    try:
        job, _ = JobQueue(db).submit({"max_tokens": 4, "stop_ids": [], **payload}, priority=1)
    finally:
        db.close()
    return str(job.job_id)


def node(swarm: LocalSwarm, node_id: str) -> dict[str, Any]:
    return next(n for n in swarm.status()["nodes"] if n["node_id"] == node_id)


def stage_nodes(swarm: LocalSwarm) -> list[dict[str, Any]]:
    """The assigned stage nodes in ring order."""
    nodes = [n for n in swarm.status()["nodes"] if n["state"] == "assigned"]
    return sorted(nodes, key=lambda n: int(n["stage"]))


def test_two_stages_in_one_process_fail_the_job_free_it_everywhere_and_blame_the_sender(
    demo_path: Path,
) -> None:
    """The ring's own path, in one event loop: the last stage's sampler refuses a seed, a
    `failed` frame goes round to stage 0, which tells its client (fault "job") and frees the
    sequence on every stage; no fault is reported. A frame with the wrong array is the
    sender's: the connection goes, and this stage reports nothing of its own."""
    import asyncio
    from dataclasses import replace

    import numpy as np

    from cellswarm.swarm.ring.frames import connect, write_frame
    from cellswarm.swarm.ring.stage import Stage, StageConfig, load_stage_model

    async def scenario() -> tuple[list[tuple[str, dict[str, Any]]], list[Any], list[Stage]]:
        configs = [StageConfig(str(demo_path), (0, 15), first=True, last=False),
                   StageConfig(str(demo_path), (15, 30), first=False, last=True)]  # fmt: skip
        stages = [Stage(c, load_stage_model(c)) for c in configs]
        faults: list[Any] = []
        servers = []
        for st in stages:
            st.on_fault = lambda *a: faults.append(a)
            servers.append(await asyncio.start_server(st.serve, "127.0.0.1", 0))
        ports = [srv.sockets[0].getsockname()[1] for srv in servers]
        for k, st in enumerate(stages):
            st.config = replace(st.config, next_port=ports[(k + 1) % 2])
        out: list[tuple[str, dict[str, Any]]] = []

        async def emit(f: Frame) -> None:
            out.append((f.type, f.fields))

        prompt = np.asarray([1, 2, 3], np.int64)
        for req, sampling in (("bad", BAD_SEED), ("good", {})):
            fields = {"req": req, "max_tokens": 3, "sampling": sampling}
            await stages[0].on_generate(Frame("generate", fields, prompt), emit)
        for _ in range(200):
            if ("done", {"req": "good", "reason": "max_tokens"}) in out:
                break
            await asyncio.sleep(0.02)
        reader, writer = await connect("127.0.0.1", ports[1])
        await write_frame(writer, Frame("hidden", {"seq": 9, "pos": 0, "ep": 0},
                                        np.zeros((1, 3), np.float32)))  # fmt: skip
        assert await reader.read(1) == b""  # hung up on
        for srv in servers:
            srv.close()
        return out, faults, stages

    out, faults, stages = asyncio.run(scenario())
    [error] = [f for t, f in out if t == "error"]
    assert error["req"] == "bad" and error["fault"] == "job" and bad_seed(error["message"])
    assert [f["token"] for t, f in out if t == "token"] == [79, 100, 43405]  # "good" ran
    assert faults == []
    for st in stages:
        assert st.caches == {} and st.samplers == {} and st.sequences == {}


def test_stage_0_tells_its_head_before_a_step_new_to_a_job_and_a_void_step_is_no_fault(
    demo_path: Path,
) -> None:
    """Stage 0 awaits on_frontier(req) once per sequence, before the first step its job never
    completed: a new request's prefill; a resumed one's first step past the tokens it replays
    (its prefill and replayed steps made those bits before: no crash there is the job's, and
    the coordinator strikes only jobs so exposed). A step of a sequence a reset let go of
    while it ran fails for that (its sampler is gone): not reported as this node's fault."""
    import asyncio

    import numpy as np

    from cellswarm.swarm.ring.stage import Stage, StageConfig, load_stage_model

    async def scenario() -> tuple[list[tuple[str, int, int]], list[Any], list[Any]]:
        config = StageConfig(str(demo_path), (0, 30), first=True, last=True)
        stage = Stage(config, load_stage_model(config))
        faults: list[Any] = []
        stage.on_fault = lambda *a: faults.append(a)
        seen: list[tuple[str, int, int]] = []  # request, its tokens, tokens sent so far
        out: list[tuple[str, dict[str, Any]]] = []

        async def frontier(req: str) -> None:
            [s] = [s for s in stage.sequences.values() if s.req == req]
            sent = [f for t, f in out if t == "token" and f["req"] == req]
            seen.append((req, len(s.tokens), len(sent)))

        async def emit(f: Frame) -> None:
            out.append((f.type, f.fields))

        stage.on_frontier = frontier
        for req, replay in (("new", []), ("resumed", [79, 100])):
            fields = {"req": req, "max_tokens": 3, "sampling": {}, "replay": replay}
            await stage.on_generate(Frame("generate", fields, np.asarray([1, 2, 3])), emit)
        for _ in range(200):
            if len([t for t, _ in out if t == "done"]) == 2:
                break
            await asyncio.sleep(0.02)
        await stage.step_failed(99, KeyError(99))  # seq 99: let go (or never held)
        return seen, out, faults

    seen, out, faults = asyncio.run(scenario())
    assert seen == [("new", 0, 0), ("resumed", 2, 0)]
    tokens = {r: [f["token"] for t, f in out if t == "token" and f["req"] == r]
              for r in ("new", "resumed")}  # fmt: skip
    assert tokens == {"new": [79, 100, 43405], "resumed": [43405]}
    assert faults == []


def test_a_local_pipeline_says_whose_fault_a_bad_seed_is(demo_path: Path) -> None:
    """Stage processes without a coordinator: the client gets the job's error, and no stage
    is restarted for it."""
    from cellswarm.errors import RequestError
    from cellswarm.planner.placement import even_split
    from cellswarm.swarm.local.pipeline import LocalPipeline

    bad = SamplingParams(temperature=0.5)
    object.__setattr__(bad, "seed", -1)  # past any check a client side may make
    with LocalPipeline(str(demo_path), even_split(30, 2)) as pipe:
        with pytest.raises(RequestError, match="seed"):
            pipe.generate([{"prompt": [1, 2, 3], "max_tokens": 3, "sampling": bad}])
        [r] = pipe.generate([{"prompt": [1, 2, 3], "max_tokens": 3}])
        assert len(r.tokens) == 3 and pipe.restarts == 0


def test_a_request_that_makes_the_last_stage_raise_fails_that_job_not_the_nodes(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]  # noqa: F811
) -> None:
    """Two stages and a spare: a seed of -1 makes the last stage's sampler raise. The job
    dies after 3 attempts with the reason; no node is charged, the epoch stays put, and the
    batch beside it finishes with the single-process engine's tokens."""
    with LocalSwarm(str(demo_path), 3, "160M", tmp_path, stages=2, rebalance=False) as swarm:
        epoch = swarm.wait_ready()["epoch"]
        batch = submit(swarm, items(6))
        poison = insert_job(swarm, {"prompt": [1, 2, 3], "sampling": BAD_SEED})
        dead = client.wait(swarm.url, poison, timeout_s=90)
        assert dead["state"] == "dead" and dead["attempts"] == 3, dead
        assert "failed 3 times" in dead["reason"] and bad_seed(dead["reason"]), dead
        check_outputs(drain(swarm, batch, timeout_s=120), expected)
        status = swarm.status()
        assert status["epoch"] == epoch  # never rewired
        for n in status["nodes"]:
            assert n["state"] in ("assigned", "spare") and n["failures"] == 0, n
        check_ledger(swarm, 7, dead=1)


def test_jobs_that_fail_inside_the_head_are_failed_at_once_not_leased_for_ever(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]  # noqa: F811
) -> None:
    """One stage (the head's own stage samples): eight jobs the head cannot run — a token id
    beyond int64, a seed the sampler refuses — fill its ring's eight slots ahead of a batch.
    Each fails 3 attempts and is dead-lettered with its reason; the batch then runs."""
    with LocalSwarm(str(demo_path), 1, "400M", tmp_path, max_sequences=8) as swarm:
        swarm.wait_ready()
        bad = [insert_job(swarm, {"prompt": [1, 2**70]}) for _ in range(4)]
        bad += [insert_job(swarm, {"prompt": [1, 2, 3], "sampling": BAD_SEED}) for _ in range(4)]
        batch = submit(swarm, items(6))
        check_outputs(drain(swarm, batch, timeout_s=120), expected)
        for i, rid in enumerate(bad):
            r = client.wait(swarm.url, rid, timeout_s=60)
            assert r["state"] == "dead" and r["attempts"] == 3, r
            assert "OverflowError" in r["reason"] if i < 4 else bad_seed(r["reason"]), r
        assert node(swarm, "worker-0")["failures"] == 0
        check_ledger(swarm, 14, dead=8)


def test_a_query_of_death_is_quarantined_after_poison_after_node_failures(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]  # noqa: F811
) -> None:
    """A request whose first step raises on whatever node runs it, as a plain error the node
    cannot tell from its own fault (a test hook: --fail-token). Each failure charges the node
    and strikes the job; at POISON_AFTER strikes in a row the job is quarantined (dead, with
    the reason) and the rewiring stops; the batch beside it finishes."""
    poison_token = 49_000  # in no prompt of the batch
    with LocalSwarm(str(demo_path), 3, "160M", tmp_path, stages=2, rebalance=False,
                    fail_token=poison_token) as swarm:  # fmt: skip
        epoch = swarm.wait_ready()["epoch"]
        batch = submit(swarm, items(6))
        rid = client.submit(swarm.url, {"prompt": [1, poison_token, 2], "max_tokens": 4})
        dead = client.wait(swarm.url, rid, timeout_s=120)
        assert dead["state"] == "dead", dead
        assert dead["reason"].startswith(f"quarantined as poison: present at {POISON_AFTER} "), dead
        assert "injected fault" in dead["reason"]
        check_outputs(drain(swarm, batch, timeout_s=120), expected)
        status = swarm.status()
        charged = [(n["node_id"], n["failures"], n["message"]) for n in status["nodes"]]
        assert sum(n[1] for n in charged) == POISON_AFTER, charged
        # The rewiring stops: a charged node may still rejoin as a spare (one more epoch, late
        # on a busy machine), so wait until the epoch holds still, then bound the total.
        settled = settle_epoch(swarm, quiet_s=2.0, timeout_s=60)
        assert settled - epoch <= 2 * POISON_AFTER + 2, (epoch, settled)
        check_ledger(swarm, 7, dead=1)


def settle_epoch(swarm: LocalSwarm, quiet_s: float, timeout_s: float) -> int:
    """The swarm's epoch once it has not moved for `quiet_s` (fails after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    epoch, since = swarm.status()["epoch"], time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"epoch still moving at {epoch}"
        time.sleep(0.2)
        now = swarm.status()["epoch"]
        if now != epoch:
            epoch, since = now, time.monotonic()
    return int(epoch)


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def flood(host: str, port: int, body_bytes: int, out: list[int]) -> socket.socket:
    """Connect without a proof and announce a frame of `body_bytes`, then send up to 60 MiB
    of it; how many bytes went out before the peer hung up goes to `out`."""
    sock = socket.create_connection((host, port), timeout=10)
    assert read_frame_sync(sock).type == "challenge"
    header = b"\x81\xa4type\xa5proof"  # msgpack {"type": "proof"}
    sock.sendall(PREFIX.pack(MAGIC, len(header), body_bytes, 0) + header)
    chunk, sent = b"\0" * (1 << 20), 0
    try:
        while sent < 60 << 20:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:  # reset / broken pipe: the listener hung up on us
        pass
    out.append(sent)
    return sock  # held open: a listener still reading would keep what it read so far


def test_the_data_port_reads_no_body_before_a_proof_nor_a_frame_from_a_mere_member(
    demo_path: Path, tmp_path: Path
) -> None:
    with LocalSwarm(str(demo_path), 2, "160M", tmp_path, stages=2, rebalance=False) as swarm:
        epoch = swarm.wait_ready()["epoch"]
        first, last = stage_nodes(swarm)
        host, port = last["address"].rsplit(":", 1)
        pid = swarm.procs[last["node_id"]].pid
        # 1. four strangers announce 64 MiB bodies: hung up on at the header, memory flat
        before = vm_rss(pid)
        sent: list[int] = []
        socks: list[socket.socket] = []
        threads = [threading.Thread(target=lambda: socks.append(flood(host, int(port),
                                                                      64 << 20, sent)))
                   for _ in range(4)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        grown = vm_rss(pid) - before
        for s in socks:
            s.close()
        assert len(sent) == 4 and max(sent) < 60 << 20, sent  # none could send it all
        assert grown < 16 << 20, f"the worker grew by {grown:,} bytes"
        # 2. the cluster token proved under the coordinator's name or the previous stage's
        # (every member holds it): refused at the handshake, so no frame of theirs is read
        # and nobody is charged (hostile/test_members.py tries every frame on every stage)
        token = load_token(swarm.token_file)
        for name in ("coordinator", first["node_id"]):
            with pytest.raises(ProtocolError, match="refused us"):
                connect_sync(host, int(port), token, name)
        assert node(swarm, first["node_id"])["failures"] == 0
        assert node(swarm, last["node_id"])["failures"] == 0
        assert swarm.status()["epoch"] == epoch
        swarm.wait_ready()
        done = client.wait(swarm.url, client.submit(swarm.url, {"prompt": PROMPTS[0],
                                                                "max_tokens": 4}))  # fmt: skip
        assert done["state"] == "done" and done["n_tokens"] >= 1


def closed(sock: socket.socket) -> bool:
    """Whether the far side closed it (what it sent before, a challenge or an error, read)."""
    sock.settimeout(0.05)
    try:
        while chunk := sock.recv(1 << 16):
            del chunk
        return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def test_idle_strangers_on_a_data_port_are_closed_and_cost_the_ring_nothing(
    demo_path: Path, tmp_path: Path, expected: dict[str, list[int]]  # noqa: F811
) -> None:
    """300 TCP connections to a stage's data port that never answer its challenge: at most
    MAX_UNPROVEN are held (the oldest closed for each newcomer), the rest once their proof is
    PROOF_TIMEOUT_S late; meanwhile the ring answers with one process's tokens, unrewired."""
    from cellswarm.swarm.ring.frames import MAX_UNPROVEN, PROOF_TIMEOUT_S

    with LocalSwarm(str(demo_path), 2, "160M", tmp_path, stages=2, rebalance=False) as swarm:
        epoch = swarm.wait_ready()["epoch"]
        _, last = stage_nodes(swarm)
        host, port = last["address"].rsplit(":", 1)
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(300)]
        # well before any proof is late: the cap, not the timeout, closed them
        wait_until(lambda: sum(not closed(s) for s in socks) <= MAX_UNPROVEN,
                   PROOF_TIMEOUT_S / 2)  # fmt: skip
        done = client.wait(swarm.url, client.submit(swarm.url, {"prompt": PROMPTS[0],
                                                                "max_tokens": MAX_TOKENS}))
        assert done["state"] == "done" and done["tokens"] == expected[PROMPTS[0]], done
        wait_until(lambda: all(closed(s) for s in socks), PROOF_TIMEOUT_S + 30)
        for s in socks:
            s.close()
        status = swarm.status()
        assert status["epoch"] == epoch and all(n["failures"] == 0 for n in status["nodes"])


def test_silent_strangers_on_the_coordinators_port_are_closed_and_cost_it_nothing(
    demo_path: Path, tmp_path: Path
) -> None:
    """600 TCP connections to the coordinator that send nothing and 300 that send half a
    request head (uvicorn held each for as long as the peer liked: at a 1,024 open-file
    limit that made it unreachable and lost every worker): while they hang on, it answers
    and loses no node; each is closed once its head is HEAD_TIMEOUT_S late, and its open
    files are back to what they were (api/guard.py)."""
    import resource

    from cellswarm.swarm.api.guard import HEAD_TIMEOUT_S

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    with LocalSwarm(str(demo_path), 1, "400M", tmp_path) as swarm:
        epoch = swarm.wait_ready()["epoch"]
        pid = swarm.procs["coordinator"].pid
        files_before = len(os.listdir(f"/proc/{pid}/fd"))
        host, port = swarm.url.removeprefix("http://").rsplit(":", 1)
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(900)]
        for s in socks[600:]:
            s.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 10")
        assert client.call(swarm.url, "/healthz")
        done = client.wait(swarm.url, client.submit(swarm.url, {"prompt": PROMPTS[0],
                                                                "max_tokens": 4}))  # fmt: skip
        assert done["state"] == "done"
        wait_until(lambda: all(closed(s) for s in socks), HEAD_TIMEOUT_S + 30)
        for s in socks:
            s.close()
        wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= files_before + 8, 10)
        status = swarm.status()
        assert status["epoch"] == epoch and all(n["state"] == "assigned"
                                                for n in status["nodes"])  # fmt: skip


def test_a_worker_without_a_token_listens_beyond_loopback_only_when_told() -> None:
    cmd = [sys.executable, "-m", "cellswarm.cli", "worker", "--join", "http://127.0.0.1:9",
           "--memory", "256M", "--listen", "0.0.0.0"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("cellswarm: error: no --token-file: the data port on 0.0.0.0")
    assert "--insecure" in line
    p = subprocess.Popen([*cmd, "--insecure"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
    first: list[str] = []
    reader = threading.Thread(target=lambda: first.append(p.stdout.readline() if p.stdout
                                                          else ""))  # fmt: skip
    reader.start()
    reader.join(120)
    p.kill()
    p.wait()
    assert first and first[0].startswith("warning: no --token-file (--insecure)"), first


# -- `cellswarm up` ---------------------------------------------------------------------------


def children(pid: int) -> dict[int, str]:
    """Direct children of `pid`: their command lines."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
    return {k: v.decode() for k, v in out.items()}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_cellswarm_up_outlives_a_dead_worker_and_sigterm_stops_every_child(
    demo_path: Path, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cellswarm.cli", "up", "--workers", "2", "--memory", "400M",
           "--model", str(demo_path), "--state-dir", str(tmp_path / "state"),
           "--port", str(port)]  # fmt: skip
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)  # fmt: skip
    lines: list[str] = []

    def pump() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line.rstrip())

    threading.Thread(target=pump, daemon=True).start()
    try:
        wait_until(lambda: any(x.startswith("coordinator: ") for x in lines) or up.poll(), 180)
        assert up.poll() is None, lines
        kids = children(up.pid)
        assert len(kids) == 3, kids  # the coordinator and two workers
        head = next(n for n in client.call(url, "/v1/status")["nodes"]
                    if n["state"] == "assigned")  # fmt: skip
        victim = next(p for p, c in kids.items() if f"--node-id {head['node_id']} " in c)
        os.kill(victim, signal.SIGKILL)
        rid = client.submit(url, {"prompt": PROMPTS[0], "max_tokens": 4})
        assert client.wait(url, rid, timeout_s=180)["state"] == "done"  # on the spare
        assert up.poll() is None, lines
        said = f"{head['node_id']} exited (killed by SIGKILL)"
        wait_until(lambda: any(said in x for x in lines), 10)
        os.kill(up.pid, signal.SIGTERM)
        assert up.wait(60) == 128 + signal.SIGTERM
        wait_until(lambda: not [p for p in kids if alive(p)], 10)  # reaped, not just killed
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for p in children(up.pid):
            os.kill(p, signal.SIGKILL)


def test_cellswarm_up_killed_by_sigkill_takes_its_children_with_it(
    demo_path: Path, tmp_path: Path
) -> None:
    """`kill -9` of `cellswarm up` (it cannot stop anyone then) used to leave the coordinator
    and every worker running and holding the port: each child watches its parent
    (lifecycle.py) and stops when it is gone, and the port is free again."""
    port = free_port()
    cmd = [sys.executable, "-m", "cellswarm.cli", "up", "--workers", "2", "--memory", "400M",
           "--model", str(demo_path), "--state-dir", str(tmp_path / "state"),
           "--port", str(port)]  # fmt: skip
    up = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)  # fmt: skip
    kids: dict[int, str] = {}
    try:
        wait_until(lambda: len(children(up.pid)) == 3 or up.poll() is not None, 120)
        kids = children(up.pid)
        client.wait_wired(f"http://127.0.0.1:{port}", 120)
        os.kill(up.pid, signal.SIGKILL)
        up.wait(10)
        wait_until(lambda: not [p for p in kids if alive(p)], 30)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server would
            s.bind(("127.0.0.1", port))  # free: nobody listens on it
            s.listen()
    finally:
        for p in kids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_cellswarm_up_on_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "cellswarm.cli", "up", "--workers", "1",
                              "--state-dir", str(tmp_path), "--port", str(port)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out
    [line] = out.stderr.strip().splitlines()
    assert f"port {port} on 127.0.0.1 is in use" in line and "--port" in line, line


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_cellswarm_up_stops_every_child_on_sigint_and_sighup_even_while_starting(
    demo_path: Path, tmp_path: Path, sig: int
) -> None:
    """The signal comes while the workers are still loading (before the swarm is ready)."""
    cmd = [sys.executable, "-m", "cellswarm.cli", "up", "--workers", "2", "--memory", "400M",
           "--model", str(demo_path), "--state-dir", str(tmp_path), "--port",
           str(free_port())]  # fmt: skip
    up = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: len(children(up.pid)) >= 2 or up.poll() is not None, 120)
        kids = children(up.pid)
        os.kill(up.pid, sig)
        assert up.wait(60) == 128 + sig
        assert up.stderr is not None
        assert f"{signal.Signals(sig).name}: the swarm is stopped" in up.stderr.read()
        wait_until(lambda: not [p for p in kids if alive(p)], 10)  # reaped, not just killed
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_an_answer_cut_short_is_a_connection_error_the_worker_retries() -> None:
    """A coordinator killed between its headers and its body leaves the worker a truncated
    answer. urllib raises http.client.IncompleteRead for it, which is not an OSError: the
    worker's loop once let it through and the worker died (a CI run after 20 coordinator
    kills found both workers gone). It must be a ConnectionError, retried like a refusal."""
    import urllib.request

    from cellswarm.swarm.node.net import fetch_answer

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer_half() -> None:
        conn, _ = server.accept()
        got = b""  # the whole request: a close with unread bytes is a reset, not a cut answer
        while not got.endswith(b"{}"):
            got += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"shard\": nu")  # fmt: skip
        conn.close()

    threading.Thread(target=answer_half, daemon=True).start()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/heartbeat", b"{}")
    with pytest.raises(ConnectionError, match="cut short"):
        fetch_answer(req, 5.0)
    server.close()
