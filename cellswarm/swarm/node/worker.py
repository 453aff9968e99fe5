"""A worker: joins a coordinator over outbound HTTP, holds the shard it is given, serves it.

    join (HMAC proof) -> heartbeat every H s -> answer: shard? probe? -> load, listen, serve

Two threads, each with its own asyncio loop. The heartbeat's (join, beats, over HTTP or
NATS) runs nothing else: no step, compile, fetch or disk write can delay a beat, so a node
busy with a long step — a 3,000-token prefill, a page-in from a slow disk — is seen busy,
never lost. The main loop serves the stage (its TCP server, its steps), leads its ring as
a head, and applies what the beats bring back (a shard, a probe, a doctor round); the log
shipper has a thread of its own. The kernels are compiled before the worker joins (a first
step that ran gcc for seconds looked dead to the coordinator). A worker that cannot reach its
coordinator for `stop_after_s` stops serving — a coordinator that is gone may already have
given its layers to another node — keeps its logs, and joins again when the coordinator
answers. Its peak RSS (VmHWM, Python included) goes out with every heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np

from cellswarm.engine.memory import cgroup_memory, peak_rss_bytes, rss_bytes
from cellswarm.engine.model import Model
from cellswarm.errors import BudgetError, CellswarmError, RequestError, SwarmError
from cellswarm.io.weights import Selection
from cellswarm.kernels import cache_dir as kernels_cache
from cellswarm.kernels import cache_dir as kernels_cache_dir
from cellswarm.swarm.auth import NO_TOKEN, digest, load_token, node_binding, node_key, prove
from cellswarm.swarm.node.awake import KeepAwake
from cellswarm.swarm.node.head import Head
from cellswarm.swarm.node.metrics import Power
from cellswarm.swarm.node.metrics import serve as serve_metrics
from cellswarm.swarm.node.net import (
    ClockOffset,
    Progress,
    fetch_answer,
    is_loopback,
    parse_address,
    route_source,
)
from cellswarm.swarm.protocol import PROTOCOL, shard_id
from cellswarm.swarm.protocol.jsonvalue import JsonObject
from cellswarm.swarm.protocol.messages import (
    Assignment,
    CheckAsk,
    CheckResult,
    Fault,
    Heartbeat,
    HeartbeatAnswer,
    LogBatch,
    LogEvent,
    NodeStats,
    PartHolding,
    decode,
    encode,
)
from cellswarm.swarm.ring.faults import Faults
from cellswarm.swarm.ring.frames import listen_tls
from cellswarm.swarm.ring.parts import PartConfig, PartServer, PartSpec, load_part_model
from cellswarm.swarm.ring.stage import (
    Stage,
    StageConfig,
    load_draft,
    load_stage_model,
    shard_need_bytes,
    stage_selection,
)
from cellswarm.swarm.settings import WorkerConfig
from cellswarm.swarm.tls import check_url, client_context, server_context, tls_failure
from cellswarm.swarm.transport.beats import NatsBeats
from cellswarm.swarm.transport.logship import LogShipper

log = logging.getLogger("cellswarm.worker")

HTTP_TIMEOUT_S = 2.0
MANIFEST_TIMEOUT_S = 600.0  # the fetch manifest's request (the coordinator hashes the model)
JOIN_REFUSALS = 3  # refused proofs in a row before a worker gives up (a wrong token stays wrong)
SAY_EVERY_S = 60.0  # a warning that retrying may mend, at most once in this long
# the beats' last word to the main loop (Worker.fatal says why); compared by identity
GIVE_UP = HeartbeatAnswer(held=True, problem="the beats gave up")


def measure_capabilities(config: WorkerConfig) -> JsonObject:
    """What the coordinator places by: the budget, and a quick measure of this host's memory
    bandwidth and compute (8 MiB, so the measurement itself stays far inside the budget)."""
    a = np.ones(2 << 20, np.float32)
    t0 = time.perf_counter()
    for _ in range(8):
        a.sum()
    bandwidth = 8 * a.nbytes / (time.perf_counter() - t0)
    m = np.ones((256, 256), np.float32)
    t0 = time.perf_counter()
    for _ in range(8):
        m @ m
    flops = 8 * 2 * 256**3 / (time.perf_counter() - t0)
    caps: JsonObject = {
        "memory_bytes": config.memory_bytes, "profile": config.profile,
        "bandwidth_bytes_per_s": int(bandwidth), "flops": int(flops), "rack": config.rack,
        "protocol": PROTOCOL,  # the coordinator refuses another version (swarm/protocol)
        "draft": bool(config.draft),  # speculative "draft" asks for a first stage with one
        # this id's binding to this home: another process with the token cannot take it over
        "binding": node_binding(kernels_cache() / "nodes", config.node_id),
    }  # fmt: skip
    cgroup = cgroup_memory()  # a supervisor restarted us after the kernel's OOM killer?
    if cgroup:
        caps["oom_kills"] = cgroup["oom_kills"]
        caps["cgroup_limit_bytes"] = cgroup.get("limit_bytes")
    if config.profile:
        from cellswarm.planner.profiles import get_profile

        caps["link_bytes_per_s"] = int(get_profile(config.profile).link_bytes_per_s)
    return caps


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.token = load_token(config.token_file) if config.token_file else None
        self.urls = [u.strip().rstrip("/") for u in config.join.split(",") if u.strip()]
        self.current = 0  # the coordinator answering us; the others take over if it stops
        self.session: str | None = None
        self.heartbeat_s = 0.5
        self.lease_s = 10.0
        self.stage: Stage | None = None
        self.part: PartServer | None = None
        self.head: Head | None = None  # when this worker holds a replica's stage 0
        self.wired = False  # the coordinator says the whole layout is wired ...
        self.coordinator_epoch = -1  # ... in this epoch
        self.ready: str | None = None  # the shard_id of what it serves
        self.server: asyncio.Server | None = None
        self.shard_key: tuple[str, str, int, int] | None = None  # shard_id, model, context, seqs
        self.data_port: int | None = None
        self.refused = ""
        self.fetched: tuple[int, int] | None = None  # a shard's fetch: (bytes done, of total)
        self.probe: tuple[bool, str] | None = None
        self.check: CheckResult | None = None  # a doctor round's answer, for the next beat
        self.echo_s: float | None = None  # the last heartbeat's round trip
        self.caps: JsonObject = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loading: asyncio.Task[None] | None = None  # the shard being loaded, if any
        if not self.urls:
            raise RequestError("--join names no coordinator: give its URL, e.g. "
                               "http://10.0.0.5:8000")  # fmt: skip
        for url in self.urls:
            check_url(url, config.tls_dir)
        self.bind = parse_address(config.listen or route_source(self.urls[0]), "--listen")
        if self.token is None and not is_loopback(self.bind.host) and not config.insecure:
            raise RequestError(
                f"no --token-file: the data port on {self.bind.host} would let anyone who can "
                "reach it drive this node's stage (and bypass the job queue); give "
                "--token-file (the cluster's token), --listen 127.0.0.1, or --insecure"
            )
        self.advertised = parse_address(config.advertise, "--advertise") if config.advertise \
            else None  # fmt: skip
        self.clock = ClockOffset()  # the coordinator's clock minus ours
        self.tls = client_context(config.tls_dir) if config.tls_dir else None  # we dial
        self.tls_server = server_context(config.tls_dir) if config.tls_dir else None  # we serve
        self.tls_failure = ""  # the last TLS error said, so it is said once
        self.shipper = LogShipper(self._ship_logs)  # its events, to the coordinator's table
        self.power = Power()  # the energy estimate (its watts come with the join's answer)
        self.metrics_port: int | None = None  # GET /metrics (node/metrics.py), once started
        self.awake = KeepAwake() if config.keep_awake else None  # while steps arrive
        self._beat_now = threading.Event()
        self._said: tuple[str, float] = ("", 0.0)  # the last warning _say_once said, and when
        self.fatal = ""  # why the beats gave up (GIVE_UP)
        self._problem = ""  # why the coordinator cannot place the model, as last told
        self.nats: NatsBeats | None = None
        if config.control:  # heartbeats through NATS (transport/beats.py)
            self.nats = NatsBeats(config.control, config.node_id, self.token, config.tls_dir)

    # -- talking to the coordinator --------------------------------------------------------

    @property
    def url(self) -> str:
        return self.urls[self.current]

    def _post(self, path: str, data: Mapping[str, object]) -> dict[str, object]:
        """POST to the current coordinator; one that does not answer is skipped for the
        next in the list (coordinators sharing a database accept each other's sessions)."""
        failure: OSError | None = None
        for k in range(len(self.urls)):
            i = (self.current + k) % len(self.urls)
            req = urllib.request.Request(self.urls[i] + path, json.dumps(data).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            try:
                wait_s = data.get("wait_s", 0.0)  # a long poll
                timeout_s = HTTP_TIMEOUT_S + (float(wait_s) if isinstance(wait_s, int | float)
                                              else 0.0)  # fmt: skip
                out: dict[str, object] = json.loads(fetch_answer(req, timeout_s, self.tls))
            except urllib.error.HTTPError:
                raise  # it answered: its answer stands
            except OSError as exc:
                failure = exc
                continue
            if i != self.current:
                log.warning("coordinator %s does not answer; now %s", self.url, self.urls[i])
                self.current = i
            return out
        assert failure is not None
        raise failure

    def _join(self) -> None:
        nonce = str(self._post("/v1/challenge", {})["nonce"])
        proof = prove(self.token, nonce, self.config.node_id) if self.token else ""
        answer = self._post("/v1/join", {"node_id": self.config.node_id, "nonce": nonce,
                                         "proof": proof, "capabilities": self.caps})  # fmt: skip
        self.session = str(answer["session"])
        self.trust()
        heartbeat_s = answer.get("heartbeat_s", self.heartbeat_s)
        if not isinstance(heartbeat_s, int | float):
            raise ValueError(f"the join's answer: heartbeat_s {str(heartbeat_s)[:20]}")
        self.heartbeat_s = float(heartbeat_s)
        power = answer.get("power_w")
        if power:
            if not (isinstance(power, list) and len(power) == 3):
                raise ValueError(f"the join's answer: power_w {str(power)[:60]}")
            self.power.set(*power)
        print(f"JOINED {self.config.node_id}", flush=True)

    def node_key(self) -> bytes | None:
        """The key this node shares with the coordinator on the data plane (auth.node_key),
        from this session (under auth.NO_TOKEN without a cluster token); None before a join."""
        if self.session is None:
            return None
        return node_key(self.token or NO_TOKEN, digest(self.session))

    def trust(self) -> None:
        """Give what serves the data port this session's key: the coordinator proves it
        there, and seals the wiring's link keys with it."""
        key = self.node_key()
        for server in (self.stage, self.part):
            if key is not None and server is not None:
                server.trust(key)

    def _beat_body(self) -> Heartbeat:
        probe, self.probe = self.probe or (None, None), None
        check, self.check = self.check, None
        data_port, data_host = self.data_address()
        return Heartbeat(
            node_id=self.config.node_id, session=str(self.session), rss_bytes=rss_bytes(),
            peak_rss_bytes=peak_rss_bytes(), data_port=data_port, data_host=data_host,
            ready=self.ready, sent_s=time.time(), clock_offset_s=self.clock.offset_s,
            clock_error_s=self.clock.error_s, refused=self.refused or None,
            max_sequences=self.stage.config.max_sequences if self.stage else None,
            stats=self.stats(), metrics_port=self.metrics_port,
            probe_ok=probe[0], probe_error=probe[1], check=check)  # fmt: skip

    async def _beat(self) -> HeartbeatAnswer:
        """One heartbeat and its answer: through NATS with --control (transport/beats.py),
        else — or when NATS does not answer — over HTTP."""
        beat = self._beat_body()
        body = encode(beat)
        t0 = time.perf_counter()
        answer = None
        if self.nats is not None:
            answer = await self.nats.beat(body, max(0.2, self.heartbeat_s))
        if answer is None:
            answer = await asyncio.to_thread(self._post, "/v1/heartbeat", body)
        self.echo_s = time.perf_counter() - t0
        return self._heard(beat, answer)

    def _heard(self, beat: Heartbeat, said: Mapping[str, object]) -> HeartbeatAnswer:
        answer = decode(HeartbeatAnswer, said)  # typed here, once: apply reads its fields
        if answer.now_s is not None and beat.sent_s is not None:
            self.clock.add(beat.sent_s, answer.now_s, time.time())
        if answer.heartbeat_s:  # a bigger swarm beats less often
            self.heartbeat_s = answer.heartbeat_s
        return answer

    def stats(self) -> NodeStats:
        """Its stage's counters (none without one) and its energy so far."""
        stats = self.stage.stats() if self.stage else NodeStats()
        joules = self.power.joules(float(stats.busy_s or 0), self.awake_s())
        done, total = self.fetched if self.fetched is not None else (None, None)
        return msgspec.structs.replace(
            stats, energy_j=round(joules, 3) if joules is not None else None,
            temp_c=temperature_c(), fetch_done_bytes=done, fetch_total_bytes=total,
        )  # fmt: skip

    def awake_s(self) -> float:
        """Seconds this node has kept the CPUs out of deep sleep (awake.py)."""
        return self.awake.held_s() if self.awake is not None else 0.0

    def start_metrics(self) -> None:
        if self.config.metrics == "off":
            return
        host, _, port = self.config.metrics.rpartition(":")
        try:
            self.metrics_port = serve_metrics(self, host or self.bind.host, int(port or 0))
        except (OSError, ValueError) as exc:
            raise RequestError(f"--metrics {self.config.metrics!r}: cannot listen ({exc}); "
                               "give a free [HOST:]PORT, or 'off'") from None  # fmt: skip

    def data_address(self) -> tuple[int | None, str | None]:
        """Where peers reach this node's data port (port, host): the advertised address, else
        the bound one (a wildcard bind leaves the host to the coordinator, None: the address
        we came from)."""
        if self.data_port is None:
            return None, None
        adv = self.advertised
        host = adv.host if adv else self.bind.host
        port = adv.port if adv and adv.port else self.data_port
        wildcard = host in ("0.0.0.0", "::", "")
        return port, None if wildcard else host

    def _post_session(self, path: str, data: Mapping[str, object]) -> dict[str, object]:
        return self._post(path, {**data, "node_id": self.config.node_id, "session": self.session})

    def report_fault(
        self, kind: str, detail: str, epoch: int, job: str | None = None
    ) -> asyncio.Future[None] | None:
        """Called by the stage on a failed step (of `epoch`, of request `job`); told to the
        coordinator at once. The call in flight, for a stage that must wait for it."""
        data = encode(Fault(node_id=self.config.node_id, session=str(self.session), kind=kind,
                            detail=detail, epoch=epoch, job=job))  # fmt: skip
        if self.loop is None:
            return None
        return self.loop.run_in_executor(None, self._post_quietly, "/v1/fault", data)

    def _post_quietly(self, path: str, data: Mapping[str, object]) -> None:
        try:
            self._post(path, data)
        except (OSError, ValueError) as exc:
            log.warning("could not tell the coordinator %s: %s", path, exc)

    def _ship_logs(self, events: list[dict[str, object]]) -> None:
        """The shipper's thread: one batch; raises unless the coordinator took it."""
        if self.session is None:
            raise OSError("not joined: the batch waits")
        try:
            batch = LogBatch(run=self.shipper.run, events=[LogEvent.of(e) for e in events],
                             clock_offset_s=self.clock.offset_s, clock_error_s=self.clock.error_s)
            self._post("/v1/logs", {"node_id": self.config.node_id, "session": self.session,
                                    **encode(batch)})  # fmt: skip
        except urllib.error.HTTPError as exc:
            if exc.code == 401 or exc.code >= 500:
                raise  # a session it no longer knows (we join again), or a passing fault
            log.warning("coordinator refused %d log events (HTTP %s)", len(events), exc.code)

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        await asyncio.to_thread(build_kernels)  # before joining: no compile in a step
        self.caps = measure_capabilities(self.config)
        note_runtime()  # what every shard's budget counts for the runtime, measured here
        self.start_metrics()
        self._leading = asyncio.create_task(self.lead())  # for the process's life
        answers: asyncio.Queue[HeartbeatAnswer] = asyncio.Queue()
        loop = self.loop

        def heard(answer: HeartbeatAnswer) -> None:  # the beat thread: to this loop
            loop.call_soon_threadsafe(answers.put_nowait, answer)

        beats = threading.Thread(target=lambda: asyncio.run(self.beat_forever(heard)),
                                 name="heartbeat", daemon=True)  # fmt: skip
        beats.start()
        while True:  # what the beats bring back, in order, on this loop
            answer = await answers.get()
            if answer is GIVE_UP:
                raise SwarmError(self.fatal)
            try:
                await self.apply(answer)
            except Exception:  # a bug in one answer must not end the node
                log.exception("applying the coordinator's answer failed")

    def beat_now(self) -> None:
        """The next beat goes at once (a shard was loaded: the coordinator wires the ring)."""
        self._beat_now.set()

    async def beat_forever(self, heard: Callable[[HeartbeatAnswer], None]) -> None:
        """The heartbeat thread's loop: join, beat every heartbeat_s, hand each answer to
        the main loop (`heard`); nothing else runs here. What stops it joining is said in
        one line: a refused proof JOIN_REFUSALS times ends the worker (`heard(GIVE_UP)`: a
        wrong token does not come right); a coordinator that does not answer is said once a
        minute while the worker keeps trying (it may be starting)."""
        last_ok, refusals = time.monotonic(), 0
        while True:
            joining = self.session is None
            try:
                if joining:
                    await asyncio.to_thread(self._join)
                answer = await self._beat()
            except (urllib.error.HTTPError, PermissionError) as exc:
                # 401 / PermissionError (NATS): a bad proof, or a session the coordinator
                # no longer knows (it was wiped): join again
                if isinstance(exc, urllib.error.HTTPError) and exc.code == 409 and joining:
                    self.fatal = f"the coordinator at {self.url} refused us: {said(exc)}"
                    heard(GIVE_UP)  # another protocol version: waiting will not help
                    return
                if isinstance(exc, urllib.error.HTTPError) and exc.code != 401:
                    self._say_once(f"the coordinator at {self.url} refused a heartbeat: "
                                   f"{said(exc)}")  # fmt: skip
                else:
                    self.session = None
                    why = said(exc) if isinstance(exc, urllib.error.HTTPError) else str(exc)
                    refusals = refusals + 1 if joining else 0
                    if refusals >= JOIN_REFUSALS:
                        self.fatal = (f"the coordinator at {self.url} refused to let "
                                      f"{self.config.node_id} join {refusals} times ({why}): "
                                      "is --token-file the cluster's token?")  # fmt: skip
                        heard(GIVE_UP)
                        return
                    log.warning("coordinator %s refused us: %s", self.url, why)
            except (OSError, ValueError) as exc:
                self._say_tls_failure(exc)
                if joining:
                    self._say_once(f"cannot reach the coordinator at {self.url} ({exc}); "
                                   "trying again, said once a minute while it does not "
                                   "answer")  # fmt: skip
                quiet_s = time.monotonic() - last_ok
                if quiet_s > self.config.stop_after_s and self.session is not None:
                    await self._on_main(self.stop_serving(
                        f"no coordinator for {quiet_s:.1f} s ({exc})"))  # fmt: skip
                    self.session = None  # join again when it is back
            except Exception:  # a bug in one beat must not end the node: beat again
                log.exception("heartbeat failed")
            else:
                last_ok, refusals = time.monotonic(), 0
                heard(answer)
            await asyncio.to_thread(self._beat_now.wait, self.heartbeat_s)
            self._beat_now.clear()

    async def _on_main(self, work: Coroutine[object, object, None]) -> None:
        """Run `work` on the main loop and wait for it (from the heartbeat thread)."""
        assert self.loop is not None
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self.loop))

    def _say_once(self, line: str, key: str | None = None) -> None:
        """A warning that retrying may mend: said at once, then once a minute while it lasts
        (not twice a second: a worker's log is read by a person); `key` names what lasts
        (the line up to its parenthesis, the error's details, by default)."""
        now = time.monotonic()
        key = line.split(" (")[0] if key is None else key
        if key != self._said[0] or now - self._said[1] >= SAY_EVERY_S:
            log.warning("%s", line)
            self._said = (key, now)

    def _say_tls_failure(self, exc: Exception) -> None:
        """A refused handshake is not an outage: say what it was (once), not just retry."""
        why = tls_failure(exc) if self.tls is not None else ""
        if why and why != self.tls_failure:
            log.warning("TLS with the coordinator failed: %s; does --tls %s hold a certificate "
                        "of this cluster's CA?", why, self.config.tls_dir)  # fmt: skip
        self.tls_failure = why

    async def lead(self) -> None:
        """As a replica's head: pull jobs and run them whenever the ring is wired."""
        while True:
            head, stage = self.head, self.stage
            if head is not None and stage is not None:
                wired = self.wired and stage.epoch == self.coordinator_epoch
                try:
                    await head.tick(wired)
                except Exception:  # a bad job or a bug: keep leading
                    log.exception("head tick failed")
            # 50 ticks a second while jobs run (checkpoints, resends); an idle head only
            # restarts its long poll, so 10 a second is plenty
            await asyncio.sleep(0.02 if head is not None and head.runs else 0.1)

    def _say_problem(self, answer: HeartbeatAnswer) -> None:
        """A worker left without a shard is told why by its coordinator: said once a
        minute while it lasts (a budget too small for any shard, too few workers), once it
        is told the same twice in a row (the first answers after a join may carry the
        reason from before it came)."""
        problem = answer.problem if answer.shard is None else ""
        told, self._problem = self._problem, problem
        if problem and problem == told:
            self._say_once(f"{self.config.node_id} holds no shard: the coordinator cannot place "
                           f"the model ({problem})", key=problem)  # fmt: skip

    async def apply(self, answer: HeartbeatAnswer) -> None:
        if answer.held:  # heard while the coordinator's core was busy: nothing new
            return
        self._say_problem(answer)
        given = answer.shard
        self.wired = answer.wired
        self.coordinator_epoch = answer.epoch
        self.lease_s = answer.lease_s if answer.lease_s is not None else self.lease_s
        if answer.probe:
            self.probe = await self.probe_beside_nothing()
        if answer.check:
            self.check = await self.run_checks(answer.check)
        if given is None:
            if self.stage is not None or self.part is not None:
                await self.stop_serving("the coordinator gave this node no shard")
            self.refused = ""
            return
        key = (shard_id(given.shard), given.model, given.context, given.max_sequences)
        if key == self.shard_key:
            return
        await self.stop_serving("a new shard")
        self.shard_key = key
        # Loading (a fetch over a slow link, reading a big shard) runs beside the heartbeat:
        # a node that stops beating while it loads looks dead to the coordinator.
        self.loading = asyncio.create_task(self.load(given))

    async def load(self, given: Assignment) -> None:
        # What the last shard left only in reference cycles (asyncio's tasks and protocols of
        # its connections, tracebacks) goes before this one loads: the budget counts on it,
        # and a ring that makes little garbage per token may not run the collector for long
        await asyncio.sleep(0)  # the old connections' tasks end (their transports closed)
        gc.collect()
        try:
            if given.shard.role == "part":
                await self.start_part(given)
            else:
                await self.start_serving(given)
            self.ready = shard_id(given.shard)
        except (CellswarmError, OSError) as exc:  # a budget, a file, a fetch: say which
            await self.stop_serving("could not serve its shard")
            self.refused = str(exc)
            print(f"REFUSED {exc}", flush=True)
            return
        self.beat_now()  # tell the coordinator at once (it wires the ring)

    async def start_serving(self, given: Assignment) -> None:
        c, shard = self.config, given.shard
        if shard.layers is None:
            raise SwarmError(f"stage shard {shard.slot} names no layers: a coordinator bug")
        config = StageConfig(
            model=c.model or given.model, layers=shard.layers, first=shard.first,
            last=shard.last, threads=c.threads, memory_bytes=c.memory_bytes,
            context=given.context, max_sequences=given.max_sequences, log_dir=c.log_dir,
            cache_type=cache_type_for(c.cache_type, given.cache_type),
            node_id=c.node_id, profile=c.profile, token_file=c.token_file, peers=(),
            parts=tuple(PartSpec.from_wire(p) for p in given.parts),
            dram_budget_bytes=c.dram_budget_bytes, tls_dir=c.tls_dir,
            draft=c.draft if shard.first else None,
        )  # fmt: skip
        if c.fetch or c.model is None:
            config = replace(config, model=str(await asyncio.to_thread(self.fetch, config)))
        # in a thread: the heartbeat goes on while a big shard loads (or the node looks dead)
        if not config.dram_budget_bytes:  # a tiered shard sizes its cache from its budget
            config = await asyncio.to_thread(size_kv, config)
        model = await asyncio.to_thread(load_stage_model, config)
        if c.flip_bit:
            log.warning("test hook: one bit of %s flipped", flip_a_weight_bit(model))
        self.stage = Stage(config, model)
        self.stage.on_fault = self.report_fault
        self.stage.log.sink = self.shipper.add  # the local file stays; a thread ships
        if c.fail_forward or c.fail_token is not None or c.perturb or c.stall_step_s:
            self.stage.faults = Faults(fail_forward=c.fail_forward, fail_token=c.fail_token,
                                       perturb=c.perturb, stall_once_s=c.stall_step_s)  # tests
        self.stage.on_step = self.awake.touch if self.awake is not None else None
        self.stage.epoch = -1  # serves nothing until the coordinator wires the ring
        self.trust()
        if config.first:
            self.head = Head(self.stage, self._post_session, self.lease_s)
            self.stage.on_frontier = self.head.frontier
        self.server = await asyncio.start_server(self.stage.serve, *self._bind(),
                                                 **listen_tls(self.tls_server))  # fmt: skip
        self.data_port = self.server.sockets[0].getsockname()[1]
        self.refused = ""
        log.info("serving layers %s on port %s", config.layers, self.data_port)
        print(f"SERVING {config.layers[0]}..{config.layers[1] - 1} {self.data_port}", flush=True)

    async def start_part(self, given: Assignment) -> None:
        """Serve a part: routed experts of some layers, or vocabulary rows (swarm/ring/parts.py)."""
        c = self.config
        holding = given.shard.spec or PartHolding()
        spec = PartSpec.from_wire(holding.at(c.node_id, "127.0.0.1", 0))  # it binds _bind's
        model_path = c.model or given.model
        if c.fetch or c.model is None:
            path = await asyncio.to_thread(self.fetch_selection, spec.selection())
            model_path = str(path)
        config = PartConfig(model_path, spec, c.threads, c.token_file, (),
                            tls_dir=c.tls_dir)  # fmt: skip
        model = await asyncio.to_thread(load_part_model, config)
        check_part_budget(model, c.memory_bytes, spec)
        self.part = PartServer(config, model)
        self.part.on_step = self.awake.touch if self.awake is not None else None
        self.trust()
        self.server = await asyncio.start_server(self.part.serve, *self._bind(),
                                                 **listen_tls(self.tls_server))  # fmt: skip
        self.data_port = self.server.sockets[0].getsockname()[1]
        self.refused = ""
        print(f"SERVING part {spec.node_id} {self.data_port}", flush=True)

    def _bind(self) -> tuple[str, int]:
        return self.bind.host, self.bind.port

    def fetch(self, config: StageConfig) -> Path:
        return self.fetch_selection(stage_selection(config))

    def fetch_selection(self, sel: Selection) -> Path:
        """This shard's bytes of the model, from the coordinator: only the chunks holding
        its tensors, each checked against the manifest, cached by content hash on disk."""
        from cellswarm.swarm.transport.fetch import Manifest, ensure_local

        headers = {"X-Cellswarm-Session": f"{self.config.node_id}:{self.session}"}

        def get(path: str, timeout_s: float = 30) -> bytes:
            return fetch_answer(urllib.request.Request(self.url + path, headers=headers),
                                timeout_s, self.tls)  # fmt: skip

        # a coordinator started moments ago may still be hashing a big model (~30 s for 10 GB
        # here): the manifest is worth waiting for, a chunk is not
        manifest = Manifest.from_json(get("/v1/model/manifest", MANIFEST_TIMEOUT_S))
        show = Progress("shard")

        def progress(done: int, total: int) -> None:
            self.fetched = (done, total)  # the heartbeat carries it (the dashboard's bar)
            show(done, total)

        report = ensure_local(manifest, sel, lambda i: get(f"/v1/model/chunks/{i}"),
                              self.config.cache_dir, progress)  # fmt: skip
        print(f"FETCHED {report.chunks_fetched} chunks ({report.bytes_fetched:,} bytes), "
              f"{report.chunks_cached} from cache", flush=True)  # fmt: skip
        return report.path

    async def stop_serving(self, why: str) -> None:
        loading, self.loading = self.loading, None
        if loading is not None and loading is not asyncio.current_task():
            loading.cancel()  # a fetch in its thread finishes; its result is dropped
        if self.stage is not None:
            self.stage.log.event("stop", None, why=why)
            print(f"STOPPED {why}", flush=True)
        if self.server is not None:
            self.server.close()
        if self.stage is not None:
            self.stage.close_connections()
            self.stage.forget_sequences()  # its KV caches, and the cycles through its head
        if self.head is not None:
            self.head.forget()
        if self.awake is not None:
            self.awake.release()
        self.stage = self.part = self.server = self.head = None
        self.shard_key = self.data_port = self.ready = None

    async def probe_beside_nothing(self) -> tuple[bool, str]:
        """The probe runs the stage's model, whose scratch buffers every step shares: it runs
        where the steps run (this loop, or an emulated stage's compute thread), one after
        another — never in a thread beside a step, which corrupted the tokens of the
        sequences an offline node was still finishing."""
        if self.stage is not None:
            return await self.stage.compute(self.run_probe)
        return await asyncio.to_thread(self.run_probe)

    async def run_checks(self, ask: CheckAsk) -> CheckResult:
        """A doctor round (swarm/ring/checks.py), run where the steps run, as the probe is."""
        from cellswarm.swarm.ring import checks

        stage, c = self.stage, self.config
        folders = (c.log_dir, c.cache_dir, str(kernels_cache_dir()))

        def run() -> CheckResult:
            return checks.run(ask.seed, stage.model if stage else None, folders, c.perturb)

        out = await stage.compute(run) if stage is not None else await asyncio.to_thread(run)
        layers = list(stage.config.layers) if stage is not None else None
        env = msgspec.structs.replace(out.env, rss_bytes=rss_bytes())
        return msgspec.structs.replace(out, env=env, round=ask.round, echo_s=self.echo_s,
                                       layers=layers)  # fmt: skip

    def run_probe(self) -> tuple[bool, str]:
        """A health check an offline node must pass to get a shard again: one forward step
        of its shard (or a small matmul without one), checked to be finite."""
        try:
            if self.config.fail_forward:
                raise RuntimeError("injected fault: this node's forward pass always fails")
            if self.stage is not None:
                model = self.stage.model
                cache = model.new_cache(1)
                d = model.arch.config.d_model if hasattr(model.arch, "config") else 0
                x = np.full((1, d), 0.01, np.float32)
                out = model.forward(x, cache)
            else:
                m = np.eye(64, dtype=np.float32)
                out = m @ m
            if not np.isfinite(out).all():
                raise RuntimeError("non-finite output")
            return True, ""
        except Exception as exc:  # whatever breaks, the probe says so
            return False, f"{type(exc).__name__}: {exc}"


def build_kernels() -> None:
    """Compile the C kernels for this machine now, saying so and how long it took; a worker
    that cannot says why and does not join (the numpy path is 10x slower and computes other
    bits: CELLSWARM_KERNELS=numpy asks for it knowingly)."""
    from cellswarm.kernels import KernelBuildError, prebuild

    try:
        built = prebuild()
    except KernelBuildError as exc:
        raise RequestError(f"cannot build the kernels: {exc}") from None
    print(built.line() if built else "KERNELS off (CELLSWARM_KERNELS=numpy)", flush=True)


def note_runtime() -> None:
    """This worker's resident set before it holds any weight, its kernels loaded (their
    shared object and OpenMP runtime are part of it): the runtime its budgets count
    (planner/overhead.py note_runtime_bytes)."""
    from cellswarm import kernels
    from cellswarm.planner.overhead import note_runtime_bytes

    kernels.enabled()
    note_runtime_bytes(rss_bytes())


def temperature_c() -> float | None:
    """The host's first thermal zone (a Raspberry Pi's SoC, a PS3 under Linux), where the
    kernel exposes one; None in most VMs and containers."""
    try:
        return int(Path("/sys/class/thermal/thermal_zone0/temp").read_text()) / 1000
    except (OSError, ValueError):
        return None


def check_part_budget(model: Model, memory_bytes: int, spec: PartSpec) -> None:
    """A part holds weights only (no KV cache): they and the runtime must fit the budget."""
    from cellswarm.planner.overhead import runtime_overhead_bytes

    need = model.weights.nbytes() + runtime_overhead_bytes()
    if need > memory_bytes:
        raise BudgetError(
            f"part {spec.node_id} needs {need:,} bytes (weights {model.weights.nbytes():,}, "
            f"runtime {runtime_overhead_bytes():,}) but --memory is {memory_bytes:,}: "
            f"{need - memory_bytes:,} bytes short; use more expert/vocab nodes"
        )


def cache_type_for(mine: str | None, given: str) -> str:
    """The KV cache type to serve a shard with: the coordinator's, which this worker's own
    --cache-type, when given, must match (one swarm, one cache type: a sequence's bits must
    not depend on which node holds its layers)."""
    if mine is not None and mine != given:
        raise BudgetError(f"this worker serves a {mine} KV cache (--cache-type {mine}) but the "
                          f"coordinator's swarm runs {given}: start it with --cache-type "
                          f"{given}, or without --cache-type")  # fmt: skip
    return given


def size_kv(config: StageConfig) -> StageConfig:
    """How many sequences' KV cache fit in what the budget leaves after weights, scratch and
    runtime: at most what the coordinator asked for, at least one, or BudgetError."""
    from cellswarm.loader import load

    lo, hi = config.layers
    probe: Model = load(config.model, selection=stage_selection(config), tokenizer=False,
                        cache_type=config.cache_type)
    if config.draft and config.first:
        probe.draft = load_draft(config.draft, config.model)
        probe.draft.set_cache_type(config.cache_type)
    need = shard_need_bytes(probe, replace(config, max_sequences=0))
    per_seq = probe.kv_sequence_bytes(config.context) + (
        probe.draft.kv_sequence_bytes(config.context) if probe.draft is not None else 0)
    left = int(config.memory_bytes or 0) - sum(need.values())
    fits = left // per_seq if per_seq else config.max_sequences
    if fits < 1:
        parts = ", ".join(f"{k} {v:,}" for k, v in need.items())
        total = sum(need.values()) + per_seq
        raise BudgetError(
            f"layers {lo}..{hi - 1} need {total:,} bytes ({parts}, KV for one "
            f"{config.context}-token sequence {per_seq:,}) but --memory is "
            f"{config.memory_bytes:,}: {total - int(config.memory_bytes or 0):,} bytes short; "
            "add workers so each holds fewer layers, or give this one more memory"
        )
    return replace(config, max_sequences=int(min(fits, config.max_sequences)))


def main(config: WorkerConfig) -> None:
    from cellswarm.swarm.ring.emulate import precise_loop
    from cellswarm.swarm.tls import lean_tls_buffers

    logging.basicConfig(level=logging.WARNING)
    worker = Worker(config)  # a bad flag is one line (RequestError) before anything starts
    lean_tls_buffers()  # a stranger's TLS connection costs 16 KiB until it proves a key
    if worker.token is None:
        where = "loopback only" if is_loopback(worker.bind.host) else "--insecure"
        print(f"warning: no --token-file ({where}): any process that can reach this node's "
              f"data port on {worker.bind.host} may drive its stage", flush=True)  # fmt: skip
    # an emulated node's waits must be precise to well under its step time (emulate.py)
    with asyncio.Runner(loop_factory=precise_loop if config.profile else None) as runner:
        runner.run(worker.run())


def said(exc: urllib.error.HTTPError) -> str:
    """An error answer's message (`{"error": {"message"}}`), else its first 200 characters:
    read from a socket, maybe cut short."""
    try:
        text = exc.read().decode(errors="replace")[:200]
    except Exception as cut:  # http.client.IncompleteRead is no OSError
        return f"HTTP {exc.code} ({cut!r})"
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, TypeError, KeyError):
        return text


def flip_a_weight_bit(model: Model) -> str:
    """Test hook (--flip-bit): one bit of one quantized weight of this shard flipped, in this
    process's copy: a node whose memory or file went bad by one bit. The text it writes often
    stays the same; the logits' bits do not, which --verify compares. -> the tensor's name."""
    from cellswarm.quant import PackedMatrix

    for name in model.weights:
        t = model.weights[name]
        if isinstance(t, PackedMatrix) and name.startswith("blk.") and "ffn_down" in name:
            data = np.array(t.data)  # memory of its own: the file stays as it is
            data.reshape(-1)[data.size // 2] ^= 0x04
            # and no repacked copy (kernels.c's 16-row groups) read in its place
            t.data, t._fused_args, t._repacked = data, False, None
            return name
    return "nothing (no ffn_down here)"
