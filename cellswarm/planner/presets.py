"""Model presets for the planner: Hugging Face config.json contents for well-known models.

The data is `cellswarm/planner/data/models.toml`, one table per preset holding the config
keys the engine's config readers use (`model_type` included), plus three reserved keys:
`source` (the config's origin, normally the hub repository), `assumptions` (strings the
planner prints when a preset is not a published config, e.g. Kimi K3) and a `published`
sub-table with the authors' stated total/active parameter counts, for comparison.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Any

from cellswarm.errors import RequestError

PRESETS_FILE = "models.toml"
_RESERVED = ("source", "assumptions", "published", "default_quant")


@dataclass(frozen=True)
class Preset:
    name: str
    hf_config: Mapping[str, Any]  # config.json keys, read-only
    source: str
    assumptions: tuple[str, ...] = ()
    published_total_params: int | None = None
    published_active_params: int | None = None
    default_quant: str = "q4_0"  # what `plan` sizes it at without --quant

    @property
    def model_type(self) -> str:
        return str(self.hf_config["model_type"])

    def config_dict(self) -> dict[str, Any]:
        """A plain, mutable copy of hf_config (dicts and lists), e.g. for json.dumps."""
        return _thaw(self.hf_config)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _count(where: str, key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RequestError(f"{where}: {key} = {value!r} must be a whole number > 0")
    return value


def _preset(name: str, table: Mapping[str, Any]) -> Preset:
    where = f"model preset {name!r}"
    source = table.get("source")
    if not isinstance(source, str) or not source:
        raise RequestError(f"{where}: source = {source!r} must name where the config comes from")
    assumptions = table.get("assumptions", [])
    if not isinstance(assumptions, list) or not all(isinstance(a, str) for a in assumptions):
        raise RequestError(f"{where}: assumptions = {assumptions!r} must be a list of strings")
    published = table.get("published", {})
    if not isinstance(published, dict):
        raise RequestError(f"{where}: published = {published!r} is not a table")
    config = {k: v for k, v in table.items() if k not in _RESERVED}
    if not isinstance(config.get("model_type"), str):
        raise RequestError(f"{where}: model_type = {config.get('model_type')!r} is not a string")
    total = _count(where, "published.total_params", published.get("total_params"))
    active = _count(where, "published.active_params", published.get("active_params"))
    if total is not None and active is not None and active > total:
        raise RequestError(
            f"{where}: published.active_params = {active} exceeds total_params = {total}"
        )
    return Preset(
        name=name,
        hf_config=_freeze(config),
        source=source,
        assumptions=tuple(assumptions),
        published_total_params=total,
        published_active_params=active,
        default_quant=str(table.get("default_quant", "q4_0")),
    )


def load_presets() -> dict[str, Preset]:
    text = resources.files("cellswarm.planner").joinpath("data", PRESETS_FILE).read_text("utf-8")
    return {name: _preset(name, table) for name, table in tomllib.loads(text).items()}


def get_preset(name: str) -> Preset:
    presets = load_presets()
    if name not in presets:
        raise RequestError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(presets))} "
            "(or give a GGUF file or a Hugging Face model folder instead)"
        )
    return presets[name]
