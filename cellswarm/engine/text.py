"""The text of a generation as its tokens come, with stop strings: one implementation for the
engine (`Model.generate` / `Model.stream`) and the OpenAI API."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


class StopText:
    """A generation's text as its tokens come: each `feed` gets every token so far and gives
    the new text, never the half of a UTF-8 character (a trailing U+FFFD waits) nor what could
    be the start of a stop string; the text is cut before the first stop string. The one text
    stream: the engine's generate/stream and the OpenAI API (which adds `finish`) use it."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Iterable[str] = ()) -> None:
        self.decode, self.stops = decode, [s for s in stops if s]
        self.shown = ""  # what feed gave so far
        self.text = ""  # all the text so far, cut at a stop string (the answer once it ends)
        self.stopped = False  # a stop string ended it
        self.stopped_by: str | None = None  # which (the first in the text)
        self.used = 0  # tokens the answer took
        self.tokens: list[int] = []  # every token so far
        self.finish: str | None = None  # the OpenAI API's: "stop" or "length"

    def feed(self, tokens: Sequence[int], last: bool) -> str:
        if self.stopped:
            return ""
        text = self.decode(tokens)
        self.tokens, self.used = list(tokens), len(tokens)
        cut, by = min(((i, s) for s in self.stops if (i := text.find(s)) >= 0),
                      default=(None, None))  # fmt: skip
        if cut is not None:
            self.stopped, self.stopped_by = True, by
            self.used = self._fewest(tokens)
            self.text = text[:cut]
            return self._advance(text[:cut])
        self.text = text
        if not last:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._partial_stop(text)]
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.shown):  # more tokens changed earlier text: keep what went
            return ""
        delta, self.shown = text[len(self.shown) :], text
        return delta

    def _partial_stop(self, text: str) -> int:
        return max((m for s in self.stops for m in range(1, len(s)) if text.endswith(s[:m])),
                   default=0)  # fmt: skip

    def _fewest(self, tokens: Sequence[int]) -> int:
        k = len(tokens)
        while k > 1 and any(s in self.decode(tokens[: k - 1]) for s in self.stops):
            k -= 1
        return k
