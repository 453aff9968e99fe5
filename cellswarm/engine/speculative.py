"""Speculative decoding: guess a few tokens cheaply, check them all in one step.

A drafter proposes up to k next tokens: from the text so far (prompt lookup: the tokens that
followed the last place where the text's last n tokens occurred before; no weights), or from
a small draft model that shares the tokenizer, greedily. The model then runs the last token
and the k drafts as one step of k+1 rows (each row the bits of a decode step alone:
Model.forward) and `accept` picks the token at each row in turn with the request's own
sampler: the same draw, from the same generator, that decoding without speculation makes at
that position. A draft is kept while it equals that pick; the first pick that differs is the
model's own token and ends the round, and the cache forgets the rows after it.

So the text is the text without speculation, token for token: for greedy decoding, bit for
bit; for sampling, for every seed. In distribution, keeping a one-token draft d exactly when
the draw equals d accepts it with probability p(d) and otherwise leaves a draw from p without
d, renormalized: speculative rejection sampling (Leviathan et al., 2023) for a draft that is
one token, so the distribution is exact too.

How many to draft (`AdaptiveK`): a round of k drafts gives (1 - a^(k+1)) / (1 - a) tokens
when each draft is kept with probability a, and costs 1 + c*k steps' time, c being what a
verified row costs beyond the first (measured by whoever runs the rounds: on a memory-bound
node a row is nearly free, on a compute-bound one it costs most of a step). k is the best of
0..max for the measured a and c; 0 when no k pays. In `auto`, drafting stops there; lookup
drafts still cost nothing, so they keep being compared with what the model says, and k
comes back when they start to agree (a long quotation). In `lookup` and `draft`, k >= 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cellswarm.errors import RequestError

if TYPE_CHECKING:
    from cellswarm.engine.model import Model

MODES = ("auto", "off", "lookup", "draft")
MAX_DRAFT = 8  # k's ceiling: a verification is one pass of at most k+1 <= MAX_BATCH rows
NGRAM_MAX = 3  # the longest n-gram a lookup matches (the longest match wins)


def check_mode(mode: str) -> str:
    """The speculative setting, or a one-line error naming it and the choices."""
    if mode not in MODES:
        raise RequestError(f"speculative {mode!r} must be one of {', '.join(MODES)}")
    return mode


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of k drafts gives when each is kept with probability `acceptance`:
    the kept drafts, then the model's own token."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def accept(rows: np.ndarray, drafts: Sequence[int], pick: Callable[[np.ndarray, list[int]], int]
           ) -> list[int]:  # fmt: skip
    """rows (k+1, vocab): row i's logits follow the last token and drafts[:i]. `pick(row,
    kept)` is the request's sampler at that row, `kept` the tokens this round took before
    it. Returns the drafts kept, then the model's own token (1..k+1 tokens)."""
    kept: list[int] = []
    for i in range(len(drafts) + 1):
        token = pick(rows[i], kept)
        kept.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return kept


class Lookup:
    """Prompt-lookup drafts: an index of every n-gram (n <= NGRAM_MAX) of the text so far to
    where it last ended, kept as the text grows, so a draft is a few dict lookups."""

    def __init__(self) -> None:
        self.text: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the position after it

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            at = len(self.text)  # n-grams that end before `token` now have a continuation
            for n in range(1, NGRAM_MAX + 1):
                if at >= n:
                    self._ends[tuple(self.text[at - n : at])] = at
            self.text.append(int(token))

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram
        the text ends with; [] when none occurred."""
        for n in range(min(NGRAM_MAX, len(self.text)), 0, -1):
            at = self._ends.get(tuple(self.text[-n:]))
            if at is not None:
                return self.text[at : at + k]
        return []


class DraftModel:
    """Greedy drafts from a small model of the same tokenizer, with a cache of its own that
    follows the text: what it drafted and the text did not keep is forgotten."""

    def __init__(self, model: Model, capacity: int) -> None:
        self.model, self.cache = model, model.new_cache(capacity)
        self.fed: list[int] = []  # the tokens in the cache, in order

    def draft(self, text: Sequence[int], k: int) -> list[int]:
        same = 0
        for a, b in zip(self.fed, text, strict=False):
            if a != b:
                break
            same += 1
        same = min(same, len(text) - 1)  # the last token is run again: its logits are needed
        self.cache.truncate(same)
        self.fed = list(text)
        logits = self.model.step(np.asarray(text[same:], np.int64), self.cache, last_only=True)
        out: list[int] = []
        while len(out) < k:
            out.append(int(np.argmax(logits[-1])))
            if len(out) < k and self.cache.length < self.cache.capacity:
                logits = self.model.step(np.asarray(out[-1:], np.int64), self.cache)
                self.fed.append(out[-1])
            else:
                break
        return out


@dataclass
class AdaptiveK:
    """k for the next round, from the acceptance seen so far (decayed: the text changes from
    quoting to writing) and the measured cost of a verified row beyond the first."""

    max_k: int = 4
    least: int = 0  # 1 when the user asked for drafting (lookup, draft)
    row_cost: float = 0.3  # prior, until measured (a ring of memory-bound nodes: less)
    kept: float = 1.0  # decayed counts of drafts kept and refused (a prior of 1:1)
    refused: float = 1.0
    drafted: int = 0  # the totals (stats)
    accepted: int = 0
    _costs: dict[int, float] = field(default_factory=dict)  # rows -> decayed mean step time

    DECAY = 0.9

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.refused)

    def k(self) -> int:
        if 1 not in self._costs and not self.least:  # a step of one row first: the baseline
            return 0  # a wider round's cost is measured against (else the prior stays)
        a, best, best_gain = self.acceptance, 0, 1.0
        for k in range(1, self.max_k + 1):
            gain = expected_tokens(a, k) / (1.0 + self.row_cost * k)
            if gain > best_gain:
                best, best_gain = k, gain
        return max(best, min(self.least, self.max_k))

    def observe(self, drafts: int, kept: int, counted: bool = True) -> None:
        """A round's drafts and how many were kept (the first refusal ends a round: what
        came after it says nothing). `counted`: drafts verified, not only compared."""
        if drafts == 0:
            return
        self.kept = self.kept * self.DECAY + kept
        self.refused = self.refused * self.DECAY + (1 if kept < drafts else 0)
        if counted:
            self.drafted, self.accepted = self.drafted + drafts, self.accepted + kept

    def timed(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds`: the row cost follows (1 row vs more)."""
        was = self._costs.get(rows)
        self._costs[rows] = seconds if was is None else 0.8 * was + 0.2 * seconds
        one = self._costs.get(1)
        wider = [(r, s) for r, s in self._costs.items() if r > 1]
        if one and wider:
            costs = [(s / one - 1.0) / (r - 1) for r, s in wider]
            self.row_cost = min(max(sum(costs) / len(costs), 0.0), 1.0)


@dataclass
class Speculator:
    """One sequence's drafting: the mode, its drafter(s), and k."""

    mode: str
    lookup: Lookup = field(default_factory=Lookup)
    draft_model: DraftModel | None = None
    k: AdaptiveK = field(default_factory=AdaptiveK)
    _shadow: list[int] = field(default_factory=list)  # a free lookup draft k=0 did not send

    @classmethod
    def of(cls, mode: str, text: Sequence[int], draft: DraftModel | None = None,
           max_k: int = 4) -> Speculator | None:  # fmt: skip
        """None for `off`; `draft` asks for a draft model, `auto` uses one if given."""
        if check_mode(mode) == "off":
            return None
        if mode == "draft" and draft is None:
            raise RequestError("speculative 'draft' needs a draft model: give --draft "
                               "MODEL.gguf (the same tokenizer), or use 'lookup'")  # fmt: skip
        uses = draft if mode in ("draft", "auto") else None
        spec = cls(mode, draft_model=uses, k=AdaptiveK(max_k=min(max_k, MAX_DRAFT),
                                                       least=0 if mode == "auto" else 1))
        spec.lookup.extend(text)
        return spec

    def draft(self, text: Sequence[int], room: int) -> list[int]:
        """Drafts after `text` (the lookup index has seen all of it), at most `room`."""
        k = min(self.k.k(), room)
        if self.draft_model is not None:
            return self.draft_model.draft(text, k) if k > 0 else []
        drafts = self.lookup.draft(max(k, 1))
        self._shadow = drafts if k == 0 else []
        return drafts[:k]

    def took(self, drafts: Sequence[int], tokens: Sequence[int], guess: int | None = None
             ) -> None:  # fmt: skip
        """The round's drafts and the tokens it gave (the kept drafts, then the model's).
        `guess`: the model's own token as a round sent behind this one guessed it (a ring's
        pipelining, swarm/ring/rounds.py): verified there, so a draft of its own."""
        kept = len(tokens) - 1
        if drafts:
            self.k.observe(len(drafts), kept)
        if guess is not None and kept == len(drafts):
            self.k.observe(1, int(tokens[-1] == guess))
        elif self._shadow and not drafts:  # k was 0: the free draft is still compared
            self.k.observe(1, int(tokens[0] == self._shadow[0]), counted=False)
        self._shadow = []
        self.lookup.extend(tokens)
