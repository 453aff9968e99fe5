"""The swarm's settings are written once (swarm/settings.py, swarm/policy/__init__.py):
the flags are derived from the config dataclass and give the same config back."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

import pytest

from cellswarm.swarm import policy
from cellswarm.swarm.settings import (
    CoordinatorConfig,
    WorkerConfig,
    add_flags,
    from_args,
    to_flags,
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, CoordinatorConfig)
    return parser.parse_args(argv)


BASE = CoordinatorConfig(model="m.gguf")


@pytest.mark.parametrize(
    "config",
    [BASE,
     replace(BASE, heartbeat_s=0.25, heartbeat_timeout_s=2.0, offline_after=5, stages=3),
     replace(BASE, rebalance=False, lease_s=2.5, evict_after_disagreements=1, replicas=2),
     replace(BASE, token_file="/t", api_key_file="/k", log_dir="/l", expert_nodes=4,
             vocab_nodes=2, context=1024, max_sequences=1, leader_ttl_s=9.0)],
)  # fmt: skip
def test_flags_give_the_config_back(config: CoordinatorConfig) -> None:
    assert from_args(CoordinatorConfig, parse(to_flags(config)), model="m.gguf") == config


def test_no_flags_are_the_dataclass_defaults_and_the_policy() -> None:
    assert from_args(CoordinatorConfig, parse([]), model="m.gguf") == BASE
    assert BASE.offline_after == policy.OFFLINE_AFTER < policy.POISON_AFTER
    assert BASE.lease_s == policy.LEASE_S


def test_every_flag_is_named_once() -> None:
    flags = [f.metadata["flag"] for f in fields(CoordinatorConfig) if "flag" in f.metadata]
    assert len(flags) == len(set(flags)) > 10


def test_the_cli_and_local_swarm_share_the_defaults(tmp_path: object) -> None:
    from cellswarm.swarm.local.up import TEST_CONTEXT_TOKENS, LocalSwarm

    swarm = LocalSwarm("m.gguf", 1, "100M", tmp_path)  # type: ignore[arg-type]
    config = swarm.coordinator_config()
    for name in ("lease_s", "offline_after", "max_sequences", "replicas",
                 "leader_ttl_s", "evict_after_disagreements", "rebalance"):  # fmt: skip
        assert getattr(config, name) == getattr(BASE, name), name
    # the context is not shared: a coordinator serves the model's own (None), a test swarm a
    # short one, and `cellswarm up` fits it to its workers (LocalSwarm.fit)
    assert (BASE.context, config.context) == (None, TEST_CONTEXT_TOKENS)


@pytest.mark.parametrize(
    "config",
    [WorkerConfig(join="http://c:8470", memory_bytes=256 << 20, node_id="n1"),
     WorkerConfig(join="http://a,http://b", memory_bytes=10**9, node_id="n2", model="/m.gguf",
                  threads=2, fetch=True, perturb=0.5, dram_budget_bytes=3 << 30,
                  fail_forward=True, fail_token=7, insecure=True, stop_after_s=1.5)],
)  # fmt: skip
def test_worker_flags_give_the_config_back(config: WorkerConfig) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig)
    assert from_args(WorkerConfig, parser.parse_args(to_flags(config))) == config


def test_a_worker_needs_join_and_memory() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, WorkerConfig)
    with pytest.raises(SystemExit):
        parser.parse_args(["--join", "http://c"])
    assert parser.parse_args(["--join", "u", "--memory", "256M"]).memory_bytes == 256 << 20
