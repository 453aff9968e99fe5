"""A loaded model: an architecture over a weight store, a tokenizer, and generation.

`Model.forward` runs any contiguous range of layers, which is all a pipeline stage needs;
`logits` and `generate` run the whole model in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from cellswarm import kernels
from cellswarm.cache_types import DEFAULT_CACHE_TYPE, check_cache_type
from cellswarm.engine import PREFILL_CHUNK
from cellswarm.engine.completions import Completions
from cellswarm.engine.memory import MemoryReport, memory_report, peak_rss_bytes
from cellswarm.engine.sampling import SamplingParams, sample
from cellswarm.engine.speculative import DraftModel, Speculator, accept, check_mode
from cellswarm.engine.text import StopText
from cellswarm.errors import RequestError
from cellswarm.io.weights import Selection, WeightStore, non_finite
from cellswarm.kernels.awake import awake
from cellswarm.models.base import Architecture
from cellswarm.models.kv_cache import KVCache, bytes_per_token, read_bytes, sequence_bytes

if TYPE_CHECKING:
    from cellswarm.io.tokenizer import Tokenizer
    from cellswarm.models import FamilyConfig



@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    peak_rss_bytes: int
    stop_reason: str  # "stop_token" | "stop_string" | "max_tokens"
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified,
    accepted_tokens: int = 0  # and those of them the model agreed with

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes from prefill; the rest are decode steps.
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "peak_rss_bytes": self.peak_rss_bytes,
            "stop_reason": self.stop_reason,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
        }


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats


@dataclass(frozen=True)
class GenerateOptions:
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] | None = None  # None: the tokenizer's end-of-turn tokens
    # tokens of KV cache a generation may take, prompt + max_tokens (the CLI's --context;
    # None: unchecked, the cache takes what the generation needs)
    context: int | None = None
    speculative: str = "auto"  # speculative.MODES: drafts verified k+1 rows at a time

    def __post_init__(self) -> None:
        check_mode(self.speculative)
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens {self.max_tokens} must be at least 1")
        if self.context is not None and self.context < 1:
            raise RequestError(f"context {self.context} must be at least 1 token")


SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))


def options_from(options: GenerateOptions | None, settings: dict[str, Any]) -> GenerateOptions:
    """GenerateOptions from keywords (max_tokens, stop, stop_ids and SamplingParams' fields:
    temperature, top_k, top_p, min_p, repetition_penalty, seed), or the options given."""
    if options is not None and settings:
        raise RequestError("give generation settings as options= or as keywords, not both")
    if options is not None:
        return options
    known = ("max_tokens", "stop", "stop_ids", "speculative", *SAMPLING_KEYS)
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise RequestError(f"unknown generation setting {unknown[0]!r}; use {', '.join(known)}")
    stop = settings.get("stop", ())
    stop_ids = settings.get("stop_ids")
    return GenerateOptions(
        max_tokens=int(settings.get("max_tokens", GenerateOptions.max_tokens)),
        sampling=SamplingParams(**{k: settings[k] for k in SAMPLING_KEYS if k in settings}),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_ids=None if stop_ids is None else frozenset(stop_ids),
        speculative=str(settings.get("speculative", GenerateOptions.speculative)),
    )


class TextStream:
    """Pieces of text as they are decoded; `.result` (the Generation) once they end."""

    def __init__(self, generator: _Generator) -> None:
        self._gen, self._pieces, self._done = generator, generator.run(), False

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except StopIteration:
            self._done = True
            raise

    @property
    def result(self) -> Generation:
        if not self._done:
            raise RequestError("the stream has not ended: read it to the end first")
        return self._gen.result()


class Model(Completions):
    """A loaded model (or shard): its steps, and generation — `generate`/`stream` and
    llama-cpp-python's OpenAI-shaped methods (completions.py)."""

    def __init__(
        self,
        config: FamilyConfig,
        arch: Architecture,
        weights: WeightStore,
        tokenizer: Tokenizer | None,
        selection: Selection,
        kv_budget_bytes: int | None = None,
    ) -> None:
        self.config = config
        self.arch = arch
        self.weights = weights
        self._tokenizer = tokenizer
        self.selection = selection
        self.kv_budget_bytes = kv_budget_bytes
        self.name = "model"  # the file's name, set by the loader (OpenAI answers' "model")
        self.n_ctx: int | None = None  # load(n_ctx=): the context a generation may take
        # what its KV caches store values as (cache_types.py: f16, q8_0, f32)
        self.cache_type = DEFAULT_CACHE_TYPE
        self.draft: Model | None = None  # a draft model for speculative decoding (use_draft)

    def use_draft(self, draft: Model) -> None:
        """Draft with `draft` (speculative 'draft', and 'auto'): it must share this model's
        tokenizer, token for token, or its guesses would be of other tokens."""
        mine, theirs = self._tokenizer, draft._tokenizer
        if mine is None or theirs is None or mine.vocabulary() != theirs.vocabulary():
            raise RequestError(f"the draft model {draft.name} has another tokenizer than "
                               f"{self.name}: draft with a model of the same family and "
                               "vocabulary")  # fmt: skip
        self.draft = draft

    def prepare(self) -> None:
        """Lay every layer's weights out for the fused kernels now (their repacked copies),
        as the first step would. Why at load: a first prompt that repacked a MoE's experts
        as it reached them ran at half its later speed (docs/same-bits.md, "Cold"), and a
        served model's first user waited for it; llama.cpp repacks in its load too."""
        self.arch.prepare(self.layers)

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RequestError("this model was loaded without a tokenizer; pass token ids")
        return self._tokenizer

    @property
    def layers(self) -> range:
        lo, hi = self.selection.layers or (0, self.config.n_layers)
        return range(lo, hi)

    def new_cache(self, capacity: int) -> KVCache:
        specs = {i: self.arch.cache_spec(i) for i in self.layers}
        return KVCache(specs, capacity, self.kv_budget_bytes, self.cache_type)

    def set_cache_type(self, cache_type: str) -> None:
        """Store the KV caches made from now on as `cache_type` (one line if unknown, or if
        this model's cached vectors do not split into q8_0's blocks)."""
        check_cache_type(cache_type)
        self.kv_bytes_per_token(cache_type)  # q8_0 refuses vectors not in blocks of 32
        self.cache_type = cache_type

    def kv_bytes_per_token(self, cache_type: str | None = None) -> int:
        specs = {i: self.arch.cache_spec(i) for i in self.layers}
        return bytes_per_token(specs, cache_type or self.cache_type)

    def kv_read_bytes(self, capacity: int) -> int:
        """The float copies of one layer's cache a step makes while it attends (kv_cache
        read_bytes): part of a step's scratch for a cache not of f32."""
        specs = [self.arch.cache_spec(i) for i in self.layers]
        return max((read_bytes(s, capacity, self.cache_type) for s in specs), default=0)

    def kv_sequence_bytes(self, capacity: int) -> int:
        """What new_cache(capacity) allocates (the keys' padding included)."""
        specs = {i: self.arch.cache_spec(i) for i in self.layers}
        return sequence_bytes(specs, capacity, self.cache_type)

    def forward(self, x: np.ndarray, cache: KVCache, layers: range | None = None) -> np.ndarray:
        """Hidden states (T, d) through `layers` at cache positions cache.length .. +T.

        NonFiniteError, naming the layer and the tensor, when activations become NaN or
        infinite (a corrupt weight): caught where it first shows, not at a sampler later."""
        # NaN and inf are tested for below, and reported as errors: numpy's warnings about
        # them would only add lines to a one-line error
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return self._forward(x, cache, layers)

    def _forward(self, x: np.ndarray, cache: KVCache, layers: range | None) -> np.ndarray:
        positions = np.arange(cache.length, cache.length + x.shape[0])
        layers = layers if layers is not None else self.layers
        self.arch.prepare(layers)
        if x.shape[0] == 1:  # one token: one C call per layer, where the model can
            out = self.arch.decode_fused(x, positions, cache, layers)
            if out is not None:
                out = np.asarray(out)
                # One test of the stage's output on this path (its layers are C calls with
                # nothing in between); only on failure do the layers run again one by one,
                # to find the first that made a NaN or infinity.
                if not np.isfinite(out).all():
                    self._find_non_finite(x, positions, cache, layers)
                return out
        if 1 < x.shape[0] <= kernels.MAX_BATCH:  # a few rows: one pass over the weights
            out = self._rows_fused(x, positions, cache, layers)
            if out is not None:
                return out
        # several tokens of one sequence (a prefill): the same int8 kernels as a decode step,
        # each token's row computed as if alone, so a prefill gives every position the bits
        # a decode of it would (recovery by re-prefill, verification of k drafted tokens)
        for i in layers:
            x = self.arch.block(i, x, positions, cache.layer(i))
            # One np.isfinite over the hidden state per layer, microseconds next to the
            # layer's own numpy work: NaN or inf is caught at the layer that made it.
            if not np.isfinite(x).all():
                raise self._non_finite(i)
        return x

    def _rows_fused(
        self, x: np.ndarray, positions: np.ndarray, cache: KVCache, layers: range
    ) -> np.ndarray | None:
        """T consecutive rows of one sequence (a speculative check's k+1, a short prompt) as
        the batched decode kernel's T "sequences" that share one cache: every row's keys are
        written before any row attends, and row t attends to positions ..positions[t], so it
        is causal, and each row is the bits of a decode step alone, for one read of the
        weights. None (the caller runs the rows as a prefill) where the architecture has no
        such kernel or a row is not finite (the prefill names the layer)."""
        self.arch.prepare(layers)
        caches = [cache] * x.shape[0]
        out = self.arch.decode_fused_many(np.ascontiguousarray(x, np.float32), positions,
                                          caches, layers)  # fmt: skip
        if out is None or not np.isfinite(out).all():
            return None
        return np.asarray(out)

    def _find_non_finite(
        self, x: np.ndarray, positions: np.ndarray, cache: KVCache, layers: range
    ) -> None:
        """Raise NonFiniteError for the first of `layers` whose output is not finite, running
        them again one by one from their input `x` (rewriting this step's cache entries)."""
        for i in layers:
            x = self.arch.block(i, x, positions, cache.layer(i))
            if not np.isfinite(x).all():
                raise self._non_finite(i)
        raise non_finite(f"layers {layers.start}..{layers.stop - 1}", self.weights, ())

    def _non_finite(self, layer: int) -> Exception:
        """The error for a layer whose output is not finite: one of its weights is, or the
        embedding's rows that entered the first layer were."""
        prefix = f"blk.{layer}."
        names = [n for n in self.weights if n.startswith(prefix)]
        first = layer == self.layers.start
        if first and "token_embd.weight" in self.weights and self.selection.embed:
            names = ["token_embd.weight", *names]
        return non_finite(f"layer {layer}", self.weights, names)

    def forward_many(self, x: np.ndarray, caches: Sequence[KVCache]) -> np.ndarray:
        """One new token of each of n sequences: hidden states (n, d) -> (n, d) through this
        model's layers, sequence i at position caches[i].length. Where the architecture can
        (`decode_fused_many`: the llama family, DeepSeek), the n tokens share each pass over
        the weights (and each routed expert runs once for the tokens routed to it), each
        token's bits those of a decode step alone; else one sequence at a time."""
        if len(caches) > kernels.MAX_BATCH:  # the kernels' widest batch: in groups of that many
            return np.concatenate([self.forward_many(x[i : i + kernels.MAX_BATCH],
                                                     caches[i : i + kernels.MAX_BATCH])
                                   for i in range(0, len(caches), kernels.MAX_BATCH)])  # fmt: skip
        if len(caches) > 1:
            positions = np.array([c.length for c in caches], dtype=np.int64)
            self.arch.prepare(self.layers)
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                out = self.arch.decode_fused_many(x, positions, list(caches), self.layers)
            if out is not None and np.isfinite(out).all():
                return np.asarray(out)
            # None, or not finite: one by one, which rewrites this step's cache entries and
            # names the layer that failed
        return np.concatenate([self.forward(x[i : i + 1], c) for i, c in enumerate(caches)])

    def step_many(self, token_ids: Sequence[int], caches: Sequence[KVCache]) -> np.ndarray:
        """One token per sequence -> logits (n, vocab), each cache one token longer."""
        ids = np.asarray(token_ids, dtype=np.int64)
        h = self.forward_many(self.arch.embed(ids), caches)
        for c in caches:
            c.length += 1
        return self.arch.head(h)

    def step(self, token_ids: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
        """Token ids (T,) -> logits (T, vocab), appending them to the cache; with last_only,
        (1, vocab) for the last position (generation needs no more, and the head over a
        whole prompt can cost as much as a layer)."""
        out = []
        for start in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = token_ids[start : start + PREFILL_CHUNK]
            h = self.forward(self.arch.embed(chunk), cache)
            cache.length += len(chunk)
            out.append(h[-1:] if last_only else self.arch.head(h))
        return self.arch.head(out[-1]) if last_only else np.concatenate(out, axis=0)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits (len(token_ids), vocab) for a fresh sequence."""
        ids = self._check_ids(token_ids)
        return self.step(ids, self.new_cache(len(ids)))

    def encode_prompt(self, prompt: str | Sequence[Any], chat: bool = False) -> list[int]:
        """Text (chat: as one user message), token ids, or messages ({"role", "content"}
        dicts, through the chat template with the generation prompt)."""
        if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict)
                                                              for m in prompt):  # fmt: skip
            text = self.tokenizer.apply_chat_template(list(prompt))
            return self.tokenizer.encode(text, add_special=False)
        if not isinstance(prompt, str):
            if any(type(t) is not int and not isinstance(t, np.integer) for t in prompt):
                raise RequestError("a prompt is text, token ids, or messages ({'role': ..., "
                                   "'content': ...} dicts)")  # fmt: skip
            return list(self._check_ids([int(t) for t in prompt]))
        tok = self.tokenizer
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}])
            return tok.encode(text, add_special=False)
        return tok.encode(prompt)

    def generate(
        self,
        prompt: str | Sequence[Any],
        options: GenerateOptions | None = None,
        on_text: Callable[[str], None] | None = None,
        chat: bool = False,
        **settings: Any,
    ) -> Generation:
        """Continue `prompt` (text, or token ids): `model.generate("...", max_tokens=64,
        temperature=0.7, seed=1, stop=["\n\n"])`, or with a GenerateOptions. The result has
        `.text`, `.token_ids` and `.stats`. `on_text` gets each piece as it is decoded."""
        stream = self.stream(prompt, options, chat=chat, **settings)
        for piece in stream:
            if on_text is not None:
                on_text(piece)
        return stream.result

    def stream(
        self,
        prompt: str | Sequence[Any],
        options: GenerateOptions | None = None,
        chat: bool = False,
        **settings: Any,
    ) -> TextStream:
        """As generate, piece by piece: `for piece in model.stream("...", max_tokens=64)`.
        Pieces are whole UTF-8 characters and never part of a stop string; once the loop
        ends, `.result` is the Generation."""
        opts = options_from(options, settings)
        if opts.context is None and self.n_ctx is not None:
            opts = replace(opts, context=self.n_ctx)
        return TextStream(_Generator(self, self.encode_prompt(prompt, chat), opts))

    def memory(self, batch: int = 1, context: int | None = None) -> MemoryReport:
        return memory_report(self, batch, context or self.config.context_length)

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise RequestError("token_ids must be a non-empty 1-D sequence of integers")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise RequestError(
                f"token id {int(bad[0])} is outside the vocabulary "
                f"(0..{self.config.vocab_size - 1})"
            )
        return ids


class _Generator:
    """One generation: prefill, then decode until a stop token, stop string or max_tokens."""

    def __init__(self, model: Model, prompt_ids: list[int], opts: GenerateOptions) -> None:
        self.model, self.prompt_ids, self.opts = model, prompt_ids, opts
        need = len(prompt_ids) + opts.max_tokens
        if opts.context is not None and need > opts.context:  # before any cache is taken
            raise RequestError(
                f"the context is {opts.context} tokens, but {need} were asked ("
                f"{len(prompt_ids)} in the prompt, {opts.max_tokens} in max_tokens): shorten "
                "the prompt or max_tokens, or raise --context")  # fmt: skip
        self.rng = np.random.default_rng(opts.sampling.seed)
        tok = model._tokenizer
        default_stops = tok.stop_ids if tok is not None else frozenset()
        self.stop_ids = opts.stop_ids if opts.stop_ids is not None else default_stops
        self.out_ids: list[int] = []
        self.text = StopText(model.tokenizer.decode if tok is not None else lambda ids: "",
                             opts.stop)  # fmt: skip
        self.stop_reason = ""  # "stop_token" | "stop_string" | "max_tokens", once it ends
        self.times = [0.0, 0.0]
        drafter = None if model.draft is None else DraftModel(model.draft, need + 1)
        self.spec = Speculator.of(opts.speculative, prompt_ids, drafter)
        self._drafts: list[int] = []  # the last round's

    def run(self) -> Iterator[str]:
        # threads that wait at every barrier: their cores stay awake meanwhile (awake.py)
        with awake(kernels.threads() > 1):
            yield from self._run()

    def _run(self) -> Iterator[str]:
        cache = self.model.new_cache(len(self.prompt_ids) + self.opts.max_tokens)
        t0 = time.perf_counter()
        logits = self.model.step(np.asarray(self.prompt_ids), cache, last_only=True)
        self.times[0] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tokens = [self._pick(logits[-1], [])]
        while self.stop_reason == "":
            for token in tokens:  # a round's tokens: the drafts kept, then the model's own
                yield from self._take(token)
                if self.stop_reason:
                    break
            else:
                tokens = self._round(tokens, cache)
        self.times[1] = time.perf_counter() - t0
        tail = self.text.feed(self.out_ids, last=True) if self.out_ids else ""
        if tail:
            yield tail

    def _take(self, token: int) -> Iterator[str]:
        """One token out (its text, if whole characters are ready), or the reason to stop."""
        if token in self.stop_ids:
            self.stop_reason = "stop_token"
            return
        self.out_ids.append(token)
        piece = self.text.feed(self.out_ids, last=False)
        if piece:
            yield piece
        if self.text.stopped:
            self.stop_reason = "stop_string"
        elif len(self.out_ids) >= self.opts.max_tokens:
            self.stop_reason = "max_tokens"

    def _round(self, tokens: list[int], cache: KVCache) -> list[int]:
        """One step: the last token and the drafts after it (none without speculation) as
        rows, verified (speculative.accept); the cache kept up to the last kept draft."""
        spec, text = self.spec, self.prompt_ids + self.out_ids
        if spec is not None:
            spec.took(self._drafts, tokens)
        room = self.opts.max_tokens - len(self.out_ids) - 1  # drafts past max_tokens: waste
        drafts = spec.draft(text, room) if spec is not None and room > 0 else []
        t0 = time.perf_counter()
        rows = self.model.step(np.asarray([text[-1], *drafts]), cache)  # (k+1, vocab)
        kept = accept(rows, drafts, self._pick)
        if spec is not None:
            spec.k.timed(len(drafts) + 1, time.perf_counter() - t0)
        cache.truncate(len(text) + len(kept) - 1)  # the rows of drafts refused: forgotten
        self._drafts = drafts
        return kept

    def _pick(self, row: np.ndarray, kept: list[int]) -> int:
        """The sampler at one row, `kept` the round's tokens before it: the draw decoding
        without speculation makes there (the same generator, in the same order)."""
        history = self.prompt_ids + self.out_ids + kept
        return sample(row, self.opts.sampling, self.rng, history, len(self.prompt_ids))

    def result(self) -> Generation:
        stats = GenerationStats(
            prompt_tokens=len(self.prompt_ids),
            generated_tokens=len(self.out_ids),
            prefill_s=self.times[0],
            decode_s=self.times[1],
            peak_rss_bytes=peak_rss_bytes(),
            stop_reason=self.stop_reason,
            drafted_tokens=0 if self.spec is None else self.spec.k.drafted,
            accepted_tokens=0 if self.spec is None else self.spec.k.accepted,
        )
        return Generation(self.text.text, list(self.out_ids), stats)
