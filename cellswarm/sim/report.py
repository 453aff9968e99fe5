"""A simulation's summary for people (a rich table) and as charts (`--plot FILE.png`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cellswarm.errors import RequestError


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 3600:
        return f"{s / 3600:,.2f} h"
    if s >= 60:
        return f"{s / 60:,.1f} min"
    return f"{s:,.2f} s"


def render(out: dict[str, Any], console: Console | None = None) -> None:
    con = console or Console()
    sc, plan, jobs, fail = out["scenario"], out["plan"], out["jobs"], out["failures"]
    net, energy, lat, rep = out["network"], out["energy"], out["latency_s"], out["replay"]
    con.print(
        f"[bold]{sc['model']}[/] ({sc['quant']}) on [bold]{sc['count']:,} x {sc['node']}[/], "
        f"{_dur(sc['duration_s'])} simulated, seed {sc['seed']}"
    )
    t = Table(title="Simulation", show_header=False, title_justify="left")
    t.add_row(
        "replicas x nodes (spares)",
        f"{plan['replicas']:,} x {plan['min_nodes']:,} ({plan['spares']:,} spare)",
    )
    t.add_row(
        "planner: decode / swarm tokens/s",
        f"{_f(plan['decode_tokens_per_s'], 3)} / {_f(plan['throughput_tokens_per_s'])}",
    )
    t.add_row("simulated: tokens/s (whole run)", f"[bold]{_f(out['tokens_per_s'])}[/]")
    t.add_row("simulated: decode tokens/s per sequence", _f(out["decode_tokens_per_s"], 3))
    spec, acceptance = plan.get("speculation"), sc["workload"].get("acceptance")
    if spec and acceptance:
        t.add_row("speculative decoding, a lone sequence",
                  f"acceptance {acceptance:.2f}: {spec['speedup']:.2f}x (k={spec['k']}, "
                  f"{spec['in_flight']} round(s) in flight)")  # fmt: skip
    t.add_row("tokens generated", f"{out['tokens']:,.0f}")
    t.add_row("latency p50 / p99", f"{_dur(lat['p50'])} / {_dur(lat['p99'])}")
    t.add_row("jobs submitted / done", f"{jobs['submitted']:,} / {jobs['done']:,}")
    t.add_row(
        "jobs retried / dead-lettered / lost",
        f"{jobs['retried']:,} / {jobs['dead']:,} / {jobs['lost']:,}",
    )
    t.add_row("jobs queued / in flight at end", f"{jobs['queued']:,} / {jobs['in_flight']:,}")
    t.add_row(
        "failures (node / rack), per hour",
        f"{fail['node_failures']:,} / {fail['rack_failures']:,}, {_f(fail['failures_per_hour'])}/h",
    )
    t.add_row(
        "spare replacements, replicas dissolved",
        f"{fail['spare_replacements']:,}, {fail['replicas_dissolved']:,}",
    )
    t.add_row("node-hours lost to failures", _f(fail["node_hours_lost"], 1))
    t.add_row("nodes taken offline", f"{fail['offline_nodes']:,}")
    t.add_row("replays, replay time", f"{rep['replays']:,}, {_dur(rep['replay_s'])}")
    for tier in ("access", "aggregation", "core"):
        t.add_row(
            f"link utilisation {tier} (mean / peak)",
            f"{net['mean_utilization'][tier]:.2%} / {net['peak_utilization'][tier]:.2%}",
        )
    sat = "saturated" if net["saturated"] else "not saturated"
    t.add_row(
        "first saturated tier",
        f"{net['first_saturated_tier']} ({sat}, slowdown x{net['slowdown']:.2f})",
    )
    _control_rows(t, out["control"])
    t.add_row("energy", f"{_f(energy['kwh'], 1)} kWh ({_f(energy['mwh_per_day'], 1)} MWh/day)")
    t.add_row("joules per token", _f(energy["j_per_token"], 1))
    t.add_row("events", f"{out['events']:,}")
    con.print(t)  # fmt: skip


def _control_rows(t: Table, cp: dict[str, Any]) -> None:
    t.add_row("control plane: beat every / lost after",
              f"{_dur(cp['heartbeat_interval_s'])} / {_dur(cp['detect_s'])}")
    t.add_row("control plane load: beats + leases",
              f"{cp['beat_load']:.1%} + {cp['job_load']:.1%} of {cp['cores']:g} core(s)")
    wait = cp["lease_wait_s"]
    t.add_row("lease wait p50 / p99", f"{_dur(wait['p50'])} / {_dur(wait['p99'])}")
    if cp["saturated"]:
        verdict = "[red]saturated: beats alone exceed it, every node is lost[/]"
    elif cp["bottleneck"]:
        verdict = f"[yellow]the bottleneck ({cp['load']:.0%} busy)[/]"
    else:
        verdict = f"not the bottleneck ({cp['load']:.1%} busy)"
    t.add_row("control plane", verdict)  # fmt: skip


def plot(out: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RequestError("--plot needs matplotlib: pip install 'cellswarm[plot]'") from None
    s = out["series"]
    hours = [t / 3600 for t in s["t_s"]]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    panels = (
        ("tokens_per_s", "tokens/s (swarm)"),
        ("live_replicas", "live replicas"),
        ("queue_depth", "queue depth (jobs)"),
    )
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.plot(hours, s[key], drawstyle="steps-post" if key != "tokens_per_s" else "default")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("hours")
    sc = out["scenario"]
    fig.suptitle(f"{sc['model']} on {sc['count']:,} x {sc['node']} (seed {sc['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
