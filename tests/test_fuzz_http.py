"""Schemathesis over the coordinator's OpenAPI schema, against the running coordinator:
whatever a client sends to any route, the answer is never a 500 (bounded and seeded)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from cellswarm.swarm.local.up import LocalSwarm  # noqa: E402


@pytest.fixture(scope="module")
def swarm(demo_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(str(demo_path), 0, "120M", tmp_path_factory.mktemp("fuzz")) as s:
        yield s


def test_no_route_answers_500(swarm: LocalSwarm) -> None:
    schema = schemathesis.openapi.from_url(f"{swarm.url}/openapi.json")
    failures: list[tuple[str, int, str]] = []
    calls: list[int] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        fuzz(operation, swarm.url, failures, calls)
    print(f"{len(calls)} calls, statuses {sorted(set(calls))}")
    assert len(calls) >= 100, len(calls)  # every route, many bodies: not a vacuous pass
    assert not failures, failures


def fuzz(
    operation: Any, url: str, failures: list[tuple[str, int, str]], calls: list[int]
) -> None:
    @settings(max_examples=15, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(operation.as_strategy())
    def check(case: Any) -> None:
        response = case.call(base_url=url)
        calls.append(response.status_code)
        if response.status_code >= 500:
            failures.append((operation.label, response.status_code, response.text[:200]))

    check()
