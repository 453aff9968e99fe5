"""Shared fixtures: tiny random reference models built with transformers, and the demo model."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# `make test-fast` (CELLSWARM_FAST=1): the developer loop's lane. A test that starts a process
# (a swarm, a pipeline, the CLI, the lab, PostgreSQL, llama.cpp) is skipped at the moment it
# tries; small tools (the compiler building the kernels, uname) still run. `make test` and CI
# run everything.
FAST_LANE = os.environ.get("CELLSWARM_FAST") == "1"
FAST_LANE_SKIPS = ("python", "cellswarm", "llama-", "ip", "tc", "initdb", "pg_ctl", "postgres")


def _starts_a_node(argv: list[Any]) -> bool:
    prog = os.path.basename(str(argv[0]).split()[0]) if argv else ""
    return prog == os.path.basename(sys.executable) or prog.startswith(FAST_LANE_SKIPS)


def pytest_configure(config: pytest.Config) -> None:
    if FAST_LANE:
        import subprocess

        real_init = subprocess.Popen.__init__

        def init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            if _starts_a_node(argv):
                pytest.skip("starts a process: not in the fast lane (`make test` runs it)")
            real_init(self, args, *rest, **kw)

        subprocess.Popen.__init__ = init  # type: ignore[method-assign]


def max_rel_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference as a fraction of the largest absolute reference logit."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def prefill_then_decode(model: Any, ids: np.ndarray, prefill: int) -> np.ndarray:
    """Logits for `ids`: one prefill of `prefill` tokens, then one token per step."""
    cache = model.new_cache(len(ids))
    out = [model.step(ids[:prefill], cache)]
    out += [model.step(ids[i : i + 1], cache) for i in range(prefill, len(ids))]
    return np.concatenate(out, axis=0)


def greedy_reference(
    path: Path, texts: list[str], max_tokens: int
) -> dict[tuple[int, ...], list[int]]:
    """Prompt ids -> one process's greedy tokens (no stop ids: every run makes max_tokens)."""
    import cellswarm
    from cellswarm.engine.model import GenerateOptions

    model = cellswarm.load(path)
    opts = GenerateOptions(max_tokens, stop_ids=frozenset())
    prompts = [tuple(model.tokenizer.encode(t)) for t in texts]
    return {p: model.generate(list(p), opts).token_ids for p in prompts}


@pytest.fixture(scope="session")
def demo_path() -> Path:
    from cellswarm.demo import demo_model_path

    return demo_model_path()


@pytest.fixture(scope="session")
def pg_cluster() -> Any:
    """A throwaway PostgreSQL cluster for the session (tests/pg_cluster.py); skips without
    PostgreSQL's binaries or psycopg."""
    from tests import pg_cluster as pg

    reason = pg.why_not()
    if reason:
        pytest.skip(reason)
    cluster = pg.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(pg_cluster: Any) -> str:
    """A fresh, empty database on the session's cluster."""
    return str(pg_cluster.new_database())


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


