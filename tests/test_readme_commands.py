"""The README's commands as written (issue 34, item 9): each either works or says in one line
what is missing — before any work; long waits say what they wait for; tables fit 80 columns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "cellswarm"]


def run(argv: list[str], env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    import os

    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})  # fmt: skip


def without(module: str, folder: Path) -> dict[str, str]:
    """An environment where `import module` fails, as on a machine without it."""
    (folder / f"{module}.py").write_text(f"raise ImportError('no {module} here')\n")
    return {"PYTHONPATH": str(folder)}


def test_eval_names_the_formats_it_can_make_before_any_work(demo_path: Path) -> None:
    r = run([*CLI, "eval", str(demo_path), "--quant", "q8_0,q4_k"])
    said = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(said) == 1, said
    assert "cannot make Q4_K" in said[0] and "q8_0" in said[0] and "q4_0" in said[0]
    help_text = run([*CLI, "eval", "--help"]).stdout
    assert "q4_k" not in help_text and "q8_0" in help_text


def test_a_plot_without_matplotlib_is_said_before_the_work(
    demo_path: Path, tmp_path: Path
) -> None:
    env = without("matplotlib", tmp_path)
    for argv in (["eval", str(demo_path), "--quant", "q8_0", "--plot", "q.png"],
                 ["plan", "kimi-k3", "--node", "ps3", "--count", "100000", "--plot", "p.png"]):
        r = run([*CLI, *argv], env)
        said = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(said) == 1 and "pip install" in said[0], (argv, said)
        assert "eval:" not in r.stderr  # no progress line: nothing was computed first


def test_eval_says_what_it_is_doing(demo_path: Path) -> None:
    r = run([*CLI, "eval", str(demo_path), "--quant", "q8_0", "--window", "64"], timeout=600)
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stderr.splitlines() if line.startswith("eval:")]
    assert len(steps) == 2 and "1 of 2" in steps[0] and "q8_0" in steps[1], steps


def test_the_control_plane_bench_runs_what_it_can_without_nats(tmp_path: Path) -> None:
    r = run([sys.executable, "-m", "bench.control_plane", "--nodes", "20", "--seconds", "2",
             "--rings", "1", "--jobs", "50"], without("nats", tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "skipping --via nats: nats-py is not installed" in r.stderr
    assert "relay/40" in r.stdout


def test_calibrate_reports_and_exits_0_unless_strict(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from cellswarm.cli import main
    from cellswarm.sim import calibrate

    def check(workers: int, killed: bool, measured: float, predicted: float) -> Any:
        run_ = SimpleNamespace(workers=workers, killed=killed, tokens_per_s=measured,
                               p50_latency_s=1.0)  # fmt: skip
        return calibrate.Check(run_, SimpleNamespace(tokens_per_s=predicted,  # type: ignore[arg-type]
                                                     latency_p50_s=1.0))
    params = SimpleNamespace(hop_overhead_s=0.0005, step_overhead_s=0.001,
                             replace_overhead_s=0.3)  # fmt: skip
    fake = calibrate.Calibration(params,  # type: ignore[arg-type]
                                 (check(4, False, 100.0, 101.0), check(4, True, 60.0, 36.0)))
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(calibrate, "calibrate", lambda **kw: fake)
    assert main(["simulate", "--calibrate"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "1 of 2 runs predicted within ±15%" in flat and "4 workers with a kill" in flat
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    assert main(["simulate", "--calibrate", "--strict"]) == 1


def test_batch_watch_rates_over_the_last_minute_and_says_why_it_stalls() -> None:
    from cellswarm.swarm.batch_cli import stall_reason, stalled_s, watch_detail

    info = {"counts": {"done": 30, "dead": 0, "cancelled": 0, "queued": 70, "leased": 0},
            "finished": 30, "total": 100}  # fmt: skip
    moving = [(0.0, 10, 100), (30.0, 20, 200), (60.0, 30, 300)]
    assert watch_detail(info, moving, None).endswith(
        "0.33 jobs/s, 3.3 tok/s over 60 s | ETA 210 s")  # fmt: skip
    still = [(0.0, 30, 300), (20.0, 30, 300)]
    assert stalled_s(still) == 20.0
    status = {"wired": False, "problem": ""}
    line = watch_detail(info, still, status)
    assert "stalled 20 s: the ring is being rewired" in line and "ETA" not in line
    assert "cannot place the model (no workers)" in stall_reason(
        {"wired": False, "problem": "no workers"}, info["counts"])  # fmt: skip
    assert "none is leased" in stall_reason({"wired": True}, info["counts"])


def test_status_fits_80_columns(monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from cellswarm.swarm.commands import print_status

    monkeypatch.setenv("COLUMNS", "80")
    nodes = [{"node_id": f"worker-{i}", "state": s, "holds": h, "address": "127.0.0.1:34137",
              "peak_rss_bytes": 108 << 20, "memory_bytes": 128 << 20, "last_seen_s_ago": 0.2,
              "served": 4, "failures": 0, "message": "loaded in 0.4 s" if i == 0 else "",
              "clock_offset_s": -1e-4, "clock_error_s": 2e-4}
             for i, (s, h) in enumerate([("assigned", "layers 0..14"),
                                         ("assigned", "layers 15..29 + head"), ("spare", "-")])]
    print_status({"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "epoch": 2, "wired": True,
                  "context": 684, "sequences": 2, "bottlenecks": [], "problem": "",
                  "nodes": nodes})  # fmt: skip
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    for n in nodes:
        assert str(n["node_id"]) in out and str(n["holds"]) in out
    assert "127.0.0.1:34137" in out and "108.0 of 128.0 MiB" in out
    assert "worker-0: loaded in 0.4 s" in out


def test_eval_scores_files_made_elsewhere_as_the_engine_runs_them(
    demo_path: Path, tmp_path: Path
) -> None:
    """--files: the same model quantized elsewhere (here: the file itself, run on the fused
    kernels) scored against the model's float32 path; a missing file is one line first."""
    r = run([*CLI, "eval", str(demo_path), "--files", str(tmp_path / "nope.gguf")])
    said = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(said) == 1 and "nope.gguf: no such file" in said[0], said
    r = run([*CLI, "eval", str(demo_path), "--files", str(demo_path), "--window", "64",
             "--json"], timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["quant"] for row in rows] == ["f32", demo_path.name]
    assert rows[1]["mean_kl"] < 0.01 and rows[1]["top1_agreement"] > 0.9
