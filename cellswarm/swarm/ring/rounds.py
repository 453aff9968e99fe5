"""Stage 0's speculative steps in flight, pipelined as PipeInfer does: pure functions.

A round is one step of a sequence: its rows are the last token and the drafts after it
(engine/speculative.py), verified by the last stage, which sends back the drafts it kept and
its own next token. Waiting for that answer leaves every stage but one idle, so while a
round travels, stage 0 sends the next one too, optimistically: it assumes every draft in
flight is kept, guesses the last stage's own token (the next token of the same lookup), and
drafts on from there. When the answer says otherwise, the rounds behind it were built on
text that is not the sequence's: stage 0 forgets them and steps again from what was kept.
A round may be a guess alone (one row, no drafts): on a deep ring of compute-bound stages,
where a verified row costs nearly a step, that is how speculation pays most: the stages that
would idle each run the next guessed token, and a right guess is a token for no extra work.

They are still in flight, so the last stage tells them apart itself (`Expect`): a round is
the sequence's next only if it starts at the position after the last token the last stage
gave and with that token; any other is dropped there before its layers run, unsampled, so the
sampler sees exactly the rounds decoding without speculation would have run, in order.
Earlier stages run it and write cache entries at positions past the kept text, which the
next round writes over (a cache's entries past its text are never read: attention is causal).
"""

from __future__ import annotations

from dataclasses import dataclass

# how many in flight: the planner's own rule, so what it and the simulator predict is what
# the ring does (planner/speculative.py in_flight)
from cellswarm.planner.speculative import sends_behind


@dataclass(frozen=True)
class Round:
    """A step in flight: its rows' tokens at positions pos.., and when it left (monotonic s).
    `lead`: sent with none in flight before it, so its time there and back is a step's own
    (one sent behind others waits for them at each stage too)."""

    pos: int
    rows: tuple[int, ...]
    sent_s: float
    lead: bool = True

    @property
    def end(self) -> int:
        """The position after its last row: where the round after it starts if all is kept."""
        return self.pos + len(self.rows)


def ahead(rounds: list[Round]) -> list[int]:
    """The tokens the rounds in flight assume after the sequence's text: the first round's
    drafts, then each later round's rows (its first row is the guess of the round before's
    own token)."""
    out = list(rounds[0].rows[1:]) if rounds else []
    for r in rounds[1:]:
        out.extend(r.rows)
    return out


def kept_whole(done: Round, got: list[int], behind: list[Round]) -> bool:
    """Whether the rounds behind `done` still hold, now that it gave `got`: all its drafts
    kept, and its own token the one the next round guessed."""
    return bool(behind) and len(got) == len(done.rows) and behind[0].rows[0] == got[-1]


def next_round(rounds: list[Round], continuation: list[int], acceptance: float,
               last_pos: int, now_s: float) -> Round | None:  # fmt: skip
    """The round to send behind those in flight, as many rows as the last one (its guess of
    the last one's own token, then drafts), or None: none in flight to go behind, the
    planner's rule says no more (sends_behind), or no guess. `continuation`:
    what the lookup says follows the sequence's text (it must agree with what the rounds in
    flight assume); `last_pos`: the last position a row may take (its output must still be
    a token the request may have)."""
    # the rows in flight: each one's drafts, and the guess of its own token (the next's)
    if not rounds or not sends_behind(acceptance, sum(len(r.rows) for r in rounds), len(rounds)):
        return None
    assumed = ahead(rounds)
    if continuation[: len(assumed)] != assumed:
        return None
    pos = rounds[-1].end
    rows = continuation[len(assumed) : len(assumed) + len(rounds[-1].rows)]
    rows = rows[: max(0, last_pos - pos + 1)]
    if not rows:
        return None
    return Round(pos, tuple(rows), now_s, lead=False)


@dataclass(frozen=True)
class Expect:
    """The last stage's word on a sequence: its next round starts at `pos` with `token`."""

    pos: int
    token: int

    def takes(self, pos: int, token: int | None) -> bool:
        return pos == self.pos and (token is None or token == self.token)


def continues(length: int, last: int, at: int | None, follows: int | None) -> bool:
    """Whether an answer (a `token` frame) continues stage 0's text of `length` tokens, the
    last `last`, where it stands: its first token takes position `length`, after a step
    whose first row ran `last`. Anything else answers a step the text no longer has (a
    round dropped at stage 0, a frame come twice): emitting it would repeat or skip a token.
    None: not said (a plain decode step's rows carry no token)."""
    return (at is None or at == length) and (follows is None or follows == last)
