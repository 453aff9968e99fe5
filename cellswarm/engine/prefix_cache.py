"""Shared prefixes computed once: KV of token blocks, addressed by the whole prefix.

A block is BLOCK_TOKENS positions of one sequence's cache (every layer this process holds)
and the hidden states its last layer gave them, stored under the sha256 chain of the tokens
from the start of the sequence to the block's end — so a block is found only by a sequence
that begins with exactly those tokens (vLLM's automatic prefix caching, SGLang's radix
cache). A later sequence copies its longest run of cached blocks into its own cache and
computes only what follows. The bits are the same as computing the prefix again: a
position's keys, values and output are a function of the tokens up to it (each row is
computed alone, at any chunking), so a cache hit changes no logit (tests/test_prefix_cache.py).
The output rows go with a block so that a pipeline stage with a hit can hand the next stage
its input whether or not that stage has the block too. LRU within a byte budget.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cellswarm.models.kv_cache import KVCache

BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Block:
    kv: dict[int, dict[str, np.ndarray]]  # layer -> tensor -> its BLOCK_TOKENS positions
    out: np.ndarray  # (BLOCK_TOKENS, d): the last layer's output at those positions
    nbytes: int


def block_keys(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> list[bytes]:
    """Key of each whole block of `tokens`: the hash of every token from the start to its end."""
    keys, h = [], hashlib.sha256()
    ids = np.asarray(tokens, dtype="<i8")
    for i in range(len(ids) // block):
        h.update(ids[i * block : (i + 1) * block].tobytes())
        keys.append(h.copy().digest())
    return keys


class PrefixCache:
    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS) -> None:
        self.budget_bytes, self.block = int(budget_bytes), block
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0  # in blocks

    def restore(self, tokens: Sequence[int], cache: KVCache, limit: int) -> np.ndarray | None:
        """Copy the longest run of cached blocks that starts `tokens` and ends by position
        `limit` into `cache` (positions 0..); their output rows (n, d), or None on no hit.
        Every whole block up to `limit` that is not found counts as a miss."""
        wanted = block_keys(tokens[:limit], self.block)
        found: list[Block] = []
        for key in wanted:
            b = self._blocks.get(key)
            if b is None:
                break
            found.append(b)
        self._touch(wanted[: len(found)])
        self.hits += len(found)
        self.misses += len(wanted) - len(found)
        for i, b in enumerate(found):
            for layer, parts in b.kv.items():
                cache.layer(layer).put(i * self.block, parts)
        return np.concatenate([b.out for b in found]) if found else None

    def outputs(self, tokens: Sequence[int], rows: int) -> list[np.ndarray] | None:
        """The output rows of the whole blocks that start `tokens` and hold its first `rows`
        positions (a multiple of the block), one array a block; None unless all are held.
        A pipeline stage that restored them sends the next stage only the rows after them,
        and these if that stage turns out not to hold them (swarm/ring/stage.py). No count
        and no recency: a lookup, not a use."""
        found = [self._blocks.get(key) for key in block_keys(tokens[:rows], self.block)]
        if rows % self.block or len(found) != rows // self.block:
            return None
        return None if any(b is None for b in found) else [b.out for b in found if b]

    def remember(self, tokens: Sequence[int], cache: KVCache, out: np.ndarray) -> None:
        """Keep the whole blocks of `tokens` (computed into `cache`, `out` their output rows)
        that are not kept yet, then evict the least recently used past the budget."""
        keys = block_keys(tokens, self.block)
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            a, b = i * self.block, (i + 1) * self.block
            kv = {layer: cache.layer(layer).take(a, b) for layer in cache.layers}
            rows = np.array(out[a:b], dtype=np.float32)
            size = rows.nbytes + sum(v.nbytes for parts in kv.values() for v in parts.values())
            self._blocks[key] = Block(kv, rows, size)
            self.bytes += size
        self._touch(keys)
        while self.bytes > self.budget_bytes:
            _, old = self._blocks.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1

    def _touch(self, keys: list[bytes]) -> None:
        """Most recently used: a chain's first block last, so eviction takes a chain from its
        end (a block after one that is gone could never be found again)."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def stats(self) -> dict[str, int]:
        return {"prefix_hits": self.hits, "prefix_misses": self.misses,
                "prefix_evictions": self.evictions, "prefix_bytes": self.bytes,
                "prefix_blocks": len(self._blocks)}  # fmt: skip
