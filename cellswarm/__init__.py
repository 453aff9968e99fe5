"""cellswarm: run language models too large for one machine on swarms of small nodes.

import cellswarm
model = cellswarm.load("model.gguf")          # or a Hugging Face folder; no path: the demo
model.logits([1, 2, 3])                        # float32 (3, vocab)
model.generate("The capital of France is")     # Generation(text, token_ids, stats)
model("Q: Name a planet. A:", max_tokens=16)   # llama-cpp-python's habits: OpenAI dicts
swarm = cellswarm.connect("http://127.0.0.1:8470", api_key=None)  # the same, on a swarm
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from cellswarm.version import __version__ as __version__

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
    from cellswarm.swarm.api.remote import Swarm

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
    "connect",
    "load",
    "plan",
]


def load(path: str | os.PathLike[str] | None = None, *, n_ctx: int | None = None,
         n_threads: int | None = None, model_path: str | os.PathLike[str] | None = None,
         **options: Any) -> Model:  # fmt: skip
    """A model in this process (see `cellswarm.loader.load` for `quant`, `selection`, ...):
    `path` (or llama-cpp-python's `model_path`) a .gguf file or Hugging Face folder, none
    for the demo model; `n_ctx` the context a generation may take (prompt + completion,
    refused beyond it); `n_threads` the kernels' and BLAS' threads (default: all cores).
    A whole model's weights are laid out for the kernels before it returns (Model.prepare),
    so its first prompt runs at full speed. Imported lazily so `import cellswarm` stays light."""
    from cellswarm.loader import load as _load

    if path is not None and model_path is not None:
        raise RequestError("give path or model_path, not both")
    path = path if path is not None else model_path
    if path is None:
        from cellswarm.demo import demo_model_path

        path = demo_model_path()
    if n_threads is not None:
        from cellswarm import kernels

        if n_threads < 1:
            raise RequestError(f"n_threads {n_threads} must be at least 1")
        kernels.set_threads(n_threads)
    if n_ctx is not None and n_ctx < 1:
        raise RequestError(f"n_ctx {n_ctx} must be at least 1 token")
    model = _load(path, **options)
    model.n_ctx = n_ctx
    if options.get("selection") is None:  # a whole model: laid out now (a part as it runs)
        model.prepare()
    return model


def connect(url: str, api_key: str | None = None, tls: str | None = None) -> Swarm:
    """A running swarm (its coordinator's URL) with the model's methods: `create_completion`,
    `create_chat_completion`, calling it, `tokenize`, `detokenize` (swarm/api/remote.py);
    `api_key` one of its --api-key-file keys, `tls` a certificate folder for https."""
    from cellswarm.swarm.api.remote import Swarm as _Swarm

    return _Swarm(url, api_key=api_key, tls=tls)


def plan(model: str, **options: Any) -> PlanResult:
    """See `cellswarm.planner.api.plan`: will `model` run on N nodes, how fast, what power."""
    from cellswarm.planner.api import plan as _plan

    return _plan(model, **options)
