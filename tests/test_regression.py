"""The seed's fixed-prompt regression test: the demo model's greedy outputs for the prompts
in tests/regression/ against the golden file beside them (written once with
`cellswarm eval DEMO --prompts tests/regression/demo_prompts.txt --golden
tests/regression/demo_golden.json --write`; rewrite it only for a deliberate change)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import cellswarm
from cellswarm.engine import golden

HERE = Path(__file__).parent / "regression"
PROMPTS, GOLDEN = HERE / "demo_prompts.txt", HERE / "demo_golden.json"


@pytest.fixture(scope="module")
def demo(demo_path: Path) -> cellswarm.Model:
    return cellswarm.load(demo_path)


def test_the_demo_model_still_says_what_it_said(demo: cellswarm.Model) -> None:
    goldens = golden.load(GOLDEN)
    prompts = [p for p in PROMPTS.read_text().splitlines() if p.strip()]
    assert [g.prompt for g in goldens] == prompts
    checks = golden.check(demo, goldens)
    assert [c.mismatch for c in checks] == [None] * len(checks), checks
    # most steps are far from a tie: the check is not vacuous
    assert sum(c.checked for c in checks) >= len(checks) * 8, [c.checked for c in checks]
    assert "Paris" in goldens[0].text


def test_a_changed_output_fails_at_its_first_sure_token(
    demo: cellswarm.Model, tmp_path: Path
) -> None:
    g = golden.load(GOLDEN)[0]
    first_sure = next(i for i, m in enumerate(g.margins) if m >= golden.MIN_MARGIN)
    tokens = list(g.tokens)
    tokens[first_sure] = (tokens[first_sure] + 1) % 1000
    [c] = golden.check(demo, [golden.Golden(g.prompt, tokens, g.margins, g.text)])
    assert c.mismatch == first_sure and not c.ok


@pytest.mark.slow
def test_the_eval_command_checks_and_fails_in_its_exit_status(
    demo_path: Path, tmp_path: Path
) -> None:
    cmd = [sys.executable, "-m", "cellswarm", "eval", str(demo_path), "--prompts", str(PROMPTS),
           "--golden"]  # fmt: skip
    ok = subprocess.run([*cmd, str(GOLDEN)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.count("ok ") == 5, ok.stdout + ok.stderr
    bad = json.loads(GOLDEN.read_text())
    bad[1]["tokens"] = [t + 1 for t in bad[1]["tokens"]]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    run = subprocess.run([*cmd, str(tmp_path / "bad.json")], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 1 and "FAIL at token" in run.stdout, run.stdout + run.stderr


@pytest.mark.slow
def test_eval_quant_table_orders_the_formats_by_their_cost(demo_path: Path) -> None:
    from cellswarm.evaluate import quant_table

    rows = {r["quant"]: r for r in quant_table(str(demo_path), ["q8_0", "q4_0"], None, 128)}
    assert rows["f32"]["mean_kl"] == 0 and rows["f32"]["top1_agreement"] == 1
    assert 0 < rows["q8_0"]["mean_kl"] < rows["q4_0"]["mean_kl"]
    assert rows["q8_0"]["top1_agreement"] > rows["q4_0"]["top1_agreement"]


def test_eval_plot_draws_the_table(tmp_path: Path) -> None:
    from cellswarm.evaluate import plot_quant

    rows = [{"quant": "f32", "perplexity": 14.7, "mean_kl": 0.0, "top1_agreement": 1.0},
            {"quant": "q8_0", "perplexity": 14.8, "mean_kl": 0.0012, "top1_agreement": 0.985},
            {"quant": "q4_0", "perplexity": 17.0, "mean_kl": 0.03, "top1_agreement": 0.9}]
    out = tmp_path / "quant.png"
    plot_quant(rows, out, "demo")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
