"""llama-cpp-python's habits on a model in this process: OpenAI-shaped answers.

    model = cellswarm.load()                       # the demo model (or a path, n_ctx=, n_threads=)
    model("Q: Name the planets. A:", max_tokens=32, stop=["Q:"])          # create_completion
    model.create_chat_completion(messages=[{"role": "user", "content": "Hi"}])
    for chunk in model.create_completion("Once", stream=True): ...
    model.tokenize(b"Hello"), model.detokenize([...])                     # bytes, as theirs

The answers are the dicts the OpenAI routes of a swarm give (`cellswarm.connect(url)` has
the same methods over one), and the defaults are llama-cpp-python's (temperature 0.8, top_p
0.95, top_k 40, min_p 0.05), sent explicitly by both, so a local and a remote call with the
same arguments make the same tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from cellswarm.engine.openai_shapes import chat_logprobs, completion_logprobs
from cellswarm.engine.scoring import log_norms, token_detail
from cellswarm.errors import RequestError

# llama-cpp-python's create_completion defaults
DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                            "repeat_penalty": 1.0}  # fmt: skip
# their names -> ours (SamplingParams)
RENAMED = {"repeat_penalty": "repetition_penalty"}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed",
            "presence_penalty", "frequency_penalty", "logit_bias")  # fmt: skip


def sampling_settings(kw: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python-style sampling keywords as ours, their defaults filled in (a local
    model's methods and cellswarm.connect's send the same)."""
    unknown = sorted(set(kw) - set(SAMPLING))
    if unknown:
        raise RequestError(f"unknown setting {unknown[0]!r}; use max_tokens, stop, echo, "
                           f"logprobs, stream, {', '.join(SAMPLING)}")  # fmt: skip
    return {RENAMED.get(k, k): v for k, v in {**DEFAULTS, **kw}.items() if v is not None}


def settings(max_tokens: int | None, stop: str | Sequence[str] | None,
             kw: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The engine's generation settings for llama-cpp-python-style keywords."""
    out = sampling_settings(kw)
    out["max_tokens"] = 16 if max_tokens is None else max_tokens
    out["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    return out


def finish(stop_reason: str) -> str:
    return "length" if stop_reason == "max_tokens" else "stop"


class Completions:
    """The mixin Model takes: needs `generate`, `stream`, `encode_prompt`, `logits`,
    `tokenizer` and `name`."""

    name: str
    tokenizer: Any

    def __call__(self, prompt: str | Sequence[int], **kw: Any) -> Any:
        return self.create_completion(prompt, **kw)

    def create_completion(
        self, prompt: str | Sequence[int], max_tokens: int | None = 16,
        stop: str | Sequence[str] | None = None, echo: bool = False,
        logprobs: int | None = None, stream: bool = False, **kw: Any,
    ) -> Any:  # fmt: skip
        """OpenAI's text_completion dict (a generator of chunks with stream=True)."""
        ids = self.encode_prompt(prompt)  # type: ignore[attr-defined]
        s = settings(max_tokens, stop, kw)
        head = {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion",
                "created": int(time.time()), "model": self.name}  # fmt: skip
        prefix = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        if stream:
            if logprobs is not None:
                raise RequestError("logprobs come with the whole answer; ask without stream")
            return self._chunks(ids, s, head, prefix if echo else "", chat=False)
        gen = self.generate(ids, **s)  # type: ignore[attr-defined]
        choice: dict[str, Any] = {"text": (prefix if echo else "") + gen.text, "index": 0,
                                  "logprobs": None,
                                  "finish_reason": finish(gen.stats.stop_reason)}  # fmt: skip
        if logprobs is not None:
            shown = ids + gen.token_ids if echo else gen.token_ids
            detail = self.detail(ids + gen.token_ids, 1 if echo else len(ids), logprobs)
            choice["logprobs"] = completion_logprobs(self.tokenizer, shown, detail,
                                                     0 if echo else len(prefix))  # fmt: skip
        return {**head, "choices": [choice], "usage": _usage(ids, gen.token_ids)}

    def create_chat_completion(
        self, messages: list[dict[str, Any]], max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None, logprobs: bool = False,
        top_logprobs: int | None = None, stream: bool = False, **kw: Any,
    ) -> Any:  # fmt: skip
        """OpenAI's chat.completion dict (a generator of chunks with stream=True)."""
        ids = self.encode_prompt(messages)  # type: ignore[attr-defined]
        context = getattr(self, "n_ctx", None) or self.config.context_length  # type: ignore[attr-defined]
        room = int(context) - len(ids)  # OpenAI's default: the rest of the context
        s = settings(max_tokens if max_tokens is not None else max(room, 1), stop, kw)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion",
                "created": int(time.time()), "model": self.name}  # fmt: skip
        if stream:
            if logprobs:
                raise RequestError("logprobs come with the whole answer; ask without stream")
            return self._chunks(ids, s, head, "", chat=True)
        gen = self.generate(ids, **s)  # type: ignore[attr-defined]
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                          "content": gen.text},
                                  "logprobs": None,
                                  "finish_reason": finish(gen.stats.stop_reason)}  # fmt: skip
        if logprobs:
            detail = self.detail(ids + gen.token_ids, len(ids), top_logprobs or 0)
            choice["logprobs"] = chat_logprobs(self.tokenizer, gen.token_ids, detail)
        return {**head, "choices": [choice], "usage": _usage(ids, gen.token_ids)}

    def _chunks(self, ids: list[int], s: dict[str, Any], head: dict[str, Any], echo: str,
                chat: bool) -> Iterator[dict[str, Any]]:  # fmt: skip
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, why: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else (
                    {} if text is None else {"content": text})  # fmt: skip
                c: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                c = {"index": 0, "text": text or ""}
            return {**head, "object": kind,
                    "choices": [{**c, "logprobs": None, "finish_reason": why}]}  # fmt: skip

        if chat:
            yield chunk(None, None, first=True)
        if echo:
            yield chunk(echo, None)
        pieces = self.stream(ids, **s)  # type: ignore[attr-defined]
        for piece in pieces:
            yield chunk(piece, None)
        yield chunk(None if chat else "", finish(pieces.result.stats.stop_reason))

    def detail(self, ids: list[int], start: int, top: int) -> list[list[Any]]:
        """Each token of ids[start:] scored: [logprob, greedy, top alternatives]."""
        if start >= len(ids):
            return []
        import numpy as np

        logits = self.logits(ids)[start - 1 : -1].astype(np.float64)  # type: ignore[attr-defined]
        return token_detail(logits, log_norms(logits), np.asarray(ids[start:]), top)

    def tokenize(self, text: bytes | str, add_bos: bool = True,
                 special: bool = False) -> list[int]:  # fmt: skip
        """Token ids of `text` (bytes, as llama-cpp-python's, or str); `special` is accepted
        for their signature (special tokens' text is always recognised)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self.tokenizer.encode(text, add_special=add_bos))

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The UTF-8 bytes of `tokens` (bytes, as llama-cpp-python's)."""
        return str(self.tokenizer.decode(list(tokens))).encode()


def _usage(prompt: Sequence[int], made: Sequence[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(made),
            "total_tokens": len(prompt) + len(made)}  # fmt: skip
