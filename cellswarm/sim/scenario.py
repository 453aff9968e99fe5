"""Scenario files (TOML) -> `Scenario`; command-line values override the file's.

model = "kimi-k3"           # preset, .gguf file or Hugging Face folder
quant = "1.74"              # optional
node = "ps3"
count = 100000
context = 1024
concurrency = 4             # sequences in flight per replica
duration = "24h"
seed = 1
[workload]                  # a batch queued at t=0 (jobs = N) or arrivals (rate = jobs/s)
jobs = 12000
prompt_tokens = 512
output_tokens = 512
poison_fraction = 0.0
acceptance = 0.0            # drafts kept (speculative decoding; a lone sequence gains)
[failures]                  # durations: "90s", "30m", "4h", "2d", "3y" or seconds
mtbf = "10000h"
mttr = "4h"
rack_mtbf = "50000h"
rack_mttr = "1h"
slow_fraction = 0.02
slow_speed = 0.5
[network]                   # any key of nodes.toml's [defaults.network]
core_bandwidth = "3.2T"
[params]                    # SimParams fields (calibration)
hop_overhead_s = 0.0
[control]                   # ControlPlane fields (sim/control.py): the coordinator's capacity
max_beats_per_s = 4000.0
cores = 1.0
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from cellswarm.errors import RequestError
from cellswarm.sim.control import ControlPlane
from cellswarm.sim.params import Scenario, SimParams, parse_duration

_TOP = {"model", "quant", "node", "count", "context", "concurrency", "duration", "seed"}
_WORKLOAD = {"jobs", "rate", "prompt_tokens", "output_tokens", "poison_fraction", "acceptance"}
_FAILURES = {"mtbf", "mttr", "rack_mtbf", "rack_mttr", "slow_fraction", "slow_speed"}
_TABLES = {"workload", "failures", "network", "params", "control", "description"}


def read_scenario_file(path: Path) -> dict[str, Any]:
    """A scenario file -> flat keyword values (not yet validated)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RequestError(f"scenario file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"scenario file {path}: {exc}") from None
    out: dict[str, Any] = {}
    _take(out, raw, _TOP | _TABLES, str(path), "")
    for table, keys in (("workload", _WORKLOAD), ("failures", _FAILURES)):
        part = raw.get(table, {})
        if not isinstance(part, dict):
            raise RequestError(f"{path}: [{table}] is not a table")
        _take(out, part, keys, str(path), f"[{table}] ")
    for table in ("network", "params", "control"):
        part = raw.get(table, {})
        if not isinstance(part, dict):
            raise RequestError(f"{path}: [{table}] is not a table")
        out[table] = dict(part)
    return out


def _take(out: dict[str, Any], raw: dict[str, Any], keys: set[str], where: str, t: str) -> None:
    for key, value in raw.items():
        if key not in keys:
            raise RequestError(f"{where}: {t}key {key!r} is unknown; known: {sorted(keys)}")
        if key not in _TABLES:
            out[key] = value


def make_scenario(values: dict[str, Any]) -> Scenario:
    """Flat values (from a file and/or the command line) -> a validated Scenario."""
    v = {k: val for k, val in values.items() if val is not None}
    if "model" not in v:
        raise RequestError("no model: give MODEL or a scenario file with model = ...")
    params = v.get("params", {})
    known = {f.name for f in dataclasses.fields(SimParams)}
    unknown = set(params) - known
    if unknown:
        raise RequestError(f"[params] keys {sorted(unknown)} are unknown; known: {sorted(known)}")
    control = v.get("control", {})
    known = {f.name for f in dataclasses.fields(ControlPlane)}
    if set(control) - known:
        raise RequestError(f"[control] keys {sorted(set(control) - known)} are unknown; "
                           f"known: {sorted(known)}")  # fmt: skip
    kw: dict[str, Any] = {
        "model": str(v["model"]),
        "params": SimParams(**params),
        "control": ControlPlane(**control),
        "network": tuple((str(k), val) for k, val in v.get("network", {}).items()),
    }
    for key in ("node", "quant"):
        if key in v:
            kw[key] = str(v[key])
    ints = ("count", "context", "concurrency", "seed", "jobs", "prompt_tokens", "output_tokens")
    for key in ints:
        if key in v:
            kw[key] = _int(key, v[key])
    for key in ("rate", "poison_fraction", "slow_fraction", "slow_speed", "acceptance"):
        if key in v:
            kw[key] = _float(key, v[key])
    for key, field in (("duration", "duration_s"), ("mttr", "mttr_s"),
                       ("rack_mttr", "rack_mttr_s")):  # fmt: skip
        if key in v:
            kw[field] = parse_duration(v[key], f"--{key.replace('_', '-')}")
    for key, field in (("mtbf", "mtbf_s"), ("rack_mtbf", "rack_mtbf_s")):
        if key in v and str(v[key]).strip().lower() not in ("off", "none"):
            kw[field] = _mtbf(key, v[key])
    return Scenario(**kw)


def _mtbf(key: str, value: Any) -> float:
    text = str(value).strip()
    if text.startswith("-"):
        raise RequestError(f"--{key.replace('_', '-')} {text} must be a positive duration")
    return parse_duration(value, f"--{key.replace('_', '-')}")


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise RequestError(f"{key} = {value!r} must be an integer")
    try:
        return int(value)
    except ValueError:
        raise RequestError(f"{key} = {value!r} must be an integer") from None


def _float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise RequestError(f"{key} = {value!r} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise RequestError(f"{key} = {value!r} must be a number") from None
