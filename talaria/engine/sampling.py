"""Token sampling for the embedded engine: next token ids from logits, greedy or
temperature / top-k / top-p, each row drawn from its own generator, so a seeded request gets
the same tokens whatever batch it runs in. The request's knobs and stop conditions are
torch-free and live in :mod:`talaria.generation`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from talaria.generation import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request: seeded with ``params.seed``, or from OS entropy if None."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def _filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` [vocab] with everything below the k-th largest set to -inf (k=0: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` [vocab] keeping the smallest most-likely set whose probability is >= p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from ``logits`` [vocab]: temperature, then top-k, then top-p, then a draw."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits.float() / params.temperature
    # large logits over a small temperature overflow to +inf (and inf - inf is NaN in the
    # softmax): cap at the largest float, keeping masked ids at -inf
    big = torch.finfo(scaled.dtype).max
    scaled = torch.nan_to_num(scaled, nan=float("-inf"), posinf=big, neginf=float("-inf"))
    scaled = _filter_top_p(_filter_top_k(scaled, params.top_k), params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def skip_draws(generator: torch.Generator, n: int, vocab: int, device: torch.device) -> None:
    """Advance ``generator`` past ``n`` draws of :func:`sample_row` over ``vocab`` ids, as if
    they had been made here: a draw (``torch.multinomial`` of one sample) consumes random
    numbers by the row's width, never by its values, so drawing from a uniform row of the
    same width advances it identically. Mutates ``generator`` only."""
    row = torch.full((vocab,), 1.0 / vocab, device=device)
    for _ in range(n):
        torch.multinomial(row, 1, generator=generator)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Next token ids [batch] (int64, on ``logits.device``) for ``logits`` [batch, vocab].

    Row i uses ``params[i]`` and ``generators[i]`` (None is allowed for greedy rows only). Greedy
    rows take the argmax (first index on ties); other rows draw from their own generator, which
    advances. Nothing else mutates.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [batch, vocab] with one params and one "
            f"generator per row ({len(params)} params, {len(generators)} generators)"
        )
    out = torch.argmax(logits, dim=-1)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        if generator is None:
            raise ValueError(f"row {row} samples (temperature {p.temperature}) without a generator")
        out[row] = sample_row(logits[row], p, generator)
    return out
