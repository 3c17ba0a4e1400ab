"""Grammar-constrained decoding in the embedded engine, with llguidance.

A call whose :class:`~talaria.generation.SamplingParams` carry a
:class:`~talaria.generation.Grammar` draws every token from the tokens the grammar allows
next: :class:`GrammarMask` holds one call's matcher, masks a row of logits before the draw
(greedy or sampled alike) and consumes the drawn token after it. Once the grammar is
complete only the end-of-sequence token is allowed, so the call ends there.

Why llguidance (``llguidance`` on PyPI) rather than xgrammar: it has no dependencies (a
3 MB wheel; xgrammar pulls triton and transformers into the serving install), computes a
mask in tens of microseconds on a CPU core, covers JSON schema well, and reads Lark
grammars that embed JSON schemas (``%json{...}``), which a tool call inside a model's own
wrapper needs; vLLM's structured outputs run it too (its ``guidance`` backend), so the
embedded and vLLM backends take the same grammars.

:func:`talaria.grammar.check_grammar` refuses a grammar the library cannot build (the API
calls it before a call is queued). :func:`ll_tokenizer` builds the tokenizer view the masks
need (about half a second for a 50K vocabulary: build one per model and keep it).
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from talaria.engine.tokenizer import Tokenizer
from talaria.errors import BadRequest
from talaria.grammar import Grammar, check_grammar

__all__ = ["GrammarMask", "ll_tokenizer"]


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` for a model of ``vocab_size`` logits (ids past the
    tokenizer's own are never allowed)."""
    return llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
    )


class GrammarMask:
    """One call's grammar state: which tokens may come next. Mutated by ``accept`` only;
    not thread-safe (one call's draws are sequential)."""

    def __init__(
        self, grammar: Grammar, tokenizer: llguidance.LLTokenizer, vocab_size: int
    ) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, check_grammar(grammar), log_level=0)
        if self._matcher.is_error():
            raise BadRequest(f"the {grammar.kind.value} cannot be used: {self._error}")
        self.vocab_size = vocab_size

    @property
    def _error(self) -> str:
        return str(self._matcher.get_error())

    @property
    def done(self) -> bool:
        """The grammar is complete: only the end of the answer may follow."""
        return bool(self._matcher.is_stopped())

    def allowed(self) -> torch.Tensor:
        """A bool row of ``vocab_size``: the tokens the grammar allows next."""
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(packed, bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(np.bool_))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (one row, any length up to ``vocab_size``) with every token the grammar
        forbids at -inf (a new tensor)."""
        allowed = self.allowed()[: logits.shape[-1]].to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, tokens: Sequence[int]) -> None:
        """The call drew ``tokens`` (or they were its answer so far, on a lost instance):
        the grammar moves past them. ``RuntimeError`` if it forbade one (the call fails)."""
        for token in tokens:
            if not self._matcher.consume_token(int(token)):
                raise RuntimeError(f"the grammar refused token {token}: {self._error}")
