"""What a generation request asks for and when its output ends: torch-free, shared by the
runtime, the API, the server and every executor.

- :class:`SamplingParams`: one request's knobs, validated on construction (BadRequest).
- :class:`StopChecker`: end-of-sequence, stop token ids, stop strings (matched on decoded text,
  with a possible partial match held back), min tokens and max tokens, with a finish reason.
- :class:`TokenLogprob`: what an executor reports of one drawn token when asked for logprobs.

Drawing tokens from logits is the executor's business (``talaria.engine.sampling``, with the
per-request logits processing of ``talaria.engine.logits``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol

import attrs

from talaria.errors import BadRequest, ConfigError
from talaria.grammar import Grammar

FinishReason = Literal["stop", "length"]
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (vLLM's default bound)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0


# Temperatures below this sample greedily, as vLLM's do: dividing logits by a temperature near
# zero (5e-324, say) overflows them to inf and the draw fails.
GREEDY_BELOW = 1e-5


def _check_temperature(_: Any, __: Any, value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0.0:
        raise BadRequest(f"temperature must be a number >= 0, got {value!r}")


def _check_top_p(_: Any, __: Any, value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 < value <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {value!r}")


def _check_int(name: str, minimum: int, optional: bool = False) -> Any:
    def check(_: Any, __: Any, value: int | None) -> None:
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            none = " or null" if optional else ""
            raise BadRequest(f"{name} must be an integer >= {minimum}{none}, got {value!r}")

    return check


def _check_seed(_: Any, __: Any, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise BadRequest(f"seed must be an integer or null, got {value!r}")


def _to_stop(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(s, str) and s for s in items):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {value!r}")
    return items


def _check_penalty(name: str, low: float, high: float, low_open: bool = False) -> Any:
    def check(_: Any, __: Any, value: float) -> None:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        above = number and (value > low if low_open else value >= low)
        if not (above and value <= high):
            bound = "(" if low_open else "["
            raise BadRequest(f"{name} must be a number in {bound}{low}, {high}], got {value!r}")

    return check


def _check_bool(name: str) -> Any:
    def check(_: Any, __: Any, value: bool) -> None:
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false, got {value!r}")

    return check


def _check_logprobs(_: Any, __: Any, value: int | None) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(
            f"logprobs (top alternatives per token) must be an integer in 0..{MAX_LOGPROBS} "
            f"or null, got {value!r}"
        )


def _to_ids(value: Iterable[int] | None) -> tuple[int, ...]:
    items = tuple(value or ())
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise BadRequest(f"stop_token_ids must be non-negative integers, got {value!r}")
    return items


def _check_grammar(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, Grammar):
        raise BadRequest(f"grammar must be a Grammar or None, got {type(value).__name__}")


@attrs.frozen
class SamplingParams:
    """One request's sampling knobs.

    ``temperature`` below :data:`GREEDY_BELOW` (0 included) is greedy (argmax). ``top_k == 0``
    disables top-k; ``top_p == 1`` disables nucleus filtering. ``max_tokens`` counts generated
    tokens, the end token included; None lets the in-process API pick it (the server's
    ``default_max_tokens``, or what the context leaves beside the prompt if less).
    ``seed`` makes sampling reproducible. ``stop`` strings end the output before the match;
    ``stop_token_ids`` and the model's end-of-sequence ids (unless ``ignore_eos``) end it too.

    Logits processing (``talaria.engine.logits``), as vLLM does it: until ``min_tokens`` tokens
    were generated the end ids (end-of-sequence unless ``ignore_eos``, and ``stop_token_ids``)
    cannot be drawn and stop strings do not end the output. ``repetition_penalty`` (> 0, 1 is
    off; Hugging Face / vLLM semantics) divides the positive logits and multiplies the negative
    ones of every token present in the prompt or the output; ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2], 0 is off; OpenAI semantics) subtract ``frequency *
    count + presence * (count > 0)`` from each token's logit, ``count`` its occurrences in the
    output so far. ``logprobs`` (None: off) asks for each drawn token's log-probability under
    the model (the raw distribution, before any processing, as vLLM reports it by default) and
    that many most likely alternatives. ``grammar`` (None: free text) constrains every drawn
    token to keep the answer within it. ``max_tokens`` must be >= ``min_tokens``.
    Invalid values raise BadRequest.
    """

    temperature: float = attrs.field(default=1.0, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    top_k: int = attrs.field(default=0, validator=_check_int("top_k", 0))
    max_tokens: int | None = attrs.field(
        default=16, validator=_check_int("max_tokens", 1, optional=True)
    )
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_ids)
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool("ignore_eos"))
    min_tokens: int = attrs.field(default=0, validator=_check_int("min_tokens", 0))
    repetition_penalty: float = attrs.field(
        default=1.0,
        validator=_check_penalty("repetition_penalty", 0.0, MAX_REPETITION_PENALTY, True),
    )
    presence_penalty: float = attrs.field(
        default=0.0, validator=_check_penalty("presence_penalty", -MAX_PENALTY, MAX_PENALTY)
    )
    frequency_penalty: float = attrs.field(
        default=0.0, validator=_check_penalty("frequency_penalty", -MAX_PENALTY, MAX_PENALTY)
    )
    logprobs: int | None = attrs.field(default=None, validator=_check_logprobs)
    grammar: Grammar | None = attrs.field(default=None, validator=_check_grammar)

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise BadRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )

    @property
    def cap(self) -> int:
        """``max_tokens`` once resolved: a call runs with a number (the in-process API
        resolves None before it submits; ``LiveCluster.submit`` refuses None)."""
        if self.max_tokens is None:
            raise BadRequest("max_tokens is unresolved: give the call an output cap")
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """True when the logits are changed before the draw (min tokens or a penalty): only
        such requests pay for per-request logits processing."""
        return (
            self.min_tokens > 0
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@attrs.frozen
class TokenLogprob:
    """One drawn token's log-probability (natural log) and the ``top`` most likely tokens of
    the same distribution as ``(token id, logprob)``, most likely first (ties: lower id first).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TextStream(Protocol):
    """What :class:`StopChecker` needs from a detokenizer (``DetokenizeStream`` is one)."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@attrs.frozen
class StopUpdate:
    """What one generated token produced: text safe to send now and, at the end, why it ended.

    ``stop_reason`` is the matched stop string or the stop / end token id (None for length).
    """

    text: str
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some string of
    ``stops`` (stop strings; the tool-call parsers' markers)."""
    longest = min(len(text), max((len(s) - 1 for s in stops), default=0))
    for size in range(longest, 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stops):
            return size
    return 0


class StopChecker:
    """Decides when one sequence ends, and what text of it may be sent.

    ``update(token_id)`` is called once per generated token, in order. An end token
    (``eos_token_ids`` unless ``ignore_eos``, or a ``stop_token_ids`` entry) ends with "stop" and
    its own text is not sent; a stop string ends with "stop" and the text from the match on is
    not sent; reaching ``max_tokens`` ends with "length". Text that could be the start of a stop
    string is held back until it cannot be. Until ``min_tokens`` tokens came (as vLLM: the
    end ids are masked from the draw for as long, see ``SamplingParams``), an end token is
    text like any other and a stop string ends nothing; from then on a stop string that is
    complete in the text not yet sent ends the output. Mutates itself and ``stream`` only.
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        stream: TextStream | None = None,
    ) -> None:
        if params.stop and stream is None:
            raise ConfigError("stop strings need a text stream to match against")
        self._params = params
        self._stream = stream
        self._end_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._end_ids.update(eos_token_ids)
        self._pending = ""
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_string: str | None = None  # the stop string that ended the output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_id: int) -> StopUpdate:
        """Account for one generated token; see the class docstring. Raises after the end."""
        if self.finished:
            raise RuntimeError("update() after the sequence finished")
        self.num_tokens += 1
        if token_id in self._end_ids and self.num_tokens > self._params.min_tokens:
            tail = self._stream.flush() if self._stream is not None else ""
            return self._scan(tail, final=True, reason=token_id)
        delta = self._stream.push(token_id) if self._stream is not None else ""
        cap = self._params.max_tokens
        if cap is None or self.num_tokens < cap:
            return self._scan(delta, final=False, reason=None)
        done = self._scan(delta, final=False, reason=None)
        if done.finish_reason is not None:
            return done
        tail = self._stream.flush() if self._stream is not None else ""
        last = self._scan(tail, final=True, reason=None)
        return StopUpdate(done.text + last.text, last.finish_reason, last.stop_reason)

    def _scan(self, delta: str, *, final: bool, reason: int | None) -> StopUpdate:
        """Add ``delta`` to the held text; end on a stop string, or when ``final``."""
        text = self._pending + delta
        stops = self._params.stop
        early = self.num_tokens < self._params.min_tokens
        hits = [] if early else [(text.find(s), s) for s in stops if s in text]
        if hits:
            position, matched = min(hits)
            self._pending = ""
            self.finish_reason = "stop"
            self.stop_string = matched
            return StopUpdate(text[:position], "stop", matched)
        if final:
            self._pending = ""
            self.finish_reason = "stop" if reason is not None else "length"
            return StopUpdate(text, self.finish_reason, reason)
        held = held_suffix(text, stops)
        self._pending = text[len(text) - held :] if held else ""
        return StopUpdate(text[: len(text) - held])
