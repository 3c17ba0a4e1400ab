"""Decode speed with and without a grammar on the embedded engine (SmolLM2-135M, one call).

One greedy call of ``--tokens`` new tokens, decoded free and under a JSON schema whose one
string field is long enough never to close first (so every step is masked), alternated
``--reps`` times; reported: milliseconds per generated token (median over the reps) of
each, and the grammar's own cost per token (its mask and its token check) timed inside the
constrained runs::

    .venv/bin/python benchmarks/grammar_decode.py --json benchmarks/results/grammar_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from talaria.backends.embedded import EmbeddedInstance, build_embedded
from talaria.config import InstanceSpec
from talaria.engine.grammar import GrammarMask
from talaria.generation import SamplingParams
from talaria.grammar import Grammar
from talaria.policy.baselines import POLICIES
from talaria.types import Call, TokenSeq

MODEL = "smollm2-135m"
SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "maxLength": 2000}},
    "required": ["note"],
    "additionalProperties": False,
}


class _Timed:
    """Wraps GrammarMask's two per-token methods to add up their seconds."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0
        self._apply = GrammarMask.apply
        self._accept = GrammarMask.accept

    def install(self) -> None:
        timed = self

        def apply(mask: GrammarMask, logits: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = timed._apply(mask, logits)
            timed.seconds += time.perf_counter() - t0
            timed.tokens += 1
            return out

        def accept(mask: GrammarMask, tokens: Any) -> None:
            t0 = time.perf_counter()
            timed._accept(mask, tokens)
            timed.seconds += time.perf_counter() - t0

        GrammarMask.apply = apply  # type: ignore[method-assign]
        GrammarMask.accept = accept  # type: ignore[method-assign]


def one_call(inst: EmbeddedInstance, key: str, tokens: int, grammar: Grammar | None) -> float:
    """Seconds per generated token of one greedy call."""
    tok = inst.tokenizers[MODEL]
    assert tok is not None
    text = tok.apply_chat_template([{"role": "user", "content": "Write a long note as JSON."}])
    prompt = TokenSeq(tok.encode(text, add_special_tokens=False))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    local = inst.instance
    call = Call(key, 0, MODEL, prompt, tokens)
    local.submit(call, 0.0, params=params)
    local.step(0.0)  # the prefill and the first token, not timed
    t0 = time.perf_counter()
    now = 0.0
    while not local.idle:
        now += 0.01
        local.step(now)
    seconds = time.perf_counter() - t0
    n = len(local.take_output(call.key))
    return seconds / max(1, n - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    spec = InstanceSpec(
        name="g0",
        hardware="cpu",
        device_memory_bytes=2 * 10**9,
        host_memory_bytes=2 * 10**9,
        block_size=16,
        memory_utilization=0.9,
    )
    inst = build_embedded(spec, [MODEL], POLICIES["talaria"], torch.bfloat16)
    grammar = Grammar.json_schema(SCHEMA)
    timed = _Timed()
    timed.install()
    one_call(inst, "warm-free", 8, None)
    one_call(inst, "warm-grammar", 8, grammar)
    timed.seconds, timed.tokens = 0.0, 0
    free, constrained = [], []
    for r in range(args.reps):
        free.append(one_call(inst, f"free-{r}", args.tokens, None))
        constrained.append(one_call(inst, f"grammar-{r}", args.tokens, grammar))
    out = {
        "model": MODEL,
        "new_tokens": args.tokens,
        "reps": args.reps,
        "free_ms_per_token": 1e3 * statistics.median(free),
        "grammar_ms_per_token": 1e3 * statistics.median(constrained),
        "grammar_own_ms_per_token": 1e3 * timed.seconds / max(1, timed.tokens),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(out, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
