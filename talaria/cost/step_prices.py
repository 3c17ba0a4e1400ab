"""The additive step model: a step's seconds as a sum of counts times measured prices.

A GPU step overlaps its parts (the roofline's ``max(compute, memory)`` in
:mod:`talaria.cost.cost_model`); the embedded engine on a CPU runs them one after another:
it reads the weights, reads the cached KV, multiplies, attends. So where a calibration has
measured them, a step costs::

    t = overhead_s
      + decode_seqs x per_seq_s
      + prefill chunks x per_chunk_s           (each prefilling sequence attends alone)
      + weight bytes x (small_weight_s_per_B if rows <= small_rows else weight_s_per_B)
      + decode KV bytes x decode_kv_s_per_B      (the decoding sequences' contexts)
      + rows x FLOPs per token x matmul_s_per_flop
      + prefill attention FLOPs x attention_s_per_flop
      + cached-prefix KV bytes x prefix_kv_s_per_B   (each chunk gathers its prefix's KV)

``rows`` is the step's tokens (prefill plus decode). The engine multiplies up to
``small_rows`` rows by the weights with its native small-batch product, which reads the
weights near memory bandwidth, and more rows with torch's matmul: two code paths, two
weight-read prices (``small_rows`` is 0 where the native kernel is not built).

:func:`step_counts` is the one place that turns a step into its counts: the cost model prices
with it and the calibration (:mod:`talaria.calibration.linear`) fits the prices with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

from talaria.config import ModelSpec
from talaria.cost.step_shape import StepShape
from talaria.errors import ConfigError

TERMS: Final = (
    "overhead_s",
    "per_seq_s",
    "per_chunk_s",
    "small_weight_s_per_B",
    "weight_s_per_B",
    "decode_kv_s_per_B",
    "matmul_s_per_flop",
    "attention_s_per_flop",
    "prefix_kv_s_per_B",
)
"""The prices, in the order of :func:`step_counts`."""


def step_counts(model: ModelSpec, step: StepShape, small_rows: int) -> tuple[float, ...]:
    """The counts each price of :data:`TERMS` multiplies, for ``step`` of ``model``: the
    small-batch weight price applies up to ``small_rows`` rows."""
    rows = step.tokens
    weights = float(model.weight_bytes)
    small = rows <= small_rows
    kv = model.kv_bytes_per_token
    return (
        1.0,
        float(step.decode_seqs),
        float(step.chunks),
        weights if small else 0.0,
        0.0 if small else weights,
        float(step.decode_context_tokens) * kv,
        rows * model.flops_per_token,
        model.attention_flops(step.prefill_attn_tokens),
        step.prefix * kv,
    )


def _prices(value: Any) -> tuple[float, ...]:
    out = tuple(value)
    if len(out) != len(TERMS) or not all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
        for v in out
    ):
        raise ConfigError(f"StepPrices needs {len(TERMS)} finite prices >= 0 ({TERMS})")
    return tuple(float(v) for v in out)


def _rows(_inst: Any, _attr: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"StepPrices.small_rows must be an integer >= 0, got {value!r}")


@attrs.frozen
class StepPrices:
    """Seconds per unit of each count of :func:`step_counts` (``prices``, in the order of
    :data:`TERMS`) and the rows up to which the small-batch weight price applies."""

    prices: tuple[float, ...] = attrs.field(converter=_prices)
    small_rows: int = attrs.field(validator=_rows)

    def step_s(self, model: ModelSpec, step: StepShape) -> float:
        """Seconds of ``step`` of ``model``."""
        counts = step_counts(model, step, self.small_rows)
        return math.fsum(c * p for c, p in zip(counts, self.prices, strict=True))

    def price(self, term: str) -> float:
        """The price called ``term`` (one of :data:`TERMS`)."""
        if term not in TERMS:
            raise ConfigError(f"unknown step price {term!r}; known: {TERMS}")
        return self.prices[TERMS.index(term)]

    def plus(self, overhead_s: float, per_seq_s: float) -> StepPrices:
        """These prices with ``overhead_s`` and ``per_seq_s`` added (what the serving path
        adds to a bare forward), each sum floored at 0."""
        p = list(self.prices)
        p[0] = max(0.0, p[0] + overhead_s)
        p[1] = max(0.0, p[1] + per_seq_s)
        return StepPrices(tuple(p), self.small_rows)

    def to_json(self) -> dict[str, Any]:
        return {"small_rows": self.small_rows, **dict(zip(TERMS, self.prices, strict=True))}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StepPrices:
        """Inverse of :meth:`to_json`; ConfigError naming what is missing or wrong."""
        missing = [k for k in ("small_rows", *TERMS) if k not in doc]
        if missing:
            raise ConfigError(f"step prices lack {missing}")
        return cls(tuple(doc[k] for k in TERMS), doc["small_rows"])
