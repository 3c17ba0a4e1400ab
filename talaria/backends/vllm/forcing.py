"""A vLLM v1 logits processor that makes a request answer exactly the ids it was given.

A trace replay teacher-forces each call's answer (the next prompt, which the trace built from
that answer, then finds its prefix cached, as a real agent's would). The embedded engine
does it in its sampler; on vLLM this processor does it inside the engine: a request whose
``SamplingParams.extra_args`` holds ``talaria_forced`` (a list of ids) gets, at each step,
logits that are ``-inf`` everywhere but at the next forced id, so greedy or random sampling
draws that id while the forward pass and the KV cache are vLLM's own. Requests without the
key are untouched. Loaded by name in each engine core process (``logits_processors`` of
the engine args), so this module must import without the rest of Talaria's runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from talaria.backends.vllm.catalog import FORCED_KEY


class _Force:
    """One request's forced answer: row logits become one-hot at the next id."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = [int(i) for i in ids]

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        n = len(output_ids)
        if n >= len(self.ids):
            return logits
        token = self.ids[n]
        if token >= logits.shape[-1]:  # outside this model's vocabulary: never kill the engine
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[token] = 0.0
        return forced


class ForcedAnswers(AdapterLogitsProcessor):  # type: ignore[misc]
    """vLLM's per-request adapter: applies :class:`_Force` to requests that ask for it."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        extra = sampling_params.extra_args or {}
        ids = extra.get(FORCED_KEY)
        if ids is None:
            return
        ok = isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        )
        if not ok:
            raise ValueError(f"{FORCED_KEY} must be a list of non-negative token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which id is the maximum

    def new_req_logits_processor(self, params: Any) -> _Force | None:
        ids = (params.extra_args or {}).get(FORCED_KEY)
        return _Force(ids) if ids else None
