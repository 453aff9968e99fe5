"""Prometheus itself (Debian's package) scraping a live swarm: the coordinator's /metrics and
every worker found through its http_sd route; each query docs/metrics.md recommends
evaluated, and its alert rule firing when a worker is killed for real."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cellswarm.swarm.api import client
from cellswarm.swarm.local.pipeline import free_port
from cellswarm.swarm.local.up import LocalSwarm
from tests.waiting import wait_until

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def doc_blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


def query(prom: str, q: str) -> list[dict[str, Any]]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (q, body)
    return list(body["data"]["result"])


def ready(prom: str) -> bool:
    try:
        with urllib.request.urlopen(f"{prom}/-/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def alerts(prom: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{prom}/api/v1/alerts", timeout=10) as r:
        return list(json.loads(r.read())["data"]["alerts"])


@pytest.fixture
def prometheus_bin() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CELLSWARM_REQUIRE_PROMETHEUS"):
            pytest.fail("prometheus is required here (.ci/run installs Debian's)")
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    return found


def test_prometheus_scrapes_the_swarm_evaluates_the_docs_queries_and_alerts(
    prometheus_bin: str, demo_path: Path, tmp_path: Path
) -> None:
    rules = doc_blocks("yaml")[-1].replace("for: 1m", "for: 0s")
    (tmp_path / "cellswarm-rules.yml").write_text(rules)
    with LocalSwarm(str(demo_path), 3, "160M", tmp_path / "swarm", stages=2) as swarm:
        swarm.wait_ready()
        coord = swarm.url.removeprefix("http://")
        (tmp_path / "prometheus.yml").write_text(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: cellswarm
    static_configs: [{{targets: ["{coord}"]}}]
  - job_name: cellswarm-worker
    http_sd_configs: [{{url: "{swarm.url}/v1/metrics/targets", refresh_interval: 1s}}]
rule_files: [{tmp_path / "cellswarm-rules.yml"}]
""")
        port = free_port()
        prom = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            wait_until(lambda: ready(prom), 60)
            wait_until(lambda: len(query(prom, 'up{job="cellswarm-worker"} == 1')) == 3, 60)
            wait_until(lambda: query(prom, "cellswarm_build_info"), 30)
            ids = [client.submit(swarm.url, {"prompt": p, "max_tokens": 8})
                   for p in ("Once upon a time", "The capital of France is", "1, 2, 3,")]
            for rid in ids:
                assert client.wait(swarm.url, rid, timeout_s=120)["state"] == "done"
            wait_until(lambda: query(prom, "cellswarm_generation_tokens_total > 0"), 30)
            time.sleep(3)  # a few more scrapes: rates over the window have two points
            for q in doc_blocks("promql")[0].strip().splitlines():
                result = query(prom, q)
                assert result, q  # every recommended query has data on a working swarm
            ttft = float(query(prom, doc_blocks("promql")[0].splitlines()[0])[0]["value"][1])
            assert ttft > 0
            # one series per worker, labelled by its node id alone
            ups = query(prom, 'up{job="cellswarm-worker"}')
            assert sorted(u["metric"]["node"] for u in ups) == ["worker-0", "worker-1",
                                                                 "worker-2"]  # fmt: skip
            assert all("state" not in u["metric"] for u in ups)
            swarm.kill("worker-2")  # the spare: the swarm keeps serving, the alert fires
            wait_until(lambda: any(a["labels"].get("node") == "worker-2" and a["state"] ==
                                   "firing" for a in alerts(prom)), 90)  # fmt: skip
            assert [a["labels"]["alertname"] for a in alerts(prom)] == ["CellswarmWorkerDown"]
            # its series stayed one: the worker's state changes did not split it
            assert len(query(prom, 'up{job="cellswarm-worker",node="worker-2"}')) == 1
        finally:
            proc.terminate()
            proc.wait(10)
