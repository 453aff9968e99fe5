"""What the coordinator shows: status, the model's manifest (for workers fetching their
shard), its tokenizer, and the model facts a request is checked against."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cellswarm.swarm.control import rebalance
from cellswarm.swarm.control.membership import Shard, ring
from cellswarm.swarm.control.store import text_of
from cellswarm.swarm.control.work import Work
from cellswarm.swarm.protocol.jsonvalue import JsonObject, JsonValue
from cellswarm.swarm.protocol.messages import PartHolding

if TYPE_CHECKING:
    from cellswarm.io.tokenizer import Tokenizer
    from cellswarm.swarm.transport.fetch import Manifest

log = logging.getLogger("cellswarm.coordinator")


class Views(Work):
    """Status and the model's facts (a part of Coordinator)."""


    def status(self) -> JsonObject:
        now = time.time()
        nodes: list[JsonValue] = [
            {"node_id": n.node_id, "state": n.state,
             "layers": list(n.shard.layers) if n.shard and n.shard.layers else None,
             "holds": describe(n.shard),
             "stage": n.shard.stage if n.shard else None,
             "replica": n.shard.replica if n.shard else None,
             "agreements": n.agreements, "disagreements": n.disagreements,
             "memory_bytes": n.memory_bytes, "rss_bytes": n.rss_bytes,
             "peak_rss_bytes": n.peak_rss_bytes, "last_seen_s_ago": round(now - n.last_seen_s, 2),
             "served": n.served, "failures": n.failures, "message": n.message,
             "profile": text_of(n.capabilities, "profile"), "serving": n.serving,
             "rack": text_of(n.capabilities, "rack"),
             "stats": self.node_stats.get(n.node_id),
             "busy_s": rebalance.seconds_of(self.node_stats.get(n.node_id), "running_s"),
             "address": f"{n.host}:{n.data_port}" if n.data_port else n.host,
             "clock_offset_s": self._clock(n.node_id)[0],
             "clock_error_s": self._clock(n.node_id)[1]}
            for n in map(self.live, self.store.nodes())
        ]  # fmt: skip
        epoch = self.epoch
        times = [rebalance.ring_times(ring(self.placed(), r), self.node_stats,
                                      rebalance.STATUS_MIN_STEPS)
                 for r in range(self.config.replicas)]  # fmt: skip
        return {"epoch": epoch, "wired": self.wired_epoch == epoch, "problem": self.problem,
                "context": self.context, "sequences": self.sequences,
                "bottlenecks": [t.bottleneck() for t in times if t is not None],
                "speculative": self.drafting(),
                "coordinator": self.id, "leader": self.leading,
                "model": Path(self.config.model).name, "nodes": nodes}  # fmt: skip

    def drafting(self) -> dict[str, JsonValue]:
        """Speculative decoding over the swarm: drafts its stage 0s sent to be verified, and
        those kept (each node's counters since it started, from its beats)."""
        sums = {"drafted_tokens": 0, "accepted_tokens": 0}
        for stats in self.node_stats.values():
            for key in sums:
                value = stats.get(key) if isinstance(stats, dict) else None
                sums[key] += value if type(value) is int else 0
        return {"drafted": sums["drafted_tokens"], "accepted": sums["accepted_tokens"]}

    def _clock(self, node_id: str) -> tuple[float | None, float | None]:
        """How far the node's clock is behind ours (s; negative: ahead), and the error."""
        return self.node_clock.get(node_id, (None, None))

    def manifest(self) -> Manifest:
        """The model file's content id and chunk hashes, for workers that fetch their shard
        (hashed once, at start by warm_up, then cached by path, size and mtime; a request
        that comes while it is hashed waits for that one hashing)."""
        with self._manifest_lock:
            if self._manifest is None:
                from cellswarm.swarm.transport.fetch import build_manifest

                self._manifest = build_manifest(self.config.model)
            return self._manifest

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            from cellswarm.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.model)
        return self._tokenizer

    @property
    def model_facts(self) -> tuple[int, int]:
        """(vocabulary rows, the most UTF-8 bytes one token stands for; 0 with no tokenizer):
        what the API checks a request against with the ring's context (schema.limits_of),
        read once."""
        with self._limits_lock:
            if self._limits is None:
                from cellswarm.errors import CellswarmError
                from cellswarm.loader import read_config

                try:
                    tok = self.tokenizer
                    token_bytes = max((len(tok.token_text(i).encode("utf-8", "surrogatepass"))
                                       for i in range(int(tok.vocab_size))), default=0)  # fmt: skip
                except CellswarmError:  # no tokenizer: only token ids can be sent
                    token_bytes = 0
                self._limits = (int(read_config(self.config.model).vocab_size), token_bytes)
            return self._limits

    def warm_up(self) -> None:
        """The tokenizer, the limits and the fetch manifest, made beside the event loop at
        start (work the first request would otherwise hold the loop, and heartbeats, for)."""
        try:
            self.model_facts  # noqa: B018
        except Exception as exc:  # a bad model file: each request says so
            log.warning("could not read the model's limits: %s", exc)
            return
        try:  # the chunks' hashes, before the first worker asks (a 10 GB file: ~30 s)
            self.manifest()
        except Exception as exc:
            log.warning("could not hash the model for fetching: %s", exc)


def describe(shard: Shard | None) -> str:
    """A shard in a few words, for the status table."""
    if shard is None:
        return "-"
    if shard.role == "stage" and shard.layers:
        lo, hi = shard.layers
        return f"layers {lo}..{hi - 1}"
    spec = shard.spec or PartHolding()
    if spec.vocab_rows:
        a, b = spec.vocab_rows
        return f"vocab rows {a}..{b - 1}"
    experts = spec.experts
    per_layer = len(next(iter(experts.values()), []))
    return f"{per_layer} experts x {len(experts)} layers"
