"""Per-request logits processing for the embedded engine: what a request's
:class:`~talaria.generation.SamplingParams` change in its logits before the draw, and the
log-probabilities it asks for.

:class:`LogitsProcessor` holds one request's state (which tokens its prompt holds, how often
each was generated) and applies, in vLLM's order: the ``min_tokens`` mask (end ids at -inf
while fewer than ``min_tokens`` tokens were generated), then ``repetition_penalty`` over the
prompt and the output, then ``frequency_penalty`` and ``presence_penalty`` over the output.
:func:`token_logprob` reads one drawn token's log-probability and its top alternatives off
the raw logits. The runner (``talaria.engine.runner``) builds a processor only for requests
whose params process logits, so every other request's draw is unchanged and pays nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from talaria.generation import SamplingParams, TokenLogprob

__all__ = ["LogitsProcessor", "token_logprob"]


class LogitsProcessor:
    """One request's logits processing over a vocabulary of ``vocab`` ids (see the module
    docstring). ``prompt`` is the request's whole prompt (ids >= ``vocab`` are ignored);
    ``end_ids`` are the ids that end it (``stop_token_ids``, and end-of-sequence unless
    ``ignore_eos``), masked until ``min_tokens`` tokens came. :meth:`__call__` returns new
    float32 logits and mutates nothing; :meth:`observe` records a generated token."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        end_ids: Collection[int],
        vocab: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.params = params
        self.vocab = vocab
        self.generated = 0
        ends = sorted({i for i in end_ids if 0 <= i < vocab})
        self._ends = torch.tensor(ends, dtype=torch.long, device=device)
        counted = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self._counts = torch.zeros(vocab, dtype=torch.float32, device=device) if counted else None
        self._seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = torch.tensor([i for i in prompt if 0 <= i < vocab], dtype=torch.long)
            self._seen[ids.to(device)] = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] processed for the next token (a new float32 tensor)."""
        if logits.shape != (self.vocab,):
            raise ValueError(f"logits {tuple(logits.shape)} must be [{self.vocab}]")
        p = self.params
        out = logits.float().clone()
        if self.generated < p.min_tokens and self._ends.numel():
            out[self._ends] = float("-inf")
        if self._seen is not None:
            rp = p.repetition_penalty
            hit = out[self._seen]
            out[self._seen] = torch.where(hit > 0, hit / rp, hit * rp)
        if self._counts is not None:
            out -= p.frequency_penalty * self._counts
            out -= p.presence_penalty * (self._counts > 0).float()
        # a tiny repetition_penalty (say 1e-160) overflows logits to +inf: cap them at the
        # largest float so the draw stays defined (masked ids keep -inf)
        return torch.nan_to_num(
            out, nan=float("-inf"), posinf=torch.finfo(out.dtype).max, neginf=float("-inf")
        )

    def observe(self, token: int) -> None:
        """Record one generated ``token`` (mutates the counts)."""
        self.generated += 1
        if not 0 <= token < self.vocab:
            return
        if self._counts is not None:
            self._counts[token] += 1.0
        if self._seen is not None:
            self._seen[token] = True


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` [vocab] (log-softmax in float32) and the
    ``top`` most likely ids with theirs, most likely first, equal ones by id."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]))
        pairs = zip(ids.tolist(), values.tolist(), strict=True)
        best = tuple(sorted(pairs, key=lambda pair: (-pair[1], pair[0])))
    return TokenLogprob(token, float(logp[token]), best)
