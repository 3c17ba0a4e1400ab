"""Helpers shared by the rows of ``benchmarks/engine.py``: the sizes of a run, the KV block
size, the progress console and the median timer.

Every benchmark module beside it imports from here: ``engine_ours.py`` (our engine),
``engine_transformers.py`` (the transformers reference), ``engine_switch.py`` (model switches
and memory) and ``engine_vllm.py`` (the vLLM rows); ``engine.py`` is the command line that runs
them and ``engine_report.py`` prints their tables. This module imports no talaria.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import attrs
from rich.console import Console

BLOCK_TOKENS = 16


@attrs.frozen
class Sizes:
    """Token counts of one run (full or ``--quick``)."""

    prefill_one: int = 1024
    prefill_batch: int = 4
    prefill_each: int = 512
    decode_ctx: int = 512
    decode_steps: int = 32
    decode_batches: tuple[int, ...] = (1, 8, 32)
    tf_decode_batches: tuple[int, ...] = (1, 8)
    ttft_prefix: int = 4096
    ttft_new: int = 300
    reps: int = 3


QUICK = Sizes(
    prefill_one=128,
    prefill_batch=4,
    prefill_each=64,
    decode_ctx=64,
    decode_steps=8,
    ttft_prefix=256,
    ttft_new=32,
    reps=1,
)

PROGRESS = Console(stderr=True)


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after ``warmup`` untimed runs."""
    PROGRESS.log(f"timing {getattr(fn, '__name__', 'step')}", _stack_offset=2)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def contiguous_table(first_block: int, n_tokens: int) -> tuple[int, ...]:
    """Block ids ``first_block ..`` covering ``n_tokens`` tokens."""
    return tuple(range(first_block, first_block + -(-n_tokens // BLOCK_TOKENS)))
