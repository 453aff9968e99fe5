"""Log-probabilities in OpenAI's two shapes, from the ring's per-token detail.

The ring scores a sequence's tokens (engine/scoring.py `token_detail`): each as [its
log-probability, whether it is the argmax, the row's k likeliest as [id, logprob]]. These
are the logits the generation saw, bit for bit (a row's logits are the same in any batch),
so scoring the answer after it is made gives what sampling it gave. The first token of a
sequence has no log-probability (nothing predicts it): `None`, as OpenAI's echo shows it.

    completions  {"tokens", "token_logprobs", "top_logprobs", "text_offset"}  (legacy shape;
                 each top_logprobs dict also holds the chosen token, as vLLM's: a client
                 tells greedy tokens by `token_logprob == max(top.values())`)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Detail = Sequence[Sequence[Any]]  # per token: [logprob, greedy, [[id, logprob], ...]]


def completion_logprobs(tok: Any, ids: Sequence[int], detail: Detail,
                        offset: int = 0) -> dict[str, Any]:  # fmt: skip
    """The legacy shape for `ids`, the last len(detail) of which were scored; text offsets
    count from `offset` (the echoed prompt's start, or the completion's)."""
    unscored = len(ids) - len(detail)
    tokens = [tok.token_text(t) for t in ids]
    token_logprobs: list[float | None] = [None] * unscored
    top: list[dict[str, float] | None] = [None] * unscored
    for t, (lp, _, alts) in zip(ids[unscored:], detail, strict=True):
        token_logprobs.append(float(lp))
        top.append({**{tok.token_text(i): float(x) for i, x in alts},
                    tok.token_text(t): float(lp)})  # fmt: skip
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(tok: Any, ids: Sequence[int], detail: Detail) -> dict[str, Any]:
    """The chat shape: one entry per generated token (all of them scored)."""
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        text = tok.token_text(token_id)
        return {"token": text, "logprob": float(lp), "bytes": list(text.encode())}

    content = [{**entry(t, lp), "top_logprobs": [entry(i, x) for i, x in alts]}
               for t, (lp, _, alts) in zip(ids, detail, strict=True)]  # fmt: skip
    return {"content": content, "refusal": None}
