"""The coordinator's half of `cellswarm doctor --coordinator`: rounds of node checks carried
by heartbeats, the references they are judged against, and the judgement.

A round asks every live node (spare, assigned, offline) for the checks of
`swarm/ring/checks.py` with a fresh seed; each node's next heartbeat answer carries the ask,
the one after brings the result (a node that never answers fails its echo). Judging is a
pure function of the results and the references, in the seed's order: input (the model's
tokenizer), then per node echo -> matmul -> forward (a node that fails a step is not judged
on the later ones), then the environment across nodes (each node's memory and disk, and every
fact that differs between nodes: versions, kernels, CPU flags).
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from cellswarm.swarm.control.store import whole_of
from cellswarm.swarm.policy import MIN_DISK_BYTES
from cellswarm.swarm.protocol.checks import Result
from cellswarm.swarm.protocol.jsonvalue import number, whole
from cellswarm.swarm.protocol.messages import CheckAsk, CheckResult
from cellswarm.swarm.ring.checks import digest_error
from cellswarm.units import format_bytes

if TYPE_CHECKING:
    from cellswarm.swarm.control.store import Node

# A node's answer as plain data (msgspec.to_builtins of its CheckResult), as judged here.
Answer = Mapping[str, object]

MATMUL_TOLERANCE = 2e-2  # int8 activations: ~1e-2 of the largest output on random data
FORWARD_TOLERANCE = 5e-2  # a shard's step on another node's kernels: ~1e-3; a wrong one: ~1
ECHO_SLOW_S = 1.0  # a heartbeat round trip beyond this makes leases and liveness fragile
# What must match on every node for them to compute the same bits. Not the machine, the CPU
# flags or the kernels' compiler flags: the kernels give the same bits on every CPU path
# (kernels/exact.c); a differing CPU is only slower or faster (cpu_flags, below).
SAME_EVERYWHERE = ("cellswarm", "python", "numpy", "kernels", "kernel_build")


@dataclass
class Round:
    """One doctor run's checks: who was asked, and what each answered."""

    round_id: str
    seed: int
    asked: set[str]
    started_s: float = field(default_factory=time.monotonic)
    results: dict[str, dict[str, object]] = field(default_factory=dict)  # judged as plain data

    @property
    def complete(self) -> bool:
        return self.asked <= set(self.results)


class Checkups:
    """The rounds in flight (a few at most: one per doctor running)."""

    def __init__(self) -> None:
        self.rounds: dict[str, Round] = {}

    def start(self, node_ids: list[str]) -> Round:
        self._forget_old()
        r = Round(secrets.token_hex(4), secrets.randbelow(1 << 30), set(node_ids))
        self.rounds[r.round_id] = r
        return r

    def ask(self, node_id: str) -> CheckAsk | None:
        """What to put in this node's heartbeat answer: the oldest round it has not answered."""
        for r in self.rounds.values():
            if node_id in r.asked and node_id not in r.results:
                return CheckAsk(round=r.round_id, seed=r.seed)
        return None

    def take(self, node_id: str, result: CheckResult) -> None:
        r = self.rounds.get(str(result.round))
        if r is not None and node_id in r.asked:
            r.results[node_id] = msgspec.to_builtins(result)

    def _forget_old(self, max_age_s: float = 600.0) -> None:
        now = time.monotonic()
        self.rounds = {k: r for k, r in self.rounds.items() if now - r.started_s < max_age_s}


# -- judging (pure) -------------------------------------------------------------------------


def judge_tokenizer(tokens: int | None, rows: int) -> Result:
    if tokens is None:
        return Result("input", "tokenizer", "PASS", f"the model carries no tokenizer "
                      f"({rows} embedding rows): clients send token ids")  # fmt: skip
    ok = tokens <= rows
    return Result("input", "tokenizer", "PASS" if ok else "FAIL",
                  f"{tokens} tokens for {rows} embedding rows",
                  "" if ok else "give the coordinator the tokenizer that came with the model "
                  "(ids past the embedding index nothing)")  # fmt: skip


def judge_node(node_id: str, state: str, result: Answer | None, matmul_ref: np.ndarray,
               forward_ref: Mapping[str, object] | None,
               own: np.ndarray | None = None) -> list[Result]:  # fmt: skip
    """One node's staged bring-up: echo, then matmul, then forward; a failed step skips the
    ones after it (they would only repeat it). `own`: the coordinator's kernels' product,
    which a node on the C kernels must match to the bit."""
    return [replace(r, node=node_id) for r in _bring_up(node_id, state, result, matmul_ref,
                                                          forward_ref, own)]  # fmt: skip


def _bring_up(node_id: str, state: str, result: Answer | None, matmul_ref: np.ndarray,
              forward_ref: Mapping[str, object] | None,
              own: np.ndarray | None) -> list[Result]:  # fmt: skip
    who = f"{node_id} ({state})"
    if result is None:
        return [Result("node", f"{node_id} echo", "FAIL", f"{who} did not answer the check",
                       "look at the node: is its process up and can it reach the "
                       "coordinator? (`cellswarm status`, its log)")]  # fmt: skip
    out = [_echo(node_id, who, result)]
    if result.get("error"):
        out.append(Result("node", f"{node_id} matmul", "FAIL", f"{who}: {result['error']}",
                          "read the node's log; run `cellswarm doctor --model` there"))  # fmt: skip
        return out
    out.append(_matmul(node_id, who, result, matmul_ref, own))
    if out[-1].status != "PASS":
        out.append(Result("node", f"{node_id} forward", "SKIP", "its matmul failed"))
        return out
    out.append(_forward(node_id, who, result, forward_ref))
    return out


def _echo(node_id: str, who: str, result: Answer) -> Result:
    got = result.get("echo_s")
    if got is None:
        return Result("node", f"{node_id} echo", "PASS", f"{who} answered (no round trip yet)")
    rtt = number(got)
    ok = rtt <= ECHO_SLOW_S
    return Result("node", f"{node_id} echo", "PASS" if ok else "FAIL",
                  f"{who} heartbeat round trip {rtt * 1e3:.1f} ms",
                  "" if ok else "a slow link or an overloaded coordinator: leases and "
                  "liveness need round trips well under a second")  # fmt: skip


def _exact(result: Answer) -> bool:
    """Both sides ran the C kernels: their numbers must be the same bits (kernels/exact.c)."""
    from cellswarm import kernels

    return kernels.enabled() and _env(result).get("kernels") == "c"


def _matmul(node_id: str, who: str, result: Answer, ref: np.ndarray,
            own: np.ndarray | None = None) -> Result:  # fmt: skip
    got = np.asarray(_list(result.get("matmul")), np.float64)
    err = float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-12)) \
        if got.shape == ref.shape else float("inf")  # fmt: skip
    kind = _env(result).get("kernels", "?")
    if own is not None and _exact(result):
        ok = got.shape == own.shape and np.array_equal(got.astype(np.float32), own)
        how = "the same bits as the coordinator's" if ok else "other bits than the coordinator's"
    else:
        ok, how = err <= MATMUL_TOLERANCE, f"{kind} kernels"
    return Result("node", f"{node_id} matmul", "PASS" if ok else "FAIL",
                  f"{who} Q8_0 matmul: {how}, within {err:.1e} of the float product",
                  "" if ok else "this node's kernels give wrong numbers: delete its kernel "
                  "cache (~/.cache/cellswarm/kernels) and restart it, or run it with "
                  "CELLSWARM_KERNELS=numpy; take it out of the swarm until it passes")  # fmt: skip


def _forward(node_id: str, who: str, result: Answer,
             ref: Mapping[str, object] | None) -> Result:  # fmt: skip
    got = result.get("forward")
    if got is None or ref is None:
        return Result("node", f"{node_id} forward", "PASS", f"{who} holds no layers (a spare)")
    if not isinstance(got, Mapping):
        raise TypeError(f"a node's forward digest is {type(got).__name__}, not an object")
    err = digest_error(got, ref)
    if _exact(result) and ref.get("bits"):
        ok = got.get("bits") == ref["bits"] and err <= FORWARD_TOLERANCE
        how = "the same bits as" if ok else f"other bits than (within {err:.1e} of)"
    else:
        ok, how = err <= FORWARD_TOLERANCE, f"within {err:.1e} of"
    return Result("node", f"{node_id} forward", "PASS" if ok else "FAIL",
                  f"{who} layers {_span(result.get('layers'))}: one step {how} the "
                  "coordinator's", "" if ok else "this node's shard computes something else: "
                  "is its model file the coordinator's (same checksum)? re-fetch it, then "
                  "check its kernels")  # fmt: skip


def _span(layers: object) -> str:
    if not layers:
        return "-"
    lo, hi = _sequence(layers)[:2]
    return f"{lo}..{whole(hi) - 1}"


# -- a node's answer as plain data, narrowed where it is read --------------------------------


def _env(result: Answer) -> Mapping[str, object]:
    """The facts of a node's host in its answer (CheckResult.env: always an object)."""
    env = result.get("env", {})
    if not isinstance(env, Mapping):
        raise TypeError(f"a node's env is {type(env).__name__}, not an object")
    return env


def _sequence(value: object) -> list[object] | tuple[object, ...]:
    if not isinstance(value, list | tuple):
        raise TypeError(f"{type(value).__name__} where a list was expected")
    return value


def _list(value: object) -> list[object] | tuple[object, ...]:
    """A list of the answer, [] for one null or empty (`value or []`)."""
    return _sequence(value) if value else []


def collapse(results: list[Result], limit: int = 8) -> list[Result]:
    """With more than `limit` nodes, each node's passing lines of a kind become one line
    (a swarm of thousands reads as its failures, not as thousands of PASS lines)."""
    per_kind: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        if r.node:
            per_kind.setdefault((r.step, r.name.partition(" ")[2]), []).append(r)
    if len({r.node for r in results if r.node}) <= limit:
        return results
    out, said = [], set()
    for r in results:
        key = (r.step, r.name.partition(" ")[2])
        if not r.node or r.status != "PASS":
            out.append(r)
        elif key not in said:
            said.add(key)
            passed = [x for x in per_kind[key] if x.status == "PASS"]
            out.append(Result(r.step, f"{len(passed)} nodes {key[1]}", "PASS",
                              f"e.g. {passed[0].detail}"))  # fmt: skip
    return out


def judge_environment(envs: Mapping[str, Mapping[str, object]],
                      budgets: Mapping[str, int]) -> list[Result]:  # fmt: skip
    """Each node's room (memory for its budget, disk), OOM kills, then what differs."""
    out: list[Result] = []
    for node_id, env in sorted(envs.items()):
        out += [replace(r, node=node_id) for r in _room(node_id, env, budgets.get(node_id))]
    for key in SAME_EVERYWHERE:
        out.append(_same(key, {n: str(e.get(key)) for n, e in envs.items()}))
    flags = {n: ",".join(map(_text, _list(e.get("cpu_flags")))) or "-" for n, e in envs.items()}
    out.append(_same("cpu_flags", flags, fix="nodes with fewer CPU features run slower "
                     "kernels: place by the measured speed, or group alike nodes"))  # fmt: skip
    return out


def _text(value: object) -> str:
    """A text of the answer (a CPU flag): str.join takes nothing else."""
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not text")
    return value


def _room(node_id: str, env: Mapping[str, object], budget: int | None) -> list[Result]:
    out = []
    got = env.get("memory_available_bytes")
    rss = whole(env.get("rss_bytes") or 0)
    if got is not None and budget:
        free = whole(got)
        ok = free + rss >= budget
        out.append(Result("environment", f"{node_id} memory", "PASS" if ok else "FAIL",
                          f"--memory {format_bytes(budget)}; {format_bytes(free)} "
                          f"available beside its {format_bytes(rss)}",
                          "" if ok else "the host cannot give the budget: lower --memory or "
                          "free memory there"))  # fmt: skip
    limit = env.get("cgroup_limit_bytes")
    if limit and budget and budget > whole(limit):
        out.append(Result("environment", f"{node_id} cgroup", "FAIL",
                          f"--memory {format_bytes(budget)} is over its memory cgroup's limit "
                          f"{format_bytes(whole(limit))}", "the kernel would kill it before its "
                          "budget is reached: give --memory below the cgroup's limit"))  # fmt: skip
    disks = env.get("disk_free_bytes") or {}
    if not isinstance(disks, Mapping):
        raise TypeError(f"disk_free_bytes is {type(disks).__name__}, not an object")
    if disks:
        where, least = min(((k, whole(v)) for k, v in disks.items()), key=lambda kv: kv[1])
        ok = least >= MIN_DISK_BYTES
        out.append(Result("environment", f"{node_id} disk", "PASS" if ok else "FAIL",
                          f"{format_bytes(least)} free at {where}",
                          "" if ok else f"free space there (at least "
                          f"{format_bytes(MIN_DISK_BYTES)}): logs and fetched shards need "
                          "it"))  # fmt: skip
    kills = whole(env.get("oom_kills_cgroup") or 0)
    seen = whole(env.get("oom_kills") or 0)
    out.append(Result("environment", f"{node_id} oom kills", "PASS" if kills == 0 else "FAIL",
                      f"{kills} in its memory cgroup; {seen} in the host's kernel log",
                      "" if kills == 0 else "the kernel killed processes of this node for "
                      "memory: give it a budget below its cgroup limit"))  # fmt: skip
    return out


def _same(key: str, values: dict[str, str], fix: str = "") -> Result:
    counts = Counter(values.values())
    if len(counts) <= 1:
        value = next(iter(counts), "-")
        return Result("environment", f"same {key}", "PASS", f"{value} on every node")
    usual = counts.most_common(1)[0][0]
    odd = sorted(n for n, v in values.items() if v != usual)
    detail = f"{', '.join(f'{n}: {values[n]}' for n in odd)}; the others: {usual}"
    return Result("environment", f"same {key}", "FAIL", detail, fix or
                  f"install the same {key} on every node (a node that differs may compute "
                  "different numbers)")  # fmt: skip


# -- one round, judged (the coordinator's thread: it loads the shards' layers) --------------


def judge_round(model_path: str, tokenizer_size: int | None, rnd: Round,
                nodes: Sequence[Node]) -> list[Result]:  # fmt: skip
    """Every line of a round, in the seed's order: input, nodes, environment."""
    from cellswarm.loader import read_config
    from cellswarm.swarm.ring.checks import matmul_here, matmul_reference

    rows = int(read_config(model_path).vocab_size)
    out = [judge_tokenizer(tokenizer_size, rows)]
    matmul_ref = matmul_reference(rnd.seed)
    own = np.asarray(matmul_here(rnd.seed), np.float32)  # this process's kernels' bits
    refs: dict[tuple[int, int], dict[str, object]] = {}
    for n in sorted(nodes, key=lambda n: n.node_id):
        result = rnd.results.get(n.node_id)
        layers = _layers(result.get("layers")) if result and result.get("layers") else None
        if layers is not None and layers not in refs:
            refs[layers] = forward_reference(model_path, layers, rnd.seed)
        out += judge_node(n.node_id, n.state, result, matmul_ref,
                          refs.get(layers) if layers else None, own)  # fmt: skip
    envs = {k: env for k, r in rnd.results.items() if isinstance(env := r.get("env"), dict)}
    budgets: dict[str, int] = {n.node_id: whole_of(n.capabilities, "memory_bytes")
                               for n in nodes}  # fmt: skip
    return collapse(out + judge_environment(envs, budgets))


def _layers(value: object) -> tuple[int, int]:
    """The layers [lo, hi) a node holds, as its answer gave them."""
    lo, hi = _sequence(value)
    return whole(lo), whole(hi)


def forward_reference(model_path: str, layers: tuple[int, int], seed: int) -> dict[str, object]:
    """The coordinator's own step of layers lo..hi-1 on the round's input (its copy of the
    model, these layers only), digested as a node digests its own."""
    from cellswarm.io.weights import Selection
    from cellswarm.loader import load
    from cellswarm.swarm.ring.checks import forward_digest

    model = load(model_path, selection=Selection(layers=layers, embed=False, head=False),
                 tokenizer=False)  # fmt: skip
    plain: dict[str, object] = msgspec.to_builtins(forward_digest(model, seed))
    return plain
