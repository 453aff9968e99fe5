"""The doctor's judgement of node checks (control/checkup.py): pure functions, tested with
tables; the rounds a coordinator carries in heartbeats."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cellswarm.swarm.control import checkup
from cellswarm.swarm.protocol.checks import Result
from cellswarm.swarm.protocol.messages import CheckAsk, CheckResult
from cellswarm.swarm.ring import checks

SEED = 11
REF = checks.matmul_reference(SEED)
FWD = checks.digest(checks.hidden_input(SEED, 64), SEED)


def answer(scale: float = 1.0, forward: dict[str, Any] | None = FWD, **kw: Any) -> dict[str, Any]:
    return {"matmul": list(REF * scale), "forward": forward, "echo_s": 0.002,
            "layers": [0, 4], "env": {"kernels": "c"}, **kw}  # fmt: skip


@pytest.mark.parametrize(
    ("result", "want"),
    [
        (answer(), {"echo": "PASS", "matmul": "PASS", "forward": "PASS"}),
        (None, {"echo": "FAIL"}),  # never answered: nothing else is judged
        (answer(echo_s=2.5), {"echo": "FAIL", "matmul": "PASS", "forward": "PASS"}),
        (answer(1.1), {"echo": "PASS", "matmul": "FAIL", "forward": "SKIP"}),
        (answer(error="RuntimeError: boom"), {"echo": "PASS", "matmul": "FAIL"}),
        (answer(forward={**FWD, "proj": [p * 1.5 for p in FWD["proj"]]}),
         {"echo": "PASS", "matmul": "PASS", "forward": "FAIL"}),
        (answer(forward={**FWD, "n": 65}), {"echo": "PASS", "matmul": "PASS", "forward": "FAIL"}),
        (answer(forward=None, layers=None), {"echo": "PASS", "matmul": "PASS", "forward": "PASS"}),
    ],
)  # fmt: skip
def test_a_node_is_brought_up_in_stages(result: dict[str, Any] | None,
                                        want: dict[str, str]) -> None:  # fmt: skip
    fwd = FWD if result and result.get("layers") else None
    got = checkup.judge_node("n1", "assigned", result, REF, fwd)
    assert {r.name.split()[1]: r.status for r in got} == want
    assert {r.node for r in got} == {"n1"}


def test_rounding_alone_passes_and_a_small_error_in_the_kernels_does_not() -> None:
    near = checks.matmul_here(SEED)  # this machine's kernels: int8 activations
    assert checkup.judge_node("n", "spare", answer(forward=None) | {"matmul": near}, REF,
                              None)[1].status == "PASS"  # fmt: skip
    off = [v * 1.05 for v in near]
    assert checkup.judge_node("n", "spare", answer(forward=None) | {"matmul": off}, REF,
                              None)[1].status == "FAIL"  # fmt: skip


def test_on_the_c_kernels_one_ulp_off_fails_where_the_tolerance_would_pass() -> None:
    """Kernels give the same bits on every CPU (issue 32): a node's matmul or forward step
    that differs from the coordinator's in the last bit is wrong, however close; a node on
    the numpy path (other bits by design) is still judged by the tolerance."""
    own = np.asarray(checks.matmul_here(SEED), np.float32)
    exact = answer(forward=None) | {"matmul": [float(v) for v in own]}
    assert checkup.judge_node("n", "spare", exact, REF, None, own)[1].status == "PASS"
    ulp = np.nextafter(own, np.float32(np.inf))
    off = exact | {"matmul": [float(v) for v in ulp]}
    assert checkup.judge_node("n", "spare", off, REF, None, own)[1].status == "FAIL"
    numpy_node = off | {"env": {"kernels": "numpy"}}
    assert checkup.judge_node("n", "spare", numpy_node, REF, None, own)[1].status == "PASS"
    other_bits = answer(forward={**FWD, "bits": "0" * 16}) | {"matmul": exact["matmul"]}
    got = checkup.judge_node("n", "assigned", other_bits, REF, FWD, own)
    assert got[2].status == "FAIL" and "other bits" in got[2].detail


def env(**kw: Any) -> dict[str, Any]:
    base = {"cellswarm": "0.1.0", "python": "3.11.7", "numpy": "2.0", "kernels": "c",
            "kernel_build": "abc", "machine": "x86_64", "cpu_flags": ["avx2"],
            "memory_available_bytes": 8 << 30, "rss_bytes": 1 << 20,
            "disk_free_bytes": {"/logs": 50 << 30}, "oom_kills_cgroup": 0, "oom_kills": 0}
    return base | kw  # fmt: skip


@pytest.mark.parametrize(
    ("envs", "failing"),
    [
        ({"a": env(), "b": env()}, set()),
        ({"a": env(), "b": env(cellswarm="0.0.9"), "c": env()}, {"same cellswarm"}),
        ({"a": env(), "b": env(kernel_build="def")}, {"same kernel_build"}),  # other sources
        ({"a": env(), "b": env(machine="aarch64")}, set()),  # the same bits on every CPU
        ({"a": env(), "b": env(cpu_flags=[])}, {"same cpu_flags"}),
        ({"a": env(disk_free_bytes={"/logs": 5 << 20}), "b": env()}, {"a disk"}),
        ({"a": env(memory_available_bytes=100 << 20), "b": env()}, {"a memory"}),
        ({"a": env(oom_kills_cgroup=2), "b": env()}, {"a oom kills"}),
        ({"a": env(oom_kills=7), "b": env()}, set()),  # the host's log: said, not blamed
        ({"a": env(cgroup_limit_bytes=512 << 20), "b": env()}, {"a cgroup"}),  # budget 1 GiB
        ({"a": env(cgroup_limit_bytes=2 << 30), "b": env()}, set()),
    ],
)  # fmt: skip
def test_the_environment_names_what_differs(envs: dict[str, Any], failing: set[str]) -> None:
    got = checkup.judge_environment(envs, {n: 1 << 30 for n in envs})
    assert {r.name for r in got if r.status == "FAIL"} == failing


def test_many_nodes_read_as_their_failures() -> None:
    lines = [r for i in range(20) for r in checkup.judge_node(
        f"n{i}", "spare", answer(1.5 if i == 7 else 1.0, forward=None, layers=None), REF, None)]
    short = checkup.collapse([Result("input", "tokenizer", "PASS", ""), *lines])
    names = [r.name for r in short]
    assert "n7 matmul" in names and "n7 forward" in names  # the failure and its skip, by name
    assert "20 nodes echo" in names and "19 nodes matmul" in names
    assert len(short) < 10


def test_a_round_is_asked_until_answered_and_old_answers_are_ignored() -> None:
    rounds = checkup.Checkups()
    r = rounds.start(["a", "b"])
    assert rounds.ask("a") == CheckAsk(round=r.round_id, seed=r.seed)
    assert rounds.ask("z") is None
    rounds.take("a", CheckResult(round="stale", env={}))
    assert rounds.ask("a") is not None and not r.complete
    rounds.take("a", CheckResult(round=r.round_id))
    rounds.take("b", CheckResult(round=r.round_id))
    assert r.complete and rounds.ask("a") is None


def test_digest_is_the_same_for_the_same_step_and_moves_for_another() -> None:
    out = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    assert checks.digest_error(checks.digest(out, 3), checks.digest(out, 3)) == 0.0
    assert checks.digest_error(checks.digest(out * 1.001, 3), checks.digest(out, 3)) < 1e-2
    assert checks.digest_error(checks.digest(-out, 3), checks.digest(out, 3)) > 1.0
