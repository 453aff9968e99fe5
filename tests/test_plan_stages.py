"""`cellswarm plan --stages N --topology FILE` predicts the swarm the lab builds: the
coordinator's own split over N stages (ring/costs.py: budget_split, what `up --stages`
places), on the network the lab's topology file wires."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cellswarm.demo import demo_model_path
from cellswarm.planner import api
from cellswarm.swarm.ring.costs import budget_split

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "examples" / "lab-seed.toml"


@pytest.mark.parametrize(("stages", "context", "sequences"), [(8, 64, 1), (8, 64, 16), (3, 256, 4)])
def test_plan_stages_is_the_coordinators_split(stages: int, context: int, sequences: int) -> None:
    """(An f32 cache: the planner counts KV without the keys' padding, so at f16 a split can
    differ from the coordinator's by a layer where two are nearly even.)"""
    model = str(demo_model_path())
    plan = api.plan(api.resolve_model(model, cache_type="f32"), node="ps3/40", count=stages,
                    context=context, concurrency=sequences, stages=stages)  # fmt: skip
    assert plan.fits, plan.problem
    split = [s.layers for s in plan.placement.slots]
    assert split == [tuple(r) for r in budget_split(model, stages, 1 << 40, context, sequences,
                                                    cache_type="f32")]  # fmt: skip
    assert plan.min_nodes == stages


def _plan(*flags: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "cellswarm", "plan", str(demo_model_path()),
                          "--node", "ps3/40", "--json", *flags],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_the_topology_file_is_the_labs_network_and_hosts() -> None:
    from cellswarm.lab.cli import spec_of_file
    from cellswarm.lab.topology import build

    got = _plan("--stages", "6", "--topology", str(SEED), "--context", "64")
    assert got["count"] == 24  # the file's hosts
    assert got["min_nodes"] == 6 and got["replicas"] == 4
    assert len(got["placement"]) == 6  # type: ignore[arg-type]
    spec = spec_of_file(SEED)
    assert (spec.racks, spec.access_oversubscription) == (4, 20.0)
    net = build(spec).network_spec()
    # the seed's 20:1 rack uplinks: 6 hosts at 1 Gbit/s share 0.3 Gbit/s
    assert net.access_uplink_bits_per_s == pytest.approx(6 * 1e9 / 20)
    tiers = {t["tier"] for t in got["network"]}  # type: ignore[attr-defined]
    assert "access" in tiers


def test_bad_stages_and_topology_are_one_line() -> None:
    for flags, said in ((["--stages", "0"], "--stages 0"), (["--stages", "99"], "--stages 99"),
                        (["--topology", "/nonexistent.toml"], "--topology /nonexistent.toml"),
                        (["--stages", "2", "--parallel", "tensor"], "--stages")):  # fmt: skip
        out = subprocess.run([sys.executable, "-m", "cellswarm", "plan", str(demo_model_path()),
                              *flags], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode != 0
        assert said in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
