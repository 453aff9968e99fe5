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
    if r.tiers is None:
        ax.barh(names, values, color="tab:blue")
    else:  # a tiered box: each kind split into what DRAM holds and what only the slow tier does
        fast = [v / 2**30 for v in _in_dram(r, parts).values()]
        slow = [v - f for v, f in zip(values, fast, strict=True)]
        ax.barh(names, fast, color="tab:blue", label=r.tiers.dram_name)
        ax.barh(names, slow, left=fast, color="tab:orange", label=f"{r.tiers.slow_name} only")
        ax.legend(loc="lower right")
    ax.set_xlabel("GiB (one replica)")
    ax.invert_yaxis()
    ax.set_title("Memory breakdown")


def _in_dram(r: PlanResult, parts: dict[str, int]) -> dict[str, int]:
    """Bytes of each part the DRAM tier holds: pinned kinds whole, the experts up to the
    expert cache, the KV cache and runtime (they live in DRAM), nothing else."""
    tp = r.tiers
    assert tp is not None
    out = {}
    for name, size in parts.items():
        if name in tp.pinned_kinds or name.startswith(("KV", "runtime")):
            out[name] = size
        elif name == "experts":
            out[name] = min(size, tp.cached_expert_bytes)
        else:
            out[name] = 0
    return out


def _scaling(ax: Any, r: PlanResult) -> None:
    lo = max(r.min_nodes, 1)
    hi = max(r.request.count, lo * 4)
    counts = sorted({int(lo + (hi - lo) * i / (COUNT_STEPS - 1)) for i in range(COUNT_STEPS)})
    tps = [
        plan(r.model, dataclasses.replace(r.request, count=c)).throughput_tokens_per_s
        for c in counts
    ]
    ax.plot(counts, tps, marker="o")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole nodes: no tick at 1.5
    ax.set_xlabel("nodes")
    ax.set_ylabel("tokens/s (whole swarm)")
    ax.set_title(f"Throughput, {r.request.concurrency} in flight per replica")
    ax.grid(True, alpha=0.3)
