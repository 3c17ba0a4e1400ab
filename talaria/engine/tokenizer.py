"""Tokenizers and chat templates for the embedded engine.

A :class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` built either from a ``tokenizer.json``
(Hugging Face directories) or from the vocabulary a GGUF file carries in its metadata
(``tokenizer.ggml.*``; byte-level BPE only, llama.cpp's ``gpt2`` model). It encodes, decodes,
detokenizes incrementally for streaming (:class:`DetokenizeStream`) and renders the model's
jinja2 chat template in a sandbox configured the way transformers configures it.

Nothing here downloads anything and nothing here touches torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from talaria.errors import BadRequest, ConfigError

_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_end|>
_USER_DEFINED = 4  # llama.cpp token type of added, non-special tokens such as <think>

# llama.cpp's `tokenizer.ggml.pre` names whose split differs from GPT-2's byte-level regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp's ``tokenizer.ggml.pre`` names (GPT-2's regex by default).

    ``smollm`` isolates every digit before the GPT-2 split, as SmolLM2's own tokenizer.json does.
    """
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_vocab(tokens: Sequence[str]) -> dict[str, int]:
    """Token -> id; tokens spelled outside the byte alphabet are respelled, as transformers does."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    return vocab


def _post_processor(
    backend: tokenizers.Tokenizer, bos: str | None, eos: str | None
) -> processors.PostProcessor:
    """A template adding ``bos`` before and ``eos`` after a sequence (either may be None)."""
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    head = f"{bos}:0 " if bos is not None else ""
    tail = f" {eos}:0" if eos is not None else ""
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail} $B:1", special_tokens=specials
    )


def _backend_from_gguf(meta: Mapping[str, Any], source: str) -> tokenizers.Tokenizer:
    """Byte-level BPE from ``tokenizer.ggml.*`` metadata, with control tokens added as special."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"{source}: field tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') "
            "vocabularies are supported"
        )
    tokens = _require(meta, "tokenizer.ggml.tokens", source)
    merges: list[tuple[str, str]] = []
    for merge in _require(meta, "tokenizer.ggml.merges", source):
        left, space, right = merge.partition(" ")
        if not space:
            raise ConfigError(f"{source}: field tokenizer.ggml.merges holds {merge!r} (no space)")
        merges.append((left, right))
    bpe = models.BPE(vocab=_byte_level_vocab(tokens), merges=merges, fuse_unk=False)
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    alphabet = set(bytes_to_unicode().values())
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind_ in zip(tokens, types, strict=False)
        if kind_ == _CONTROL and set(t) <= alphabet
    ]
    backend.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind_ in zip(tokens, types, strict=False)
        if kind_ == _USER_DEFINED
    ]
    backend.add_tokens(user)
    return backend


def _require(meta: Mapping[str, Any], key: str, source: str) -> list[str]:
    """``meta[key]`` as a non-empty list of strings, or ConfigError naming the field."""
    value = meta.get(key)
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise ConfigError(f"{source}: field {key} is missing or not a list of strings")
    return value


def _token_text(value: Any) -> str | None:
    """A special token's text from tokenizer_config.json (a string or an AddedToken dict)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers' tracker tag)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API declares a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str, template: str) -> jinja2.Template:
    """Compile ``template`` in an immutable sandbox configured as transformers configures it.

    trim_blocks and lstrip_blocks on, loop controls, a ``tojson`` that keeps non-ASCII text,
    ``raise_exception`` and ``strftime_now`` globals. Raises ConfigError naming ``source`` when the
    template does not parse.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{source}: chat template does not parse: {exc}") from exc


def _plain(value: Any) -> Any:
    """A deep copy of ``value`` made of JSON types only (what a sandboxed template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str):  # subclasses (enums, ...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts without None-valued keys, reasoning aliased as transformers does
    (``thinking`` and ``reasoning_content`` both set); BadRequest when one is malformed."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        plain = {str(k): _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


class Tokenizer:
    """Encode, decode, stream and chat-template for one model. Immutable after construction.

    ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` are token strings (or None);
    ``add_bos`` / ``add_eos`` say what ``encode(..., add_special_tokens=True)`` adds. The chat
    template is compiled once here (ConfigError when it does not parse).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
    ) -> None:
        self._backend = backend
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.chat_template = chat_template
        if add_bos or add_eos:  # on a copy: the caller's backend is never mutated
            backend = tokenizers.Tokenizer.from_str(backend.to_str())
            self._backend = backend
            backend.post_processor = _post_processor(
                backend, bos_token if add_bos else None, eos_token if add_eos else None
            )
        self._template = (
            compile_chat_template(source, chat_template) if chat_template is not None else None
        )
        self._added = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()}
        byte_level = isinstance(self._backend.decoder, decoders.ByteLevel)
        self._unbyte = {c: b for b, c in bytes_to_unicode().items()} if byte_level else None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str) -> Tokenizer:
        """Build from a GGUF file's metadata as plain values (``tokenizer.ggml.*``,
        ``tokenizer.chat_template``). ``source`` names the file in error messages."""
        backend = _backend_from_gguf(meta, source)
        tokens = _require(meta, "tokenizer.ggml.tokens", source)

        def special(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            if index is None:
                return None
            if not isinstance(index, int) or not 0 <= index < len(tokens):
                raise ConfigError(
                    f"{source}: field tokenizer.ggml.{key}={index!r} is not a token id"
                )
            return tokens[index]

        return cls(
            backend,
            source=source,
            bos_token=special("bos_token_id"),
            eos_token=special("eos_token_id"),
            pad_token=special("padding_token_id"),
            unk_token=special("unknown_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        )

    @classmethod
    def from_hf_dir(cls, directory: Path) -> Tokenizer:
        """Build from ``tokenizer.json`` (its post-processor kept as saved) and, when present,
        ``tokenizer_config.json`` (special tokens, ``chat_template``) in ``directory``.

        Raises ConfigError naming the file when one is missing or malformed.
        """
        path = Path(directory) / "tokenizer.json"
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ConfigError(f"{path}: cannot read tokenizer: {exc}") from exc
        config = _read_tokenizer_config(Path(directory) / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(
            backend,
            source=str(directory),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            unk_token=_token_text(config.get("unk_token")),
            chat_template=template if isinstance(template, str) else None,
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (do not mutate)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str | None) -> int | None:
        """The id of ``token`` (None when it is None or unknown)."""
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are matched whole."""
        if not isinstance(text, str):
            raise BadRequest(f"text to encode must be a string, not {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; BadRequest when an id is outside the vocabulary."""
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise BadRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_str(self, token_id: int) -> str:
        """The vocabulary's own string for ``token_id`` (byte-level BPE's ``Ġ`` for a space,
        as transformers' ``convert_ids_to_tokens``); BadRequest outside the vocabulary."""
        piece = self._backend.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if piece is None:
            raise BadRequest(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        return str(piece)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for in decoded text: a byte-level BPE token's raw
        bytes (possibly part of a UTF-8 character), an added token's text in UTF-8, else
        the UTF-8 of its decoding alone. BadRequest outside the vocabulary."""
        piece = self.token_str(token_id)
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        if self._unbyte is not None and all(c in self._unbyte for c in piece):
            return bytes(self._unbyte[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def stream(self, skip_special_tokens: bool = True) -> DetokenizeStream:
        """A fresh incremental detokenizer for one generated sequence."""
        return DetokenizeStream(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the chat template as transformers' ``apply_chat_template(tokenize=False)`` does.

        The template sees ``messages`` (None-valued keys dropped), ``tools``, ``documents=None``,
        ``add_generation_prompt``, the special token strings and ``kwargs``. BadRequest when the
        model has no template, a message is malformed, or the template raises.
        """
        if self._template is None:
            raise BadRequest(f"model {self.source} has no chat template; send a plain prompt")
        context: dict[str, Any] = {
            name: token
            for name, token in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if token is not None
        }
        context.update(_plain(kwargs))
        try:
            return self._template.render(
                messages=_normalize_messages(messages),
                tools=_plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except Exception as exc:  # the template is untrusted code: any failure is the input's
            raise BadRequest(f"chat template rejected the conversation: {exc}") from exc


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` as a dict ({} when absent); ConfigError when malformed."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read tokenizer config: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: tokenizer config must be a JSON object")
    return data


class DetokenizeStream:
    """Incremental detokenization: push ids one at a time, get text deltas back.

    A delta never ends inside a UTF-8 character: while the decoded tail is an incomplete byte
    sequence (U+FFFD at the end) the text is held back. ``"".join(deltas) + flush()`` equals
    ``tokenizer.decode(all_ids)``. Mutates only itself.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of the ids already turned into emitted text

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far (a copy)."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text ("" while a character is incomplete)."""
        self._ids.append(token_id)
        window = self._ids[self._prefix :]
        seen = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tokenizer.decode(window, self._skip)
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]

    def flush(self) -> str:
        """Whatever is still held back (possibly with U+FFFD); the stream is then caught up."""
        seen = self._tokenizer.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(seen) :]
