"""Text <-> token ids, built from a GGUF file's metadata or from a Hugging Face folder.

The encoding itself runs in the `tokenizers` library (Rust). This module only assembles a
`tokenizers.Tokenizer` that cuts text the way llama.cpp does for the same GGUF file, and renders
chat templates the way transformers does, so prompts reach the model as its authors' tools would
send them.

    tok = Tokenizer.from_gguf_metadata(meta)      # meta: GGUF key -> python value
    tok = Tokenizer.from_hf_dir("path/to/model")  # tokenizer.json + tokenizer_config.json
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    check_vocab(tok, model_vocab_size)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from cellswarm.errors import RequestError, TokenizerError

__all__ = ["Tokenizer", "check_vocab"]

# llama.cpp's token types (gguf `tokenizer.ggml.token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as "end of generation" whenever they are in the vocabulary, because
# chat models end a turn with them even when the file names a different EOS.
_END_OF_TURN_TEXTS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
    "<|return|>",
    "<|call|>",
)

_SPECIAL_NAMES = ("bos", "eos", "unk", "pad")


# --------------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe applies them (src/llama-vocab.cpp).
#
# llama.cpp runs a list of regexes in turn, each over the pieces the previous one left, keeping the
# text between matches as pieces too. A `Sequence` of `Split(..., "isolated")` does exactly that.
# llama.cpp's GPT-2 regex has no final `|\s+`; the text it leaves unmatched (one whitespace
# character before a non-space) becomes a piece of its own anyway, so adding `|\s+` changes nothing.

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# llama.cpp spells `(?i:'s|...)` as explicit classes so that no Unicode case folding sneaks in.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK ideographs, hiragana, katakana
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# The tokenizer.json originals; llama.cpp rewrites them with lookaheads only because std::regex
# lacks \p{Lu} and friends, which the tokenizers library (Oniguruma) has.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# What llama.cpp falls back to for 'default' or a file without tokenizer.ggml.pre.
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _PreSplit:
    regexes: tuple[str, ...]
    # llama.cpp: take a piece whole when it is already a token, before trying merges (Llama 3).
    ignore_merges: bool = False
    # llama.cpp's add-BOS default for this family when the file has no tokenizer.ggml.add_bos_token.
    add_bos: bool = False


def _family(names: Iterable[str], split: _PreSplit) -> dict[str, _PreSplit]:
    return dict.fromkeys(names, split)


_PRE_SPLITS: dict[str, _PreSplit] = {
    **_family(["default"], _PreSplit(_DEFAULT)),
    **_family(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"], _PreSplit((_GPT2,))),
    # Single digits first, then GPT-2: SmolLM's tokenizer.json is Digits(individual) + ByteLevel.
    **_family(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        _PreSplit((r"\p{N}", _GPT2)),
    ),
    **_family(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"],
        _PreSplit((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **_family(["dbrx", "smaug-bpe"], _PreSplit((_LLAMA3,))),
    **_family(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], _PreSplit((_QWEN2,))),
    **_family(["deepseek-v3"], _PreSplit(_DEEPSEEK3)),
    **_family(["gpt-4o", "llama4"], _PreSplit((_GPT4O,))),
    **_family(["tekken"], _PreSplit((_TEKKEN,), ignore_merges=True, add_bos=True)),
}

_MODEL_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE with scores"}


class Tokenizer:
    """A model's tokenizer: text to ids and back, stop tokens, and its chat template.

    Build one with `from_gguf_metadata` or `from_hf_dir`; the constructor takes an assembled
    `tokenizers.Tokenizer` plus what the model file says about special tokens.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: Mapping[str, str],
        add_bos: bool,
        add_eos: bool = False,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
        special_ids: Mapping[str, int] | None = None,
    ) -> None:
        """`special_tokens` maps "bos"/"eos"/"unk"/"pad" to token text (templates read them);
        `special_ids` gives their ids when the file states them, else the text is looked up."""
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._add_bos = add_bos
        self._add_eos = add_eos
        self.chat_template: str | None = chat_template
        self._compiled: tuple[str, jinja2.Template] | None = None
        vocab = backend.get_vocab(with_added_tokens=True)
        # Ids, not entry counts: a vocabulary with holes still needs max id + 1 embedding rows.
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        ids = special_ids or {}
        self.bos_id: int | None = ids.get("bos", self._id_of("bos"))
        self.eos_id: int | None = ids.get("eos", self._id_of("eos"))
        self.stop_ids: frozenset[int] = _stop_ids(vocab, self.eos_id, extra_stop_ids)

    # ---------------------------------------------------------------------------------- builders

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes under its `tokenizer.ggml.*` keys.

        Supports tokenizer.ggml.model 'gpt2' (byte-level BPE, pre-tokenized per tokenizer.ggml.pre)
        and 'llama' (SentencePiece BPE: merges from tokenizer.ggml.merges or from the scores).
        """
        kind = str(_required(meta, "tokenizer.ggml.model"))
        tokens = [str(token) for token in _required(meta, "tokenizer.ggml.tokens")]
        types = _token_types(meta, len(tokens))
        if kind == "gpt2":
            backend, add_bos_default = _byte_level_backend(meta, tokens, types)
        elif kind == "llama":
            # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
            backend, add_bos_default = _sentencepiece_backend(meta, tokens, types), True
        else:
            supported = ", ".join(f"{name!r} ({what})" for name, what in _MODEL_KINDS.items())
            raise TokenizerError(
                f"tokenizer.ggml.model is {kind!r}, which cellswarm cannot build; it supports "
                f"{supported} — use Tokenizer.from_hf_dir with the model's tokenizer.json instead"
            )
        _add_special_tokens(backend, tokens, types)
        ids = _gguf_special_ids(meta, len(tokens))
        return cls(
            backend,
            special_tokens={name: tokens[index] for name, index in ids.items()},
            special_ids=ids,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=_optional_str(meta.get("tokenizer.chat_template")),
            extra_stop_ids=_gguf_end_ids(meta, len(tokens)),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` from a Hugging Face model folder.

        Special tokens, `add_bos_token`/`add_eos_token` and the chat template come from
        `tokenizer_config.json` (or `chat_template.jinja`, which newer transformers writes);
        `generation_config.json`'s eos ids, when present, become stop ids too. Without an explicit
        `add_bos_token`, BOS is added exactly when tokenizer.json's post-processor adds it.
        """
        folder = Path(path)
        backend = _load_backend(folder / "tokenizer.json")
        config = _read_json(folder / "tokenizer_config.json")
        special = _hf_special_tokens(config)
        return cls(
            backend,
            special_tokens=special,
            add_bos=_hf_adds(config, "add_bos_token", backend, special.get("bos"), first=True),
            add_eos=_hf_adds(config, "add_eos_token", backend, special.get("eos"), first=False),
            chat_template=_hf_chat_template(folder, config),
            extra_stop_ids=_hf_generation_eos(folder),
        )

    # ---------------------------------------------------------------------------------- encoding

    def vocabulary(self) -> dict[str, int]:
        """Every token's text and id (added tokens too): two models whose vocabularies are
        equal read and write the same ids (a draft model's check)."""
        return dict(self._backend.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids for `text`. Special-token strings in `text` become their single ids.

        With `add_special`, BOS (and EOS) are added only when the model asks for them: chat
        templates usually write BOS themselves, so SmolLM2, Qwen and others add nothing.
        """
        # The backend's own post-processor is bypassed so one rule (the model's flags) decides.
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special and self._add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_special and self._add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for `ids`. Ids the tokenizer does not know (embedding padding rows) give nothing."""
        ids = [int(token_id) for token_id in ids]  # also takes numpy integers
        if ids and min(ids) < 0:
            raise RequestError(f"token ids must not be negative, got {min(ids)}")
        return self._backend.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for, e.g. " world"; special tokens give their own text.

        A token holding part of a UTF-8 character gives U+FFFD; decode whole sequences for output.
        """
        return self.decode([token_id])

    # ---------------------------------------------------------------------------------- chat

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers does.

        The template sees `messages`, `add_generation_prompt`, `tools`, `documents`,
        `bos_token`/`eos_token`/`unk_token`/`pad_token` and any `extra` keyword, with transformers'
        globals (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII).

        A model without a template falls back to plain lines, "role: content\\n" per message, then
        "assistant:" when `add_generation_prompt` — readable, but not what any model was tuned on.
        """
        if self.chat_template is None:
            return _plain_chat(messages, add_generation_prompt)
        context: dict[str, Any] = {f"{name}_token": t for name, t in self._special_tokens.items()}
        context |= {"tools": None, "documents": None, **extra}
        context["messages"] = _template_messages(messages)
        context["add_generation_prompt"] = add_generation_prompt
        return _render(self._template(), context)

    def _template(self) -> jinja2.Template:
        source = self.chat_template
        assert source is not None
        # Keyed by the source so that assigning a new chat_template takes effect.
        if self._compiled is None or self._compiled[0] != source:
            self._compiled = (source, _compile_template(source))
        return self._compiled[1]

    def _id_of(self, name: str) -> int | None:
        text = self._special_tokens.get(name)
        return None if text is None else self._backend.token_to_id(text)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Refuse a tokenizer whose ids would index past the model's embedding.

    A model with more rows than the tokenizer has tokens is fine: embeddings are often padded to a
    multiple of 64 or 128, and the extra rows are never produced by encoding.
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise TokenizerError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
            f"{model_vocab_size} rows; use the tokenizer that came with the model"
        )


# ------------------------------------------------------------------------------------ GGUF helpers


def _required(meta: Mapping[str, Any], key: str) -> Any:
    value = meta.get(key)
    if value is None:
        raise TokenizerError(
            f"GGUF metadata has no {key!r}, so the file carries no usable tokenizer; "
            "load the model's tokenizer folder with Tokenizer.from_hf_dir instead"
        )
    return value


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _token_types(meta: Mapping[str, Any], count: int) -> list[int]:
    raw = meta.get("tokenizer.ggml.token_type")
    if raw is None:
        return [NORMAL] * count
    types = [int(kind) for kind in raw]
    if len(types) != count:
        raise TokenizerError(
            f"GGUF tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens "
            f"has {count}; the file is corrupt — re-convert the model"
        )
    return types


def _gguf_special_ids(meta: Mapping[str, Any], count: int) -> dict[str, int]:
    ids = {}
    for name, key in zip(_SPECIAL_NAMES, ("bos", "eos", "unknown", "padding"), strict=True):
        index = _gguf_token_id(meta, f"tokenizer.ggml.{key}_token_id", count)
        if index is not None:
            ids[name] = index
    return ids


def _gguf_end_ids(meta: Mapping[str, Any], count: int) -> list[int]:
    keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [index for key in keys if (index := _gguf_token_id(meta, key, count)) is not None]


def _gguf_token_id(meta: Mapping[str, Any], key: str, count: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    index = int(value)
    if index in (-1, 0xFFFFFFFF):  # llama.cpp's "no such token", signed or as uint32
        return None
    if not 0 <= index < count:
        raise TokenizerError(
            f"GGUF {key} is {index} but the vocabulary has {count} tokens; the file is corrupt"
        )
    return index


def _byte_level_backend(
    meta: Mapping[str, Any], tokens: list[str], types: list[int]
) -> tuple[Backend, bool]:
    pre = meta.get("tokenizer.ggml.pre")
    name = "default" if pre is None else str(pre)  # what llama.cpp assumes for old files
    split = _PRE_SPLITS.get(name)
    if split is None:
        raise TokenizerError(
            f"tokenizer.ggml.pre is {name!r}, a pre-tokenizer cellswarm does not know; supported: "
            f"{', '.join(sorted(_PRE_SPLITS))} — or load the model's tokenizer.json (from_hf_dir)"
        )
    merges = _gguf_merges(_required_merges(meta))
    model = _bpe(_byte_level_vocab(tokens, types), merges, ignore_merges=split.ignore_merges)
    backend = Backend(model)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()
    return backend, split.add_bos


def _required_merges(meta: Mapping[str, Any]) -> Sequence[str]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError(
            "GGUF metadata has no 'tokenizer.ggml.merges', which a 'gpt2' (BPE) tokenizer needs; "
            "re-convert the model with llama.cpp's convert_hf_to_gguf.py or use from_hf_dir"
        )
    return [str(merge) for merge in merges]


def _gguf_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        # Search from index 1, as llama.cpp does, so a left part that is itself " " survives.
        cut = merge.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"GGUF merge {merge!r} is not 'left right'; the file is corrupt")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=merges, **options)
    except Exception as error:  # the Rust side reports a merge naming an unknown token
        raise TokenizerError(f"GGUF tokenizer merges do not match its tokens ({error})") from error


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Token text -> id, every ordinary token spelled in GPT-2's byte alphabet.

    Special and user-defined tokens stay raw (llama.cpp matches them in text as written, e.g.
    DeepSeek's "<｜end▁of▁sentence｜>"); an ordinary token that a converter wrote as plain text is
    re-spelled so that merges can reach it and decoding gives its bytes back.
    """
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    vocab = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        raw = kind in (CONTROL, USER_DEFINED, UNKNOWN) or set(token) <= letters
        # Last one wins on duplicate texts, as in llama.cpp's token_to_id.
        vocab[token if raw else "".join(alphabet[b] for b in token.encode("utf-8"))] = index
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (space is 'Ġ', newline 'Ċ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shifted)
            shifted += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _byte_level_pre_tokenizer(split: _PreSplit) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in split.regexes
    ]
    # The regexes did the splitting; ByteLevel only maps bytes to GPT-2's alphabet.
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> Backend:
    """SentencePiece-style BPE as llama.cpp's SPM tokenizer runs it.

    Spaces become '▁', and with tokenizer.ggml.add_space_prefix (default on) a '▁' is put in front
    of the text and after every special token — llama.cpp and the original sentencepiece do that;
    the newer transformers "non-legacy" mode only prefixes the start. Unknown characters fall back
    to <0xNN> byte tokens.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges") is not None:
        merges = _gguf_merges(_required_merges(meta))
    else:
        scores = [float(score) for score in _required(meta, "tokenizer.ggml.scores")]
        merges = _merges_from_scores(tokens, types, scores)
    unk = _gguf_token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    model = _bpe(
        vocab,
        merges,
        unk_token=None if unk is None else tokens[unk],
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Backend(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = _spm_normalizer(prefix)
    backend.decoder = _spm_decoder(prefix)
    return backend


def _merges_from_scores(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies: every split of a piece into two tokens, ranked by
    the piece's score (llama.cpp merges the best-scoring pair first). Ties are broken like
    transformers' `generate_merges` so both produce the same ranks."""
    if len(scores) != len(tokens):
        raise TokenizerError(
            f"GGUF tokenizer.ggml.scores has {len(scores)} entries but there are {len(tokens)} "
            "tokens; the file is corrupt — re-convert the model"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[float, str, str]] = []
    for token, kind, score in zip(tokens, types, scores, strict=True):
        if kind not in (NORMAL, USER_DEFINED):  # control and byte tokens are never merged into
            continue
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted(
            ((left, right) for left, right in splits if left in vocab and right in vocab),
            key=lambda pair: (vocab[pair[0]], vocab[pair[1]]),
        )
        ranked.extend((score, left, right) for left, right in pairs)
    ranked.sort(key=lambda item: (item[0], len(item[1]), len(item[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


def _spm_normalizer(prefix: bool) -> normalizers.Normalizer:
    # Normalizers run on each stretch of text between special tokens, hence "after every special".
    escape = normalizers.Replace(" ", "▁")
    return normalizers.Sequence([normalizers.Prepend("▁"), escape]) if prefix else escape


def _spm_decoder(prefix: bool) -> decoders.Decoder:
    steps: list[decoders.Decoder] = [
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if prefix:  # drop the space the prefix put in front
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int]) -> None:
    """Control (and unknown) tokens become special added tokens, user-defined ones plain added
    tokens: both are then matched whole in text, as llama.cpp does, instead of cut into pieces."""
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, UNKNOWN)]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED]
    # normalized=False: match the text as typed, before any '▁' escaping.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


# ------------------------------------------------------------------------- Hugging Face helpers


def _load_backend(file: Path) -> Backend:
    if not file.is_file():
        raise TokenizerError(
            f"{file} not found; point at the model folder that holds tokenizer.json "
            "(transformers' tokenizer.save_pretrained(folder) writes one)"
        )
    try:
        return Backend.from_file(str(file))
    except Exception as error:  # the Rust side says what it could not parse
        raise TokenizerError(
            f"{file} cannot be read by the tokenizers library ({error}); "
            "re-save it with a recent transformers"
        ) from error


def _read_json(file: Path) -> dict[str, Any]:
    """The object in `file`, or {} when the file is absent (every field in it is optional)."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(
            f"{file} is not valid JSON ({error}); restore it from the model repo"
        ) from error
    if not isinstance(value, dict):
        raise TokenizerError(f"{file} holds a {type(value).__name__}, not a JSON object")
    return value


def _hf_special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    special = {}
    for name in _SPECIAL_NAMES:
        value = config.get(f"{name}_token")
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    return special


def _hf_adds(
    config: Mapping[str, Any], key: str, backend: Backend, token: str | None, *, first: bool
) -> bool:
    """Whether the model wants BOS (first) / EOS (last) added: the config's flag if it has one,
    else whatever tokenizer.json's post-processor does to an empty text."""
    if token is None:
        return False
    flag = config.get(key)
    if isinstance(flag, bool):
        return flag
    added = backend.encode("", add_special_tokens=True).ids
    return bool(added) and added[0 if first else -1] == backend.token_to_id(token)


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():  # newer transformers saves the template here, not in the config
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates; "default" is the one transformers uses
        named = {item.get("name"): item.get("template") for item in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _hf_generation_eos(folder: Path) -> list[int]:
    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    return [index for index in eos if isinstance(index, int)] if isinstance(eos, list) else []


# ---------------------------------------------------------------------------------- stop tokens


def _stop_ids(vocab: Mapping[str, int], eos: int | None, extra: Iterable[int]) -> frozenset[int]:
    ids = {eos} if eos is not None else set()
    ids.update(extra)
    ids.update(vocab[text] for text in _END_OF_TURN_TEXTS if text in vocab)
    # gpt-oss ends a message with <|end|> but the answer only with <|return|> (llama.cpp does this).
    if "<|return|>" in vocab and "<|end|>" in vocab:
        ids.discard(vocab["<|end|>"])
    return frozenset(ids)


# --------------------------------------------------------------------------------- chat template


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception: it refuses the conversation (caller's problem)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes '<' and '&', which would change what the model sees.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates, without the class itself (its attributes lead out of the sandbox)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as transformers' does (CPython internals).

    Namespace routes every attribute lookup on itself to the template's values, hence the
    module-level check instead of a method.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in dict(*args, **kwargs):
            _check_namespace_name(name)
        super().__init__(*args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering just outputs the body, but the tag must parse."""

    tags = {"generation"}  # noqa: RUF012 -- jinja2 declares `tags` a plain attribute

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers builds (chat_template_utils._compile_jinja_template)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise TokenizerError(
            f"the model's chat template does not parse (line {error.lineno}: {error.message}); "
            "fix tokenizer.chat_template or pass a working template"
        ) from error


def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
    try:
        return template.render(**context)
    except _TemplateRaised as error:
        raise RequestError(f"the chat template refused these messages: {error.message}") from error
    except jinja2.TemplateError as error:
        raise TokenizerError(f"the model's chat template failed to render: {error}") from error


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to templates: keys set to None dropped (templates test
    presence, not None), reasoning also filed under `reasoning_content` and `thinking`."""
    prepared = []
    for message in messages:
        if not isinstance(message, dict):
            raise RequestError(f"chat messages must be dicts, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        names = ("reasoning_content", "thinking", "reasoning")
        reasoning = next((message[key] for key in names if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _plain_chat(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    lines = [f"{message['role']}: {_text_of(message.get('content'))}\n" for message in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "".join(lines)


def _text_of(content: Any) -> str:
    """Message content as text: a string, or the text parts of an OpenAI-style parts list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise RequestError(f"message content must be text or a list of parts, got {content!r}")


def gguf_tokenizer(meta: dict[str, Any], vocab_size: int) -> Tokenizer | None:
    """The file's own tokenizer; None when it has none (random test models)."""
    if "tokenizer.ggml.model" not in meta:
        return None
    tok = Tokenizer.from_gguf_metadata(meta)
    check_vocab(tok, vocab_size)
    return tok
