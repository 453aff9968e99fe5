"""Node profiles (what one machine of a kind offers) and cluster defaults, read from TOML.

The built-in profiles live in `cellswarm/planner/data/nodes.toml`, each figure with its source.
A user file (`--profiles FILE`) adds profiles or overrides them: a table named like a built-in
changes only the fields it gives; a table with `base = "rpi4"` starts from that profile (a
built-in or one from the same file; `base` naming the table's own name means the built-in
underneath); any other table must give every field. Built-in profiles resolve their own
bases among the built-ins, so overriding `ps3` does not change `ps3-slim`. The reserved
table `[defaults]` holds `[defaults.network]` and `[defaults.power]`, whose keys a user file
may override one by one.

Units, as written in the TOML files:

* capacities -- `memory`, a tier's `capacity` -- are byte counts with BINARY suffixes,
  parsed by `cellswarm.units.parse_bytes`: "196M" = 196 * 2**20 bytes, "256MiB" the same.
* rates -- `memory_bandwidth` and a tier's `bandwidth` in bytes/s, `link_bandwidth` and the
  network's uplinks in BITS/s, `flops` in FLOP/s -- use DECIMAL SI suffixes, parsed by
  `parse_rate`: "25.6G" = 25.6e9, "941M" = 941e6, as spec sheets quote them (25.6 GB/s,
  1 Gbit/s). Plain TOML numbers are accepted too.
* times are in seconds (`link_rtt_s`, `latency_s`), power in watts, efficiencies are the
  fractions of peak actually achieved, in (0, 1].

Every bad value raises a one-line `RequestError` naming the profile, the field and the value.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from cellswarm.errors import RequestError
from cellswarm.units import parse_bytes

BUILTIN_FILE = "nodes.toml"
DEFAULTS_TABLE = "defaults"

_RATE_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([KMGT]?)\s*$", re.IGNORECASE)


def parse_rate(text: str | float) -> float:
    """'941M' -> 941e6, '25.6G' -> 25.6e9. Decimal SI suffixes k/K, M, G, T (case-insensitive);
    the unit (bytes/s, bits/s, FLOP/s) is the field's. A number passes through as a float."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    m = _RATE_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise RequestError(
            f"rate {text!r} is not a number with a decimal suffix; write e.g. 941M, 25.6G or 3.2T"
        )
    return float(m.group(1)) * _RATE_SUFFIX[m.group(2).upper()]


# -- validation helpers: one-line messages "<where>: <field> = <value> must be ..." -----------


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{where}: {key} = {value!r} is not a finite number")
    return float(value)


def _check_positive(where: str, key: str, value: Any) -> None:
    if _number(where, key, value) <= 0:
        raise RequestError(f"{where}: {key} = {value!r} must be > 0")


def _check_non_negative(where: str, key: str, value: Any) -> None:
    if _number(where, key, value) < 0:
        raise RequestError(f"{where}: {key} = {value!r} must be >= 0")


def _check_fraction(where: str, key: str, value: Any) -> None:
    if not 0 < _number(where, key, value) <= 1:
        raise RequestError(f"{where}: {key} = {value!r} must be in (0, 1]")


def _check_count(where: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{where}: {key} = {value!r} must be a whole number >= 1")


def _check_name(where: str, key: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{where}: {key} = {value!r} must be a non-empty string")


# -- the records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryTier:
    """One level of a memory hierarchy (DRAM, persistent memory, swap)."""

    name: str
    capacity_bytes: int
    bandwidth_bytes_per_s: float  # peak read bandwidth
    efficiency: float  # fraction of peak our reads achieve
    latency_s: float  # load-to-use latency of one access

    def __post_init__(self) -> None:
        _check_name("memory tier", "name", self.name)
        where = f"memory tier {self.name!r}"
        _check_count(where, "capacity", self.capacity_bytes)
        _check_positive(where, "bandwidth", self.bandwidth_bytes_per_s)
        _check_fraction(where, "efficiency", self.efficiency)
        _check_positive(where, "latency_s", self.latency_s)

    @property
    def effective_bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency


@dataclass(frozen=True)
class Thermal:
    """What a box's hot parts ask of its cooling (from the profile's `[NAME.thermal]`): the
    seed's homelab learned these the hard way for 4 Optane PMem 200 modules."""

    part: str  # "Optane PMem 200"
    modules: int
    module_w: tuple[float, float]  # under load, low..high
    airflow_m_s: tuple[float, float]  # needed across them
    throttle_c: float  # they slow down above
    shutdown_c: float  # and stop above

    def __post_init__(self) -> None:
        where = f"thermal of {self.part!r}"
        _check_count(where, "modules", self.modules)
        for name, pair in (("module_w", self.module_w), ("airflow_m_s", self.airflow_m_s)):
            if len(pair) != 2 or not 0 < pair[0] <= pair[1]:
                raise RequestError(f"{where}: {name} = {list(pair)} must be [low, high] > 0")
        if not 0 < self.throttle_c <= self.shutdown_c:
            raise RequestError(f"{where}: throttle_c must be > 0 and at most shutdown_c")

    def line(self) -> str:
        lo, hi = (self.modules * w for w in self.module_w)
        return (f"{self.modules} x {self.part} at {self.module_w[0]:g}-{self.module_w[1]:g} W: "
                f"{lo:g}-{hi:g} W next to the DRAM; needs {self.airflow_m_s[0]:g}-"
                f"{self.airflow_m_s[1]:g} m/s of airflow; throttles at {self.throttle_c:g} C, "
                f"shuts down at {self.shutdown_c:g} C")

    def as_dict(self) -> dict[str, Any]:
        return {"part": self.part, "modules": self.modules, "module_w": list(self.module_w),
                "airflow_m_s": list(self.airflow_m_s), "throttle_c": self.throttle_c,
                "shutdown_c": self.shutdown_c}  # fmt: skip


@dataclass(frozen=True)
class NodeProfile:
    """What one node of a kind offers us. `tiers`, when given, lists every memory tier fastest
    first (the first normally being the DRAM that `memory_*` describe); `swap` is an optional
    slow tier used only as swap (the PS3's GDDR3)."""

    name: str
    description: str
    memory_bytes: int  # usable by our process
    memory_bandwidth_bytes_per_s: float  # peak
    memory_efficiency: float  # fraction of peak a streaming read achieves
    flops: float  # peak float32 FLOP/s usable by us
    compute_efficiency: float  # fraction of peak a quantized matvec achieves
    cores: int
    link_bits_per_s: float  # TCP goodput of the node's network link
    link_rtt_s: float  # round trip to a node on the same access switch
    power_busy_w: float
    power_idle_w: float
    tiers: tuple[MemoryTier, ...] = ()
    swap: MemoryTier | None = None
    # The part of a batch-1 quantized matvec's compute that is done once per read of the
    # weights (unpacking the blocks), not once per sequence: a pass of B sequences computes
    # share + B x (1 - share) matvecs' worth. 0: every sequence pays it all (the roofline's
    # FLOPs x B). bench.batch measures it on the host's own kernels (0.6 on a Zen 4 core).
    unpack_share: float = 0.0
    thermal: Thermal | None = None  # its cooling needs, where the profile knows them

    def __post_init__(self) -> None:
        _check_name("node profile", "name", self.name)
        where = f"node profile {self.name!r}"
        _check_name(where, "description", self.description)
        _check_count(where, "memory", self.memory_bytes)
        _check_positive(where, "memory_bandwidth", self.memory_bandwidth_bytes_per_s)
        _check_fraction(where, "memory_efficiency", self.memory_efficiency)
        _check_positive(where, "flops", self.flops)
        _check_fraction(where, "compute_efficiency", self.compute_efficiency)
        _check_count(where, "cores", self.cores)
        _check_positive(where, "link_bandwidth", self.link_bits_per_s)
        _check_positive(where, "link_rtt_s", self.link_rtt_s)
        _check_positive(where, "power_busy_w", self.power_busy_w)
        _check_positive(where, "power_idle_w", self.power_idle_w)
        if not 0 <= _number(where, "unpack_share", self.unpack_share) < 1:
            raise RequestError(f"{where}: unpack_share = {self.unpack_share!r} must be in [0, 1)")
        if self.power_idle_w > self.power_busy_w:
            raise RequestError(
                f"{where}: power_idle_w = {self.power_idle_w!r} exceeds "
                f"power_busy_w = {self.power_busy_w!r}"
            )
        for tier in (*self.tiers, *((self.swap,) if self.swap else ())):
            if not isinstance(tier, MemoryTier):
                raise RequestError(f"{where}: tier {tier!r} is not a MemoryTier")

    @property
    def effective_bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_bytes_per_s * self.memory_efficiency

    @property
    def effective_flops(self) -> float:
        return self.flops * self.compute_efficiency

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_bits_per_s / 8


@dataclass(frozen=True)
class NetworkSpec:
    """A three-tier (access / aggregation / core) tree. Rates in bits/s; the *_added_rtt_s
    are round-trip times added to a profile's link_rtt_s (which already crosses one access
    switch) when the path between two nodes climbs to that tier."""

    nodes_per_access_switch: int
    access_uplinks: int
    access_uplink_bits_per_s: float  # one uplink
    access_oversubscription: float  # node bandwidth down : uplink bandwidth up
    access_switches_per_aggregation: int
    aggregation_uplinks: int
    aggregation_uplink_bits_per_s: float  # one uplink
    aggregation_oversubscription: float
    core_bandwidth_bits_per_s: float
    access_added_rtt_s: float
    aggregation_added_rtt_s: float
    core_added_rtt_s: float

    def __post_init__(self) -> None:
        where = "network defaults"
        for key in ("nodes_per_access_switch", "access_uplinks"):
            _check_count(where, key, getattr(self, key))
        for key in ("access_switches_per_aggregation", "aggregation_uplinks"):
            _check_count(where, key, getattr(self, key))
        for key, attr in _NETWORK_RATES.items():
            _check_positive(where, key, getattr(self, attr))
        for key in ("access_oversubscription", "aggregation_oversubscription"):
            _check_positive(where, key, getattr(self, key))
        for key in ("access_added_rtt_s", "aggregation_added_rtt_s", "core_added_rtt_s"):
            _check_non_negative(where, key, getattr(self, key))

    @property
    def nodes_per_aggregation(self) -> int:
        return self.nodes_per_access_switch * self.access_switches_per_aggregation

    @property
    def access_uplink_total_bits_per_s(self) -> float:
        return self.access_uplinks * self.access_uplink_bits_per_s

    @property
    def aggregation_uplink_total_bits_per_s(self) -> float:
        return self.aggregation_uplinks * self.aggregation_uplink_bits_per_s


@dataclass(frozen=True)
class PowerSpec:
    price_per_kwh: float  # currency-neutral
    pue: float  # facility power usage effectiveness, >= 1

    def __post_init__(self) -> None:
        _check_non_negative("power defaults", "price_per_kwh", self.price_per_kwh)
        if _number("power defaults", "pue", self.pue) < 1:
            raise RequestError(f"power defaults: pue = {self.pue!r} must be >= 1")


# -- TOML keys -> record fields ---------------------------------------------------------------

Converter = Callable[[Any], Any]


def _as_capacity(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise RequestError("not a byte count; write e.g. 196M or 1.5G (binary units)")
    return parse_bytes(value)


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError("not a number")
    return float(value)


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError("not a whole number")
    return value


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise RequestError("not a string")
    return value


# TOML key -> (dataclass field, converter)
_PROFILE_KEYS: dict[str, tuple[str, Converter]] = {
    "description": ("description", _as_str),
    "memory": ("memory_bytes", _as_capacity),
    "memory_bandwidth": ("memory_bandwidth_bytes_per_s", parse_rate),
    "memory_efficiency": ("memory_efficiency", _as_float),
    "flops": ("flops", parse_rate),
    "compute_efficiency": ("compute_efficiency", _as_float),
    "cores": ("cores", _as_int),
    "link_bandwidth": ("link_bits_per_s", parse_rate),
    "link_rtt_s": ("link_rtt_s", _as_float),
    "power_busy_w": ("power_busy_w", _as_float),
    "power_idle_w": ("power_idle_w", _as_float),
}
_PROFILE_OPTIONAL = ("tiers", "swap", "base", "unpack_share", "thermal")
_TIER_KEYS: dict[str, tuple[str, Converter]] = {
    "name": ("name", _as_str),
    "capacity": ("capacity_bytes", _as_capacity),
    "bandwidth": ("bandwidth_bytes_per_s", parse_rate),
    "efficiency": ("efficiency", _as_float),
    "latency_s": ("latency_s", _as_float),
}
_NETWORK_RATES = {
    "access_uplink": "access_uplink_bits_per_s",
    "aggregation_uplink": "aggregation_uplink_bits_per_s",
    "core_bandwidth": "core_bandwidth_bits_per_s",
}
NETWORK_KEYS: dict[str, tuple[str, Converter]] = {
    "nodes_per_access_switch": ("nodes_per_access_switch", _as_int),
    "access_uplinks": ("access_uplinks", _as_int),
    "access_uplink": ("access_uplink_bits_per_s", parse_rate),
    "access_oversubscription": ("access_oversubscription", _as_float),
    "access_switches_per_aggregation": ("access_switches_per_aggregation", _as_int),
    "aggregation_uplinks": ("aggregation_uplinks", _as_int),
    "aggregation_uplink": ("aggregation_uplink_bits_per_s", parse_rate),
    "aggregation_oversubscription": ("aggregation_oversubscription", _as_float),
    "core_bandwidth": ("core_bandwidth_bits_per_s", parse_rate),
    "access_added_rtt_s": ("access_added_rtt_s", _as_float),
    "aggregation_added_rtt_s": ("aggregation_added_rtt_s", _as_float),
    "core_added_rtt_s": ("core_added_rtt_s", _as_float),
}
_POWER_KEYS: dict[str, tuple[str, Converter]] = {
    "price_per_kwh": ("price_per_kwh", _as_float),
    "pue": ("pue", _as_float),
}


def _convert(
    where: str, raw: Mapping[str, Any], keys: Mapping[str, tuple[str, Converter]]
) -> dict[str, Any]:
    """TOML table -> dataclass keyword arguments; every key must be known and present."""
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise RequestError(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(keys)}")
    missing = [k for k in keys if k not in raw]
    if missing:
        raise RequestError(f"{where}: missing field {missing[0]!r}")
    out: dict[str, Any] = {}
    for key, (attr, convert) in keys.items():
        value = raw[key]
        try:
            out[attr] = convert(value)
        except RequestError as e:
            raise RequestError(f"{where}: {key} = {value!r}: {e}") from None
    return out


def _tier(where: str, field: str, raw: Any) -> MemoryTier:
    if not isinstance(raw, Mapping):
        raise RequestError(f"{where}: {field} = {raw!r} is not a table")
    kwargs = _convert(f"{where}: {field}", raw, _TIER_KEYS)
    try:
        return MemoryTier(**kwargs)
    except RequestError as e:  # "memory tier 'pmem': efficiency = 1.5 must be in (0, 1]"
        detail = str(e).removeprefix("memory tier")
        sep = "" if detail.startswith(":") else " "
        raise RequestError(f"{where}: {field}{sep}{detail.strip()}") from None


def _profile(name: str, raw: Mapping[str, Any], origin: str) -> NodeProfile:
    where = f"node profile {name!r}{origin}"
    fields = {k: v for k, v in raw.items() if k not in _PROFILE_OPTIONAL}
    missing = [k for k in _PROFILE_KEYS if k not in fields]
    if missing:
        raise RequestError(
            f"{where}: missing field {missing[0]!r} (give it, or inherit it with "
            f'base = "<profile>")'
        )
    kwargs = _convert(where, fields, _PROFILE_KEYS)
    tiers = raw.get("tiers", [])
    if not isinstance(tiers, list):
        raise RequestError(f"{where}: tiers = {tiers!r} is not an array of tables")
    kwargs["tiers"] = tuple(_tier(where, f"tiers[{i}]", t) for i, t in enumerate(tiers))
    swap = raw.get("swap", False)
    kwargs["swap"] = None if swap is False else _tier(where, "swap", swap)
    kwargs["unpack_share"] = raw.get("unpack_share", 0.0)
    if "thermal" in raw:
        kwargs["thermal"] = _thermal(where, raw["thermal"])
    try:
        return NodeProfile(name=name, **kwargs)
    except RequestError as e:
        msg = str(e)
        if origin and msg.startswith(f"node profile {name!r}"):
            msg = where + msg[len(f"node profile {name!r}") :]
        raise RequestError(msg) from None


def _thermal(where: str, raw: Any) -> Thermal:
    keys = ("part", "modules", "module_w", "airflow_m_s", "throttle_c", "shutdown_c")
    if not isinstance(raw, dict) or set(raw) != set(keys):
        raise RequestError(f"{where}: thermal must be a table of exactly {', '.join(keys)}")
    try:
        return Thermal(str(raw["part"]), int(raw["modules"]),
                       (float(raw["module_w"][0]), float(raw["module_w"][1])),
                       (float(raw["airflow_m_s"][0]), float(raw["airflow_m_s"][1])),
                       float(raw["throttle_c"]), float(raw["shutdown_c"]))  # fmt: skip
    except (TypeError, ValueError, IndexError):
        raise RequestError(f"{where}: thermal {raw!r}: module_w and airflow_m_s are [low, "
                           "high] pairs of numbers, the rest numbers") from None


# -- files ------------------------------------------------------------------------------------


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise RequestError(f"profiles file {str(path)!r} does not exist") from None
    except OSError as e:
        raise RequestError(f"profiles file {str(path)!r} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise RequestError(f"profiles file {str(path)!r} is not valid TOML: {e}") from None
    for key, value in data.items():
        if not isinstance(value, dict):
            raise RequestError(
                f"profiles file {str(path)!r}: top-level key {key!r} = {value!r} is not a "
                f"table; write [{key}] and its fields below it"
            )
    return data


def _builtin() -> dict[str, Any]:
    text = resources.files("cellswarm.planner").joinpath("data", BUILTIN_FILE).read_text("utf-8")
    return tomllib.loads(text)


def _layers(extra: Path | None) -> list[tuple[str, dict[str, Any]]]:
    """(origin note, top-level tables) for the built-in file, then the user's."""
    layers = [("", _builtin())]
    if extra is not None:
        layers.append((f" (in {extra})", _read_toml(Path(extra))))
    return layers


def _resolve(
    name: str,
    layers: list[tuple[str, dict[str, Any]]],
    top: int,
    chain: tuple[tuple[str, int], ...],
) -> dict[str, Any]:
    """The merged raw table of profile `name` as seen from layer `top` downwards: the table
    itself over its base (`base = "x"`), or over the same name's table in a lower layer."""
    level = next((i for i in range(top, -1, -1) if name in layers[i][1]), None)
    if level is None:
        known = sorted({n for _, t in layers for n in t if n != DEFAULTS_TABLE})
        raise RequestError(
            f"node profile {chain[-1][0]!r}: base = {name!r} is not a known profile; "
            f"known: {', '.join(known)}"
        )
    if (name, level) in chain:
        path = " -> ".join([n for n, _ in chain] + [name])
        raise RequestError(f"node profile {chain[-1][0]!r}: base = {name!r} makes a cycle ({path})")
    chain = (*chain, (name, level))
    table = dict(layers[level][1][name])
    base = table.pop("base", None)
    if base is None:
        below = any(name in layers[i][1] for i in range(level))
        parent = _resolve(name, layers, level - 1, chain) if below else {}
    elif not isinstance(base, str):
        raise RequestError(f"node profile {name!r}: base = {base!r} is not a profile name")
    else:
        parent = _resolve(base, layers, level - 1 if base == name else level, chain)
    return parent | table


def load_profiles(extra: Path | None = None) -> dict[str, NodeProfile]:
    """Built-in profiles, then the tables of `extra` adding or overriding profiles."""
    layers = _layers(extra)
    names: dict[str, str] = {}
    for origin, tables in layers:
        for name in tables:
            if name != DEFAULTS_TABLE:
                names[name] = origin
    return {
        name: _profile(name, _resolve(name, layers, len(layers) - 1, ()), origin)
        for name, origin in names.items()
    }


def get_profile(name: str, extra: Path | None = None) -> NodeProfile:
    """A profile by name; `NAME/K` is that node slowed K times (see `dilate`)."""
    base, slash, factor = name.partition("/")
    if slash:
        try:
            k = float(factor)
        except ValueError:
            k = 0.0
        if not k >= 1.0:
            raise RequestError(f"node profile {name!r}: after '/' give a slowdown >= 1, "
                               f"e.g. {base}/20")  # fmt: skip
        return dilate(get_profile(base, extra), k)
    profiles = load_profiles(extra)
    if name not in profiles:
        raise RequestError(
            f"unknown node profile {name!r}; known: {', '.join(sorted(profiles))} "
            "(or define it in a TOML file with --profiles)"
        )
    return profiles[name]


def _defaults(section: str, extra: Path | None) -> tuple[dict[str, Any], str]:
    merged: dict[str, Any] = {}
    origin = ""
    for layer_origin, tables in _layers(extra):
        defaults = tables.get(DEFAULTS_TABLE, {})
        if not isinstance(defaults, dict):
            raise RequestError(f"[{DEFAULTS_TABLE}]{layer_origin} is not a table")
        part = defaults.get(section, {})
        if not isinstance(part, dict):
            raise RequestError(f"[{DEFAULTS_TABLE}.{section}]{layer_origin} is not a table")
        merged |= part
        origin = layer_origin if part else origin
    return merged, origin


def load_network(extra: Path | None = None) -> NetworkSpec:
    raw, origin = _defaults("network", extra)
    return NetworkSpec(**_convert(f"network defaults{origin}", raw, NETWORK_KEYS))


def load_power(extra: Path | None = None) -> PowerSpec:
    raw, origin = _defaults("power", extra)
    return PowerSpec(**_convert(f"power defaults{origin}", raw, _POWER_KEYS))


def dilate(p: NodeProfile, k: float) -> NodeProfile:
    """The node in slow motion: memory, compute and link rates divided by k, round trips
    times k. Every time it predicts is k times longer and every ratio (which tier saturates
    first, where a pipeline's bottleneck is) stays, so a machine too small to emulate a
    swarm at full speed can run it at 1/k and report figures that scale back by k. Memory
    sizes are not scaled: what fits still fits."""
    from dataclasses import replace

    return replace(
        p, name=f"{p.name}/{k:g}", description=f"{p.description} (slowed {k:g}x)",
        memory_bandwidth_bytes_per_s=p.memory_bandwidth_bytes_per_s / k, flops=p.flops / k,
        link_bits_per_s=p.link_bits_per_s / k, link_rtt_s=p.link_rtt_s * k,
        tiers=tuple(_dilate_tier(t, k) for t in p.tiers),
        swap=_dilate_tier(p.swap, k) if p.swap else None,
    )  # fmt: skip


def _dilate_tier(t: MemoryTier, k: float) -> MemoryTier:
    from dataclasses import replace

    return replace(t, bandwidth_bytes_per_s=t.bandwidth_bytes_per_s / k, latency_s=t.latency_s * k)
