"""The batch one forward step takes, and the device tensors it is planned into.

A step mixes prefill chunks and decode steps: each sequence (:class:`SeqInput`) computes some
tokens starting at the number of tokens its KV cache already holds; :class:`BatchInput` holds
the sequences computed together and splits the logits back per sequence.
:class:`~talaria.engine.model.LlamaModel` validates a batch against the model and the KV pool
and plans it (``LlamaModel._plan``) into a :class:`Plan`: token ids, KV write slots, rotary
tables and the attention work (:class:`SeqAttn` per multi-token sequence, :class:`DecodeAttn`
per chunk of single-token sequences, over :class:`~talaria.engine.attention.PagedGroup`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from talaria.engine.attention import PagedGroup
from talaria.errors import BadRequest


def _ints(field: str, values: Iterable[int]) -> tuple[int, ...]:
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError as exc:
        raise BadRequest(f"{field} must be a sequence of integers: {exc}") from None


def _token_ids(values: Iterable[int]) -> tuple[int, ...]:
    return _ints("token_ids", values)


def _block_table(values: Iterable[int]) -> tuple[int, ...]:
    return _ints("block_table", values)


def _non_neg_int(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{attr.name} must be an integer >= 0, got {value!r}")


@attrs.frozen
class SeqInput:
    """One sequence's share of a step.

    ``token_ids`` are the tokens to compute now, at positions ``start .. start + n - 1``;
    ``start`` is the number of tokens whose KV is already in the cache (a prefill chunk and a
    decode step are the same thing). ``block_table`` lists the KV block ids holding the
    sequence's tokens in order (token ``p`` sits in ``block_table[p // tokens_per_block]``);
    it must cover ``start + n`` tokens. ``all_logits``: return logits for every computed token,
    else only for the last.
    """

    token_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    start: int = attrs.field(validator=_non_neg_int)
    block_table: tuple[int, ...] = attrs.field(converter=_block_table)
    all_logits: bool = False

    @property
    def end(self) -> int:
        """Tokens in the cache after this step."""
        return self.start + len(self.token_ids)

    @property
    def n_logits(self) -> int:
        """Rows of logits this sequence gets."""
        return len(self.token_ids) if self.all_logits else 1


@attrs.frozen
class BatchInput:
    """Sequences computed together in one step. Logits rows come back in sequence order,
    ``seqs[i].n_logits`` rows each (see :meth:`split`)."""

    seqs: tuple[SeqInput, ...] = attrs.field(converter=tuple)

    def split(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence slices of a ``[rows, vocab]`` logits tensor."""
        out, row = [], 0
        for s in self.seqs:
            out.append(logits[row : row + s.n_logits])
            row += s.n_logits
        return out


@attrs.frozen(eq=False)
class SeqAttn:
    """Attention work of one multi-token sequence: rows ``row0:row1`` of the batch attend
    the ``group.ctx`` positions of their sequence (``group.n == 1``)."""

    row0: int
    row1: int
    group: PagedGroup
    mask: torch.Tensor | None  # [n, ctx] bool, None when plain causal from position 0


@attrs.frozen(eq=False)
class DecodeAttn:
    """Single-token sequences attended together: batch ``rows`` (a slice when consecutive,
    else an index tensor), their KV in ``group``."""

    rows: slice | torch.Tensor
    group: PagedGroup


@attrs.frozen(eq=False)
class Plan:
    """Device tensors for one step: token ids, KV write slots, rotary tables ``[T, 1, hd]``,
    attention work and the rows that produce logits (None: every row, in order)."""

    ids: torch.Tensor
    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    multi: tuple[SeqAttn, ...]
    decode: tuple[DecodeAttn, ...]
    logit_rows: torch.Tensor | None

    @property
    def whole(self) -> PagedGroup | None:
        """The group of a step that is one decode chunk of every row in order, else None."""
        if self.multi or len(self.decode) != 1:
            return None
        rows = self.decode[0].rows
        if isinstance(rows, slice) and rows.start == 0 and rows.stop == self.ids.shape[0]:
            return self.decode[0].group
        return None
