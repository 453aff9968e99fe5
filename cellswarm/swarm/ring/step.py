"""The compute of one step at a stage, in gpt-fast's shape: the engine's step functions
(Model.forward, Model.forward_many) over rows at positions passed in, then the head. The
stage (stage.py) does the rest: frames, faults, timing and counters, sampling, sending on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from cellswarm.engine import PREFILL_CHUNK
from cellswarm.engine.model import Model
from cellswarm.models.kv_cache import KVCache

T = TypeVar("T")
Run = Callable[..., Awaitable[Any]]  # fn(*args) where the stage computes (Stage.compute)


class Rows(NamedTuple):
    """Hidden states h (T, d) of one sequence at positions pos.. of its cache."""

    h: np.ndarray
    cache: KVCache
    pos: int


def _always() -> bool:
    return True


async def step(
    model: Model, groups: Sequence[Rows], run: Run, head: Callable[[np.ndarray], T] | None,
    kept: np.ndarray | None = None, alive: Callable[[], bool] = _always,
) -> tuple[np.ndarray, T | None] | None:  # fmt: skip
    """Each group's rows through the model's layers, then `head` (the last stage's) over all
    the output rows: (rows, what the head gave). One row of each of several sequences (a
    decode step of each) is one pass over the weights (Model.forward_many, each row the bits
    of its step alone); otherwise the groups run in turn, in chunks of PREFILL_CHUNK
    positions (Model.forward, as Model.step: one process's bits), a long one freeing the
    loop between two chunks: None if `alive()` then says its sequence was let go. `kept`:
    output rows at hand already, before the groups' (a prefix cache's). Only here is a
    cache's length set: to a pass's position before it, to the group's end after."""
    batched = len(groups) > 1 and all(len(g.h) == 1 for g in groups)
    batched = batched and len({id(g.cache) for g in groups}) == len(groups)
    out = [] if kept is None else [kept]
    if batched:  # a decode step of each of several sequences
        for g in groups:
            g.cache.length = g.pos
        h = np.ascontiguousarray(np.concatenate([g.h for g in groups]), np.float32)
        out.append(await run(model.forward_many, h, [g.cache for g in groups]))
    else:
        for g in groups:
            for start in range(0, len(g.h), PREFILL_CHUNK):
                g.cache.length = g.pos + start
                chunk = np.ascontiguousarray(g.h[start : start + PREFILL_CHUNK], np.float32)
                out.append(await run(model.forward, chunk, g.cache))
                if len(g.h) > PREFILL_CHUNK:  # a long prompt: others' frames meanwhile
                    await asyncio.sleep(0)
                    if not alive():
                        return None
    for g in groups:
        g.cache.length = g.pos + len(g.h)
    h = out[0] if len(out) == 1 else np.concatenate(out)
    return h, None if head is None else await run(head, h)
