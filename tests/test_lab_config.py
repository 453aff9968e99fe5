"""`cellswarm lab`'s pure parts: the topology as data (tables), its TOML file, and where the
lab cannot run (one line saying why, exit status 2, nothing built). The lab itself is
tests/test_lab.py, which needs root and network namespaces."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cellswarm.cli import build_parser, main
from cellswarm.errors import LabError
from cellswarm.lab import system
from cellswarm.lab.cli import spec_from_args
from cellswarm.lab.topology import LabSpec, build, rack_of

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lab-seed.toml"


@pytest.mark.parametrize(
    ("hosts", "racks", "expected"),
    [(8, 1, [0] * 8), (8, 2, [0, 0, 0, 0, 1, 1, 1, 1]), (5, 2, [0, 0, 0, 1, 1]),
     (24, 4, [r for r in range(4) for _ in range(6)])],
)  # fmt: skip
def test_hosts_fill_racks_in_order(hosts: int, racks: int, expected: list[int]) -> None:
    assert [rack_of(i, hosts, racks) for i in range(hosts)] == expected


@pytest.mark.parametrize(
    ("spec", "access_bits", "aggregation_bits"),
    [(LabSpec(hosts=8, racks=2), [4e9 / 2.4] * 2, [8e9 / 2.4 / 4]),  # planner defaults
     (LabSpec(hosts=24, racks=4, access_oversubscription=20), [6e9 / 20] * 4,
      [12e9 / 20 / 4] * 2),  # the seed's 20:1, two aggregation switches
     (LabSpec(hosts=6, racks=1, host_bits_per_s=1e7, access_oversubscription=1,
              aggregation_oversubscription=1), [6e7], [6e7])],
)  # fmt: skip
def test_uplinks_carry_their_hosts_over_the_oversubscription(
    spec: LabSpec, access_bits: list[float], aggregation_bits: list[float]
) -> None:
    topo = build(spec)
    access = [lk.rate_bits_per_s for lk in topo.links if lk.tier == "access"]
    agg = [lk.rate_bits_per_s for lk in topo.links if lk.tier == "aggregation"]
    assert access == pytest.approx(access_bits) and agg == pytest.approx(aggregation_bits)
    hosts = [lk for lk in topo.links if lk.tier == "host" and lk.rate_bits_per_s]
    assert len(hosts) == spec.hosts
    net = topo.network_spec()
    assert net.nodes_per_access_switch == spec.hosts // spec.racks
    assert net.access_uplink_bits_per_s == pytest.approx(min(access_bits))


def test_addresses_are_unique_and_coordinators_sit_on_the_core() -> None:
    topo = build(LabSpec(hosts=10, racks=3, coordinators=2))
    assert len({h.address for h in topo.hosts}) == len(topo.hosts) == 13
    assert [h.name for h in topo.hosts[:3]] == ["c0", "c1", "db"]
    assert all(h.switch == "core" for h in topo.hosts[:3])
    assert topo.host("h1").address == "10.77.1.1" and topo.host("h10").address == "10.77.3.3"


def test_a_topology_file_sets_the_spec() -> None:
    args = build_parser().parse_args(["lab", "up", "--topology", str(EXAMPLE)])
    spec = spec_from_args(args)
    assert (spec.hosts, spec.racks, spec.racks_per_aggregation) == (24, 4, 2)
    assert (spec.access_oversubscription, spec.aggregation_oversubscription) == (20.0, 4.0)
    assert spec.slow_hosts == {"h5": 0.2} and spec.memory_bytes == 128 << 20


def test_bad_lab_options_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["--hosts", "2", "--racks", "3"], ["--oversubscription", "20"],
                 ["--slow", "h1=fast"]):  # fmt: skip
        assert main(["lab", "up", "--state-dir", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("cellswarm: error:"), err


def test_without_root_the_lab_refuses_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(system.os, "geteuid", lambda: 1000)
    assert main(["lab", "up", "--state-dir", str(tmp_path / "lab"), "--detach"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err and "sudo" in err
    assert not (tmp_path / "lab" / "lab.json").exists()


def test_elsewhere_than_linux_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system.sys, "platform", "darwin")
    assert "Linux network namespaces" in str(system.why_not_supported())


def test_status_of_no_lab_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lab", "status", "--state-dir", str(tmp_path)]) == 2
    assert "cellswarm lab up" in capsys.readouterr().err


def _paper_lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: LabSpec | None = None) -> Any:
    """A Lab whose hosts are folders only: no namespace, no cgroup (their creation is
    stubbed), processes started on this machine as they are (no nsenter)."""
    from cellswarm.lab.lab import Lab

    monkeypatch.setattr(system, "cgroup_create", lambda *a: system.Cgroup("v1", ()))
    lab = Lab(spec or LabSpec(hosts=2, racks=1), tmp_path, prefix="cspaper")
    monkeypatch.setattr(lab, "enter", lambda host: [])
    lab.state_dir.mkdir(parents=True, exist_ok=True)
    lab._make_hosts()
    return lab


def test_every_host_starts_with_an_empty_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As cold as a machine on day one: nothing compiled or fetched on this machine (its
    kernels, models, manifests) is put into a host's folder; each compiles and fetches its
    own into its own cache (HOME and CELLSWARM_CACHE point there)."""
    lab = _paper_lab(tmp_path, monkeypatch)
    for h in lab.topology.hosts:
        d = lab.host_dir(h.name)
        cache = d / "cache"
        assert not cache.exists() or not any(cache.iterdir()), list(cache.rglob("*"))
        assert {p.name for p in d.iterdir()} <= {"logs", "cluster.token"}
        env = lab.env(h.name)
        assert (env["HOME"], env["CELLSWARM_CACHE"]) == (str(d), str(cache))


def _up_spec(*argv: str) -> LabSpec:
    return spec_from_args(build_parser().parse_args(["lab", "up", *argv]))


def test_host_memory_and_cpu_quota_come_from_flags() -> None:
    """`--host-memory` / `--cpu-quota`: a bare value for every worker host, HOST=VALUE for
    one host (a coordinator too), which wins; the worker's own --memory is unchanged."""
    spec = _up_spec("--hosts", "3", "--racks", "1", "--host-memory", "300M",
                    "--host-memory", "h2=64M", "--host-memory", "c0=1G", "--cpu-quota", "0.5",
                    "--cpu-quota", "h3=0.25", "--slow", "h1=0.2")  # fmt: skip
    topo = build(spec)
    limits = {h.name: (h.memory_limit_bytes, h.cpu_quota) for h in topo.hosts}
    assert limits == {"c0": (1 << 30, None), "h1": (300 << 20, 0.2), "h2": (64 << 20, 0.5),
                      "h3": (300 << 20, 0.25)}  # fmt: skip
    assert {h.memory_bytes for h in topo.workers()} == {128 << 20}
    # without them: a PS3's 256 MiB, room for gcc to build the host's own kernels (or the
    # worker's --memory, if more); coordinators are unlimited
    default = build(_up_spec("--hosts", "2", "--racks", "1"))
    assert [(h.memory_limit_bytes, h.cpu_quota) for h in default.workers()] == [
        (256 << 20, None)] * 2  # fmt: skip
    assert default.host("c0").memory_limit_bytes is None
    big = build(_up_spec("--hosts", "1", "--racks", "1", "--memory", "1G"))
    assert big.host("h1").memory_limit_bytes == 1 << 30


def test_host_limits_come_from_the_topology_file(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text('[lab]\nhosts = 4\nracks = 2\nhost_memory = "256M"\ncpu_quota = 0.5\n'
                    '[lab.host.h2]\nhost_memory = "48M"\ncpu_quota = 0.1\n'
                    '[lab.host.c0]\ncpu_quota = 1.5\n[lab.slow]\nh4 = 0.2\n')  # fmt: skip
    topo = build(_up_spec("--topology", str(path)))
    limits = {h.name: (h.memory_limit_bytes, h.cpu_quota) for h in topo.hosts}
    assert limits == {"c0": (None, 1.5), "h1": (256 << 20, 0.5), "h2": (48 << 20, 0.1),
                      "h3": (256 << 20, 0.5), "h4": (256 << 20, 0.2)}  # fmt: skip
    # a flag wins over the file
    over = build(_up_spec("--topology", str(path), "--cpu-quota", "h2=0.3"))
    assert over.host("h2").cpu_quota == 0.3 and over.host("h1").cpu_quota == 0.5


@pytest.mark.parametrize(
    ("argv", "names"),
    [(["--host-memory", "300X"], ["'300X'", "300M"]),
     (["--host-memory", "1M"], ["--host-memory", "16M"]),
     (["--host-memory", "h9=300M"], ["'h9'", "h1, h2"]),
     (["--cpu-quota", "half"], ["'half'", "0.5"]),
     (["--cpu-quota", "0"], ["--cpu-quota '0'", "0.01"]),
     (["--cpu-quota", "h2=-1"], ["h2=-1", "0.01"]),
     (["--cpu-quota", "nan"], ["nan", "0.5"]),
     (["--slow", "0.2"], ["HOST=CORES"]),
     (["--cpu-quota", "db=0.5"], ["'db'", "c0, h1"])],
)  # fmt: skip
def test_bad_host_limits_are_one_line_errors(
    argv: list[str], names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lab", "up", "--hosts", "2", "--racks", "1", "--state-dir", str(tmp_path),
                 *argv]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("cellswarm: error:"), err
    for name in names:
        assert name in err, err
    assert not (tmp_path / "lab.json").exists()


@pytest.mark.parametrize(
    ("toml", "names"),
    [('[lab.host.h1]\nhost_memory = "lots"\n', ["[lab.host.h1] host_memory", "'lots'"]),
     ("[lab.host.h1]\nmemory = 5\n", ["[lab.host.h1]", "host_memory and cpu_quota"]),
     ("[lab.host.h7]\ncpu_quota = 0.5\n", ["'h7'", "hosts: c0, h1, h2"]),
     ('[lab]\ncpu_quota = "x"\n', ["cpu_quota", "'x'"])],
)  # fmt: skip
def test_bad_host_limits_in_the_file_are_one_line_errors(
    toml: str, names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "lab.toml"
    path.write_text("[lab]\nhosts = 2\nracks = 1\n" + toml.replace("[lab]\n", ""))
    assert main(["lab", "up", "--topology", str(path), "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("cellswarm: error:"), err
    for name in names:
        assert name in err, err


def test_a_process_that_exits_while_the_lab_waits_is_reported_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coordinator that dies during startup (psycopg missing, a bad flag): the lab says so
    with its exit status and last lines at once, not when its wait for READY times out."""
    lab = _paper_lab(tmp_path, monkeypatch)
    lab.spawn("c0", "coordinator", ["sh", "-c", "echo starting; echo 'no module psycopg'; exit 3"])
    t0 = time.monotonic()
    with pytest.raises(LabError) as exc:
        lab.wait_output("c0", "coordinator", "READY", timeout_s=15)
    assert time.monotonic() - t0 < 5
    assert "exited with status 3" in str(exc.value) and "no module psycopg" in str(exc.value)
    lab.spawn("h1", "worker", ["sh", "-c", "kill -9 $$"])
    with pytest.raises(LabError, match="was killed by SIGKILL before printing 'JOINED'"):
        lab.wait_output("h1", "worker", "JOINED", timeout_s=15)


def test_restart_runs_the_same_command_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lab restart h1` (from another shell: lab.json): the worker's process group is
    stopped, the same command started again, and it waits for the new one's JOINED, not the
    old one's line; an unknown host is one line naming the hosts it can restart."""
    from cellswarm.lab import lab as lab_module
    from cellswarm.lab.lab import Lab

    lab = _paper_lab(tmp_path, monkeypatch)
    cmd = ["sh", "-c", "echo JOINED $$; exec sleep 600"]
    first = lab.spawn("h1", "worker", cmd)
    lab.wait_output("h1", "worker", "JOINED")
    monkeypatch.setattr(Lab, "enter", lambda self, host: [])  # Lab.load's object, too
    monkeypatch.setattr(lab_module, "RESTART_GRACE_S", 2.0)
    try:
        assert main(["lab", "restart", "h1", "--state-dir", str(tmp_path)]) == 0
        assert first.wait(10) is not None  # stopped: SIGTERM to its group
        again = Lab.load(tmp_path).started["h1"]["worker"]
        assert again.cmd == tuple(cmd) and again.pid != first.pid
        assert f"JOINED {again.pid}" in lab.output("h1", "worker")
        assert f"(pid {again.pid}, the same flags)" in capsys.readouterr().out
        assert main(["lab", "restart", "h9", "--state-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("cellswarm: error:"), err
        assert "'h9'" in err and "hosts: h1" in err
    finally:  # no sleeper left behind, whatever failed
        pids = {first.pid}
        with contextlib.suppress(Exception):
            pids |= {s.pid for s in Lab.load(tmp_path).started["h1"].values()}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_two_coordinators_without_psycopg_say_so_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cellswarm.lab.lab import Lab

    monkeypatch.setitem(sys.modules, "psycopg", None)  # `import psycopg` fails

    def build_network(self: Lab) -> None:
        raise AssertionError("built a lab before saying what is missing")

    monkeypatch.setattr(Lab, "_build_network", build_network)
    assert main(["lab", "up", "--coordinators", "2", "--hosts", "2", "--racks", "1",
                 "--prefix", "cspgtest", "--state-dir", str(tmp_path / "lab"),
                 "--detach"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("cellswarm: error:"), err
    assert "psycopg" in err and "cellswarm[postgres]" in err


def test_the_lab_bench_writes_its_tables_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m bench.lab --out DIR` (here from saved runs, as `--runs` does) without
    matplotlib: lab.json and lab-table.md written, one line that the plot needs it."""
    from types import SimpleNamespace

    from bench import lab as bench_lab
    from cellswarm.sim import calibrate
    from cellswarm.sim.params import SimParams

    runs = EXAMPLE.parent.parent / "docs" / "lab-runs.jsonl"
    saved = [json.loads(line) for line in runs.read_text().splitlines()[:3]]  # one setup
    # the predictions are the simulator's and planner's own tests' (a minute here): stubbed
    monkeypatch.setattr(calibrate, "fit", lambda runs, host_floor: SimParams())
    monkeypatch.setattr(bench_lab, "simulate", lambda run, topology, params: SimpleNamespace(
        tokens_per_s=2.0, latency_p50_s=15.0, latency_p99_s=25.0))  # fmt: skip
    monkeypatch.setattr(bench_lab, "plan_rate", lambda *a: (2.1, 0.03, "aggregation"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    bench_lab.predict_and_report(saved, "ps3/40", tmp_path, as_json=False)
    assert json.loads((tmp_path / "lab.json").read_text())["rows"]
    assert (tmp_path / "lab-table.md").read_text().count("| 1 rack x 8 |") == 3
    assert not (tmp_path / "lab.png").exists()
    note = [line for line in capsys.readouterr().out.splitlines() if "matplotlib" in line]
    assert len(note) == 1 and "cellswarm[plot]" in note[0], note
