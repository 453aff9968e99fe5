"""cellswarm: run language models too large for one machine on swarms of small nodes.

import cellswarm
model = cellswarm.load("model.gguf")          # or a Hugging Face folder
model.logits([1, 2, 3])                        # float32 (3, vocab)
model.generate("The capital of France is")     # Generation(text, token_ids, stats)
"""

from __future__ import annotations

__version__ = "0.1.0"  # pyproject.toml reads it; nodes report it (doctor compares)

import os
from typing import TYPE_CHECKING, Any

from cellswarm.errors import (
    BudgetError,
    CellswarmError,
    MissingTensorError,
    ModelFileError,
    RequestError,
    ShapeMismatchError,
    SwarmError,
    TokenizerError,
    UnsupportedArchitectureError,
    UnsupportedQuantError,
)

if TYPE_CHECKING:
    from cellswarm.engine.model import Model
    from cellswarm.planner.plan import PlanResult

__all__ = [
    "BudgetError",
    "CellswarmError",
    "MissingTensorError",
    "ModelFileError",
    "RequestError",
    "ShapeMismatchError",
    "SwarmError",
    "TokenizerError",
    "UnsupportedArchitectureError",
    "UnsupportedQuantError",
    "load",
    "plan",
]


def load(path: str | os.PathLike[str], **options: Any) -> Model:
    """See `cellswarm.loader.load`; imported lazily so `import cellswarm` stays light."""
    from cellswarm.loader import load as _load

    return _load(path, **options)


def plan(model: str, **options: Any) -> PlanResult:
    """See `cellswarm.planner.api.plan`: will `model` run on N nodes, how fast, what power."""
    from cellswarm.planner.api import plan as _plan

    return _plan(model, **options)
