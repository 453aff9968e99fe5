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

# OpenBLAS's threads spin for 2^28 cycles (~0.1 s) after each call before they sleep, holding
# a core that the fused kernels' OpenMP threads need right after (a prefill's attention runs
# in BLAS, then its int8 matmuls: on 2 cores, 2 threads were no faster than 1). 2^14 cycles
# (~6 us) mirrors kernels.SPIN_COUNT. OpenBLAS reads it once, when numpy loads it: so here,
# before anything of ours imports numpy (a program that imported numpy first keeps its own).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "14")

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
