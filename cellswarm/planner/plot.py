"""`--plot FILE.png`: the memory breakdown, and swarm tokens/s against node count."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from cellswarm.errors import RequestError
from cellswarm.planner.plan import PlanResult, plan

COUNT_STEPS = 12


def plot(result: PlanResult, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RequestError("--plot needs matplotlib: pip install 'cellswarm[plot]'") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    _memory(left, result)
    _scaling(right, result)
    fig.suptitle(f"{result.model.name} on {result.request.node.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _memory(ax: Any, r: PlanResult) -> None:
    parts = dict(sorted(r.model.weights_by_kind().items(), key=lambda kv: -kv[1]))
    req = r.request
    parts["KV cache"] = r.kv_bytes_per_token * req.context * req.concurrency
    parts["runtime + scratch (all nodes)"] = (req.runtime_overhead_bytes + r.scratch_bytes) * max(
        r.min_nodes, 1
    )
    names, values = list(parts), [v / 2**30 for v in parts.values()]
    ax.barh(names, values, color="tab:blue")
    ax.set_xlabel("GiB (one replica)")
    ax.invert_yaxis()
    ax.set_title("Memory breakdown")


def _scaling(ax: Any, r: PlanResult) -> None:
    lo = max(r.min_nodes, 1)
    hi = max(r.request.count, lo * 4)
    counts = sorted({int(lo + (hi - lo) * i / (COUNT_STEPS - 1)) for i in range(COUNT_STEPS)})
    tps = [
        plan(r.model, dataclasses.replace(r.request, count=c)).throughput_tokens_per_s
        for c in counts
    ]
    ax.plot(counts, tps, marker="o")
    ax.set_xlabel("nodes")
    ax.set_ylabel("tokens/s (whole swarm)")
    ax.set_title(f"Throughput, {r.request.concurrency} in flight per replica")
    ax.grid(True, alpha=0.3)
