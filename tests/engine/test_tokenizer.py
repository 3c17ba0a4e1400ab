"""Tokenizer and chat template: SmolLM2's tokenizer built from its GGUF metadata against
transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, streaming detokenization,
tokenizer.json round trips, and the template sandbox.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from talaria.engine.loader import gguf_tokenizer, smollm2_gguf
from talaria.engine.tokenizer import DetokenizeStream, Tokenizer, compile_chat_template
from talaria.errors import BadRequest, ConfigError

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    'print("tabs\\tand\\nescapes"); {"json": [1, 2.5, null]}',
    "naïve café — Grüße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어",
    "emoji 😀👍🏽 flags 🇫🇷🇯🇵 family 👨‍👩‍👧 done",
    "   lots   of\n\n\n  spaces \t\t and trailing   ",
    "numbers 12345 3.14159 1,000,000 007",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special <|endoftext|> in the middle",
    "",
    " ",
    "\n",
    "zero\u200bwidth\ufeff and \u00a0nbsp",
    "Ġ literal byte-level Ċ characters",
    "I'm can't we'll they've CAPS'LL",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write `ls -la` output 😀"},
    ],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "tool_calls": None},
        {"role": "user", "content": "c\n\nd"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return gguf_tokenizer(smollm2_gguf())


@pytest.fixture(scope="module")
def reference() -> Any:
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_special_tokens_and_sizes(ours: Tokenizer, reference: Any) -> None:
    assert ours.vocab_size == len(reference) == 49152
    assert ours.bos_token == reference.bos_token == "<|im_start|>"
    assert ours.eos_token == reference.eos_token == "<|im_end|>"
    assert ours.pad_token == reference.pad_token and ours.unk_token == reference.unk_token
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.encode("<|im_start|>") == [1]
    assert ours.backend.get_vocab() == reference.get_vocab()


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(ours: Tokenizer, reference: Any, add_special: bool) -> None:
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=add_special)
        assert ours.encode(text, add_special_tokens=add_special) == expected, repr(text)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours: Tokenizer, reference: Any, skip: bool) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        ), repr(text)
        if not skip:
            assert ours.decode(ids, skip_special_tokens=False) == text
    sample = list(range(0, 49152, 97))  # arbitrary ids, including partial UTF-8 byte tokens
    assert ours.decode(sample) == reference.decode(sample, skip_special_tokens=True)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference: Any, generation_prompt: bool
) -> None:
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )
        got = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        assert got == expected


def test_streaming_concatenates_to_the_full_decode(ours: Tokenizer) -> None:
    for text in TEXTS:
        for skip in (True, False):
            ids = ours.encode(text)
            stream = ours.stream(skip_special_tokens=skip)
            deltas = [stream.push(i) for i in ids]
            assert "".join(deltas) + stream.flush() == ours.decode(ids, skip), repr(text)
            assert stream.token_ids == ids


def test_streaming_never_splits_a_character(ours: Tokenizer) -> None:
    text = "😀👍🏽🇫🇷 日本語 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = ours.encode(text)
    stream = DetokenizeStream(ours)
    deltas = [stream.push(i) for i in ids]
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # something was held back while a character was incomplete
    assert "".join(deltas) + stream.flush() == text


def test_streaming_flush_returns_an_incomplete_tail(ours: Tokenizer) -> None:
    ids = ours.encode("ok 😀")
    stream = ours.stream()
    text = "".join(stream.push(i) for i in ids[:-1])
    tail = stream.flush()
    assert text.startswith("ok") and tail.endswith("\ufffd")
    assert text + tail == ours.decode(ids[:-1])


def test_decode_rejects_ids_outside_the_vocabulary(ours: Tokenizer) -> None:
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        ours.decode([5, 49152])
    with pytest.raises(BadRequest):
        ours.encode(b"bytes")  # type: ignore[arg-type]


def test_tokenizer_json_round_trip(ours: Tokenizer, tmp_path: Path) -> None:
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "chat_template": ours.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    again = Tokenizer.from_hf_dir(tmp_path)
    assert again.bos_token == "<|im_start|>" and again.eos_token_id == 2
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
    assert again.apply_chat_template(CONVERSATIONS[0]) == ours.apply_chat_template(CONVERSATIONS[0])


def test_broken_tokenizer_files_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ConfigError, match="cannot read tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"tokenizer\.ggml\.model"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"}, "x.gguf")


def test_template_sandbox_and_helpers(ours: Tokenizer) -> None:
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
        "{{ messages[0]['content'] | tojson }}|{{ tools | tojson }}|{{ strftime_now('%Y')|length }}"
        "{% for m in messages %}{% if true %}{% break %}{% endif %}{% endfor %}"
        "{% generation %}|{{ eos_token }}{% endgeneration %}"
    )
    tok = Tokenizer(ours.backend, source="t", eos_token="<e>", chat_template=template)
    tools = [{"type": "function", "function": {"name": "ls"}}]
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], tools=tools)
    assert out == '"é"|[{"type": "function", "function": {"name": "ls"}}]|4|<e>'
    with pytest.raises(BadRequest, match="only one message"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    with pytest.raises(BadRequest, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(BadRequest):
        Tokenizer(ours.backend, source="t", chat_template=escape).apply_chat_template(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(ConfigError, match="does not parse"):
        compile_chat_template("t", "{% for %}")
    with pytest.raises(BadRequest, match="no chat template"):
        Tokenizer(ours.backend, source="t").apply_chat_template([])


def test_template_trims_blocks_like_transformers(ours: Tokenizer) -> None:
    template = "{% for m in messages %}\n    {{ m['content'] }}\n{% endfor %}"
    tok = Tokenizer(ours.backend, source="t", chat_template=template)
    assert tok.apply_chat_template([{"role": "u", "content": "x"}]) == "    x\n"
