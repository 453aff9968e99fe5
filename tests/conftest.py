"""Shared fixtures: tiny random reference models built with transformers, and the demo model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
