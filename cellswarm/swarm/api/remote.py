"""`cellswarm.connect(url)`: a running swarm with a local model's llama-cpp-python methods.

    swarm = cellswarm.connect("http://10.0.0.5:8470", api_key="sk-...")
    swarm("Q: Name the planets. A:", max_tokens=32)          # create_completion
    swarm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}])
    swarm.tokenize(b"Hello"), swarm.detokenize([...])

Each method is one call of the swarm's OpenAI routes (openai_api.py), so the answers are
OpenAI's dicts, the same a local model's methods give (engine/completions.py), with the same
llama-cpp-python defaults sent explicitly: the same arguments make the same tokens here and
there. `stream=True` gives the chunks as the routes send them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from cellswarm.engine.completions import sampling_settings
from cellswarm.swarm.api import client
from cellswarm.swarm.api.client import ModelCard, ModelList
from cellswarm.swarm.protocol.jsonvalue import JsonObject

# An OpenAI answer, or with `stream=True` its chunks as they come (llama-cpp-python's
# methods return the same union).
Answer = JsonObject | Iterator[JsonObject]


class Swarm:
    def __init__(self, url: str, api_key: str | None = None, tls: str | None = None) -> None:
        self.url, self.api_key, self.tls = url.rstrip("/"), api_key, tls
        card = self._models()["data"][0]
        self.name, self.n_ctx = str(card["id"]), card.get("max_model_len")

    def _models(self) -> ModelList:
        answer: ModelList = client.call(self.url, "/v1/models", tls=self.tls,
                                        api_key=self.api_key)  # fmt: skip
        return answer

    def _post(self, path: str, body: Mapping[str, object], stream: bool = False) -> Answer:
        if stream:
            return client.events(self.url, path, body, tls=self.tls, api_key=self.api_key)
        return self._answer(path, body)

    def _answer(self, path: str, body: Mapping[str, object]) -> JsonObject:
        answer: JsonObject = client.call(self.url, path, body, timeout_s=600, tls=self.tls,
                                         api_key=self.api_key)  # fmt: skip
        return answer

    def _body(self, stop: str | Sequence[str] | None,
              kw: dict[str, object]) -> dict[str, object]:  # fmt: skip
        body: dict[str, object] = sampling_settings(kw)
        if stop:
            body["stop"] = [stop] if isinstance(stop, str) else list(stop)
        return {"model": self.name, **body}

    def create_completion(
        self, prompt: str | Sequence[int], max_tokens: int | None = 16,
        stop: str | Sequence[str] | None = None, echo: bool = False,
        logprobs: int | None = None, stream: bool = False, **kw: object,
    ) -> Answer:  # fmt: skip
        body = {**self._body(stop, kw), "prompt": prompt if isinstance(prompt, str)
                else list(prompt), "max_tokens": max_tokens, "echo": echo,
                "stream": stream}  # fmt: skip
        if logprobs is not None:
            body["logprobs"] = logprobs
        return self._post("/v1/completions", body, stream)

    __call__ = create_completion  # swarm(prompt, ...), as a llama-cpp-python Llama

    def create_chat_completion(
        self, messages: Sequence[Mapping[str, object]], max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None, logprobs: bool = False,
        top_logprobs: int | None = None, stream: bool = False, **kw: object,
    ) -> Answer:  # fmt: skip
        body = {**self._body(stop, kw), "messages": messages, "stream": stream}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if logprobs:
            body |= {"logprobs": True, "top_logprobs": top_logprobs or 0}
        return self._post("/v1/chat/completions", body, stream)

    def tokenize(self, text: bytes | str, add_bos: bool = True,
                 special: bool = False) -> list[int]:  # fmt: skip
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        body = {"prompt": text, "add_special_tokens": add_bos}
        tokens = self._answer("/tokenize", body)["tokens"]
        if not isinstance(tokens, list):
            raise TypeError(f"/tokenize answered tokens of {type(tokens).__name__}, not a list")
        return [_whole(t) for t in tokens]

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return str(self._answer("/detokenize", {"tokens": list(tokens)})["prompt"]).encode()

    def models(self) -> Iterator[ModelCard]:
        yield from self._models()["data"]


def _whole(token: object) -> int:
    """A token id as `int()` reads one (the route sends ints)."""
    if not isinstance(token, int | float | str):
        raise TypeError(f"a token id of {type(token).__name__}")
    return int(token)
