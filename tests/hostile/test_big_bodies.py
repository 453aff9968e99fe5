"""Any API caller (or anyone, without --api-key-file) against the coordinator's liveness
(issue 56): bodies whose text could never fit the context are refused before a tokenizer or
a chat template runs over them, what is tokenized runs off the event loop that answers the
heartbeats, and a coordinator held up anyway counts no node's silence while it was deaf
(policy/nodes.py silence_s). Before: a 3 MB label, a 3 MB completion prompt, 64 prompts of
60 kB, a chat of 120,000 empty messages each froze the loop ~2-6 s and every worker was
declared lost."""

from __future__ import annotations

from pathlib import Path

import httpx

from cellswarm.swarm.api import client
from cellswarm.swarm.local.up import LocalSwarm

BIG = "word " * 600_000  # 3 MB


def test_bodies_that_cannot_fit_are_refused_unread_and_no_worker_is_lost(
    demo_path: Path, tmp_path: Path
) -> None:
    with LocalSwarm(str(demo_path), 2, "200M", tmp_path, stages=2) as swarm:
        swarm.wait_ready()
        epoch = swarm.status()["epoch"]
        said = {}

        def post(name: str, route: str, body: dict[str, object]) -> None:
            r = httpx.post(f"{swarm.url}{route}", json=body, timeout=120)
            said[name] = (r.status_code, r.text[:300])

        post("label", "/v1/batches", {"items": [{"prompt": "Is it?", "labels": ["yes", BIG]}]})
        model, empty = demo_path.stem, [{"role": "user", "content": ""}] * 120_000
        post("prompt", "/v1/completions", {"model": model, "prompt": BIG, "max_tokens": 1})
        post("64 prompts", "/v1/completions",
             {"model": model, "prompt": ["word " * 12_000] * 64, "max_tokens": 1})  # fmt: skip
        post("120,000 messages", "/v1/chat/completions", {"model": model, "messages": empty})
        post("batch chat", "/v1/batches", {"items": [{"messages": empty}]})
        assert all(code == 400 for code, _ in said.values()), said
        assert "labels[1]: 3,000,000 bytes of text cannot fit" in said["label"][1], said
        assert "messages cannot fit the context" in said["120,000 messages"][1], said
        status = swarm.status()
        assert status["epoch"] == epoch, status  # nobody lost, nothing rewired
        assert all(n["state"] == "assigned" and n["failures"] == 0 for n in status["nodes"])
        rid = client.submit(swarm.url, {"prompt": "The capital of France is", "max_tokens": 2})
        assert client.wait(swarm.url, rid, timeout_s=120)["state"] == "done"
