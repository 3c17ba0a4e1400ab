"""The work of one engine step, as every cost model prices it: :class:`StepShape`.

Prefill and decode are one idea here (computed tokens catching up with known ones): a step
prefills ``prefill_tokens`` new prompt tokens in ``chunks`` sequences after ``prefix``
cached tokens, and decodes one token for each of ``decode_seqs`` sequences whose contexts
sum to ``decode_context_tokens``. The roofline (:class:`~talaria.cost.cost_model.CostModel`)
and the measured step prices (:class:`~talaria.cost.step_prices.StepPrices`) both read it;
the schedule's :class:`~talaria.schedule.StepPlan`, the calibration grid's points and the
estimators' shortcuts build it. Validated on construction. Plain data, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from talaria.errors import BadRequest

__all__ = ["StepShape", "check_count"]


def check_count(name: str, value: Any) -> float:
    """``value`` as a float; ``BadRequest`` naming ``name`` when it is negative, NaN,
    infinite or not a number."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise BadRequest(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _count(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A field's count (None allowed where the field is optional)."""
    if value is not None or attribute.default is not None:
        check_count(attribute.name, value)


@attrs.frozen
class StepShape:
    """One engine step's work (see the module docstring).

    ``prefill_attn_tokens``: the sum over the new tokens of the keys each attends (its
    position + 1, cached prefix included). ``prefill_chunks`` and ``prefix_tokens`` (the
    sequences prefilling and their cached tokens, summed) may be left out: one chunk, its
    prefix derived from the attention sum (:attr:`chunks`, :attr:`prefix`). ``BadRequest``
    for a negative, NaN or infinite count.
    """

    prefill_tokens: int = attrs.field(default=0, validator=_count)
    prefill_attn_tokens: float = attrs.field(default=0.0, validator=_count)
    decode_seqs: int = attrs.field(default=0, validator=_count)
    decode_context_tokens: int = attrs.field(default=0, validator=_count)
    prefill_chunks: int | None = attrs.field(default=None, validator=_count)
    prefix_tokens: float | None = attrs.field(default=None, validator=_count)

    @classmethod
    def prefill(cls, new_tokens: int, cached_tokens: int = 0) -> StepShape:
        """One sequence prefilling ``new_tokens`` after ``cached_tokens`` (token ``i`` of the
        new ones attends ``cached + i + 1`` keys; the chunk and its prefix are derived)."""
        attn = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        return cls(new_tokens, attn)

    @classmethod
    def decode(cls, batch: int, context_tokens: int) -> StepShape:
        """``batch`` sequences decoding one token each, their contexts summing to
        ``context_tokens``."""
        return cls(decode_seqs=batch, decode_context_tokens=context_tokens)

    @property
    def tokens(self) -> int:
        """Rows of the step's forward: new prompt tokens and one per decoding sequence."""
        return int(self.prefill_tokens) + int(self.decode_seqs)

    @property
    def chunks(self) -> int:
        """Sequences prefilling (given, else one when any token is prefilled)."""
        if self.prefill_chunks is not None:
            return int(self.prefill_chunks)
        return 1 if self.prefill_tokens else 0

    @property
    def prefix(self) -> float:
        """Cached tokens before the chunks, summed (given, else one chunk's: its mean
        attended context less its own tokens' share, ``attn / n - (n + 1) / 2``)."""
        if self.prefix_tokens is not None:
            return float(self.prefix_tokens)
        n = self.prefill_tokens
        if not n:
            return 0.0
        return max(0.0, self.prefill_attn_tokens / n - (n + 1) / 2)
