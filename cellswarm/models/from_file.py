"""A model's config from a GGUF file's header, and the check that a file holds every tensor
the selected layers need in the shape the config implies: read by the loader and the tiered
loader alike (engine/tiered/load.py), before any weight is touched."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellswarm.errors import RequestError
from cellswarm.io.gguf_file import GGUFFile
from cellswarm.io.weights import Selection, Tensor, validate
from cellswarm.models import ArchEntry, config_from_gguf

if TYPE_CHECKING:
    from cellswarm.models import FamilyConfig


def gguf_config(path: Path, f: GGUFFile) -> tuple[ArchEntry, Any]:
    return config_from_gguf(path, f.metadata, {n: f.tensor_shape(n) for n in f.tensor_names()})


def check_tensors(
    source: Path,
    config: FamilyConfig,
    sel: Selection,
    tensors: Mapping[str, Tensor | tuple[int, ...]],
) -> None:
    """Refuse at load, not at the first forward, a file lacking a tensor the selected layers
    need or holding one in another shape than the config implies."""
    lo, hi = sel.layers or (0, config.n_layers)
    if not 0 <= lo <= hi <= config.n_layers:
        raise RequestError(
            f"selected layers [{lo}, {hi}) do not fit the model's {config.n_layers} layers; "
            f"pick a range within [0, {config.n_layers})"
        )
    if not hasattr(config, "expected_tensors"):
        return
    expected = {n: s for n, s in config.expected_tensors(range(lo, hi)).items() if sel.keeps(n)}
    if "output.weight" not in tensors:  # no head of its own: tied to the embedding
        expected.pop("output.weight", None)
    validate(tensors, expected, str(source))
