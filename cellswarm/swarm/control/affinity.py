"""Prefix affinity: a job goes, where it can, to the replica that already holds its prefix.

Every stage keeps a prefix cache (engine/prefix_cache.py): the KV of 64-token prompt blocks
under the hash of the prompt up to them. A replica that ran a job starting with some block
computes the next job starting the same way from that block on. With several replicas the
coordinator remembers, for the first block of each prompt it leased, which replicas got it,
and a replica asking for work takes those jobs first, then jobs no replica holds yet, then
the rest (SGLang's cache-aware router, vLLM's prefix-aware routing). A preference, never a
wait: a replica with room takes work held elsewhere rather than idle, and priority still
comes first. A home can be stale (a replica rewired, its cache evicted): it costs one
prefill, never a wrong result — a hit gives the same bits as a miss.

Pure: no I/O, no clock; the coordinator holds one `PrefixHomes` in memory (a new leader
starts with none: the hint rebuilds itself in a few leases).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping

# = engine/prefix_cache.BLOCK_TOKENS (tests/test_affinity.py checks): a prompt whose shared
# start is shorter than one block is cached nowhere, so it has no home.
AFFINITY_TOKENS = 64
MOST_PREFIXES = 4096  # remembered at once (LRU): a batch seldom has more distinct prefixes

HERE, NOWHERE, ELSEWHERE = 0, 1, 2  # ranks: lower is leased first


def prefix_key(payload: Mapping[str, object]) -> bytes | None:
    """The first whole block of a job's prompt, hashed; None for a shorter prompt."""
    prompt = payload.get("prompt")
    if not isinstance(prompt, list) or len(prompt) <= AFFINITY_TOKENS:
        return None  # a prompt of exactly one block leaves nothing to reuse it for
    head = ",".join(str(int(t)) for t in prompt[:AFFINITY_TOKENS])
    return hashlib.blake2b(head.encode(), digest_size=16).digest()


class PrefixHomes:
    """Which replicas were leased a job starting with each prefix block."""

    def __init__(self, most: int = MOST_PREFIXES) -> None:
        self.most = most
        self._homes: OrderedDict[bytes, set[str]] = OrderedDict()

    def rank(self, payload: Mapping[str, object], replica: str) -> int:
        """HERE: `replica` holds the job's prefix; NOWHERE: nobody does (or it has none);
        ELSEWHERE: another replica does."""
        key = prefix_key(payload)
        homes = self._homes.get(key) if key is not None else None
        if not homes:
            return NOWHERE
        return HERE if replica in homes else ELSEWHERE

    def note(self, payload: Mapping[str, object], replica: str) -> None:
        """`replica` was leased the job: from now on it holds the job's prefix."""
        key = prefix_key(payload)
        if key is None:
            return
        self._homes.setdefault(key, set()).add(replica)
        self._homes.move_to_end(key)
        while len(self._homes) > self.most:
            self._homes.popitem(last=False)

    def forget(self, replica: str) -> None:
        """The replica was rewired with other nodes: what it held is gone."""
        for homes in self._homes.values():
            homes.discard(replica)

    def __len__(self) -> int:
        return len(self._homes)
