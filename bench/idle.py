"""What an idle swarm costs: CPU of the coordinator and of each worker with nothing queued.

A coordinator and 3 workers (`cellswarm up`'s processes, the demo model) are started, left
to wire the ring, then measured for --seconds with no job: CPU time from /proc/PID/stat
(user + system, the process and its threads) over wall time, and the coordinator database's
growth (WAL bytes). Issue 13's goal: an idle coordinator <= 2% of a core, a head <= 1%.

    python -m bench.idle [--seconds 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from cellswarm.swarm.local.up import LocalSwarm

TICKS_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_S  # utime, stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from cellswarm.demo import demo_model_path

    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(
        str(demo_model_path()), workers=3, memory="256M", state_dir=Path(tmp), stages=3,
        heartbeat_s=0.5, heartbeat_timeout_s=3.0,
    ) as swarm:  # fmt: skip
        status = swarm.wait_ready()
        heads = {n["node_id"] for n in status["nodes"] if n["stage"] == 0}
        time.sleep(2.0)  # past the wiring
        pids = {name: p.pid for name, p in swarm.procs.items()}
        wal = Path(tmp) / "coordinator.db-wal"
        before = {name: cpu_s(pid) for name, pid in pids.items()}
        wal0, t0 = (wal.stat().st_size if wal.exists() else 0), time.monotonic()
        time.sleep(args.seconds)
        wall = time.monotonic() - t0
        share = {name: (cpu_s(pid) - before[name]) / wall for name, pid in pids.items()}
        wal_bytes = (wal.stat().st_size if wal.exists() else 0) - wal0
    out = {"seconds": round(wall, 1), "cpu_share": {k: round(v, 4) for k, v in share.items()},
           "heads": sorted(heads),
           "coordinator_wal_bytes_per_s": round(wal_bytes / wall)}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"idle swarm, {wall:.0f} s, nothing queued (3 workers, heartbeats every 0.5 s):")
    for name, v in share.items():
        goal = " (goal <= 2%)" if name.startswith("coord") else ""
        print(f"  {name:14s} {100 * v:5.2f}% of a core{goal}")
    print(f"  database WAL growth: {out['coordinator_wal_bytes_per_s']:,} bytes/s "
          f"(heads: {', '.join(sorted(heads))})")  # fmt: skip


if __name__ == "__main__":
    main()
