"""Our rows of ``benchmarks/engine.py``: the embedded engine's prefill, decode and time to
first token on SmolLM2-135M-Instruct.

Ours drives ``LlamaModel.forward`` directly on a ``KVPool`` (block tables built by hand,
contiguous blocks per sequence, 16 tokens a block):

* prefill: one 1,024-token prompt and a batch of 4 x 512 tokens (tok/s, logits of the last
  token only);
* decode at batch 1, 8 and 32, each sequence holding ~512 tokens of context (real KV: the
  4 x 512 prefill's blocks copied to every sequence), 32 greedy steps (tok/s, argmax and
  building the next step included);
* time to first token for a 4,096-token prefix plus 300 new tokens with the prefix's KV on
  device (compute the 300), on host (execute a HOST_TO_DEVICE ``MovePlan`` of its blocks, then
  compute the 300) and gone (compute all 4,396), and the restore-vs-recompute ratios.

Sizes, the block size and the timer come from ``engine_common.py``; ``engine.py`` builds
:class:`Ours` from the loaded GGUF and runs :func:`measure_ours`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.engine_common import BLOCK_TOKENS, Sizes, contiguous_table, median_seconds
from talaria.engine.arch import ModelArch
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.kernels import DecodeKernel, KernelUnavailable, build_decode_kernel
from talaria.engine.kv_pool import KVPool, PagedKV
from talaria.engine.model import LlamaModel
from talaria.engine.weight_layout import bind_weights
from talaria.memory.kv import MovePlan
from talaria.types import Link


class Ours:
    """Our engine: weights bound into one region, a KV pool, ``LlamaModel.forward``."""

    def __init__(
        self,
        arch: ModelArch,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device_blocks: int,
        host_blocks: int,
        decode_kernel: DecodeKernel | None = None,
    ) -> None:
        self.arch, self.dtype = arch, dtype
        self.region = torch.empty(arch.weight_bytes(dtype), dtype=torch.uint8)
        weights = bind_weights(arch, self.region, dtype)
        for name, view in weights.items():
            view.copy_(tensors[name])
        self.model = LlamaModel(arch, weights, decode_kernel)
        block_bytes = KVPool.block_bytes_for([arch], dtype, BLOCK_TOKENS)
        self.pool = KVPool(device_blocks, host_blocks, block_bytes)
        self.kv: PagedKV = self.pool.paged(arch, dtype)
        assert self.kv.tokens_per_block == BLOCK_TOKENS

    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        return self.model.forward(BatchInput(seqs), self.kv)

    def plan(self, link: Link, moves: list[tuple[int, int]]) -> MovePlan:
        return MovePlan(link, tuple(moves), self.pool.block_bytes)


def measure_ours(eng: Ours, sz: Sizes, gen: torch.Generator) -> dict[str, float]:
    vocab = eng.arch.vocab_size
    out: dict[str, float] = {}

    def rand_ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (n,), generator=gen).tolist())

    # Block layout: decode sequences first (stride = blocks of ctx + steps), then the
    # prefill sequences; the time-to-first-token phase reuses blocks from 0 afterwards.
    per_dec = -(-(sz.decode_ctx + sz.decode_steps) // BLOCK_TOKENS)
    dec_region = max(sz.decode_batches) * per_dec
    one = SeqInput(rand_ids(sz.prefill_one), 0, contiguous_table(dec_region, sz.prefill_one))
    base_b = dec_region + len(one.block_table)
    per_pre = -(-sz.prefill_each // BLOCK_TOKENS)
    batch = [
        SeqInput(
            rand_ids(sz.prefill_each), 0, contiguous_table(base_b + j * per_pre, sz.prefill_each)
        )
        for j in range(sz.prefill_batch)
    ]
    t = median_seconds(lambda: eng.forward([one]), sz.reps)
    out["prefill_tok_s_1x1024"] = sz.prefill_one / t
    last_logits: list[torch.Tensor] = []

    def run_batch() -> None:
        last_logits[:] = [eng.forward(batch)]

    t = median_seconds(run_batch, sz.reps)
    out["prefill_tok_s_4x512"] = sz.prefill_batch * sz.prefill_each / t

    # Decode: every sequence gets the KV of one of the prefilled batch (device-to-device copy
    # of its blocks), its context is decode_ctx tokens, then decode_steps greedy steps.
    first_tok = last_logits[0].argmax(-1).tolist()
    n_max = max(sz.decode_batches)
    moves = [
        (base_b + (i % sz.prefill_batch) * per_pre + b, i * per_dec + b)
        for i in range(n_max)
        for b in range(per_pre)
    ]
    eng.pool.execute(eng.plan(Link.DEVICE_TO_DEVICE, moves))
    out.update(measure_decode(eng, sz, first_tok, per_dec))
    out.update(measure_ttft(eng, sz, rand_ids))
    return out


def measure_decode(eng: Ours, sz: Sizes, first_tok: list[int], per_dec: int) -> dict[str, float]:
    """Decode tok/s at each batch size: sequence ``i`` holds ``decode_ctx`` tokens in blocks
    ``i * per_dec ..``, then ``decode_steps`` greedy steps; median of ``reps``.

    With the native kernels the same steps also run without them (PyTorch's operators:
    gather + SDPA, ``mv``), alternating with the kernel runs repetition by repetition so
    both see the same machine (``*_gather_sdpa`` keys): on this shared 2-core machine two
    back-to-back measurements can differ by more than the effect being measured."""
    kernel = eng.model.decode_kernel
    variants: dict[str, DecodeKernel | None] = {"": kernel}
    if kernel is not None:
        variants["_gather_sdpa"] = None
    out: dict[str, float] = {}
    for bsz in sz.decode_batches:
        tables = [tuple(range(i * per_dec, (i + 1) * per_dec)) for i in range(bsz)]

        def decode(steps: int, bsz: int = bsz, tables: list[tuple[int, ...]] = tables) -> None:
            toks = [first_tok[i % sz.prefill_batch] for i in range(bsz)]
            for s in range(steps):
                seqs = [SeqInput((toks[i],), sz.decode_ctx + s, tables[i]) for i in range(bsz)]
                toks = eng.forward(seqs).argmax(-1).tolist()

        times: dict[str, list[float]] = {suffix: [] for suffix in variants}
        for rep in range(sz.reps + 1):  # the first round warms up
            for suffix, variant in variants.items():
                eng.model.decode_kernel = variant
                t0 = time.perf_counter()
                decode(2 if rep == 0 else sz.decode_steps)
                if rep:
                    times[suffix].append(time.perf_counter() - t0)
        for suffix, ts in times.items():
            out[f"decode_tok_s_batch{bsz}{suffix}"] = bsz * sz.decode_steps / statistics.median(ts)
    eng.model.decode_kernel = kernel
    return out


def measure_ttft(
    eng: Ours, sz: Sizes, rand_ids: Callable[[int], tuple[int, ...]]
) -> dict[str, float]:
    """Time to first token with the prefix on device, on host (restore) and gone."""
    prefix, new = rand_ids(sz.ttft_prefix), rand_ids(sz.ttft_new)
    total = sz.ttft_prefix + sz.ttft_new
    table_a = contiguous_table(0, total)
    table_b = contiguous_table(len(table_a), total)
    n_prefix_blocks = sz.ttft_prefix // BLOCK_TOKENS  # whole blocks of the prefix
    assert sz.ttft_prefix % BLOCK_TOKENS == 0
    eng.forward([SeqInput(prefix, 0, table_a)])  # the prefix's KV, in table_a (untimed)
    eng.pool.execute(
        eng.plan(Link.DEVICE_TO_HOST, [(table_a[b], b) for b in range(n_prefix_blocks)])
    )
    restore = eng.plan(Link.HOST_TO_DEVICE, [(b, table_b[b]) for b in range(n_prefix_blocks)])
    logits: dict[str, torch.Tensor] = {}

    def on_device() -> None:
        logits["device"] = eng.forward([SeqInput(new, sz.ttft_prefix, table_a)]).argmax(-1)

    def on_host() -> None:
        eng.pool.execute(restore)
        logits["host"] = eng.forward([SeqInput(new, sz.ttft_prefix, table_b)]).argmax(-1)

    def gone() -> None:
        logits["gone"] = eng.forward([SeqInput(prefix + new, 0, table_b)]).argmax(-1)

    out = {
        "ttft_s_prefix_device": median_seconds(on_device, sz.reps),
        "ttft_s_prefix_host": median_seconds(on_host, sz.reps),
        "ttft_s_prefix_gone": median_seconds(gone, sz.reps),
        "restore_copy_s": median_seconds(lambda: eng.pool.execute(restore), max(sz.reps, 5)),
    }
    if not torch.equal(logits["device"], logits["host"]):
        raise RuntimeError("restored KV gave a different first token than KV kept on device")
    out["restore_copy_gb_s"] = restore.nbytes / out["restore_copy_s"] / 1e9
    out["ttft_ratio_gone_over_host"] = out["ttft_s_prefix_gone"] / out["ttft_s_prefix_host"]
    recompute_prefix = max(out["ttft_s_prefix_gone"] - out["ttft_s_prefix_device"], 1e-9)
    out["restore_vs_recompute_prefix_ratio"] = recompute_prefix / out["restore_copy_s"]
    return out


def decode_kernel(args: argparse.Namespace) -> tuple[DecodeKernel | None, str]:
    """The native decode kernel our rows use, and a line saying which (or why none)."""
    if not args.native_kernel:
        return None, "off (--no-native-kernel): gather + SDPA"
    try:
        kernel = build_decode_kernel()
    except KernelUnavailable as exc:
        return None, f"unavailable ({exc}): gather + SDPA"
    return kernel, repr(kernel)
